"""Muon for matrices, AdamW for everything else, in one optimiser (SPEC §2.7).

Muon (Jordan et al. 2024; the RMS-matched, weight-decayed form of Moonlight, Liu et al. 2025), for a
weight W (rows × cols) with gradient G:

    B ← μ·B + G                                   momentum, μ = 0.95
    D = G + μ·B                                   Nesterov direction
    O = NewtonSchulz(D) ≈ U·Vᵀ  (D = U·Σ·Vᵀ)       the nearest semi-orthogonal matrix
    W ← W·(1 − lr·wd) − lr · 0.2·√max(rows, cols) · O

A semi-orthogonal m × n matrix has RMS 1/√max(m, n), so the factor 0.2·√max(m, n) gives the update an
RMS of about 0.2, the typical RMS of an AdamW update: one learning rate (and one schedule) serves both.

Per-head Muon (groups with `heads = H`): the direction of a Q, K or V projection (H·r × cols) is
viewed as (H, r, cols) and each head's block is orthogonalised on its own and scaled by 0.2·√max(r, cols),
so no head's update is shaped by another head's gradient.

Idle experts (groups with `skip_idle = True`, the routed experts under `--expert-optimizer muon-active`): a
weight whose gradient is None or all zero this step received no tokens. Its step is the ordinary rule with
G = 0 except for the orthogonalisation: the momentum decays (B ← μ·B), the decoupled weight decay applies
(W ← W·(1 − lr·wd)), and no Newton–Schulz update is applied (plain Muon would apply NS(μ²·B), a full-size
step along stale momentum). A group without skip_idle leaves a weight whose gradient is None untouched.

Every state entry is a tensor (`momentum_buffer`; `exp_avg`, `exp_avg_sq`, `step` as 0-dim fp32), so
`state_dict()["state"]` saves to safetensors without pickle; `param_groups` holds plain numbers and
strings (JSON-able).
"""

import math
from collections.abc import Iterable
from typing import Any

import torch
from torch.distributed.tensor import DTensor, distribute_tensor

# Quintic coefficients (Jordan et al.): chosen to push small singular values up fast (slope a at 0)
# rather than to converge; after 5 steps the singular values lie in about [0.68, 1.13], not at 1.
NS_COEFFS = (3.4445, -4.7750, 2.0315)

ALGOS = ("muon", "adamw")
# At most this many elements per batched Newton–Schulz call. On a GPU, 64 MiB of fp32 (bounding the stacked
# copy; bigger batches only amortise launches). On a CPU, 2 MiB: a batch whose five iterates stay in cache runs
# the small bmm's at the matmul rate, while one over every expert matrix streams each product through memory
# (the small preset's 409 expert-shaped matrices: 375 ms at 2^24 elements, 213 ms at 2^19, 2 threads).
NS_BATCH_ELEMENTS = {"cpu": 2**19}
NS_BATCH_ELEMENTS_DEFAULT = 2**24


