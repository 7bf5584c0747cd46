"""The element-wise pieces of KDA that sit in front of the recurrence (SPEC §2.1).

- `kda_gate`: the per-channel log-decay g from the raw forget-gate projection.
- `l2norm`: the q/k normalisation of the public kernels, x / sqrt(Σx² + 1e-6).

Both are autograd Functions with hand-written backwards when a gradient is needed (autograd through the
formulas ran ~10 element-wise passes, each into a fresh tensor); each keeps its formula beside it as
`*_reference`, the spec the fast path is tested against. They save their own output, which the chunked
op saves too, so they keep no extra activation alive.
"""

import torch
import torch.nn.functional as F

from k3.ops.autograd import first_derivative_only
from k3.ops.numerics import at_least_fp32, inverse_norm

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
    return torch.mul(xf, inverse_norm(xf, eps)).to(x.dtype)


class _L2Norm(torch.autograd.Function):
    """y = x̂ = x·rstd;  dx = rstd·(dy − x̂·Σ(dy·x̂)).  Saves x̂ (the output, when it is in the compute
    dtype; x otherwise, so a bf16 output's rounding does not enter the gradient) and rstd."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, eps: float) -> torch.Tensor:
        xf = at_least_fp32(x)
        rstd = inverse_norm(xf, eps)
        y = torch.mul(xf, rstd)
        ctx.x_hat_saved = y.dtype == x.dtype
        ctx.save_for_backward(y if ctx.x_hat_saved else x, rstd)
        return y.to(x.dtype)

    @staticmethod
    @first_derivative_only
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


def _check_gate(g_raw: torch.Tensor, A_log: torch.Tensor | None, dt_bias: torch.Tensor | None, lower_bound) -> None:
    check_lower_bound(lower_bound)
    H, K = g_raw.shape[-2:]
    if dt_bias is not None and dt_bias.numel() != H * K:
        raise ValueError(f"dt_bias must have H*K = {H * K} elements ([H*K] or [H, K]), got {list(dt_bias.shape)}")
    if A_log is not None and A_log.numel() != H:
        raise ValueError(f"A_log must have H = {H} elements, got {list(A_log.shape)}")
    if lower_bound is None and A_log is None:
        raise ValueError("the unbounded gate (lower_bound=None) needs A_log")


def kda_gate_reference(
    g_raw: torch.Tensor,
    A_log: torch.Tensor | None,
    dt_bias: torch.Tensor | None = None,
    lower_bound: float | None = -5.0,
) -> torch.Tensor:
    """The formulas of `kda_gate` as written, autograd through every op."""
    _check_gate(g_raw, A_log, dt_bias, lower_bound)
    H, K = g_raw.shape[-2:]
    g = at_least_fp32(g_raw)
    if dt_bias is not None:
        g = g + dt_bias.reshape(H, K).to(g.dtype)
    rate = None if A_log is None else A_log.reshape(H, 1).to(g.dtype).exp()
    if lower_bound is None:
        return -rate * F.softplus(g)
    return lower_bound * torch.sigmoid(g if rate is None else rate * g)


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
    unbounded (Kimi Linear): g = −exp(A_log) · softplus(g_raw + dt_bias)   (autograd through the formula)
    """
    if lower_bound is None:
        return kda_gate_reference(g_raw, A_log, dt_bias, lower_bound)
    _check_gate(g_raw, A_log, dt_bias, lower_bound)
    inputs = (g_raw, A_log, dt_bias)
    if torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in inputs):
        return _BoundedGate.apply(g_raw, A_log, dt_bias, lower_bound)
    return _bounded_gate(g_raw, A_log, dt_bias, lower_bound)


def _bounded_gate(g_raw, A_log, dt_bias, lower_bound: float) -> torch.Tensor:
    """lower_bound · sigmoid(rate · (g_raw + dt_bias)) into one fresh tensor, in at least fp32."""
    H, K = g_raw.shape[-2:]
    g = at_least_fp32(g_raw)
    if A_log is None:
        u = g.clone() if dt_bias is None else torch.add(g, dt_bias.reshape(H, K).to(g.dtype))
    else:
        # rate·g_raw + rate·dt_bias in one pass (rate·dt_bias is (H, K) only)
        rate = A_log.reshape(H, 1).to(g.dtype).exp()
        u = torch.mul(g, rate) if dt_bias is None else torch.addcmul(rate * dt_bias.reshape(H, K).to(g.dtype), g, rate)
    return u.sigmoid_().mul_(lower_bound)


class _BoundedGate(torch.autograd.Function):
    """y = lb·s, s = sigmoid(u), u = rate·z, z = g_raw + dt_bias, rate = exp(A_log):

        dz = dy·lb·s(1−s)·rate = dy·(y − y²/lb)·rate        (lb·s(1−s) = y − y²/lb)
        dg_raw = dz,  ddt_bias = Σ_tokens dz,  dA_log = Σ_{tokens,K} dz·z   (∂u/∂A_log = rate·z)

    and Σ dz·z = Σ dz·g_raw + Σ_K dt_bias·ddt_bias, so z is never rebuilt. Saves g_raw and y."""

    @staticmethod
    def forward(ctx, g_raw, A_log, dt_bias, lower_bound: float) -> torch.Tensor:
        y = _bounded_gate(g_raw, A_log, dt_bias, lower_bound)
        ctx.lower_bound = lower_bound
        ctx.save_for_backward(g_raw, A_log, dt_bias, y)
        return y

    @staticmethod
    @first_derivative_only
    def backward(ctx, dy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        g_raw, A_log, dt_bias, y = ctx.saved_tensors
        H, K = y.shape[-2:]
        need_g, need_a, need_dt = ctx.needs_input_grad[:3]
        dz = torch.addcmul(y, y, y, value=-1.0 / ctx.lower_bound).mul_(dy)
        if A_log is not None:
            dz.mul_(A_log.reshape(H, 1).to(y.dtype).exp())
        dz_hk = dz.reshape(-1, H, K)
        ddt = dz_hk.sum(0) if need_dt or (need_a and dt_bias is not None) else None
        dA = None
        if need_a:
            dA = torch.linalg.vecdot(dz_hk, at_least_fp32(g_raw).reshape(-1, H, K)).sum(0)
            if dt_bias is not None:
                dA += torch.linalg.vecdot(ddt, dt_bias.reshape(H, K).to(y.dtype))
            dA = dA.reshape(A_log.shape).to(A_log.dtype)
        ddt = ddt.reshape(dt_bias.shape).to(dt_bias.dtype) if need_dt else None
        dg = dz.to(g_raw.dtype) if need_g else None
        return dg, dA, ddt, None
