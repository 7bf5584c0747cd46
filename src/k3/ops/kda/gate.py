"""The element-wise pieces of KDA that sit in front of the recurrence (SPEC §2.1).

- `kda_gate`: the per-channel log-decay g from the raw forget-gate projection.
- `l2norm`: the q/k normalisation of the public kernels, x / sqrt(Σx² + 1e-6).
"""

import torch
import torch.nn.functional as F

from k3.ops.numerics import at_least_fp32

# The chunked algorithm is proven safe for decays down to e^-5 per token per channel (see chunk.py);
# fla's `safe_gate` path enforces the same range.
MIN_LOWER_BOUND = -5.0


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(Σx² + eps) over the last dim, computed in fp32 (or fp64) and cast back."""
    xf = at_least_fp32(x)
    return (xf * torch.rsqrt(xf.pow(2).sum(-1, keepdim=True) + eps)).to(x.dtype)


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
