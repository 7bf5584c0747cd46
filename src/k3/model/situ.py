"""SiTU-GLU (SPEC §2.4), the gated activation of every K3 feed-forward.

    SiTU(g, u) = [β₁ tanh(g/β₁) · sigmoid(g)] · [β₂ tanh(u/β₂)]

Like SwiGLU near zero (tanh(x/β)·β ≈ x), soft-capped in the tail: |output| < β₁β₂ (= 100 for K3),
which keeps low-precision (FP8/FP4) activations in range. Computed in fp32.
"""

import torch
import torch.nn.functional as F
from torch import nn

from k3.ops.autograd import first_derivative_only
from k3.ops.numerics import at_least_fp32


def situ_reference(g: torch.Tensor, u: torch.Tensor, beta1: float = 4.0, beta2: float = 25.0) -> torch.Tensor:
    """The formula as written, autograd through every op: the spec `situ` is tested against."""
    gf, uf = at_least_fp32(g), at_least_fp32(u)
    y = beta1 * torch.tanh(gf / beta1) * torch.sigmoid(gf) * (beta2 * torch.tanh(uf / beta2))
    return y.to(g.dtype)


def situ(g: torch.Tensor, u: torch.Tensor, beta1: float = 4.0, beta2: float = 25.0) -> torch.Tensor:
    """g, u (..., I) -> y (..., I) in g's dtype, computed in fp32, with a hand-written backward.

    Called once per routed expert, on the shared experts and on the dense layer, the composed formula
    cost ~9 element-wise passes forward and twice that in autograd's backward, and saved ~6 tensors."""
    if g.shape != u.shape:  # broadcasting operands: the formula as written (the model never broadcasts them)
        return situ_reference(g, u, beta1, beta2)
    if torch.is_grad_enabled() and (g.requires_grad or u.requires_grad):
        return _SiTU.apply(g, u, beta1, beta2)
    return _situ_parts(at_least_fp32(g), at_least_fp32(u), beta1, beta2)[0].to(g.dtype)


def _situ_parts(gf: torch.Tensor, uf: torch.Tensor, beta1: float, beta2: float) -> tuple[torch.Tensor, ...]:
    """y = β₁β₂ · t₁ · s · t₂ with t₁ = tanh(g/β₁), s = sigmoid(g), t₂ = tanh(u/β₂); returns (y, t₁, s, t₂)."""
    t1 = torch.mul(gf, 1 / beta1).tanh_()
    s = torch.sigmoid(gf)
    t2 = torch.mul(uf, 1 / beta2).tanh_()
    y = torch.addcmul(t1.new_zeros(()), t1, s, value=beta1 * beta2).mul_(t2)  # one pass for t₁·s·β₁β₂
    return y, t1, s, t2


class _SiTU(torch.autograd.Function):
    """Saves t₁, s, t₂ (fp32): recomputing them from g and u in the backward (two tanh, the dearest
    element-wise op on CPU) made forward+backward 1.3-1.6x slower than saving them.

        dy/dg = β₁β₂ · t₂ · s · [(1 − t₁²)/β₁ + t₁(1 − s)]        dy/du = β₁ · t₁ · s · (1 − t₂²)
    """

    @staticmethod
    def forward(ctx, g: torch.Tensor, u: torch.Tensor, beta1: float, beta2: float) -> torch.Tensor:
        y, t1, s, t2 = _situ_parts(at_least_fp32(g), at_least_fp32(u), beta1, beta2)
        ctx.save_for_backward(t1, s, t2)
        ctx.beta, ctx.dtypes = (beta1, beta2), (g.dtype, u.dtype)
        return y.to(g.dtype)

    @staticmethod
    @first_derivative_only
    def backward(ctx, dy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        t1, s, t2 = ctx.saved_tensors
        (b1, b2), (g_dtype, u_dtype) = ctx.beta, ctx.dtypes
        dg, du = _situ_grads(dy, t1, s, t2, b1, b2, *ctx.needs_input_grad[:2])
        return (dg.to(g_dtype) if dg is not None else None), (du.to(u_dtype) if du is not None else None), None, None


def _situ_grads(
    dy: torch.Tensor,
    t1: torch.Tensor,
    s: torch.Tensor,
    t2: torch.Tensor,
    b1: float,
    b2: float,
    want_g=True,
    want_u=True,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """dy·∂y/∂g and dy·∂y/∂u in t₁'s dtype (None where not wanted), from the parts `_situ_parts` returns (only
    fresh buffers are written: t₁, s and t₂ are left as they are)."""
    dy = dy.to(t1.dtype)
    e = torch.addcmul(t1.new_zeros(()), dy, t2, value=b1 * b2)  # β₁β₂·dy·t₂
    dg = du = None
    if want_g:
        # t₁(1 − s) + (1 − t₁²)/β₁, in that order: every partial sum stays O(1), so fp32 loses no more
        # than autograd through the formula does (folding β₁β₂ in first cost two digits)
        dg = torch.addcmul(t1, t1, s, value=-1).addcmul_(t1, t1, value=-1 / b1).add_(1 / b1)
        dg = dg.mul_(s).mul_(e)
    if want_u:
        # dy·(1 − t₂²)·t₁·s·β₁, written over e (a fresh (..., I) tensor costs page faults, not only a pass)
        du = torch.addcmul(dy, e, t2, value=-1 / (b1 * b2), out=e).mul_(t1).mul_(s).mul_(b1)
    return dg, du


def glu_parts(
    g: torch.Tensor, u: torch.Tensor, act: str, beta1: float, beta2: float
) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """`glu(g, u, act, β₁, β₂)` and what `glu_backward` needs, for operators that compute their own backward
    (k3::moe_experts): SiTU's fp32 t₁, s, t₂ (its two tanh are the dearest element-wise op on a CPU, so they are
    computed once), or SwiGLU's g and u."""
    if act != "situ":
        return F.silu(g) * u, (g, u)
    y, t1, s, t2 = _situ_parts(at_least_fp32(g), at_least_fp32(u), beta1, beta2)
    return y.to(g.dtype), (t1, s, t2)


def glu_backward(
    parts: tuple[torch.Tensor, ...], dy: torch.Tensor, act: str, beta1: float, beta2: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """dy (..., I) -> (dg, du), the gradients of the glu that `glu_parts` returned `parts` for, in dy's dtype,
    without autograd."""
    if act == "situ":
        dg, du = _situ_grads(dy, *parts, beta1, beta2)
        return dg.to(dy.dtype), du.to(dy.dtype)
    g, u = parts
    sg = torch.sigmoid(g)
    # silu'(g) = s · (1 + g · (1 − s))
    return dy * u * sg * (1 + g * (1 - sg)), dy * g * sg


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
