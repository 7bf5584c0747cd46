"""The chunk-parallel part of chunked KDA, shared by the forward (chunk.py) and the backward (chunk_bwd.py).

For a run of whole chunks, everything that does not depend on the state entering a chunk is computed for
all of them at once (`chunk_terms` -> ChunkTerms): the in-chunk cumulative log-decay G, the decayed inner
products Akk and Aqk (row blocks of SUB tokens pivoted so that no factor leaves fp32, or materialised per
channel for steep unbounded gates), M = (I + βAkk)⁻¹ and the WY/UT terms U = M βv, W = M βkΓ. The forward's
sequential pass reads them; the backward recomputes them group by group instead of storing them. Also the
layout helpers both passes use: chunk layout and back, groups of chunks sized to stay in cache, and the
chunks of each packed sequence.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F

SUB = 32  # row-block length of the pivoted factorisation; the pivot sits in its middle
SAFE_EXP = 80.0  # largest exponent a pivoted factor may carry: e^80 ≈ 5.5e34 < fp32 max 3.4e38
# Chunks are processed in groups whose tensors stay near this many elements: large CPU temporaries
# cost far more per element (fresh pages, cache misses) than ones that stay in cache.
GROUP_ELEMENTS = 1 << 18


def chunked(x: torch.Tensor, C: int) -> torch.Tensor:
    """(B, n·C, H, D) -> (B·H, n, C, D), contiguous for batched matmuls."""
    B, T, H = x.shape[:3]
    # contiguous: for B = 1 the reshape is a strided view, and every matmul reading it made its own copy
    return x.reshape(B, T // C, C, H, -1).permute(0, 3, 1, 2, 4).reshape(B * H, T // C, C, -1).contiguous()


def unchunked(x: torch.Tensor, B: int) -> torch.Tensor:
    """(B·H, n, C, D) -> (B, n·C, H, D)."""
    BH, N, C, D = x.shape
    return x.reshape(B, BH // B, N * C, D).transpose(1, 2)


def floored_exp(x: torch.Tensor) -> torch.Tensor:
    """exp with arguments floored at −87: CPU exp is ~20× slower on results that underflow fp32,
    and every factor that can be floored here multiplies one ≤ 1, so the floor (1.6e-38) is noise."""
    return torch.exp(x.clamp(min=-87.0))


def _intra_chunk(q: torch.Tensor, k: torch.Tensor, G: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Decayed inner products inside each chunk: Aqk_ts = Σ_c q_tc k_sc e^{G_tc − G_sc} (s ≤ t) and
    Akk_ts the same with k_t for q_t (s < t).

    q, k, G: (BH, n, C, K), q already scaled, G the in-chunk cumulative log-decay.
    returns  Akk, Aqk: (BH, n, C, C).

    Rows are split into blocks of SUB tokens. A block's own columns are pivoted at its middle token,
    where each factor stays within e^{SAFE_EXP} while the gate is bounded (see `_pivot_spread`);
    earlier columns are pivoted at the block's first token, where both factors are ≤ 1.
    """
    BH, n, C, K = k.shape
    sub = min(SUB, C)
    nb, mid = C // sub, sub // 2
    qb, kb, Gb = (x.view(BH, n, nb, sub, K) for x in (q, k, G))
    pivot = Gb[:, :, :, mid : mid + 1]  # (BH, n, nb, 1, K)
    row = torch.exp(Gb - pivot)
    q_row, k_row = qb * row, kb * row
    col = (kb * torch.exp(pivot - Gb)).transpose(-1, -2).contiguous()  # read by two matmuls: laid out once
    Aqk = q.new_zeros(BH, n, nb, sub, nb, sub)
    Akk = q.new_zeros(BH, n, nb, sub, nb, sub)
    Aqk.diagonal(dim1=2, dim2=4).copy_((q_row @ col).movedim(2, -1))
    Akk.diagonal(dim1=2, dim2=4).copy_((k_row @ col).movedim(2, -1))
    for i in range(1, nb):
        # Re-pivot row block i from its middle to its first token: a factor in [e^-SAFE_EXP, 1].
        to_first = torch.exp(pivot[:, :, i] - Gb[:, :, i, :1])  # (BH, n, 1, K)
        start = G[:, :, i * sub : i * sub + 1]
        col = (k[:, :, : i * sub] * floored_exp(start - G[:, :, : i * sub])).transpose(-1, -2)
        Aqk[:, :, i, :, :i] = ((q_row[:, :, i] * to_first) @ col).view(BH, n, sub, i, sub)
        Akk[:, :, i, :, :i] = ((k_row[:, :, i] * to_first) @ col).view(BH, n, sub, i, sub)
    return _masked(Akk.view(BH, n, C, C), Aqk.view(BH, n, C, C))