# The iterations' compute dtype, by name (a group's `ns_dtype`, JSON-able). bfloat16 is what Jordan et al.'s Muon
# runs them in: the iteration is a contraction towards the orthogonal factor and lands σ in [0.68, 1.13] either way,
# and bf16 matmuls run 2.7× (AVX512-BF16) to 5-7× (AMX) fp32's rate where the CPU has them (k3.ops.compute_dtype).
NS_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def newton_schulz(G: torch.Tensor, steps: int = 5, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Approximately orthogonalise the last two dims: G = U·Σ·Vᵀ ↦ U·p(Σ)·Vᵀ with p(σ) ≈ 1.

    G: (..., m, n), any leading (batch) dims; each matrix is normalised and orthogonalised separately.
    Iterates X ← a·X + (b·A + c·A²)·X with A = X·Xᵀ, i.e. σ ← aσ + bσ³ + cσ⁵ on every singular value,
    starting from X = G / (‖G‖_F + 1e-7) so that all σ ≤ 1. The norm is taken in fp32, the iterations run in
    `dtype` (fp32 or bf16; fp64 input stays fp64 throughout); returned in G's dtype.
    """
    a, b, c = NS_COEFFS
    X = G if G.dtype == torch.float64 else G.float()
    X = X / (torch.linalg.matrix_norm(X, keepdim=True) + 1e-7)
    if X.dtype == torch.float32 and dtype != torch.float32:
        X = X.to(dtype)
    tall = X.shape[-2] > X.shape[-1]
    if tall:  # work on the wide side so A = X·Xᵀ is the smaller Gram matrix
        X = X.mT
    shape = X.shape
    X = X.reshape(-1, *shape[-2:])  # one batch dim, for the fused baddbmm calls
    for _ in range(steps):
        A = X @ X.mT  # (batch, min, min)
        B = torch.baddbmm(A, A, A, beta=b, alpha=c)  # b·A + c·A², without separate element-wise passes
        X = torch.baddbmm(X, B, X, beta=a)  # a·X + B·X
    X = X.reshape(shape)
    if tall:
        X = X.mT
    return X.to(G.dtype)


def muon_update(direction: torch.Tensor, heads: int = 1, ns_steps: int = 5, ns_dtype: str = "float32") -> torch.Tensor:
    """The scaled orthogonal update for (..., heads·r, cols) directions: per head block when heads > 1.

    returns (..., heads·r, cols): NewtonSchulz of each (r, cols) block (iterations in ns_dtype) times
    0.2·√max(r, cols).
    """
    *lead, rows, cols = direction.shape
    blocks = direction.reshape(*lead, heads, rows // heads, cols)  # (..., H, r, cols)
    scale = 0.2 * math.sqrt(max(rows // heads, cols))
    return (newton_schulz(blocks, ns_steps, NS_DTYPES[ns_dtype]) * scale).reshape(direction.shape)


class MuonAdamW(torch.optim.Optimizer):
    """One optimiser, two kinds of parameter group, told apart by `group["algo"]`:

    - "muon": 2-D weights; keys lr, weight_decay, momentum (0.95), ns_steps (5), heads (1 = whole matrix),
      skip_idle (False; True: a weight without gradient this step only decays, see the module docstring),
      ns_dtype ("float32"; "bfloat16": the Newton–Schulz iterations in bf16, NS_DTYPES).
    - "adamw": anything; keys lr, weight_decay, betas ((0.9, 0.95)), eps (1e-8). Standard AdamW:
      m ← β₁m + (1−β₁)g, v ← β₂v + (1−β₂)g², p ← p·(1 − lr·wd) − lr·(m/(1−β₁ᵗ)) / (√(v/(1−β₂ᵗ)) + ε).

    Each group also keeps `base_lr` (its lr at construction), which an lr schedule multiplies
    (see k3.train.optim.set_lr_factor). Parameters whose .grad is None are skipped.
    """

    def __init__(
        self,
        params: Iterable[dict[str, Any]],
        lr: float = 1e-3,
        weight_decay: float = 0.0,
        momentum: float = 0.95,
        ns_steps: int = 5,
        betas: tuple[float, float] = (0.9, 0.95),
        eps: float = 1e-8,
        ns_dtype: str = "float32",
    ):
        # Each algorithm's own keys; only lr and weight_decay are shared torch `defaults`, because the
        # base class copies every default into every group (a Muon group would carry betas).
        self.algo_defaults = {
            "muon": dict(momentum=momentum, ns_steps=ns_steps, heads=1, skip_idle=False, ns_dtype=ns_dtype),
            "adamw": dict(betas=tuple(betas), eps=eps),
        }
        super().__init__(params, dict(lr=lr, weight_decay=weight_decay))

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Fill the group's algorithm's defaults and base_lr; check that Muon gets splittable matrices.

        `params` may hold tensors or (name, tensor) pairs (torch then keeps `param_names`)."""
        group = dict(param_group)
        algo = group.get("algo")
        if algo not in ALGOS:
            raise ValueError(f"every MuonAdamW param group needs algo in {ALGOS}, got {algo!r}")
        for key, default in self.algo_defaults[algo].items():
            group.setdefault(key, default)
        group.setdefault("base_lr", group.get("lr", self.defaults["lr"]))
        params = group["params"]
        group["params"] = [params] if isinstance(params, torch.Tensor) else list(params)
        if algo == "muon":
            if group["ns_dtype"] not in NS_DTYPES:
                names = ", ".join(NS_DTYPES)
                raise ValueError(f"a Muon group's ns_dtype must be one of {names}, got {group['ns_dtype']!r}")
            heads = group["heads"]
            if not isinstance(heads, int) or heads < 1:
                raise ValueError(f"a Muon group's heads must be a positive int, got {heads!r}")
            for p in group["params"]:
                name, p = p if isinstance(p, tuple) else ("", p)
                if p.ndim != 2 or p.shape[0] % heads:
                    raise ValueError(
                        f"Muon takes 2-D weights whose rows split into heads={heads} blocks; {name} has shape "
                        f"{tuple(p.shape)}: put it in an AdamW group"
                    )
        super().add_param_group(group)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # torch keeps the given tensors when dtype and device already match, so an optimiser loaded from
        # another live optimiser's state_dict would share (and update in place) its buffers: copy them.
        state = {
            k: {n: v.clone() if isinstance(v, torch.Tensor) else v for n, v in s.items()}
            for k, s in state_dict["state"].items()
        }
        super().load_state_dict({**state_dict, "state": state})
        # torch replaces each group by the saved one: a state_dict from before a key existed lacks it
        for group in self.param_groups:
            for key, default in self.algo_defaults[group["algo"]].items():
                group.setdefault(key, default)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            if group["algo"] == "muon":
                self._muon(group)
            else:
                self._adamw(group)
        return loss

    def _muon(self, group: dict[str, Any]) -> None:
        lr, wd, mu = group["lr"], group["weight_decay"], group["momentum"]
        skip_idle = group["skip_idle"]
        params, directions = [], []
        for p in group["params"]:
            if p.grad is None and not skip_idle:
                continue
            state = self.state[p]
            if not state:
                state["momentum_buffer"] = torch.zeros_like(p)
            buf = state["momentum_buffer"]
            if skip_idle and (p.grad is None or not p.grad.any()):  # no tokens this step: G = 0, no NS call
                buf.mul_(mu)
                p.mul_(1 - lr * wd)
                continue
            buf.mul_(mu).add_(p.grad)
            params.append(p)
            directions.append(p.grad.add(buf, alpha=mu))
        # A matrix sharded by rows across ranks (FSDP2: p, its gradient and its momentum are DTensors) is
        # orthogonalised on its full value: its direction is all-gathered here, one matrix at a time in the
        # group's order, and every rank computes the same update and keeps its rows of it.
        sharded = [isinstance(d, DTensor) for d in directions]
        directions = [d.full_tensor() if s else d for d, s in zip(directions, sharded, strict=True)]
        # Same-shaped matrices (every expert's w1, all q_proj, ...) share batched Newton–Schulz calls: a few
        # large matmuls instead of hundreds of small ones, whose per-call overhead dominates on a CPU.
        by_shape: dict[torch.Size, list[int]] = {}
        for i, d in enumerate(directions):
            by_shape.setdefault(d.shape, []).append(i)
        for shape, indices in by_shape.items():
            limit = NS_BATCH_ELEMENTS.get(directions[indices[0]].device.type, NS_BATCH_ELEMENTS_DEFAULT)
            per_call = max(1, limit // shape.numel())
            for start in range(0, len(indices), per_call):
                chunk = indices[start : start + per_call]
                stacked = torch.stack([directions[i] for i in chunk])
                updates = muon_update(stacked, group["heads"], group["ns_steps"], group["ns_dtype"])
                for i, update in zip(chunk, updates, strict=True):
                    p = params[i]
                    if sharded[i]:  # this rank's rows of the full update
                        update = distribute_tensor(update, p.device_mesh, p.placements, src_data_rank=None)
                    p.mul_(1 - lr * wd)  # decoupled: the decay never enters the momentum
                    p.add_(update.to(p.dtype), alpha=-lr)

    def _adamw(self, group: dict[str, Any]) -> None:
        lr, wd, eps = group["lr"], group["weight_decay"], group["eps"]
        beta1, beta2 = group["betas"]
        for p in group["params"]:
            if p.grad is None:
                continue
            g = p.grad
            state = self.state[p]
            if not state:
                # on the CPU whatever the param's device (load_state_dict leaves `step` where it is), so
                # reading it below never waits for an accelerator
                state["step"] = torch.tensor(0.0, dtype=torch.float32)
                state["exp_avg"] = torch.zeros_like(p)
                state["exp_avg_sq"] = torch.zeros_like(p)
            state["step"] += 1
            t = state["step"].item()
            m, v = state["exp_avg"], state["exp_avg_sq"]
            # the same operations, in the same order, as torch.optim.AdamW's single-tensor path
            p.mul_(1 - lr * wd)
            m.lerp_(g, 1 - beta1)
            v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
            denom = (v.sqrt() / (1 - beta2**t) ** 0.5).add_(eps)
            p.addcdiv_(m, denom, value=-lr / (1 - beta1**t))
