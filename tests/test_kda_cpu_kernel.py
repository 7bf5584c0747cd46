"""The chunked KDA op's C++ CPU kernel (k3.ops.kda.cpu_kernel) against its reference, chunk.py / chunk_bwd.py, in
float64: outputs, final and chunk start states, every gradient and the initial state's, on odd sizes, both chunk
sizes, packed sequences (an empty one included), with and without an initial state, on every gate regime; and the
operators' contract (schema, fake kernels) as torch.compile sees them."""

import shutil

import pytest
import torch
import torch.nn.functional as F

from k3.ops import cpu_library
from k3.ops.kda import chunk_kda, cpu_kernel, fused_recurrent_kda, naive_recurrent_kda
from k3.ops.kda.chunk import chunk_kda_bwd, chunk_kda_fwd
from tiny_models import kda_step_both_ways

pytestmark = pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None, reason="no C++ compiler")


@pytest.fixture(autouse=True)
def kernel_on(monkeypatch):
    monkeypatch.setenv(cpu_kernel.ENV_VAR, "auto")
    assert cpu_kernel.usable(torch.empty(0), 64), cpu_kernel.describe()  # where g++ is, the kernel must build


def gate(kind: str, shape, gen) -> torch.Tensor:
    if kind == "weak":
        return -0.1 * torch.randn(shape, generator=gen, dtype=torch.float64).sigmoid()
    if kind == "trained":
        return -5 * torch.randn(shape, generator=gen, dtype=torch.float64).sigmoid()
    if kind == "saturated":
        return torch.full(shape, -5.0, dtype=torch.float64)
    x = torch.randn(shape, generator=gen, dtype=torch.float64)  # Kimi Linear's unbounded gate, to −20
    return (-(torch.randn(shape[-1], generator=gen, dtype=torch.float64) + 1).exp() * F.softplus(x)).clamp(min=-20)


def inputs(B, T, H, K, V, kind, seed=0, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, K, generator=gen, dtype=torch.float64)
    k = F.normalize(torch.randn(B, T, H, K, generator=gen, dtype=torch.float64), dim=-1)
    v = torch.randn(B, T, H, V, generator=gen, dtype=torch.float64)
    beta = torch.randn(B, T, H, generator=gen, dtype=torch.float64).sigmoid()
    g = gate(kind, (B, T, H, K), gen)
    return [x.to(dtype) for x in (q, k, v, g, beta)]


def close(a, b, tol):
    scale = b.abs().max().clamp_min(1e-12)
    assert (a - b).abs().max() <= tol * scale, f"max error {((a - b).abs().max() / scale).item():.2e} > {tol}"


CASES = [  # B, T, H, K, V, chunk size, initial state
    (2, 77, 3, 16, 24, 64, True),
    (1, 64, 1, 128, 16, 32, True),  # K > 2·C: the backward's per-chunk buffers at their largest against C
    (1, 130, 2, 32, 16, 32, False),
    (3, 64, 1, 8, 40, 64, True),
    (1, 5, 2, 16, 16, 32, True),
]


@pytest.mark.parametrize("kind", ["weak", "trained", "saturated", "unbounded"])
@pytest.mark.parametrize("B,T,H,K,V,C,h0", CASES)
def test_kernel_equals_reference_forward_and_backward(B, T, H, K, V, C, h0, kind):
    q, k, v, g, beta = inputs(B, T, H, K, V, kind)
    init = torch.randn(B, H, K, V, dtype=torch.float64) if h0 else None
    scale = K**-0.5
    o, final, starts = chunk_kda_fwd(q, k, v, g, beta, scale, init, C)
    o2, final2, starts2 = cpu_kernel.chunk_fwd(q, k, v, g, beta, scale, init, C)
    for got, want in ((o2, o), (final2, final), (starts2, starts)):
        assert got.shape == want.shape and got.dtype == torch.float64
        close(got, want, 1e-12)
    do, dfinal = torch.randn_like(o), torch.randn_like(final)
    want = chunk_kda_bwd(q, k, v, g, beta, starts, do, dfinal, scale, C, None)
    got = cpu_kernel.chunk_bwd(q, k, v, g, beta, starts, do, dfinal, scale, C, None)
    for name, a, b in zip(("dq", "dk", "dv", "dg", "dbeta", "dh0"), got, want, strict=True):
        assert a.shape == b.shape, name
        close(a, b, 1e-11)


