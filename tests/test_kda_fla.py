"""k3's KDA against flash-linear-attention: its pure-PyTorch references on CPU, its Triton kernels on
CUDA. Skipped cleanly when fla (or a GPU) is not there."""

import copy

import pytest
import torch

from k3.ops.kda import chunk_kda, fused_recurrent_kda, naive_recurrent_kda
from k3.ops.kda.backend import fla_kda, fla_naive
from kda_inputs import grads_of, make_inputs, random_state, rel_rms

FLA = fla_naive()
needs_fla = pytest.mark.skipif(FLA is None, reason="flash-linear-attention is not installed")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
# inside a CUDA test: the fla case is skipped without fla's kernels, the torch case still runs
needs_fla_kernels = pytest.mark.skipif(fla_kda() is None, reason="needs fla's Triton kernels")


@needs_fla
@pytest.mark.parametrize("T", [1, 65, 128])
def test_chunk_matches_fla_naive_recurrent(T):
    """fla's reference computes in fp32, so this compares at fp32 precision."""
    q, k, v, g, beta = make_inputs(2, T, 2, 32, 16, dtype=torch.float32)
    h0 = random_state(2, 2, 32, 16, dtype=torch.float32)
    o, S = chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    ref_o, ref_S = FLA.naive_recurrent_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    assert rel_rms(o, ref_o) < 1e-5 and rel_rms(S, ref_S) < 1e-5


@needs_fla
def test_chunk_matches_fla_naive_chunk_with_gva():
    q, k, v, g, beta = make_inputs(1, 128, 2, 32, 16, HV=4, dtype=torch.float32)
    h0 = random_state(1, 4, 32, 16, dtype=torch.float32)
    o, S = chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    ref_o, ref_S = FLA.naive_chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    assert rel_rms(o, ref_o) < 1e-5 and rel_rms(S, ref_S) < 1e-5


@needs_fla
def test_reference_matches_fla_reference():
    """Our per-timestep reference and fla's are the same recurrence."""
    q, k, v, g, beta = make_inputs(1, 50, 3, 16, 24, dtype=torch.float32)
    o, S = naive_recurrent_kda(q, k, v, g, beta, output_final_state=True)
    ref_o, ref_S = FLA.naive_recurrent_kda(q, k, v, g, beta, output_final_state=True)
    assert rel_rms(o, ref_o) < 1e-6 and rel_rms(S, ref_S) < 1e-6


# ---- on a GPU: fla's Triton kernels and the torch path on CUDA against the fp64 CPU reference ------------
FLAGS = dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True, lower_bound=-5.0)
BACKENDS = ["torch", pytest.param("fla", marks=needs_fla_kernels)]


def raw(B, T, H, K, V, HV=None, seed=0):
    """Pre-activation inputs (the model's), with A_log and dt_bias, in fp64 on the CPU."""
    q, k, v, g, beta = make_inputs(B, T, H, K, V, HV=HV, seed=seed, raw=True)
    gen = torch.Generator().manual_seed(seed + 3)
    HV = HV or H
    return [
        q,
        k,
        v,
        g,
        beta,
        torch.randn(HV, generator=gen, dtype=torch.float64) * 0.5,
        torch.randn(HV * K, generator=gen, dtype=torch.float64),
    ]


def tolerance(backend: str, dtype: torch.dtype) -> float:
    # fla's kernels use tf32 for fp32 dots; bf16 inputs carry bf16 rounding on either path
    return 2e-2 if dtype == torch.bfloat16 else 5e-3 if backend == "fla" else 1e-4


@needs_cuda
@pytest.mark.cuda
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("T", "HV", "cu"), [(63, None, None), (200, 4, None), (300, None, [0, 17, 130, 300])])
def test_cuda_chunk_matches_cpu_reference(backend, dtype, T, HV, cu):
    """The chunked form on CUDA with the model's flags (in-kernel gate with A_log/dt_bias, L2 norm,
    beta sigmoid), grouped value heads, packed sequences and an initial state: forward and every
    gradient against the fp64 CPU path."""
    H, K, V = 2, 64, 64
    N = 1 if cu is None else len(cu) - 1
    cpu = [*raw(1, T, H, K, V, HV=HV), random_state(N, HV or H, K, V)]
    cu_cpu = None if cu is None else torch.tensor(cu)

    def call(device_backend, cu_seqlens):
        def fn(q, k, v, g, beta, A_log, dt_bias, h0):
            return chunk_kda(
                q,
                k,
                v,
                g,
                beta,
                initial_state=h0,
                output_final_state=True,
                A_log=A_log,
                dt_bias=dt_bias,
                cu_seqlens=cu_seqlens,
                backend=device_backend,
                **FLAGS,
            )

        return fn

    o2, S2, g2 = grads_of(call("torch", cu_cpu), cpu)
    cuda = [x.to("cuda", dtype if i < 5 else torch.float32) for i, x in enumerate(cpu)]  # params and state fp32
    o1, S1, g1 = grads_of(call(backend, None if cu is None else cu_cpu.cuda()), cuda)
    tol = tolerance(backend, dtype)
    assert o1.dtype == dtype and S1.dtype == torch.float32
    assert rel_rms(o1.cpu(), o2) < tol and rel_rms(S1.cpu(), S2) < tol
    for name, a, b in zip(["q", "k", "v", "g", "beta", "A_log", "dt_bias", "h0"], g1, g2, strict=True):
        assert rel_rms(a.cpu(), b) < 4 * tol, name


