"""The chunk-parallel part of chunked KDA, shared by the forward (chunk.py) and the backward (chunk_bwd.py).

For a run of whole chunks, everything that does not depend on the state entering a chunk is computed for
all of them at once (`chunk_terms` -> ChunkTerms): the in-chunk cumulative log-decay G, the decayed inner
products Akk and Aqk (from decay.py's factors, all ≤ 1 and none subnormal, whatever the gate),
M = (I + βAkk)⁻¹ and the WY/UT terms U = M βv, W = M βkΓ. The forward's
sequential pass reads them; the backward recomputes them group by group instead of storing them. Also the
layout helpers both passes use: chunk layout and back, groups of chunks sized to stay in cache, and the
chunks of each packed sequence.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from k3.ops.kda.decay import LOG2E, DecayLevels, floored_exp2, floored_exp2_, unit_lower_inverse

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
    G2: torch.Tensor  # (BH, n, C, K) in-chunk cumulative log-decay, in bits (log₂ units)
    levels: DecayLevels  # the pivoted factors of e^{G_t − G_s}, shared by the in-chunk products and their gradients
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


def chunk_terms(q, k, v, g, beta, scale: float, C: int) -> ChunkTerms:
    """The chunk-parallel part of the forward for a run of whole chunks.

    q, k, g: (B, n·C, H, K); v: (B, n·C, H, V); beta: (B, n·C, H).
    """
    qc, kc, vc, gc = (chunked(x, C) for x in (q, k, v, g))
    bc = chunked(beta.unsqueeze(-1), C)  # (BH, n, C, 1)
    qc = qc * scale
    G2 = gc.mul(LOG2E).cumsum_(2)  # in bits: every factor below is an exp2
    levels = DecayLevels(G2)
    Akk, Aqk = levels.products([kc, qc], kc)
    Aqk.diagonal(dim1=-2, dim2=-1).copy_((qc * kc).sum(-1))  # s = t: the factor is 1
    decay = floored_exp2(G2)
    # WY/UT form: (I + βA)⁻¹ once per chunk, then U = (I + βA)⁻¹ βv and W = (I + βA)⁻¹ βkΓ by matmuls.
    M = unit_lower_inverse(Akk * bc)
    Tinv = M * bc.transpose(-1, -2)
    k_decay = kc * decay
    to_end = floored_exp2_(G2[:, :, -1:] - G2)
    U, W, q_decay, kd = Tinv @ vc, Tinv @ k_decay, qc * decay, kc * to_end
    decay_end = decay[:, :, -1].unsqueeze(-1)
    return ChunkTerms(qc, kc, vc, bc, G2, levels, decay, Akk, Aqk, M, U, W, q_decay, k_decay, to_end, kd, decay_end)


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