@pytest.mark.parametrize("C", [32, 64])
def test_packed_sequences_with_an_empty_one(C):
    """Chunk-aligned packed sequences (as chunk_kda lays them out): the state restarts at each sequence's first
    chunk from its own initial state; an empty sequence's final state is its initial state."""
    seq_chunks = [(0, 2), (2, 2), (2, 5), (5, 6)]
    T, H, K, V = 6 * C, 2, 16, 24
    q, k, v, g, beta = inputs(1, T, H, K, V, "trained", seed=3)
    init = torch.randn(len(seq_chunks), H, K, V, dtype=torch.float64)
    o, final, starts = chunk_kda_fwd(q, k, v, g, beta, 0.3, init, C, seq_chunks)
    o2, final2, starts2 = cpu_kernel.chunk_fwd(q, k, v, g, beta, 0.3, init, C, seq_chunks)
    close(o2, o, 1e-12), close(final2, final, 1e-12), close(starts2, starts, 1e-12)
    assert torch.equal(final2[1], init[1])
    do, dfinal = torch.randn_like(o), torch.randn_like(final)
    want = chunk_kda_bwd(q, k, v, g, beta, starts, do, dfinal, 0.3, C, seq_chunks)
    got = cpu_kernel.chunk_bwd(q, k, v, g, beta, starts, do, dfinal, 0.3, C, seq_chunks)
    for a, b in zip(got, want, strict=True):
        close(a, b, 1e-11)
    assert torch.equal(got[-1][1], dfinal[1])  # the empty sequence passes its gradient straight through


def test_chunk_kda_runs_the_kernel_by_default_and_the_reference_when_asked(monkeypatch):
    calls = []
    for name in ("chunk_fwd", "chunk_bwd"):
        real = getattr(cpu_kernel, name)
        monkeypatch.setattr(
            cpu_kernel, name, lambda *a, _real=real, _name=name, **kw: calls.append(_name) or _real(*a, **kw)
        )
    q, k, v, g, beta = inputs(1, 100, 2, 16, 16, "trained")
    leaves = [x.requires_grad_() for x in (q, k, v, g, beta)]
    o, _ = chunk_kda(*leaves, output_final_state=True)
    o.square().sum().backward()
    assert calls == ["chunk_fwd", "chunk_bwd"]
    grads = [x.grad.clone() for x in leaves]

    calls.clear()
    monkeypatch.setenv(cpu_kernel.ENV_VAR, "off")
    for x in leaves:
        x.grad = None
    o2, _ = chunk_kda(*leaves, output_final_state=True)
    o2.square().sum().backward()
    assert calls == []
    close(o.detach(), o2.detach(), 1e-12)
    for a, x in zip(grads, leaves, strict=True):
        close(a, x.grad, 1e-11)


def test_a_wrong_switch_value_is_named(monkeypatch):
    monkeypatch.setenv(cpu_kernel.ENV_VAR, "fast")
    q, k, v, g, beta = inputs(1, 8, 1, 8, 8, "weak")
    with pytest.raises(ValueError, match="K3_KDA_CPU_KERNEL must be one of"):
        chunk_kda(q, k, v, g, beta)


def test_gradcheck_through_chunk_kda():
    """Finite differences through the public op with the kernel's backward (the in-kernel flags on, packed)."""
    q, k, v, g, beta = inputs(1, 37, 1, 8, 8, "trained", seed=5)
    h0 = torch.randn(2, 1, 8, 8, dtype=torch.float64)
    cu = torch.tensor([0, 20, 37])
    args = [x.requires_grad_() for x in (q, k, v, g, beta, h0)]

    def f(q, k, v, g, beta, h0):
        flags = dict(output_final_state=True, cu_seqlens=cu, chunk_size=32, use_qk_l2norm_in_kernel=True)
        return chunk_kda(q, k, v, g, beta, initial_state=h0, **flags)

    assert torch.autograd.gradcheck(f, args, atol=1e-7, fast_mode=True)


