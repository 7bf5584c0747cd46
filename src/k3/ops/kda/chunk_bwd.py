"""The backward of chunked KDA (chunk.py), written by hand.

Per chunk, with start state S, the forward computed

    u = U − W S            o = (qΓ) S + Aqk u            S' = Γ_C S + kdᵀ u

so, given do and dS' (the gradient of the state after the chunk), going backwards over chunks:

    du = Aqkᵀ do + kd dS'          dS = Γ_C dS' + (qΓ)ᵀ do − Wᵀ du

Only these two lines are sequential; with the chunk start states kept by the forward, everything else
is batched over a group of chunks: dAqk = do uᵀ, d(qΓ) = do Sᵀ, dkd = u dS'ᵀ, dΓ_C = Σ_v dS' ⊙ S,
dU = du, dW = −du Sᵀ. Then through the chunk-parallel terms (recomputed, not stored):

    U = M βv, W = M β(kΓ), M = (I + βAkk)⁻¹:   dM = (dU vᵀ + dW (kΓ)ᵀ) diag β,   d(βAkk) = −Mᵀ dM Mᵀ
    Akk_ts = Σ_c k_tc k_sc e^{G_tc − G_sc}, Aqk likewise with q_t: their gradients are the same decayed
    products, Σ_s dA_ts k_s e^{G_t − G_s} (rows) and Σ_t dA_ts q_t e^{G_t − G_s} (columns), computed with
    the forward's factors (decay.py); G's gradient from them is q ⊙ (row term) − k ⊙ (column term).
    G = cumsum(g), so dg is the reverse cumulative sum of dG.
"""

import torch

from k3.ops.kda.chunk_terms import chunk_groups, chunk_terms, chunked, group_inputs, sequence_chunks, unchunked


def terms_backward(t, dU, dW, dAqk, dqd, dkd, d_decay_end, scale):
    """Gradients of a group's chunk-parallel terms (ChunkTerms t) -> dq, dk, dv, dg, dβ in chunk layout
    (BH, n, C, ·), dβ as (BH, n, C). dAqk must be zero above the diagonal; d_decay_end is (BH, n, K)."""
    kG = t.k_decay
    Tinv = t.M * t.bc.transpose(-1, -2)
    dv = Tinv.transpose(-1, -2) @ dU
    dkG = Tinv.transpose(-1, -2) @ dW
    dTinv = (dU @ t.vc.transpose(-1, -2)).add_(dW @ kG.transpose(-1, -2))
    dbeta = (dTinv * t.M).sum(-2)  # Tinv = M diag(β): column s carries β_s
    dM = dTinv * t.bc.transpose(-1, -2)
    Mt = t.M.transpose(-1, -2)
    dL = -(Mt @ dM @ Mt).tril(-1)  # L = I + diag(β) Akk; its strictly lower part is all that varies
    dbeta = dbeta + (dL * t.Akk).sum(-1)
    dAkk = dL * t.bc

    # the decayed products are fresh tensors: the sums below accumulate into them
    dq, dk = t.levels.rows_of([dAqk, dAkk], t.kc)
    dk_cols = t.levels.cols_of([(dAkk, t.kc), (dAqk, t.qc)])  # the columns' terms, from Akk and from Aqk
    # dG = qc·dq_rows + kc·(dk_rows − dk_cols) + dkG·kΓ + dqd·qΓ − dkd·kd, before dq and dk take their other terms
    dkd_kd = dkd * t.kd
    dG = torch.mul(t.qc, dq).addcmul_(t.kc, torch.sub(dk, dk_cols))
    dG.addcmul_(dkG, kG).addcmul_(dqd, t.q_decay).sub_(dkd_kd)
    dG[:, :, -1] += dkd_kd.sum(-2) + d_decay_end * t.decay_end.squeeze(-1)
    dq.addcmul_(dqd, t.decay).mul_(scale)
    dk.add_(dk_cols).addcmul_(dkG, t.decay).addcmul_(dkd, t.to_end)
    dg = dG.flip(2).cumsum(2).flip(2)  # G = cumsum(g)
    return dq, dk, dv, dg, dbeta


