"""k3's fla dispatch without a GPU: a stand-in that enforces fla 0.6.0's input contract (tests/fla_standin.py)
is installed for CPU tensors, and the op, the model, the serving engine and a training step are run
through it and compared with the torch path."""

import importlib.metadata
import warnings
from pathlib import Path

import pytest
import torch

import fla_standin
import k3.ops.kda.cpu_kernel as cpu_kernel
from k3 import K3Config, K3Model
from k3.cli import main
from k3.formats.tokenizer import byte_tokenizer
from k3.ops.kda import backend as kda_backend
from k3.ops.kda import chunk_kda, fused_recurrent_kda
from k3.ops.kda.backend import KernelContractError, fla_version_tested, resolve, use_kernels
from k3.serve.engine import EngineConfig, LLMEngine
from k3.serve.sampling import SamplingParams
from kda_inputs import grads_of, make_inputs, random_state, rel_rms
from tiny_runs import logged_losses, tiny_train_args

TOK = byte_tokenizer()

FLAGS = dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True, lower_bound=-5.0)


@pytest.fixture
def standin():
    fla_standin.CALLS.clear()
    with use_kernels(fla_standin.module, "cpu"):
        yield fla_standin.CALLS


def raw_inputs(B, T, H=2, K=16, V=16, HV=None, seed=0, dtype=torch.float32):
    q, k, v, g, beta = make_inputs(B, T, H, K, V, HV=HV, dtype=dtype, seed=seed, raw=True)
    HV = HV or H
    gen = torch.Generator().manual_seed(seed + 7)
    A_log = torch.randn(HV, generator=gen).to(dtype)
    dt_bias = torch.randn(HV * K, generator=gen).to(dtype)
    return q, k, v, g, beta, A_log, dt_bias


# ---- the chunked form --------------------------------------------------------------------------------
@pytest.mark.parametrize("HV", [None, 4])
def test_chunk_through_the_standin_equals_the_torch_path(standin, HV):
    """Flags, A_log/dt_bias, grouped value heads, packed sequences, a bf16 initial state (fla asserts
    fp32: the seam upcasts it), forward and every gradient."""
    q, k, v, g, beta, A_log, dt_bias = raw_inputs(1, 90, HV=HV)
    h0 = random_state(3, HV or 2, 16, 16, dtype=torch.float32).bfloat16()
    cu = torch.tensor([0, 7, 40, 90])

    def run(backend):
        def fn(q, k, v, g, beta, h0, A_log, dt_bias):
            return chunk_kda(
                q,
                k,
                v,
                g,
                beta,
                initial_state=h0,
                output_final_state=True,
                cu_seqlens=cu,
                A_log=A_log,
                dt_bias=dt_bias,
                backend=backend,
                **FLAGS,
            )

        return grads_of(fn, [q, k, v, g, beta, h0, A_log, dt_bias])

    o1, S1, g1 = run("fla")
    assert standin == ["chunk_kda"]
    o2, S2, g2 = run("torch")
    assert rel_rms(o1, o2) < 1e-6 and rel_rms(S1, S2) < 1e-6
    for a, b in zip(g1, g2, strict=True):
        assert rel_rms(a, b) < 1e-6


def test_chunk_new_fla_arguments_agree(standin):
    """state_v_first, cu_seqlens_cpu, disable_recompute and return_intermediate_states on both paths."""
    q, k, v, g, beta, A_log, dt_bias = raw_inputs(1, 100)
    cu = torch.tensor([0, 30, 100])
    h0 = random_state(2, 2, 16, 16, dtype=torch.float32)
    kw = dict(
        A_log=A_log,
        dt_bias=dt_bias,
        cu_seqlens=cu,
        cu_seqlens_cpu=cu.clone(),
        output_final_state=True,
        state_v_first=True,
        chunk_size=32,
        **FLAGS,
    )
    with torch.inference_mode():
        fla = chunk_kda(q, k, v, g, beta, initial_state=h0, return_intermediate_states=True, backend="fla", **kw)
        tch = chunk_kda(q, k, v, g, beta, initial_state=h0, return_intermediate_states=True, backend="torch", **kw)
    for a, b in zip(fla, tch, strict=True):
        assert rel_rms(a, b) < 1e-6
    assert tch[2].shape == (1, 1 + 3, 2, 16, 16)  # ceil(30/32) + ceil(70/32) chunks
    o3, S3 = chunk_kda(q, k, v, g, beta, initial_state=h0, disable_recompute=True, backend="fla", **kw)
    assert rel_rms(o3, tch[0]) < 1e-6 and rel_rms(S3, tch[1]) < 1e-6