def test_fp32_kernel_agrees_with_the_float64_recurrence():
    q, k, v, g, beta = inputs(2, 300, 2, 32, 32, "unbounded", seed=7)
    want, want_final = naive_recurrent_kda(q, k, v, g, beta, output_final_state=True)
    got, final = chunk_kda(*(x.float() for x in (q, k, v, g, beta)), output_final_state=True)
    close(got.double(), want, 2e-5)
    close(final.double(), want_final, 2e-5)


def test_the_operators_contract():
    """Schema, fake (meta) kernels and aliasing as torch.compile checks them (torch.library.opcheck)."""
    q, k, v, g, beta = inputs(1, 64, 2, 16, 8, "trained", dtype=torch.float32)
    h0 = torch.randn(1, 2, 16, 8)
    fwd = (q, k, v, g, beta, 0.25, 32, h0, None, None, 1, True)
    torch.library.opcheck(torch.ops.k3_kda.chunk_fwd.default, fwd, test_utils=("test_schema", "test_faketensor"))
    o, final, starts = torch.ops.k3_kda.chunk_fwd(*fwd)
    bwd = (q, k, v, g, beta, starts, torch.randn_like(o), torch.randn_like(final), 0.25, 32, None, None, 1)
    torch.library.opcheck(torch.ops.k3_kda.chunk_bwd.default, bwd, test_utils=("test_schema", "test_faketensor"))


def test_the_operators_refuse_what_they_cannot_compute():
    q, k, v, g, beta = inputs(1, 48, 1, 16, 16, "weak", dtype=torch.float32)
    with pytest.raises(RuntimeError, match="multiple of chunk_size"):
        torch.ops.k3_kda.chunk_fwd(q, k, v, g, beta, 0.25, 32, None, None, None, 1, False)
    with pytest.raises(RuntimeError, match="float32 or float64"):
        torch.ops.k3_kda.chunk_fwd(*(x.half() for x in (q, k, v, g, beta)), 0.25, 16, None, None, None, 1, False)
    with pytest.raises(RuntimeError, match="contiguous"):
        strided = torch.cat([q, q], dim=-1)[..., :16]
        torch.ops.k3_kda.chunk_fwd(strided, k, v, g, beta, 0.25, 16, None, None, None, 1, False)


@pytest.mark.parametrize("threads", [1, 3])
def test_both_schedules_equal_the_reference(threads):
    """Whole heads per thread (1 thread: no barrier between the terms and the recursion) and chunk groups in
    parallel over (head, chunk) (4 heads on 3 threads), with several chunks a group."""
    q, k, v, g, beta = inputs(2, 300, 2, 16, 24, "trained", seed=11)
    init = torch.randn(2, 2, 16, 24, dtype=torch.float64)
    o, final, starts = chunk_kda_fwd(q, k, v, g, beta, 0.25, init, 32)
    do, dfinal = torch.randn_like(o), torch.randn_like(final)
    want = chunk_kda_bwd(q, k, v, g, beta, starts, do, dfinal, 0.25, 32, None)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        o2, final2, starts2 = cpu_kernel.chunk_fwd(q, k, v, g, beta, 0.25, init, 32)
        got = cpu_kernel.chunk_bwd(q, k, v, g, beta, starts, do, dfinal, 0.25, 32, None)
    finally:
        torch.set_num_threads(before)
    for a, b in ((o2, o), (final2, final), (starts2, starts), *zip(got, want, strict=True)):
        close(a, b, 1e-11)


