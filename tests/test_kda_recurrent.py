"""fused_recurrent_kda (the decode path) against the reference, and chunked prefill + decode."""

import pytest
import torch

from k3.ops.kda import chunk_kda, fused_recurrent_kda, kda_gate, l2norm, naive_recurrent_kda
from kda_inputs import grads_of, make_inputs, random_state, rel_rms

TOL = 1e-12  # the same recurrence in a different op order: float64 rounding only


@pytest.mark.parametrize(("T", "HV"), [(1, 3), (7, 3), (33, 6)])
def test_matches_reference_with_gradients(T, HV):
    q, k, v, g, beta = make_inputs(2, T, 3, 16, 24, HV=HV)
    h0 = random_state(2, HV, 16, 24)

    def run(fn):
        return grads_of(lambda *x: fn(*x[:5], initial_state=x[5], output_final_state=True), [q, k, v, g, beta, h0])

    o1, S1, g1 = run(fused_recurrent_kda)
    o2, S2, g2 = run(naive_recurrent_kda)
    assert rel_rms(o1, o2) < TOL and rel_rms(S1, S2) < TOL
    for a, b in zip(g1, g2, strict=True):
        assert rel_rms(a, b) < TOL


def test_token_by_token_in_place_equals_one_call():
    """Decoding one token per call, writing the state back in place, equals the whole recurrence."""
    T = 20
    q, k, v, g, beta = make_inputs(2, T, 2, 16, 8)
    state = random_state(2, 2, 16, 8)
    ref_o, ref_S = naive_recurrent_kda(q, k, v, g, beta, initial_state=state.clone(), output_final_state=True)
    outs = []
    for t in range(T):
        o, _ = fused_recurrent_kda(
            *(x[:, t : t + 1] for x in (q, k, v, g, beta)), initial_state=state, inplace_final_state=True
        )
        outs.append(o)
    assert rel_rms(torch.cat(outs, dim=1), ref_o) < TOL
    assert rel_rms(state, ref_S) < TOL


def test_prefill_chunked_then_decode_equals_uncached():
    """Prefill with chunk_kda in pieces, then decode token by token: same as one pass over everything."""
    q, k, v, g, beta = make_inputs(1, 150, 2, 16, 16)
    ref, _ = naive_recurrent_kda(q, k, v, g, beta)
    outs, state = [], None
    for s, e in [(0, 37), (37, 101), (101, 140)]:
        o, state = chunk_kda(*(x[:, s:e] for x in (q, k, v, g, beta)), initial_state=state, output_final_state=True)
        outs.append(o)
    for t in range(140, 150):
        o, _ = fused_recurrent_kda(
            *(x[:, t : t + 1] for x in (q, k, v, g, beta)), initial_state=state, inplace_final_state=True
        )
        outs.append(o)
    assert rel_rms(torch.cat(outs, dim=1), ref) < 1e-10


def test_state_pool_indices_and_varlen():
    """Three sequences of different lengths packed with cu_seqlens read and write rows 4, 0, 2 of a pool;
    the other rows stay untouched."""
    lengths, rows = [3, 1, 5], torch.tensor([4, 0, 2])
    q, k, v, g, beta = make_inputs(1, sum(lengths), 2, 16, 8)
    pool = random_state(6, 2, 16, 8)
    before = pool.clone()
    cu = torch.tensor([0, 3, 4, 9])
    o, final = fused_recurrent_kda(
        q,
        k,
        v,
        g,
        beta,
        initial_state=pool,
        cu_seqlens=cu,
        ssm_state_indices=rows,
        inplace_final_state=True,
        output_final_state=True,
    )
    for i, (s, e) in enumerate([(0, 3), (3, 4), (4, 9)]):
        ref_o, ref_S = naive_recurrent_kda(
            *(x[:, s:e] for x in (q, k, v, g, beta)), initial_state=before[rows[i]][None], output_final_state=True
        )
        assert rel_rms(o[:, s:e], ref_o) < TOL
        assert rel_rms(pool[rows[i]], ref_S[0]) < TOL
        assert rel_rms(final[i], ref_S[0]) < TOL
    untouched = [1, 3, 5]
    assert torch.equal(pool[untouched], before[untouched])


def test_flags_match_reference():
    q, k, v, g_raw, b_raw = make_inputs(1, 9, 2, 16, 8, raw=True)
    A_log, dt_bias = torch.randn(2, dtype=torch.float64), torch.randn(32, dtype=torch.float64)
    o, _ = fused_recurrent_kda(
        q,
        k,
        v,
        g_raw,
        b_raw,
        use_qk_l2norm_in_kernel=True,
        use_gate_in_kernel=True,
        use_beta_sigmoid_in_kernel=True,
        A_log=A_log,
        dt_bias=dt_bias,
        lower_bound=-5.0,
    )
    ref, _ = naive_recurrent_kda(l2norm(q), l2norm(k), v, kda_gate(g_raw, A_log, dt_bias, -5.0), b_raw.sigmoid())
    assert rel_rms(o, ref) < TOL
