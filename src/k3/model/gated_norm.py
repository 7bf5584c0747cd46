"""KDA's output gating: the per-head RMSNorm times sigmoid of the output gate, in one Function.

    y = x̂ · w · s,   x̂ = x · rstd,  rstd = 1/sqrt(mean(x²) + eps),  s = sigmoid(gate)
    dgate = dy · x̂w · s(1−s),   dw = Σ dy·s · x̂,   dx = rstd · (dy·s·w − x̂ · mean(dy·s·w · x̂))

Autograd through rms_norm(x, w) * sigmoid(gate) wrote 3 forward and 5 backward tensors and kept the normed
x as well as s; this writes 2 and 4 and keeps x (its own input, which the chunked op's output is) and s.
"""

import torch

from k3.model.norm import rms_norm_reference
from k3.ops.autograd import first_derivative_only
from k3.ops.numerics import at_least_fp32, inverse_norm


def gated_rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, gate: torch.Tensor, eps: float) -> torch.Tensor:
    """The formula as written, autograd through every op."""
    return rms_norm_reference(x, weight, eps) * torch.sigmoid(gate)


def gated_rms_norm(x: torch.Tensor, weight: torch.Tensor, gate: torch.Tensor, eps: float) -> torch.Tensor:
    """x (..., D), weight (D,), gate (..., D) -> (..., D) in x's dtype; computed in at least fp32."""
    if x.shape[-1:] != weight.shape or gate.shape != x.shape:
        raise ValueError(
            f"gated RMSNorm needs weight ({x.shape[-1]},) and gate {tuple(x.shape)} for x {tuple(x.shape)}; "
            f"got weight {tuple(weight.shape)}, gate {tuple(gate.shape)}"
        )
    if torch.is_grad_enabled() and any(t.requires_grad for t in (x, weight, gate)):
        return _GatedRMSNorm.apply(x, weight, gate, eps)
    xf = at_least_fp32(x)
    s = torch.sigmoid(gate.to(xf.dtype))
    return torch.mul(xf, inverse_norm(xf, eps, mean=True)).mul_(weight.to(xf.dtype)).mul_(s).to(x.dtype)


class _GatedRMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, gate: torch.Tensor, eps: float) -> torch.Tensor:
        xf = at_least_fp32(x)
        rstd = inverse_norm(xf, eps, mean=True)
        s = torch.sigmoid(gate.to(xf.dtype))
        ctx.save_for_backward(x, weight, rstd, s)
        ctx.gate_dtype = gate.dtype
        return torch.mul(xf, rstd).mul_(weight.to(xf.dtype)).mul_(s).to(x.dtype)

    @staticmethod
    @first_derivative_only
    def backward(ctx, dy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, weight, rstd, s = ctx.saved_tensors
        xf = at_least_fp32(x)
        w = weight.to(xf.dtype)
        D = x.shape[-1]
        x_hat = torch.mul(xf, rstd)
        dn = torch.mul(dy.to(xf.dtype), s)  # the gradient reaching the normed x̂·w
        t = torch.mul(dn, x_hat)
        dw = t.reshape(-1, D).sum(0).to(weight.dtype) if ctx.needs_input_grad[1] else None
        t.mul_(w)  # dy·s·x̂·w: the gate's gradient before s's derivative, and the norm's mean term
        dx = None
        if ctx.needs_input_grad[0]:
            mean = t.sum(-1, keepdim=True).div_(-D)
            dx = x_hat.mul_(mean).addcmul_(dn, w).mul_(rstd).to(x.dtype)
        dgate = t.addcmul_(t, s, value=-1.0).to(ctx.gate_dtype) if ctx.needs_input_grad[2] else None
        return dx, dw, dgate, None