def test_torch_compile_traces_the_op_as_one_node_each_way():
    """fullgraph: no graph break from the build, the environment switch or the autograd Function; AOT autograd
    runs the fake kernels for shapes; values and gradients equal eager's."""
    from k3.ops.kda.chunk import ChunkKDAFunction

    q, k, v, g, beta = inputs(1, 100, 2, 16, 16, "trained", dtype=torch.float32)

    def f(q, k, v, g, beta):
        o, final = ChunkKDAFunction.apply(q.sin(), k, v, g, beta, None, 0.25, 64, None)
        return (o * o).sum() + final.sum()

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    results = []
    for fn in (compiled, f):
        leaves = [x.clone().requires_grad_() for x in (q, k, v, g, beta)]
        out = fn(*leaves)
        out.backward()
        results.append((out.detach(), [x.grad for x in leaves]))
    (a, ga), (b, gb) = results
    close(a, b, 1e-6)
    for x, y in zip(ga, gb, strict=True):
        close(x, y, 1e-5)


def test_a_truncated_cached_library_is_recognised(tmp_path):
    """dlopen of a truncated library can die with SIGBUS instead of raising, so the cache is checked first (a
    truncated one is built again; tried by hand: a 1,000-byte cut of the library rebuilds in ~15 s)."""
    built = next(cpu_library.cache_dir().glob(f"{cpu_library.NAME}_{cpu_library._key()}/*.so"))
    assert not cpu_library._truncated(built)
    for size in (10, 1000, built.stat().st_size - 1):
        cut = tmp_path / f"cut{size}.so"
        cut.write_bytes(built.read_bytes()[:size])
        assert cpu_library._truncated(cut), size


def test_the_operators_check_shapes_against_each_other():
    q, k, v, g, beta = inputs(2, 64, 2, 16, 8, "weak", dtype=torch.float32)
    with pytest.raises(RuntimeError, match="num_seqs must be B"):
        torch.ops.k3_kda.chunk_fwd(q, k, v, g, beta, 0.25, 32, None, None, None, 1, False)
    with pytest.raises(RuntimeError, match="v must have shape"):
        torch.ops.k3_kda.chunk_fwd(q, k, v[:1], g, beta, 0.25, 32, None, None, None, 2, False)
    with pytest.raises(RuntimeError, match="h0 must have shape"):
        torch.ops.k3_kda.chunk_fwd(q, k, v, g, beta, 0.25, 32, torch.zeros(1, 2, 16, 8), None, None, 2, False)
    first = last = torch.tensor([0, 5])
    with pytest.raises(RuntimeError, match="below num_seqs"):
        torch.ops.k3_kda.chunk_fwd(q[:1], k[:1], v[:1], g[:1], beta[:1], 0.25, 32, None, first, last, 1, False)


def test_a_first_chunk_that_starts_no_sequence_starts_from_zeros():
    """A layout the operator accepts although chunk_kda never builds it: chunk 0 belongs to no sequence. Its state
    starts from zeros, as the reference's, whatever an earlier call left in the kernel's workspaces."""
    q, k, v, g, beta = inputs(1, 96, 2, 16, 8, "weak")
    big = inputs(1, 96, 2, 16, 8, "weak", seed=1)
    cpu_kernel.chunk_fwd(*big[:2], big[2] * 1e6, *big[3:], 0.25, None, 32)  # leaves a large state behind
    seq_chunks = [(1, 3)]
    want = chunk_kda_fwd(q, k, v, g, beta, 0.25, None, 32, seq_chunks)
    got = cpu_kernel.chunk_fwd(q, k, v, g, beta, 0.25, None, 32, seq_chunks)
    for a, b in zip(got, want, strict=True):
        close(a, b, 1e-12)


def _reference_step(monkeypatch, *args, **kwargs):
    """fused_recurrent_kda's torch path (the step kernel switched off for the call)."""
    with monkeypatch.context() as m:
        m.setattr(cpu_kernel, "step_usable", lambda *a: False)
        return fused_recurrent_kda(*args, **kwargs)


