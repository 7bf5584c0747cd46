"""The per-channel decay between the tokens of a chunk, e^{G_t − G_s} (s ≤ t), as matmul factors that are all ≤ 1.

A decayed product Σ_c X_tc Y_sc e^{G_tc − G_sc} is a matmul only if the factor splits as e^{G_t − r}·e^{r − G_s}.
With the pivot r between s and t both parts are ≤ 1 (G falls along the chunk), so nothing can overflow. The
strictly lower triangle of a chunk is tiled by halving: at block size b = C, C/2, …, 2, each b-block's lower-left
quadrant (rows in its second half, columns in its first) is one product pivoted at the second half's first
token; what is left is the diagonal, where the factor is 1. Every pair s < t lies in exactly one quadrant, so a
product costs log₂C batched matmuls whatever the gate: the same work and the same accuracy for a gate that
barely decays and for an unbounded one at −20 per token (no exact fallback, no spread to measure).

No factor is subnormal: exponents are floored at 0.35·ln(tiny) (−30.6 in fp32, −248 in fp64; `floor_bits` in
base 2), where the factor is ≤ e^{−30.6} ≈ 5e-14 of the ≤ 1 factor it stands for: below fp32's resolution (and
fp64's floor below fp64's). Two floored factors multiply to ≥ e^{−61}, which leaves e^{26} of headroom for the
values they scale before fp32's normal range ends (e^{−87.3}); BLAS kernels on x86 run 10-70× slower on
subnormal operands, and exp itself is ~20× slower on results that underflow. `flush` does the same for sums
that can fall that low.
"""

import math

import torch

LOG2E = 1 / math.log(2)  # G is kept in bits: torch's CPU exp2 runs ~3× faster than its exp (measured, AVX-512)


def floor_bits(dtype: torch.dtype) -> float:
    """The smallest exponent (base 2) a decay factor keeps: 0.35·log₂(smallest normal), −44.1 in fp32 (and bf16)
    (e^−30.6), −358 in fp64."""
    return 0.35 * math.log2(torch.finfo(dtype).tiny)


def floored_exp2_(x: torch.Tensor) -> torch.Tensor:
    """2^x in place, x floored at floor_bits: for x ≤ 0 that only multiplies factors ≤ 1 (see the module docstring)."""
    return x.clamp_(min=floor_bits(x.dtype)).exp2_()


def floored_exp2(x: torch.Tensor) -> torch.Tensor:
    """floored_exp2_ into a fresh tensor."""
    return floored_exp2_(x.clone())


def floored_exp(x: torch.Tensor) -> torch.Tensor:
    """e^x with the same floor, for natural-log inputs (the decode step's per-token gate)."""
    return floored_exp2_(x * LOG2E)


def flush(x: torch.Tensor) -> torch.Tensor:
    """x with entries below 2^floor_bits in magnitude set to zero, in place: for sums of products of ≤ 1 factors
    (the chunk's (I + βA)⁻¹), whose products would otherwise reach the subnormal range."""
    return x.masked_fill_(x.abs() < 2.0 ** floor_bits(x.dtype), 0)