# ---- the recurrent form: in-place decoding over a batch ---------------------------------------------------
def noncontiguous(B, T, H=2, K=16, seed=0):
    """q, k, v as the KDA layer makes them: views split from one (B, T, 3·H·K) tensor, not contiguous."""
    gen = torch.Generator().manual_seed(seed)
    qkv = torch.randn(B, T, 3 * H * K, generator=gen)
    q, k, v = (x.reshape(B, T, H, K) for x in qkv.split(H * K, dim=-1))
    g = torch.randn(B, T, H, K, generator=gen)
    beta = torch.randn(B, T, H, generator=gen)
    return q, k, v, g, beta


def test_batched_in_place_decode_with_the_layers_views(standin):
    """Rows 1+ of a batch read the right memory: the seam makes the kernel's inputs contiguous."""
    A_log, dt_bias = torch.randn(2), torch.randn(32)
    q, k, v, g, beta = noncontiguous(3, 6)
    assert not q.is_contiguous()
    S_fla = random_state(3, 2, 16, 16, dtype=torch.float32)
    S_torch = S_fla.clone()
    for t in range(6):
        step = [x[:, t : t + 1] for x in (q, k, v, g, beta)]
        o1, _ = fused_recurrent_kda(
            *step, A_log, dt_bias, initial_state=S_fla, inplace_final_state=True, backend="fla", **FLAGS
        )
        o2, _ = fused_recurrent_kda(
            *step, A_log, dt_bias, initial_state=S_torch, inplace_final_state=True, backend="torch", **FLAGS
        )
        assert rel_rms(o1, o2) < 1e-6
    assert rel_rms(S_fla, S_torch) < 1e-6
    assert "fused_recurrent_kda_fwd" in standin


def test_pool_rows_with_one_index_per_sequence_and_several_tokens(standin):
    """k3's documented 1-D indices: sequence i reads and writes row indices[i], whatever its length.
    fla's kernel reads one index per token, so the seam gives it one; other rows stay untouched."""
    q, k, v, g, beta, A_log, dt_bias = raw_inputs(2, 5)
    pool = random_state(6, 2, 16, 16, dtype=torch.float32)
    idx = torch.tensor([4, 1])
    pools = {b: pool.clone() for b in ("fla", "torch")}
    kw = dict(ssm_state_indices=idx, inplace_final_state=True, output_final_state=True, **FLAGS)
    inputs = (q, k, v, g, beta, A_log, dt_bias)
    outs = {b: fused_recurrent_kda(*inputs, initial_state=pools[b], backend=b, **kw) for b in pools}
    assert rel_rms(outs["fla"][0], outs["torch"][0]) < 1e-6
    assert rel_rms(outs["fla"][1], outs["torch"][1]) < 1e-6
    assert torch.equal(pools["fla"][[0, 2, 3, 5]], pool[[0, 2, 3, 5]])
    assert rel_rms(pools["fla"], pools["torch"]) < 1e-6
    assert not torch.equal(pools["torch"][4], pool[4])


def test_per_token_indices_write_every_tokens_state(standin):
    """fla's [N, T] indices (verifying draft tokens): the state after token t of sequence n lands in row
    [n, t], on both paths, packed sequences of different lengths included."""
    q, k, v, g, beta, A_log, dt_bias = raw_inputs(1, 7)
    cu = torch.tensor([0, 3, 7])
    idx = torch.tensor([[0, 1, 2, -1], [3, 4, 5, 6]])  # -1: a padding slot past sequence 0's 3 tokens
    pools = {b: random_state(8, 2, 16, 16, dtype=torch.float32) for b in ("fla", "torch")}
    for b, pool in pools.items():
        fused_recurrent_kda(
            q,
            k,
            v,
            g,
            beta,
            A_log,
            dt_bias,
            initial_state=pool,
            cu_seqlens=cu,
            ssm_state_indices=idx,
            inplace_final_state=True,
            backend=b,
            **FLAGS,
        )
    assert rel_rms(pools["fla"], pools["torch"]) < 1e-6
    # row 2 is sequence 0 after its 3 tokens: what a plain call from row 0's old state gives
    start = random_state(8, 2, 16, 16, dtype=torch.float32)[0:1]
    _, S = fused_recurrent_kda(
        *(x[:, :3] for x in (q, k, v, g, beta)),
        A_log,
        dt_bias,
        initial_state=start,
        output_final_state=True,
        backend="torch",
        **FLAGS,
    )
    assert rel_rms(pools["torch"][2], S[0]) < 1e-6


