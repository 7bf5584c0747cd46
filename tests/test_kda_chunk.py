"""chunk_kda against the per-timestep reference, in float64: outputs, final states and every gradient."""

import pytest
import torch

from k3.ops.kda import chunk_kda, l2norm, naive_recurrent_kda
from k3.ops.kda.gate import kda_gate
from kda_inputs import grads_of, make_inputs, random_state, rel_rms

# float64 on both sides: the two algorithms differ only by rounding, ~1e-15 relative. A wrong term in
# the chunked algebra shows up at 1e-3 or worse, so 1e-10 separates the two with a wide margin.
TOL = 1e-10
NAMES = ["q", "k", "v", "g", "beta", "initial_state"]


def assert_close(got, ref, what):
    if not ref.any():
        # an exactly-zero reference (dg of one token from a zero state): the chunked form's terms cancel
        # there only to rounding, so the error is absolute, against the scale of the inputs (~1)
        err = got.abs().max().item()
        assert err < TOL, f"{what}: reference is zero, got max |x| = {err:.2e} >= {TOL:.0e}"
        return
    err = rel_rms(got, ref)
    assert err < TOL, f"{what}: relative RMS error {err:.2e} >= {TOL:.0e}"


def compare(fast, ref, inputs):
    o1, S1, g1 = grads_of(fast, inputs)
    o2, S2, g2 = grads_of(ref, inputs)
    assert_close(o1, o2, "o")
    assert_close(S1, S2, "final state")
    for name, a, b in zip(NAMES, g1, g2, strict=False):
        if b is not None:
            assert_close(a, b, f"d{name}")


@pytest.mark.parametrize("T", [1, 15, 63, 64, 65, 200])
@pytest.mark.parametrize(("H", "K", "V"), [(1, 16, 16), (3, 16, 24), (3, 32, 8)])
@pytest.mark.parametrize("with_state", [False, True])
def test_chunk_matches_reference(T, H, K, V, with_state):
    q, k, v, g, beta = make_inputs(2, T, H, K, V, seed=T)
    h0 = random_state(2, H, K, V) if with_state else None

    def fast(q, k, v, g, beta, h0):
        return chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True)

    def ref(q, k, v, g, beta, h0):
        return naive_recurrent_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True)

    compare(fast, ref, [q, k, v, g, beta, h0])


@pytest.mark.parametrize("T", [15, 65, 130])
@pytest.mark.parametrize("lower_bound", [-5.0, None])
def test_in_kernel_flags_match_reference(T, lower_bound):
    """l2norm, the gate and the beta sigmoid applied inside chunk_kda equal applying them outside."""
    H, K, V = 2, 16, 8
    q, k, v, g_raw, b_raw = make_inputs(1, T, H, K, V, raw=True, seed=T)
    A_log = torch.randn(H, dtype=torch.float64)
    dt_bias = torch.randn(H * K, dtype=torch.float64)
    h0 = random_state(1, H, K, V)

    def fast(q, k, v, g_raw, b_raw, h0):
        return chunk_kda(
            q,
            k,
            v,
            g_raw,
            b_raw,
            initial_state=h0,
            output_final_state=True,
            use_qk_l2norm_in_kernel=True,
            use_gate_in_kernel=True,
            use_beta_sigmoid_in_kernel=True,
            A_log=A_log,
            dt_bias=dt_bias,
            lower_bound=lower_bound,
        )

    def ref(q, k, v, g_raw, b_raw, h0):
        g = kda_gate(g_raw, A_log, dt_bias, lower_bound)
        return naive_recurrent_kda(
            l2norm(q), l2norm(k), v, g, b_raw.sigmoid(), initial_state=h0, output_final_state=True
        )

    compare(fast, ref, [q, k, v, g_raw, b_raw, h0])


def test_allow_neg_eigval_doubles_beta():
    q, k, v, _, b_raw = make_inputs(1, 40, 2, 16, 16, raw=True)
    _, _, _, g, _ = make_inputs(1, 40, 2, 16, 16)
    o, _ = chunk_kda(
        q, k, v, g, b_raw, use_beta_sigmoid_in_kernel=True, allow_neg_eigval=True, use_qk_l2norm_in_kernel=True
    )
    ref, _ = naive_recurrent_kda(l2norm(q), l2norm(k), v, g, 2 * b_raw.sigmoid())
    assert_close(o, ref, "o")


def test_grouped_value_heads():
    """HV = 2H: each q/k head serves two value heads, as fla's GVA."""
    q, k, v, g, beta = make_inputs(2, 70, 2, 16, 8, HV=4)
    h0 = random_state(2, 4, 16, 8)

    def fast(q, k, v, g, beta, h0):
        return chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True)

    def ref(q, k, v, g, beta, h0):
        return naive_recurrent_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True)

    compare(fast, ref, [q, k, v, g, beta, h0])


