"""k3's KDA against flash-linear-attention: its pure-PyTorch references on CPU, its Triton kernels on
CUDA. Skipped cleanly when fla (or a GPU) is not there."""

import pytest
import torch

from k3.ops.kda import chunk_kda, fused_recurrent_kda, naive_recurrent_kda
from k3.ops.kda.backend import fla_kda, fla_naive
from kda_inputs import grads_of, make_inputs, random_state, rel_rms

FLA = fla_naive()
needs_fla = pytest.mark.skipif(FLA is None, reason="flash-linear-attention is not installed")
needs_cuda_fla = pytest.mark.skipif(
    not torch.cuda.is_available() or fla_kda() is None, reason="needs a CUDA device and fla's Triton kernels"
)


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


@needs_cuda_fla
@pytest.mark.cuda
@pytest.mark.parametrize("T", [63, 64, 200, 1000])
@pytest.mark.parametrize("backend", ["torch", "fla"])
def test_cuda_backends_match_cpu_reference(T, backend):
    """Both backends on CUDA, forward and backward, against the fp64 CPU reference."""
    H, K, V = 2, 64, 64
    cpu = [*make_inputs(1, T, H, K, V), random_state(1, H, K, V)]

    def ref(q, k, v, g, beta, h0):
        return naive_recurrent_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True)

    def fast(q, k, v, g, beta, h0):
        return chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True, backend=backend)

    o2, S2, g2 = grads_of(ref, cpu)
    o1, S1, g1 = grads_of(fast, [x.float().cuda() for x in cpu])
    # fla's kernels use tf32/bf16 internally; the torch path on CUDA is plain fp32.
    tol = 5e-3 if backend == "fla" else 1e-4
    assert rel_rms(o1.cpu(), o2) < tol and rel_rms(S1.cpu(), S2) < tol
    for a, b in zip(g1, g2, strict=True):
        assert rel_rms(a.cpu(), b) < tol


@needs_cuda_fla
@pytest.mark.cuda
@pytest.mark.parametrize("backend", ["torch", "fla"])
def test_cuda_decode_in_place(backend):
    H, K, V = 2, 64, 64
    q, k, v, g, beta = (x.float().cuda() for x in make_inputs(3, 8, H, K, V))
    state = random_state(3, H, K, V, dtype=torch.float32).cuda()
    ref_o, ref_S = naive_recurrent_kda(q, k, v, g, beta, initial_state=state.clone(), output_final_state=True)
    outs = []
    for t in range(8):
        o, _ = fused_recurrent_kda(
            *(x[:, t : t + 1] for x in (q, k, v, g, beta)),
            initial_state=state,
            inplace_final_state=True,
            backend=backend,
        )
        outs.append(o)
    assert rel_rms(torch.cat(outs, dim=1), ref_o) < 5e-3
    assert rel_rms(state, ref_S) < 5e-3