def quadrants(A: torch.Tensor, b: int) -> torch.Tensor:
    """A view of each b-block's lower-left quadrant: (BH, n, C, C) -> (BH, n, C/b, b/2, b/2); A contiguous."""
    BH, n, C, _ = A.shape
    blocks = A.view(BH, n, C // b, b, C // b, b).diagonal(dim1=2, dim2=4).movedim(-1, 2)  # (BH, n, C/b, b, b)
    return blocks[..., b // 2 :, : b // 2]


def halves(x: torch.Tensor, b: int) -> torch.Tensor:
    """(BH, n, C, K) -> (BH, n, C/b, 2, b/2, K): each b-block's two halves (a view; x contiguous)."""
    BH, n, C, K = x.shape
    return x.view(BH, n, C // b, 2, b // 2, K)


class DecayLevels:
    """The pivoted factors of one group's chunks, for every level of the halving; computed once and read by the
    forward's two in-chunk products and the backward's four.

    G2: (BH, n, C, K) the in-chunk cumulative log-decay in bits (log₂ units), contiguous, C a power of two.
    levels: (b, rows, cols) for b = C, C/2, …, 2: rows (BH, n, C/b, b/2, K) = e^{G_t − r} for the second half's
    tokens t, cols the same shape = e^{r − G_s} for the first half's tokens s, r = G at the second half's first token.
    Both are halves of one tensor per level, 2^{−|G2 − r2|}: G falls, so that is each half's factor, and it takes one
    exp2 over the chunk.
    """

    def __init__(self, G2: torch.Tensor):
        self.levels = []
        b = G2.shape[2]
        while b >= 2:
            Gb = halves(G2, b)
            factors = floored_exp2_((Gb - Gb[:, :, :, 1:, :1]).abs_().neg_())  # (BH, n, C/b, 2, b/2, K)
            self.levels.append((b, factors[:, :, :, 1], factors[:, :, :, 0]))
            b //= 2

    def products(self, xs: list[torch.Tensor], y: torch.Tensor) -> list[torch.Tensor]:
        """For each x in xs: A_ts = Σ_c x_tc y_sc e^{G_tc − G_sc} for s < t, zero on and above the diagonal.

        xs: tensors (BH, n, C, K); y: (BH, n, C, K). returns one (BH, n, C, C) per x. The rows of all xs share
        one matmul per level against y's columns.
        """
        BH, n, C, K = y.shape
        out = [y.new_zeros(BH, n, C, C) for _ in xs]
        m = len(xs)
        for b, rows, cols in self.levels:
            # (BH, n, C/b, m, b/2, K): every x's second halves scaled by their row factors, as one operand
            x_rows = y.new_empty(BH, n, C // b, m, b // 2, K)
            for i, x in enumerate(xs):
                torch.mul(halves(x, b)[:, :, :, 1], rows, out=x_rows[:, :, :, i])
            y_cols = (halves(y, b)[:, :, :, 0] * cols).transpose(-1, -2)  # (BH, n, C/b, K, b/2)
            parts = (x_rows.view(BH, n, C // b, m * (b // 2), K) @ y_cols).view(BH, n, C // b, m, b // 2, b // 2)
            for i, A in enumerate(out):
                quadrants(A, b).copy_(parts[:, :, :, i])
        return out

    def rows_of(self, Ds: list[torch.Tensor], y: torch.Tensor) -> list[torch.Tensor]:
        """For each D: R_t = Σ_{s ≤ t} D_ts · y_s ⊙ e^{G_t − G_s}; each D (BH, n, C, C) lower triangular,
        y (BH, n, C, K). The Ds share one matmul per level (their quadrants stacked as rows against y's columns)."""
        BH, n, C, K = y.shape
        m = len(Ds)
        outs = [D.diagonal(dim1=-2, dim2=-1).unsqueeze(-1) * y for D in Ds]
        for b, rows, cols in self.levels:
            h = b // 2
            Dq = torch.cat([quadrants(D, b) for D in Ds], dim=-2)  # (BH, n, C/b, m·h, h)
            parts = (Dq @ (halves(y, b)[:, :, :, 0] * cols)).view(BH, n, C // b, m, h, K)
            for i, out in enumerate(outs):
                halves(out, b)[:, :, :, 1].addcmul_(rows, parts[:, :, :, i])
        return outs

    def cols_of(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """Σ over (D, x) pairs of Q_s = Σ_{t ≥ s} D_ts · x_t ⊙ e^{G_t − G_s}: the same factors, read the other way
        round; the pairs' terms are summed inside one matmul per level (contracting over both D's rows)."""
        out = sum(D.diagonal(dim1=-2, dim2=-1).unsqueeze(-1) * x for D, x in pairs)
        for b, rows, cols in self.levels:
            Dq = torch.cat([quadrants(D, b) for D, _ in pairs], dim=-2)  # (BH, n, C/b, m·h, h)
            xr = torch.cat([halves(x, b)[:, :, :, 1] * rows for _, x in pairs], dim=-2)  # (BH, n, C/b, m·h, K)
            halves(out, b)[:, :, :, 0].addcmul_(cols, Dq.transpose(-1, -2) @ xr)
        return out


def unit_lower_inverse(L: torch.Tensor) -> torch.Tensor:
    """(I + L)⁻¹ for a strictly lower triangular L (BH, n, C, C), C a power of two, by the same halving; L is
    flushed in place (pass a temporary).

    A b-block [[A, 0], [B, D]] (A, D its diagonal halves, B the quadrant of L) inverts to [[A⁻¹, 0], [−D⁻¹BA⁻¹, D⁻¹]],
    so the inverse is built bottom-up from the 1×1 blocks (ones) in log₂C levels of two matmuls. Every product is
    flushed (entries below e^{floor_exponent} set to zero): entries of (I + L)⁻¹ are sums over chains of L's entries,
    which for a steep gate fall through the subnormal range (a triangular solve computes them there, slowly).
    """
    BH, n, C, _ = L.shape
    L = flush(L)
    M = torch.eye(C, dtype=L.dtype, device=L.device).expand(BH, n, C, C).contiguous()
    b = 2
    while b <= C:
        h = b // 2
        blocks = M.view(BH, n, C // b, b, C // b, b).diagonal(dim1=2, dim2=4).movedim(-1, 2)
        A_inv, D_inv = blocks[..., :h, :h], blocks[..., h:, h:]
        quadrants(M, b).copy_(flush(flush(D_inv @ quadrants(L, b)) @ A_inv).neg_())
        b *= 2
    return M