def chunk_kda_bwd(q, k, v, g, beta, starts, do, dfinal, scale, chunk_size, seq_chunks):
    """Gradients of chunk_kda_fwd's (o, final) with respect to q, k, v, g, beta and the initial state.

    Inputs as chunk_kda_fwd's; starts: (B·H, NC, K, V) the chunk start states it returned; do: (B, T, H, V);
    dfinal: (N, H, K, V). Returns dq, dk, dv, dg, dβ in the inputs' shapes and dh0 (N, H, K, V).
    """
    B, T, H, K = q.shape
    V = v.shape[-1]
    C = chunk_size
    NC = starts.shape[1]
    packed = seq_chunks is not None  # N packed sequences in one row (B = 1), else one sequence per batch row
    seq_chunks, first, last, _ = sequence_chunks(seq_chunks, NC, None, B, H, K, V)
    N = len(seq_chunks) if packed else B
    dfinal = q.new_zeros(N, H, K, V) if dfinal is None else dfinal.to(q.dtype)
    # per sequence of the recursion, its state rows: (sequences, rows, K, V)
    dfinal_rows = dfinal if packed else dfinal.reshape(1, B * H, K, V)
    dh0 = dfinal_rows.clone()  # an empty sequence passes its final state's gradient straight through
    grads = [torch.empty_like(x) for x in (q, k, v, g, beta)]  # every position is written by one group below
    do = do.to(q.dtype)
    dS = q.new_zeros(B * H, K, V)
    for c0, c1 in reversed(chunk_groups(B, H, C, K, V, NC)):
        t = chunk_terms(*group_inputs((q, k, v, g, beta), c0, c1, C, T), scale, C)
        S_n = starts[:, c0:c1]  # (BH, n, K, V)
        u = t.U - t.W @ S_n
        do_n = chunked(group_inputs((do,), c0, c1, C, T)[0], C)  # (BH, n, C, V)
        Aqk_do = t.Aqk.transpose(-1, -2) @ do_n  # (BH, n, C, V)
        qd_do = t.q_decay.transpose(-1, -2) @ do_n  # (BH, n, K, V)
        du, dS_after = [None] * (c1 - c0), [None] * (c1 - c0)
        for j in reversed(range(c1 - c0)):
            n = c0 + j
            if n in last:
                dS = dfinal_rows[last[n]]
            dS_after[j] = dS
            du[j] = torch.baddbmm(Aqk_do[:, j], t.kd[:, j], dS)
            dS = torch.baddbmm(t.decay_end[:, j] * dS + qd_do[:, j], t.W[:, j].transpose(-1, -2), du[j], alpha=-1)
            if n in first:
                dh0[first[n]] = dS
        du, dS_after = torch.stack(du, dim=1), torch.stack(dS_after, dim=1)
        dAqk = (do_n @ u.transpose(-1, -2)).tril()
        dqd = do_n @ S_n.transpose(-1, -2)
        dkd = u @ dS_after.transpose(-1, -2)
        d_decay_end = (dS_after * S_n).sum(-1)
        dW = -(du @ S_n.transpose(-1, -2))
        parts = terms_backward(t, du, dW, dAqk, dqd, dkd, d_decay_end, scale)
        t0, t1 = c0 * C, min(T, c1 * C)
        for grad, part in zip(grads, parts, strict=True):
            chunk = part if part.dim() == 4 else part.unsqueeze(-1)
            tokens = unchunked(chunk, B)[:, : t1 - t0]
            grad[:, t0:t1] = tokens if grad.dim() == 4 else tokens.squeeze(-1)
    return (*grads, dh0.reshape(N, H, K, V))