def test_states_updated_in_place_must_be_fp32():
    q, k, v, g, beta, A_log, dt_bias = raw_inputs(2, 1)
    state = random_state(2, 2, 16, 16, dtype=torch.float32).bfloat16()
    with pytest.raises(ValueError, match=r"updated in place must be torch\.float32"):
        fused_recurrent_kda(q, k, v, g, beta, A_log, dt_bias, initial_state=state, inplace_final_state=True, **FLAGS)


# ---- what the dispatch must never do silently --------------------------------------------------------------
def test_gradients_are_never_dropped(standin):
    """fla's recurrent kernel has no backward: 'auto' takes the torch path when a gradient is needed,
    and an explicit 'fla' says so."""
    q, k, v, g, beta = (x.requires_grad_() for x in make_inputs(1, 4, 2, 16, 16, dtype=torch.float32))
    o, _ = fused_recurrent_kda(q, k, v, g, beta)
    assert o.requires_grad and standin == []
    o.sum().backward()
    assert q.grad is not None and q.grad.abs().sum() > 0
    with pytest.raises(ValueError, match="no backward"):
        fused_recurrent_kda(q, k, v, g, beta, backend="fla")
    with torch.no_grad():
        fused_recurrent_kda(q, k, v, g, beta)
    assert standin == ["fused_recurrent_kda"]  # without gradients 'auto' does take fla


def test_fp64_goes_to_the_torch_path(standin):
    q, k, v, g, beta = make_inputs(1, 40, 2, 16, 16)  # float64
    chunk_kda(q, k, v, g, beta)
    assert standin == []
    with pytest.raises(ValueError, match="float64"):
        chunk_kda(q, k, v, g, beta, backend="fla")


def test_index_tensors_on_another_device_are_refused():
    q, k, v, g, beta = make_inputs(1, 8, 2, 16, 16)
    with pytest.raises(ValueError, match="cu_seqlens must be on q's device"):
        chunk_kda(q, k, v, g, beta, cu_seqlens=torch.tensor([0, 8], device="meta"))
    with pytest.raises(ValueError, match="ssm_state_indices must be on q's device"):
        step = [x[:, :1] for x in (q, k, v, g, beta)]
        fused_recurrent_kda(
            *step, initial_state=random_state(2, 2, 16, 16), ssm_state_indices=torch.tensor([1], device="meta")
        )


def test_the_standin_catches_what_fla_would_get_wrong(standin):
    """The contract checks are real: a non-contiguous input, a bf16 initial state and per-sequence
    indices for several tokens each fail when sent to the kernel directly."""
    q, k, v, g, beta = noncontiguous(2, 3)
    pool = random_state(4, 2, 16, 16, dtype=torch.float32)
    with pytest.raises(KernelContractError, match="contiguous"):
        fla_standin.fused_recurrent_kda_fwd(
            q, k, v, g, beta, initial_state=pool, ssm_state_indices=torch.tensor([0, 1])
        )
    with pytest.raises(KernelContractError, match="float32"):
        fla_standin.chunk_kda(*make_inputs(1, 8, 2, 16, 16, dtype=torch.float32), initial_state=pool[:1].bfloat16())
    with pytest.raises(ValueError, match="32 or 64"):
        fla_standin.chunk_kda(*make_inputs(1, 8, 2, 16, 16, dtype=torch.float32), chunk_size=16)
    # 1-D indices, 3 tokens each: the kernel reads indices[n + t], i.e. sequence 0's token 1 uses row 1
    q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
    rows = pool.clone()
    fla_standin.fused_recurrent_kda_fwd(
        q, k, v, g, beta, initial_state=rows, ssm_state_indices=torch.tensor([2, 3, 0, 0])
    )
    assert not torch.equal(rows[0], pool[0])  # a row neither sequence owns was written


