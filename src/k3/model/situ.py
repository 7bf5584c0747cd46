"""SiTU-GLU (SPEC §2.4), the gated activation of every K3 feed-forward.

    SiTU(g, u) = [β₁ tanh(g/β₁) · sigmoid(g)] · [β₂ tanh(u/β₂)]

Like SwiGLU near zero (tanh(x/β)·β ≈ x), soft-capped in the tail: |output| < β₁β₂ (= 100 for K3),
which keeps low-precision (FP8/FP4) activations in range. Computed in fp32.
"""

import torch
import torch.nn.functional as F
from torch import nn

from k3.ops.numerics import at_least_fp32


def situ(g: torch.Tensor, u: torch.Tensor, beta1: float = 4.0, beta2: float = 25.0) -> torch.Tensor:
    gf, uf = at_least_fp32(g), at_least_fp32(u)
    y = beta1 * torch.tanh(gf / beta1) * torch.sigmoid(gf) * (beta2 * torch.tanh(uf / beta2))
    return y.to(g.dtype)


def glu(g: torch.Tensor, u: torch.Tensor, act: str, beta1: float, beta2: float) -> torch.Tensor:
    """The configured gated activation: 'situ' (K3) or 'silu' (SwiGLU, for ablations)."""
    return situ(g, u, beta1, beta2) if act == "situ" else F.silu(g) * u


class GatedMLP(nn.Module):
    """down(act(gate(x), up(x))): the dense first-layer FFN and the shared experts (`mlp.*`,
    `shared_experts.*` in the released checkpoint)."""

    def __init__(self, dim: int, hidden: int, act: str = "situ", beta1: float = 4.0, beta2: float = 25.0):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)
        self.act, self.beta1, self.beta2 = act, beta1, beta2

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(glu(self.gate_proj(x), self.up_proj(x), self.act, self.beta1, self.beta2))


class Expert(nn.Module):
    """One routed expert in the latent space, with the checkpoint's names: w1 gate, w3 up, w2 down."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