def _masked(Akk: torch.Tensor, Aqk: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Keep Akk strictly below the diagonal and Aqk on and below it. masked_fill, not a multiply, so a
    product that overflowed above the diagonal never meets a zero."""
    on_or_above = torch.ones(Akk.shape[-1], Akk.shape[-1], dtype=torch.bool, device=Akk.device).triu()
    return Akk.masked_fill(on_or_above, 0), Aqk.masked_fill(on_or_above.triu(1), 0)


def _pivot_spread(G: torch.Tensor) -> torch.Tensor:
    """Largest exponent a pivoted factor of `_intra_chunk` carries: (BH, n, C, K) -> scalar."""
    sub = min(SUB, G.shape[2])
    Gb = G.unflatten(2, (-1, sub))
    pivot = Gb[:, :, :, sub // 2]
    return torch.maximum(Gb[:, :, :, 0] - pivot, pivot - Gb[:, :, :, -1]).amax()


def _intra_chunk_exact(q: torch.Tensor, k: torch.Tensor, G: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Same result as the pivoted form with the per-channel factor materialised, one chunk at a time
    to bound memory. Reached only by unbounded gates steeper than SAFE_EXP over half a row block."""
    Akk, Aqk = [], []
    for j in range(k.shape[1]):
        Gj = G[:, j]
        D = floored_exp((Gj.unsqueeze(2) - Gj.unsqueeze(1)).clamp(max=0))  # (BH, t, s, K)
        Akk.append(torch.einsum("btc,bsc,btsc->bts", k[:, j], k[:, j], D))
        Aqk.append(torch.einsum("btc,bsc,btsc->bts", q[:, j], k[:, j], D))
    return _masked(torch.stack(Akk, dim=1), torch.stack(Aqk, dim=1))


@dataclass
class ChunkTerms:
    """What a run of whole chunks needs, computed for all of them at once; (BH, n, ...) each.

    The forward's sequential pass reads U, W, Aqk, q_decay, kd and decay_end; the backward
    (chunk_bwd.py) also reads the inputs in chunk layout, G, M = (I + βAkk)⁻¹ and Akk.
    """

    qc: torch.Tensor  # (BH, n, C, K) q · scale
    kc: torch.Tensor  # (BH, n, C, K)
    vc: torch.Tensor  # (BH, n, C, V)
    bc: torch.Tensor  # (BH, n, C, 1) β
    G: torch.Tensor  # (BH, n, C, K) in-chunk cumulative log-decay
    decay: torch.Tensor  # (BH, n, C, K) Γ = e^G
    Akk: torch.Tensor  # (BH, n, C, C) strictly lower, without β
    Aqk: torch.Tensor  # (BH, n, C, C) lower with the diagonal
    M: torch.Tensor  # (BH, n, C, C) (I + βAkk)⁻¹, unit lower
    U: torch.Tensor  # (BH, n, C, V) M βv
    W: torch.Tensor  # (BH, n, C, K) M βkΓ
    q_decay: torch.Tensor  # (BH, n, C, K) q · scale · Γ
    k_decay: torch.Tensor  # (BH, n, C, K) k · Γ
    to_end: torch.Tensor  # (BH, n, C, K) Γ_C / Γ
    kd: torch.Tensor  # (BH, n, C, K) k · Γ_C / Γ: each token's key decayed to the chunk's end
    decay_end: torch.Tensor  # (BH, n, K, 1) Γ_C
    exact: bool  # the in-chunk products were materialised per channel (steep unbounded gates)


def chunk_terms(q, k, v, g, beta, scale: float, C: int) -> ChunkTerms:
    """The chunk-parallel part of the forward for a run of whole chunks.

    q, k, g: (B, n·C, H, K); v: (B, n·C, H, V); beta: (B, n·C, H).
    """
    qc, kc, vc, gc = (chunked(x, C) for x in (q, k, v, g))
    bc = chunked(beta.unsqueeze(-1), C)  # (BH, n, C, 1)
    qc = qc * scale
    G = gc.cumsum(2)
    # Only unbounded gates steeper than SAFE_EXP over half a row block need the exact products.
    exact = bool(_pivot_spread(G) > SAFE_EXP)
    Akk, Aqk = _intra_chunk_exact(qc, kc, G) if exact else _intra_chunk(qc, kc, G)
    decay = floored_exp(G)
    # WY/UT form: (I + βA)⁻¹ once per chunk, then U = (I + βA)⁻¹ βv and W = (I + βA)⁻¹ βkΓ by matmuls.
    eye = torch.eye(C, dtype=q.dtype, device=q.device)
    M = torch.linalg.solve_triangular(Akk * bc, eye, upper=False, unitriangular=True)
    Tinv = M * bc.transpose(-1, -2)
    k_decay = kc * decay
    to_end = floored_exp(G[:, :, -1:] - G)
    U, W, q_decay, kd = Tinv @ vc, Tinv @ k_decay, qc * decay, kc * to_end
    decay_end = decay[:, :, -1].unsqueeze(-1)
    return ChunkTerms(qc, kc, vc, bc, G, decay, Akk, Aqk, M, U, W, q_decay, k_decay, to_end, kd, decay_end, exact)


def chunk_groups(B: int, H: int, C: int, K: int, V: int, NC: int) -> list[tuple[int, int]]:
    """[c0, c1) runs of chunks whose tensors stay near GROUP_ELEMENTS elements."""
    group = max(1, GROUP_ELEMENTS // (B * H * C * max(K, V)))
    return [(c0, min(NC, c0 + group)) for c0 in range(0, NC, group)]


def group_inputs(xs, c0: int, c1: int, C: int, T: int) -> list[torch.Tensor]:
    """Tokens of chunks [c0, c1), the last one zero-padded to whole chunks."""
    t0, t1 = c0 * C, min(T, c1 * C)
    pad = (c1 - c0) * C - (t1 - t0)
    xs = [x[:, t0:t1] for x in xs]
    return [F.pad(x, (0, 0) * (x.dim() - 2) + (0, pad)) for x in xs] if pad else xs


def sequence_chunks(seq_chunks, NC, initial_state, B, H, K, V):
    """Per sequence: first chunk -> sequence, last chunk -> sequence, and each initial state as (rows, K, V)."""
    if seq_chunks is None:
        seq_chunks = [(0, NC)]
        h0 = [None if initial_state is None else initial_state.reshape(B * H, K, V)]
    else:
        h0 = [None if initial_state is None else initial_state[i] for i in range(len(seq_chunks))]
    first = {c0: i for i, (c0, c1) in enumerate(seq_chunks) if c1 > c0}
    last = {c1 - 1: i for i, (c0, c1) in enumerate(seq_chunks) if c1 > c0}
    return seq_chunks, first, last, h0