@needs_cuda
@pytest.mark.cuda
@pytest.mark.parametrize("backend", BACKENDS)
def test_cuda_decode_in_place_over_a_pool(backend):
    """Batched in-place decoding (B = 3) with the KDA layer's non-contiguous views, states in rows of a
    pool addressed by indices, against the fp64 reference; rows not named stay untouched."""
    B, T, H, K, V = 3, 8, 2, 64, 64
    q, k, v, g, beta, A_log, dt_bias = raw(B, T, H, K, V)
    h0 = random_state(B, H, K, V)
    ref_o, ref_S = chunk_kda(
        q, k, v, g, beta, A_log=A_log, dt_bias=dt_bias, initial_state=h0, output_final_state=True, **FLAGS
    )
    qkv = torch.cat([x.reshape(B, T, H * K) for x in (q, k, v)], dim=-1).float().cuda()
    q1, k1, v1 = (x.reshape(B, T, H, K) for x in qkv.split(H * K, dim=-1))  # views, as the layer has them
    g1, b1, A1, d1 = (x.float().cuda() for x in (g, beta, A_log, dt_bias))
    pool = torch.randn(7, H, K, V, device="cuda")
    rows = torch.tensor([5, 0, 3], device="cuda")
    pool[rows] = h0.float().cuda()
    before = pool.clone()
    outs = []
    for t in range(T):
        step = [x[:, t : t + 1] for x in (q1, k1, v1, g1, b1)]
        o, _ = fused_recurrent_kda(
            *step,
            A1,
            d1,
            initial_state=pool,
            ssm_state_indices=rows,
            inplace_final_state=True,
            backend=backend,
            **FLAGS,
        )
        outs.append(o)
    assert rel_rms(torch.cat(outs, dim=1).cpu(), ref_o) < 5e-3
    assert rel_rms(pool[rows].cpu(), ref_S) < 5e-3
    others = torch.tensor([1, 2, 4, 6], device="cuda")
    assert torch.equal(pool[others], before[others])


@needs_cuda
@pytest.mark.cuda
@pytest.mark.parametrize("backend", BACKENDS)
def test_cuda_several_tokens_per_sequence_into_pool_rows(backend):
    """1-D indices with T > 1 (k3's meaning: each sequence's final state in its row) on CUDA."""
    B, T, H, K, V = 2, 5, 2, 64, 64
    q, k, v, g, beta, A_log, dt_bias = raw(B, T, H, K, V, seed=4)
    h0 = random_state(B, H, K, V)
    ref_o, ref_S = chunk_kda(
        q, k, v, g, beta, A_log=A_log, dt_bias=dt_bias, initial_state=h0, output_final_state=True, **FLAGS
    )
    pool = torch.zeros(4, H, K, V, device="cuda")
    rows = torch.tensor([3, 1], device="cuda")
    pool[rows] = h0.float().cuda()
    o, _ = fused_recurrent_kda(
        *(x.float().cuda() for x in (q, k, v, g, beta, A_log, dt_bias)),
        initial_state=pool,
        ssm_state_indices=rows,
        inplace_final_state=True,
        backend=backend,
        **FLAGS,
    )
    assert rel_rms(o.cpu(), ref_o) < 5e-3 and rel_rms(pool[rows].cpu(), ref_S) < 5e-3
    assert pool[[0, 2]].abs().sum() == 0


@needs_cuda
@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_model_and_engine_match_the_cpu(dtype):
    """The tiny model's logits on CUDA (whatever backend 'auto' picks there) against the fp64 CPU model,
    and the engine's greedy tokens on CUDA against the CPU engine's."""
    from k3.formats.tokenizer import byte_tokenizer
    from k3.serve.engine import EngineConfig, LLMEngine
    from k3.serve.sampling import SamplingParams
    from tiny_models import tiny_model

    tok = byte_tokenizer()
    cpu_model = tiny_model(vocab_size=tok.vocab_size)
    with torch.no_grad():  # logits far apart, so that rounding differences cannot flip a greedy choice
        cpu_model.lm_head.weight.mul_(30)
    cuda_model = copy.deepcopy(cpu_model).to("cuda", dtype)
    tokens = torch.randint(0, tok.vocab_size, (2, 70), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = cpu_model(tokens).logits
        got = cuda_model(tokens.cuda()).logits.double().cpu()
    assert rel_rms(got, ref) < (6e-2 if dtype == torch.bfloat16 else 1e-3)

    prompts = [list(range(5, 5 + n)) for n in (3, 17, 40, 9)]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)

    def run(model):
        eng = LLMEngine(model, tok, EngineConfig(num_pages=400))
        ids = [eng.add_request(p, params) for p in prompts]
        out = {i: [] for i in ids}
        while eng.has_unfinished():
            for r in eng.step():
                out[r.request_id] += r.new_token_ids
        model_dtype = next(model.parameters()).dtype
        assert eng.pool.kda_states().dtype == (torch.float64 if model_dtype == torch.float64 else torch.float32)
        return [out[i] for i in ids]

    if dtype == torch.float32:  # bf16 may flip a near-tie greedy choice; fp32 must not
        assert run(cuda_model) == run(cpu_model)
    else:
        run(cuda_model)  # runs, with fp32 states in the bf16 pool