# ---- versions and the switch -----------------------------------------------------------------------------
def test_untested_fla_versions_fall_back_with_one_warning(monkeypatch):
    assert fla_version_tested("0.6.0") and fla_version_tested("0.6.3.dev1")
    assert not fla_version_tested("0.5.9") and not fla_version_tested("0.7.0") and not fla_version_tested(None)
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "0.4.1")
    kda_backend.fla_kda.cache_clear()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert kda_backend.fla_kda() is None
            assert kda_backend.fla_kda() is None
        assert len(caught) == 1 and "0.4.1 is outside the range" in str(caught[0].message)
        with pytest.raises(ValueError, match=r"0\.4\.1 is outside the tested range"):
            resolve("fla", _cuda_like())
    finally:
        kda_backend.fla_kda.cache_clear()


def _cuda_like() -> torch.Tensor:
    """A tensor whose device type is what the real kernels need, without a GPU: resolve only reads it."""

    class Fake:
        device = torch.device("cuda", 0)
        dtype = torch.float32

    return Fake()


# ---- the model, the serving engine and the trainer through the dispatch ------------------------------------
def test_model_training_step_through_the_standin(standin):
    """The model's forward and every parameter gradient are those of the torch path."""
    torch.manual_seed(0)
    model = K3Model(K3Config.from_preset("tiny"))
    tokens = torch.randint(0, 512, (2, 37))

    def grads() -> dict[str, torch.Tensor]:
        model.zero_grad()
        model(tokens, labels=tokens).loss.backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    with_fla = grads()
    assert "chunk_kda" in standin
    with use_kernels(None, "none"):  # nothing installed for cpu tensors: the torch path
        plain = grads()
    assert with_fla.keys() == plain.keys()
    for name in plain:
        assert rel_rms(with_fla[name], plain[name]) < 1e-5, name


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_engine_through_the_standin(standin, dtype, monkeypatch):
    """Batched prefill and decode over the page pool: KDA states stay fp32 in the pool whatever the
    model's dtype (fla asserts an fp32 initial state, and a bf16 state would be rounded every step),
    and the greedy tokens are those of the torch path."""
    # decode steps through the op layer (fla's stand-in), not the layers' C++ decoding step that takes them on a CPU
    monkeypatch.setattr(cpu_kernel, "conv_step_usable", lambda *a: False)
    torch.manual_seed(0)
    model = K3Model(K3Config.from_preset("tiny", vocab_size=TOK.vocab_size)).to(dtype).eval()
    prompts = [list(range(5, 5 + n)) for n in (3, 17, 40, 9)]
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)

    def run() -> tuple[list[list[int]], torch.dtype]:
        eng = LLMEngine(model, TOK, EngineConfig(num_pages=300))
        ids = [eng.add_request(p, params) for p in prompts]
        tokens = {i: [] for i in ids}
        while eng.has_unfinished():
            for out in eng.step():
                tokens[out.request_id] += out.new_token_ids
        return [tokens[i] for i in ids], eng.pool.kda_states().dtype

    fla_tokens, state_dtype = run()
    assert state_dtype == torch.float32
    assert {"chunk_kda", "fused_recurrent_kda_fwd"} <= set(standin)
    with use_kernels(None, "none"):
        assert run()[0] == fla_tokens


def test_train_cli_through_the_standin(standin, tmp_path):
    """`k3 train` with fla's kernels stood in logs the losses of the torch path, bitwise."""
    args = tiny_train_args(tmp_path)
    assert main([*args, "--out", str(tmp_path / "fla")]) == 0
    assert "chunk_kda" in standin
    with use_kernels(None, "none"):
        assert main([*args, "--out", str(tmp_path / "torch")]) == 0
    assert logged_losses(tmp_path / "fla") == logged_losses(tmp_path / "torch")


def test_the_pinned_fla_range_is_the_tested_one():
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())["project"]
    lo, hi = (".".join(map(str, v)) for v in kda_backend.FLA_TESTED)
    for name in ("flash-linear-attention", "fla-core"):
        assert f"{name}>={lo},<{hi}" in project["optional-dependencies"]["cuda"]
