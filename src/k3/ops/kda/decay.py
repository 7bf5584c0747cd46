"""The per-channel decay between the tokens of a chunk, e^{G_t − G_s} (s ≤ t), as matmul factors that are all ≤ 1.

A decayed product Σ_c X_tc Y_sc e^{G_tc − G_sc} is a matmul only if the factor splits as e^{G_t − r}·e^{r − G_s}.
With the pivot r between s and t both parts are ≤ 1 (G falls along the chunk), so nothing can overflow. The
strictly lower triangle of a chunk is tiled by halving: at block size b = C, C/2, …, 2, each b-block's lower-left
quadrant (rows in its second half, columns in its first) is one product pivoted at the second half's first
token; what is left is the diagonal, where the factor is 1. Every pair s < t lies in exactly one quadrant, so a
product costs log₂C batched matmuls whatever the gate: the same work and the same accuracy for a gate that
barely decays and for an unbounded one at −20 per token (no exact fallback, no spread to measure).

No factor is subnormal: exponents are floored at FLOOR = 0.35·ln(tiny) (−30.6 in fp32, −248 in fp64), where the
factor is ≤ e^{−30.6} ≈ 5e-14 of the ≤ 1 factor it stands for: below fp32's resolution (and fp64's floor below
fp64's). Two floored factors multiply to ≥ e^{−61}, which leaves e^{26} of headroom for the values they scale
before fp32's normal range ends (e^{−87.3}); BLAS kernels on x86 run 10-70× slower on subnormal operands, and
exp itself is ~20× slower on results that underflow. `flush` does the same for sums that can fall that low.
"""

import math

import torch


def floor_exponent(dtype: torch.dtype) -> float:
    """The smallest exponent a decay factor keeps: 0.35·ln(smallest normal), −30.6 in fp32 (and bf16), −248 in fp64."""
    return 0.35 * math.log(torch.finfo(dtype).tiny)


def floored_exp(x: torch.Tensor) -> torch.Tensor:
    """e^x with x floored at floor_exponent: for x ≤ 0 that only multiplies factors ≤ 1 (see the module docstring)."""
    return torch.exp(x.clamp(min=floor_exponent(x.dtype)))


def flush(x: torch.Tensor) -> torch.Tensor:
    """x with entries below e^floor_exponent in magnitude set to zero, in place: for sums of products of ≤ 1 factors
    (the chunk's (I + βA)⁻¹), whose products would otherwise reach the subnormal range."""
    return x.masked_fill_(x.abs() < math.exp(floor_exponent(x.dtype)), 0)


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

    G: (BH, n, C, K) the in-chunk cumulative log-decay, contiguous, C a power of two.
    levels: (b, rows, cols) for b = C, C/2, …, 2: rows (BH, n, C/b, b/2, K) = e^{G_t − r} for the second half's
    tokens t, cols the same shape = e^{r − G_s} for the first half's tokens s, r = G at the second half's first token.
    """

    def __init__(self, G: torch.Tensor):
        self.levels = []
        b = G.shape[2]
        while b >= 2:
            Gb = halves(G, b)
            r = Gb[:, :, :, 1, :1]  # (BH, n, C/b, 1, K)
            self.levels.append((b, floored_exp(Gb[:, :, :, 1] - r), floored_exp(r - Gb[:, :, :, 0])))
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

    def rows_of(self, D: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """R_t = Σ_{s ≤ t} D_ts · y_s ⊙ e^{G_t − G_s}; D (BH, n, C, C) lower triangular, y (BH, n, C, K)."""
        out = D.diagonal(dim1=-2, dim2=-1).unsqueeze(-1) * y
        for b, rows, cols in self.levels:
            part = quadrants(D, b) @ (halves(y, b)[:, :, :, 0] * cols)  # (BH, n, C/b, b/2, K)
            halves(out, b)[:, :, :, 1].addcmul_(rows, part)
        return out

    def cols_of(self, D: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """Q_s = Σ_{t ≥ s} D_ts · x_t ⊙ e^{G_t − G_s}: the same factors, read the other way round."""
        out = D.diagonal(dim1=-2, dim2=-1).unsqueeze(-1) * x
        for b, rows, cols in self.levels:
            part = quadrants(D, b).transpose(-1, -2) @ (halves(x, b)[:, :, :, 1] * rows)
            halves(out, b)[:, :, :, 0].addcmul_(cols, part)
        return out


def unit_lower_inverse(L: torch.Tensor) -> torch.Tensor:
    """(I + L)⁻¹ for a strictly lower triangular L (BH, n, C, C), C a power of two, by the same halving.

    A b-block [[A, 0], [B, D]] (A, D its diagonal halves, B the quadrant of L) inverts to [[A⁻¹, 0], [−D⁻¹BA⁻¹, D⁻¹]],
    so the inverse is built bottom-up from the 1×1 blocks (ones) in log₂C levels of two matmuls. Every product is
    flushed (entries below e^{floor_exponent} set to zero): entries of (I + L)⁻¹ are sums over chains of L's entries,
    which for a steep gate fall through the subnormal range (a triangular solve computes them there, slowly).
    """
    BH, n, C, _ = L.shape
    L = flush(L.clone())
    M = torch.eye(C, dtype=L.dtype, device=L.device).expand(BH, n, C, C).contiguous()
    b = 2
    while b <= C:
        h = b // 2
        blocks = M.view(BH, n, C // b, b, C // b, b).diagonal(dim1=2, dim2=4).movedim(-1, 2)
        A_inv, D_inv = blocks[..., :h, :h], blocks[..., h:, h:]
        quadrants(M, b).copy_(flush(flush(D_inv @ quadrants(L, b)) @ A_inv).neg_())
        b *= 2
    return M
