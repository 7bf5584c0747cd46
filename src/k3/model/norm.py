"""RMSNorm with fp32 statistics (STYLE rule 6), with a hand-written backward.

    y = x · rstd · w,   rstd = 1/sqrt(mean(x²) + eps)   over the last dim
    dx = rstd · (dy·w − x̂ · mean(dy·w · x̂)),   dw = Σ dy · x̂,   x̂ = x · rstd

Autograd through the composed formula ran ~8 passes over x in the backward (PowBackward, MeanBackward,
two MulBackward) and saved x and x̂; this saves x (in its own dtype) and rstd, recomputes x̂, and writes 2 tensors.
"""

import torch
from torch import nn

from k3.ops.autograd import first_derivative_only
from k3.ops.numerics import at_least_fp32, inverse_norm


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
    return torch.mul(xf, inverse_norm(xf, eps, mean=True)).mul_(weight.to(xf.dtype)).to(x.dtype)


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        xf = at_least_fp32(x)
        rstd = inverse_norm(xf, eps, mean=True)
        ctx.save_for_backward(x, weight, rstd)
        return torch.mul(xf, rstd).mul_(weight.to(xf.dtype)).to(x.dtype)

    @staticmethod
    @first_derivative_only
    def backward(ctx, dy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, weight, rstd = ctx.saved_tensors
        xf = at_least_fp32(x)
        dy = dy.to(xf.dtype)
        w = weight.to(xf.dtype)
        D = x.shape[-1]
        x_hat = torch.mul(xf, rstd)
        dy_x_hat = torch.mul(dy, x_hat).reshape(-1, D)
        dw = dy_x_hat.sum(0).to(weight.dtype) if ctx.needs_input_grad[1] else None
        dx = None
        if ctx.needs_input_grad[0]:
            # mean(dy·w·x̂) as a matrix-vector product over the dy·x̂ that dw needed anyway (vecdot allocated
            # its own product); then dx = rstd·(dy·w − x̂·mean) written over x̂
            mean = (dy_x_hat @ w).reshape(*x.shape[:-1], 1).div_(-D)
            dx = x_hat.mul_(mean).addcmul_(dy, w).mul_(rstd).to(x.dtype)
        return dx, dw, None


class RMSNorm(nn.Module):
    """y = x / sqrt(mean(x²) + eps) · weight over the last dim; statistics in fp32, output in x's dtype."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)
