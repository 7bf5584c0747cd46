"""Trained-like KDA gates for the model-level benchmarks.

A freshly initialised K3 layer barely forgets (A_log ~ log U[1, 16], dt_bias ≈ log(1e-3 .. 0.1): g ≈ −0.00 to
−0.003 after the quickstart's 120 steps), but a trained model spreads its log-decay across K3's bound, and the KDA
kernels' speed depends on it (docs/kda.md, "On every gate"). `trained_like_gates` sets every KDA layer's A_log and
dt_bias so that its gate on the given tokens is g = −5·sigmoid(z) with z ≈ N(0, 1) per head and channel: the
`trained` regime of benchmarks/kda_op.py.
"""

import torch

from k3.ops.kda import kda_gate


@torch.no_grad()
def trained_like_gates(model: torch.nn.Module, tokens: torch.Tensor) -> str:
    """Set each KDA layer's dt_bias = −mean and A_log = −log(std) of its gate pre-activation g_raw on `tokens`
    (one forward), so that rate · (g_raw + dt_bias) has unit variance per head; returns the gates' summary."""
    layers = [m for m in model.modules() if hasattr(m, "A_log") and hasattr(m, "f_b_proj")]
    if not layers:
        raise ValueError("the model has no KDA layers (modules with A_log and f_b_proj)")
    raw = {}
    hooks = [m.f_b_proj.register_forward_hook(lambda mod, i, out, m=m: raw.__setitem__(m, out)) for m in layers]
    try:
        model(tokens)
    finally:
        for h in hooks:
            h.remove()
    for m in layers:
        x = raw[m].float().reshape(-1, m.H, m.K)  # (tokens, H, K)
        m.dt_bias.copy_(-x.mean(0).reshape(-1))
        m.A_log.copy_(-(x + m.dt_bias.view(m.H, m.K)).std(dim=(0, 2)).clamp_min(1e-6).log())
    # what the gate now is, on the same tokens
    gs = []
    hooks = [m.f_b_proj.register_forward_hook(lambda mod, i, out, m=m: gs.append(_gate(m, out))) for m in layers]
    try:
        model(tokens)
    finally:
        for h in hooks:
            h.remove()
    g = torch.cat([x.flatten() for x in gs])
    g = g[:: max(1, g.numel() // 1_000_000)]  # quantile's input limit; a million samples say enough
    return f"KDA gates trained-like: g mean {g.mean():.2f}, 10th percentile {g.quantile(0.1):.2f}, min {g.min():.2f}"


def _gate(m: torch.nn.Module, g_raw: torch.Tensor) -> torch.Tensor:
    return kda_gate(g_raw.view(*g_raw.shape[:-1], m.H, m.K), m.A_log, m.dt_bias, m.lower_bound)