@pytest.mark.parametrize("lower_bound", [-5.0, None])
@pytest.mark.parametrize("layout", ["pool rows", "strided states"])
def test_decoding_step_kernel_equals_the_torch_path(monkeypatch, lower_bound, layout):
    """k3_kda::recurrent_step (one token per sequence, states updated in place) against fused_recurrent_kda's torch
    path in float64: raw inputs through the in-kernel l2norm, gate (bounded and unbounded) and sigmoid, states as
    rows of a pool or as a strided view of one (the engine's rows in arithmetic progression)."""
    B, H, K, V, P = 3, 2, 24, 40, 8
    gen = torch.Generator().manual_seed(1)
    q, k, g = (torch.randn(B, 1, H, K, generator=gen, dtype=torch.float64) for _ in range(3))
    v = torch.randn(B, 1, H, V, generator=gen, dtype=torch.float64)
    beta = torch.randn(B, 1, H, generator=gen, dtype=torch.float64)
    kw = dict(
        use_qk_l2norm_in_kernel=True,
        use_gate_in_kernel=True,
        use_beta_sigmoid_in_kernel=True,
        A_log=torch.rand(H, generator=gen, dtype=torch.float64),
        dt_bias=torch.randn(H * K, generator=gen, dtype=torch.float64),
        lower_bound=lower_bound,
        inplace_final_state=True,
    )
    pool = torch.randn(P, H, K, V, generator=gen, dtype=torch.float64)
    got_pool, want_pool = pool.clone(), pool.clone()
    if layout == "pool rows":
        rows = torch.tensor([5, 0, 3])
        got = fused_recurrent_kda(q, k, v, g, beta, initial_state=got_pool, ssm_state_indices=rows, **kw)[0]
        want = _reference_step(monkeypatch, q, k, v, g, beta, initial_state=want_pool, ssm_state_indices=rows, **kw)[0]
    else:
        got = fused_recurrent_kda(q, k, v, g, beta, initial_state=got_pool[1:7:2], **kw)[0]
        want = _reference_step(monkeypatch, q, k, v, g, beta, initial_state=want_pool[1:7:2], **kw)[0]
    close(got, want, 1e-13)
    close(got_pool, want_pool, 1e-13)
    assert not torch.equal(got_pool, pool)  # the states moved, in place


def test_decoding_step_kernel_refuses_a_row_outside_the_pool():
    B, H, K, V = 1, 1, 8, 8
    x = torch.randn(B, H, K)
    with pytest.raises(RuntimeError, match="state row 9 is outside the pool's 4 rows"):
        torch.ops.k3_kda.recurrent_step(
            x, x, torch.randn(B, H, V), x, torch.randn(B, H), None, None, 1.0, None,
            True, False, True, False, torch.zeros(4, H, K, V), torch.tensor([9]),
        )  # fmt: skip


@pytest.mark.parametrize("lower_bound", [-5.0, None])
def test_a_kda_layers_decoding_step_on_the_kernel_equals_its_reference(monkeypatch, lower_bound):
    """KimiDeltaAttention.mix for one token: k3_kda::conv_recurrent_step (convolutions, conv tails shifted in
    place, recurrence) against the layer's own path (causal_conv + fused_recurrent_kda's torch path) in float64,
    the states and tails as rows of a pool, on odd sizes and the bounded and unbounded gates."""
    from k3 import K3Config
    from k3.model.kda import KimiDeltaAttention

    config = K3Config.from_preset("tiny", kda_num_heads=3, kda_head_dim=24, gate_lower_bound=lower_bound)
    torch.manual_seed(0)
    layer = KimiDeltaAttention(config).double()
    layer.reset_gate_parameters()
    B, P, H, K = 3, 7, 3, 24
    C, w = 2 * H * K + H * K, config.short_conv_kernel_size
    rows = torch.tensor([4, 0, 6])

    states = torch.randn(P, H, K, K, dtype=torch.float64)
    convs = torch.randn(P, C, w - 1, dtype=torch.float64)
    qkv = torch.randn(B, 1, C, dtype=torch.float64)
    g_raw, beta_raw = torch.randn(B, 1, H, K, dtype=torch.float64), torch.randn(B, 1, H, dtype=torch.float64)
    assert cpu_kernel.conv_step_usable(qkv, states, convs)
    (got, fast), (want, slow) = kda_step_both_ways(layer, (qkv, g_raw, beta_raw), states, convs, rows, monkeypatch)
    close(got, want, 1e-13)
    close(fast.states, slow.states, 1e-13)
    assert torch.equal(fast.convs, slow.convs)  # the tails are shifted, not computed
    assert not torch.equal(fast.convs, convs)