@pytest.mark.parametrize("lengths", [[5, 70, 130], [64, 1, 0, 65], [200]])
def test_varlen_matches_per_sequence_reference(lengths):
    """Packed sequences with cu_seqlens equal running each one alone from its own initial state."""
    H, K, V = 2, 16, 24
    T = sum(lengths)
    q, k, v, g, beta = make_inputs(1, T, H, K, V, seed=len(lengths))
    h0 = random_state(len(lengths), H, K, V)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])

    def fast(q, k, v, g, beta, h0):
        return chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True, cu_seqlens=cu)

    def ref(q, k, v, g, beta, h0):
        outs, finals = [], []
        for i in range(len(lengths)):
            s, e = cu[i].item(), cu[i + 1].item()
            o, S = naive_recurrent_kda(
                q[:, s:e],
                k[:, s:e],
                v[:, s:e],
                g[:, s:e],
                beta[:, s:e],
                initial_state=h0[i : i + 1],
                output_final_state=True,
            )
            outs.append(o)
            finals.append(S)
        return torch.cat(outs, dim=1), torch.cat(finals)

    compare(fast, ref, [q, k, v, g, beta, h0])


@pytest.mark.parametrize("chunk_size", [32, 64])
def test_chunk_sizes(chunk_size):
    q, k, v, g, beta = make_inputs(1, 150, 2, 16, 16)
    o, S = chunk_kda(q, k, v, g, beta, output_final_state=True, chunk_size=chunk_size)
    ref_o, ref_S = naive_recurrent_kda(q, k, v, g, beta, output_final_state=True)
    assert_close(o, ref_o, "o")
    assert_close(S, ref_S, "final state")


@pytest.mark.parametrize("steepest", [30.0, 300.0])
def test_steep_unbounded_gate_matches_the_recurrence(steepest):
    """Unbounded gates, up to e^-300 per token: the halving's factors are all ≤ 1, so the chunked form
    needs no fallback; values and every gradient equal the per-token recurrence in float64."""
    q, k, v, _, beta = make_inputs(1, 100, 2, 16, 16)
    g = -steepest * torch.rand(1, 100, 2, 16, dtype=torch.float64)

    def fast(q, k, v, g, beta):
        return chunk_kda(q, k, v, g, beta, output_final_state=True)

    def ref(q, k, v, g, beta):
        return naive_recurrent_kda(q, k, v, g, beta, output_final_state=True)

    compare(fast, ref, [q, k, v, g, beta])


def test_bf16_inputs_compute_in_fp32():
    q, k, v, g, beta = make_inputs(1, 100, 2, 16, 16, dtype=torch.float32)
    o32, _ = chunk_kda(q, k, v, g, beta, output_final_state=True)
    o16, S16 = chunk_kda(*(x.bfloat16() for x in (q, k, v, g, beta)), output_final_state=True)
    assert o16.dtype == torch.bfloat16 and S16.dtype == torch.float32
    assert rel_rms(o16.float(), o32) < 2e-2


def test_lower_bound_long_sequence_stays_finite_fp32():
    """Every g at the lower bound (−5) for 65,536 tokens in fp32: the pivoted factors sit at their
    e^80 limit in every chunk; the output must stay finite and match the fp64 recurrence."""
    T, H, K, V = 65536, 1, 16, 16
    q, k, v, _, beta = make_inputs(1, T, H, K, V, dtype=torch.float32)
    g = torch.full((1, T, H, K), -5.0)
    o, S = chunk_kda(q, k, v, g, beta, output_final_state=True)
    assert torch.isfinite(o).all() and torch.isfinite(S).all()
    with torch.no_grad():
        ref_o, ref_S = naive_recurrent_kda(*(x.double() for x in (q, k, v, g, beta)), output_final_state=True)
    assert rel_rms(o, ref_o) < 1e-5
    assert rel_rms(S, ref_S) < 1e-5


def test_lower_bound_gradients_finite_fp32():
    """The overflowed products above the diagonal must not leak NaN into the backward pass."""
    q, k, v, _, beta = make_inputs(1, 256, 2, 16, 16, dtype=torch.float32)
    g = torch.full((1, 256, 2, 16), -5.0, requires_grad=True)
    q.requires_grad_()
    o, _ = chunk_kda(q, k, v, g, beta)
    o.square().sum().backward()
    assert torch.isfinite(q.grad).all() and torch.isfinite(g.grad).all()


def test_empty_sequence():
    q, k, v, g, beta = make_inputs(2, 0, 2, 16, 8)
    h0 = random_state(2, 2, 16, 8)
    o, S = chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    assert o.shape == (2, 0, 2, 8)
    assert torch.equal(S, h0)


def test_backward_is_hand_written_and_keeps_only_inputs_and_chunk_states():
    """Gradients come from ChunkKDAFunction, which saves the prepared inputs and one state per chunk,
    not autograd's intermediates (the in-chunk matrices, the WY factors, the decay factors)."""
    B, T, H, K, V = 2, 150, 3, 16, 24
    q, k, v, g, beta = (x.requires_grad_() for x in make_inputs(B, T, H, K, V))
    o, _ = chunk_kda(q, k, v, g, beta, initial_state=random_state(B, H, K, V).requires_grad_(), output_final_state=True)
    node = o.grad_fn
    while node is not None and type(node).__name__ != "ChunkKDAFunctionBackward":
        node = node.next_functions[0][0]
    assert node is not None, "the output does not come from the hand-written backward"
    saved = sum(t.numel() for t in node.saved_tensors)
    chunks = -(-T // 64)
    assert saved == B * T * H * (3 * K + V + 1) + B * H * chunks * K * V
