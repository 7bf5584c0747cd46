"""RMSNorm with fp32 statistics (STYLE rule 6), with a hand-written backward.

    y = x · rstd · w,   rstd = 1/sqrt(mean(x²) + eps)   over the last dim
    dx = rstd · (dy·w − x̂ · mean(dy·w · x̂)),   dw = Σ dy · x̂,   x̂ = x · rstd

Autograd through the composed formula ran ~8 passes over x in the backward (PowBackward, MeanBackward,
two MulBackward) and saved x and x̂; this saves x (in its own dtype) and rstd, and recomputes x̂.
"""

import torch
from torch import nn

from k3.ops.numerics import at_least_fp32


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The formula as written, autograd through every op: the spec `rms_norm` is tested against."""
    xf = at_least_fp32(x)
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (y * weight.to(y.dtype)).to(x.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x (..., D), weight (D,) -> (..., D) in x's dtype; statistics and the product in at least fp32."""
    if x.shape[-1:] != weight.shape:
        shapes = f"x {tuple(x.shape)} over its last dim: weight {tuple(weight.shape)}, not ({x.shape[-1]},)"
        raise ValueError(f"RMSNorm of {shapes}")
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        return _RMSNorm.apply(x, weight, eps)
    xf = at_least_fp32(x)
    return torch.mul(xf, _rstd(xf, eps)).mul_(weight.to(xf.dtype)).to(x.dtype)


def _rstd(xf: torch.Tensor, eps: float) -> torch.Tensor:
    """(..., D) -> (..., 1): 1/sqrt(mean(x²) + eps). vector_norm reads x once and allocates no x² (half the
    time of pow + mean); squaring the norm costs one rounding."""
    return torch.linalg.vector_norm(xf, dim=-1, keepdim=True).square_().div_(xf.shape[-1]).add_(eps).rsqrt_()


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        xf = at_least_fp32(x)
        rstd = _rstd(xf, eps)
        ctx.save_for_backward(x, weight, rstd)
        return torch.mul(xf, rstd).mul_(weight.to(xf.dtype)).to(x.dtype)

    @staticmethod
    def backward(ctx, dy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, weight, rstd = ctx.saved_tensors
        xf = at_least_fp32(x)
        dy = dy.to(xf.dtype)
        x_hat = torch.mul(xf, rstd)
        dx = dw = None
        if ctx.needs_input_grad[1]:
            dw = torch.mul(dy, x_hat).reshape(-1, x.shape[-1]).sum(0).to(weight.dtype)
        if ctx.needs_input_grad[0]:
            dyw = torch.mul(dy, weight.to(xf.dtype))
            c = torch.linalg.vecdot(dyw, x_hat, dim=-1).unsqueeze(-1).mul_(rstd).div_(-x.shape[-1])
            dx = dyw.mul_(rstd).addcmul_(x_hat, c).to(x.dtype)  # rstd·dyw − x̂ · rstd·mean(dyw·x̂)
        return dx, dw, None


class RMSNorm(nn.Module):
    """y = x / sqrt(mean(x²) + eps) · weight over the last dim; statistics in fp32, output in x's dtype."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)
