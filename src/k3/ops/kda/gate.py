"""The element-wise pieces of KDA that sit in front of the recurrence (SPEC §2.1).

- `kda_gate`: the per-channel log-decay g from the raw forget-gate projection.
- `l2norm`: the q/k normalisation of the public kernels, x / sqrt(Σx² + 1e-6).

`l2norm` is an autograd Function with a hand-written backward when a gradient is needed (autograd through
the formula ran ~6 element-wise passes, each into a fresh tensor); its formula stays beside it as
`l2norm_reference`, the spec the fast path is tested against. It saves its own output, which the chunked
op saves too, so it keeps no extra activation alive.
"""

import torch
import torch.nn.functional as F

from k3.ops.numerics import at_least_fp32

# The chunked algorithm is proven safe for decays down to e^-5 per token per channel (see chunk.py);
# fla's `safe_gate` path enforces the same range.
MIN_LOWER_BOUND = -5.0


def l2norm_reference(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """The formula as written, autograd through every op."""
    xf = at_least_fp32(x)
    return (xf * torch.rsqrt(xf.pow(2).sum(-1, keepdim=True) + eps)).to(x.dtype)


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x (..., D) -> x / sqrt(Σx² + eps) over the last dim, computed in fp32 (or fp64) and cast back."""
    if torch.is_grad_enabled() and x.requires_grad:
        return _L2Norm.apply(x, eps)
    xf = at_least_fp32(x)
    return torch.mul(xf, _rstd(xf, eps)).to(x.dtype)


def _rstd(xf: torch.Tensor, eps: float) -> torch.Tensor:
    """(..., D) -> (..., 1): 1/sqrt(Σx² + eps); vector_norm reads x once and allocates no x²."""
    return torch.linalg.vector_norm(xf, dim=-1, keepdim=True).square_().add_(eps).rsqrt_()


class _L2Norm(torch.autograd.Function):
    """y = x̂ = x·rstd;  dx = rstd·(dy − x̂·Σ(dy·x̂)).  Saves x̂ (the output, when it is in the compute
    dtype; x otherwise, so a bf16 output's rounding does not enter the gradient) and rstd."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, eps: float) -> torch.Tensor:
        xf = at_least_fp32(x)
        rstd = _rstd(xf, eps)
        y = torch.mul(xf, rstd)
        ctx.x_hat_saved = y.dtype == x.dtype
        ctx.save_for_backward(y if ctx.x_hat_saved else x, rstd)
        return y.to(x.dtype)

    @staticmethod
    def backward(ctx, dy: torch.Tensor) -> tuple[torch.Tensor | None, None]:
        saved, rstd = ctx.saved_tensors
        x_hat = saved if ctx.x_hat_saved else torch.mul(at_least_fp32(saved), rstd)
        dy = dy.to(x_hat.dtype)
        dot = torch.linalg.vecdot(dy, x_hat).unsqueeze_(-1).neg_()
        dx = torch.mul(x_hat, dot).add_(dy).mul_(rstd)
        return dx.to(saved.dtype), None


def check_lower_bound(lower_bound: float | None) -> None:
    if lower_bound is not None and not (MIN_LOWER_BOUND <= lower_bound < 0):
        raise ValueError(
            f"lower_bound must be in [{MIN_LOWER_BOUND}, 0) (per-token decay at least e^{MIN_LOWER_BOUND}), "
            f"got {lower_bound}; pass lower_bound=None for the unbounded Kimi Linear gate"
        )


def kda_gate(
    g_raw: torch.Tensor,
    A_log: torch.Tensor | None,
    dt_bias: torch.Tensor | None = None,
    lower_bound: float | None = -5.0,
) -> torch.Tensor:
    """Per-channel log-decay of KDA, in fp32 (fp64 stays fp64).

    g_raw:   (..., H, K)  the forget-gate projection f_b_proj(f_a_proj(x))
    A_log:   (H,)         per-head log rate; None means rate 1 (bounded form only)
    dt_bias: (H*K,) or (H, K)
    returns  (..., H, K)  g ∈ (lower_bound, 0), or g ≤ 0 when unbounded

    bounded (K3):           g = lower_bound · sigmoid(exp(A_log) · (g_raw + dt_bias))
    unbounded (Kimi Linear): g = −exp(A_log) · softplus(g_raw + dt_bias)
    """
    check_lower_bound(lower_bound)
    H, K = g_raw.shape[-2:]
    g = at_least_fp32(g_raw)
    if dt_bias is not None:
        if dt_bias.numel() != H * K:
            raise ValueError(f"dt_bias must have H*K = {H * K} elements ([H*K] or [H, K]), got {list(dt_bias.shape)}")
        g = g + dt_bias.reshape(H, K).to(g.dtype)
    if A_log is not None and A_log.numel() != H:
        raise ValueError(f"A_log must have H = {H} elements, got {list(A_log.shape)}")
    rate = None if A_log is None else A_log.reshape(H, 1).to(g.dtype).exp()
    if lower_bound is None:
        if rate is None:
            raise ValueError("the unbounded gate (lower_bound=None) needs A_log")
        return -rate * F.softplus(g)
    return lower_bound * torch.sigmoid(g if rate is None else rate * g)
