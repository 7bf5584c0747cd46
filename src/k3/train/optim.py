"""Which parameter gets which optimiser (SPEC §2.7), by the released checkpoint's names, and the lr schedule.

    per-head Muon   Q, K, V projections: KDA `self_attn.{q,k,v}_proj` (heads = kda_num_heads);
                    MLA `self_attn.q_b_proj` (or `q_proj` when q_lora_rank is None) and `self_attn.kv_b_proj`
                    (heads = num_attention_heads)
    Muon            every other 2-D weight of the blocks: o_proj, g_proj, f_a_proj, f_b_proj, b_proj, q_a_proj,
                    kv_a_proj_with_mqa, mlp / shared_experts / experts.{e}.w1|w2|w3, routed_expert_down_proj /
                    up_proj, the router `block_sparse_moe.gate.weight`
    AdamW           embed_tokens, lm_head, every norm gain, A_log, dt_bias, the depthwise `*_conv1d` kernels,
                    the AttnRes pseudo-queries `*_res_proj`, biases; and any other parameter that is not 2-D

The routed experts (`experts.{e}.w1|w2|w3` of every LatentMoE; not the shared experts, not the latent
down/up projections) take `expert_optimizer`: "muon" (as above, with `expert_ns_steps` Newton–Schulz steps),
"muon-active" (Muon that skips the Newton–Schulz call of an expert without gradient this step: its momentum
decays and its weight decays, k3.train.muon) or "adamw" (AdamW with weight decay, as some MoE trainers do).
Unless they differ from plain Muon, the experts stay in the "muon" group, so older checkpoints' optimiser
groups keep their layout; otherwise they form a group of their own ("muon_experts" / "adamw_experts").

A head's block is its rows of the weight: q_b_proj's rows are per head [q_nope; q_pe] (qk_head_dim rows), and
kv_b_proj's rows are per head [k_nope; v] (qk_nope_head_dim + v_head_dim rows), so each head's K and V rows
are orthogonalised together, as one block.

Weight decay goes to the weight matrices (Muon's and AdamW's: embeddings, LM head), where it bounds the
weights' growth. It is not applied to norm gains, A_log, dt_bias and biases (decay would pull gains and
rates towards 0, a meaningful value, not "no weight"), nor to the conv kernels (one 4-tap filter per
channel, a vector in all but shape) or the AttnRes queries (zero-initialised 1 × d vectors, where 0 means
uniform mixing over blocks; decay would keep pulling depth mixing back to uniform).
"""

import contextlib
import math
from collections.abc import Iterator
from typing import Any, NamedTuple

import torch
from torch import nn

from k3.model.kda import KimiDeltaAttention
from k3.model.mla import GatedMLA
from k3.model.moe import LatentMoE
from k3.train.muon import MuonAdamW

# A parameter whose module's name ends with one of these goes to AdamW without weight decay.
NO_DECAY_MODULE_SUFFIXES = ("_conv1d", "_res_proj")
NO_DECAY_LEAVES = ("bias", "A_log", "dt_bias")
ADAMW_DECAY_MODULES = ("embed_tokens", "lm_head")
# How the routed experts are optimised (module docstring); "muon" is the default (docs/benchmarks.md measures all).
EXPERT_OPTIMIZERS = ("muon", "muon-active", "adamw")
SCHEDULES = ("cosine", "wsd")


class ParamGroupError(ValueError):
    """The parameter groups do not hold every trainable parameter exactly once."""


class Assignment(NamedTuple):
    algo: str  # "muon" or "adamw"
    heads: int  # Muon: row blocks orthogonalised separately (1 = the whole matrix); AdamW: 1
    decay: bool  # weight decay applied
    expert: bool = False  # a routed expert's weight in a group of its own (expert_optimizer, expert_ns_steps)


def per_head_weights(model: nn.Module) -> dict[str, int]:
    """Parameter name -> heads, for the Q, K, V projections of every KDA and MLA layer."""
    heads: dict[str, int] = {}
    for name, module in model.named_modules():
        prefix = f"{name}." if name else ""
        if isinstance(module, KimiDeltaAttention):
            projections = ("q_proj", "k_proj", "v_proj")
        elif isinstance(module, GatedMLA):
            projections = ("q_proj" if hasattr(module, "q_proj") else "q_b_proj", "kv_b_proj")
        else:
            continue
        heads.update({f"{prefix}{proj}.weight": module.H for proj in projections})
    return heads


def routed_expert_weights(model: nn.Module) -> set[str]:
    """Names of the routed experts' parameters (w1, w2, w3 of every expert of every LatentMoE)."""
    names: set[str] = set()
    for name, module in model.named_modules():
        if isinstance(module, LatentMoE):
            prefix = f"{name}.experts" if name else "experts"
            names.update(f"{prefix}.{n}" for n, _ in module.experts.named_parameters())
    return names


def assign(model: nn.Module, expert_optimizer: str = "muon", separate_experts: bool = False) -> dict[str, Assignment]:
    """Every trainable parameter's name -> its Assignment (the table in this module's docstring).

    separate_experts: with expert_optimizer "muon", put the routed experts in a Muon group of their own (for
    their own ns_steps); "muon-active" and "adamw" always do."""
    if expert_optimizer not in EXPERT_OPTIMIZERS:
        raise ValueError(f"expert_optimizer must be one of {', '.join(EXPERT_OPTIMIZERS)}, got {expert_optimizer!r}")
    per_head = per_head_weights(model)
    experts = routed_expert_weights(model)
    plan: dict[str, Assignment] = {}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        if name in experts and p.ndim == 2 and (expert_optimizer != "muon" or separate_experts):
            plan[name] = Assignment("adamw" if expert_optimizer == "adamw" else "muon", 1, True, expert=True)
            continue
        module, _, leaf = name.rpartition(".")
        module = module.rpartition(".")[2]
        if name in per_head:
            plan[name] = Assignment("muon", per_head[name], True)
        elif module in ADAMW_DECAY_MODULES:
            plan[name] = Assignment("adamw", 1, True)
        elif leaf in NO_DECAY_LEAVES or "norm" in module or module.endswith(NO_DECAY_MODULE_SUFFIXES):
            plan[name] = Assignment("adamw", 1, False)
        elif p.ndim == 2:
            plan[name] = Assignment("muon", 1, True)
        else:  # a parameter this table does not know, not a matrix: the safe choice
            plan[name] = Assignment("adamw", 1, False)
    return plan


def group_name(a: Assignment) -> str:
    if a.expert:
        return f"{a.algo}_experts"
    if a.algo == "muon":
        return "muon" if a.heads == 1 else f"muon_per_head_{a.heads}"
    return "adamw" if a.decay else "adamw_no_decay"


def param_groups(
    model: nn.Module,
    lr: float,
    weight_decay: float,
    expert_optimizer: str = "muon",
    expert_ns_steps: int | None = None,
) -> list[dict[str, Any]]:
    """MuonAdamW groups, one per (algo, heads, decay, expert), each with `name`, `algo`, `lr`, `weight_decay`
    (0 where not decayed) and, for Muon, `heads`; a Muon experts group also `ns_steps` (expert_ns_steps, when
    given) and `skip_idle` (expert_optimizer "muon-active"). `params` are (name, tensor) pairs so the
    optimiser's state_dict records `param_names`."""
    tensors = dict(model.named_parameters())
    by_kind: dict[Assignment, list[str]] = {}
    for name, a in assign(model, expert_optimizer, separate_experts=expert_ns_steps is not None).items():
        by_kind.setdefault(a, []).append(name)
    groups = []
    for a, names in by_kind.items():
        group = dict(
            name=group_name(a),
            algo=a.algo,
            params=[(n, tensors[n]) for n in names],
            lr=lr,
            weight_decay=weight_decay if a.decay else 0.0,
        )
        if a.algo == "muon":
            group["heads"] = a.heads
        if a.algo == "muon" and a.expert:
            group["skip_idle"] = expert_optimizer == "muon-active"
            if expert_ns_steps is not None:
                group["ns_steps"] = expert_ns_steps
        groups.append(group)
    check_groups(model, groups)
    return groups


def check_groups(model: nn.Module, groups: list[dict[str, Any]]) -> None:
    """Raise ParamGroupError unless every trainable parameter of `model` is in exactly one group."""
    seen: dict[int, str] = {}
    names = {id(p): n for n, p in model.named_parameters() if p.requires_grad}
    for group in groups:
        for p in group["params"]:
            p = p[1] if isinstance(p, tuple) else p
            label = names.get(id(p), f"a tensor of shape {tuple(p.shape)} that is not a trainable model parameter")
            if id(p) in seen:
                raise ParamGroupError(f"{label} is in two parameter groups: {seen[id(p)]!r} and {group.get('name')!r}")
            seen[id(p)] = group.get("name", "?")
    missing = [n for i, n in names.items() if i not in seen]
    if missing:
        raise ParamGroupError(f"{len(missing)} trainable parameters are in no group, e.g. {missing[:3]}")
    extra = [i for i in seen if i not in names]
    if extra:
        raise ParamGroupError(f"{len(extra)} tensors in the groups are not trainable parameters of the model")


def build_optimizer(
    model: nn.Module,
    lr: float = 1e-3,
    weight_decay: float = 0.1,
    betas: tuple[float, float] = (0.9, 0.95),
    eps: float = 1e-8,
    momentum: float = 0.95,
    ns_steps: int = 5,
    expert_optimizer: str = "muon",
    expert_ns_steps: int | None = None,
    ns_dtype: str = "float32",
) -> MuonAdamW:
    """One MuonAdamW over the whole model. One lr serves both kinds: Muon's updates are RMS-matched to AdamW's.

    expert_optimizer: "muon", "muon-active" or "adamw" for the routed experts (module docstring);
    expert_ns_steps: their Newton–Schulz steps under Muon (None: ns_steps); ns_dtype: the Newton–Schulz
    iterations' dtype ("float32" or "bfloat16", k3.train.muon.NS_DTYPES)."""
    if expert_ns_steps is not None and expert_ns_steps < 1:
        raise ValueError(f"expert_ns_steps must be at least 1, got {expert_ns_steps}")
    if expert_ns_steps == ns_steps:
        expert_ns_steps = None  # the experts need no group of their own for it
    groups = param_groups(model, lr, weight_decay, expert_optimizer, expert_ns_steps)
    return MuonAdamW(
        groups,
        lr=lr,
        weight_decay=weight_decay,
        momentum=momentum,
        ns_steps=ns_steps,
        betas=betas,
        eps=eps,
        ns_dtype=ns_dtype,
    )


def lr_at(
    step: int,
    total_steps: int,
    warmup: int,
    schedule: str = "cosine",
    min_ratio: float = 0.1,
    decay_fraction: float = 0.2,
) -> float:
    """The lr factor (peak 1) for 0-based `step` of a run of `total_steps` steps (0 … total_steps − 1).

    warmup:  (step + 1) / warmup for step < warmup, so the first step already learns and step warmup − 1 is the peak
    cosine:  min_ratio + (1 − min_ratio)·½(1 + cos πs) over the remaining steps
    wsd:     1 (stable), then linear 1 → min_ratio over the last `decay_fraction` of the steps
    where s ∈ (0, 1] is the progress through the decay, reaching 1 (factor = min_ratio) at the last step;
    later steps stay at min_ratio.
    """
    if total_steps < 1 or not 0 <= warmup <= total_steps or not 0 <= min_ratio <= 1:
        raise ValueError(
            f"lr_at needs total_steps ≥ 1, 0 ≤ warmup ≤ total_steps and 0 ≤ min_ratio ≤ 1; got total_steps="
            f"{total_steps}, warmup={warmup}, min_ratio={min_ratio}"
        )
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown lr schedule {schedule!r}; choose 'cosine' or 'wsd'")
    if step < warmup:
        return (step + 1) / warmup
    if schedule == "cosine":
        start = warmup
    else:
        start = max(warmup, total_steps - round(decay_fraction * total_steps))
        if step < start:
            return 1.0
    s = min(1.0, (step - start + 1) / max(1, total_steps - start))
    if schedule == "cosine":
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * s))
    return 1 - (1 - min_ratio) * s


@contextlib.contextmanager
def hyperparameters_kept(optimizer: torch.optim.Optimizer) -> Iterator[None]:
    """Loading a checkpoint's optimiser state inside this keeps each group's base_lr, weight_decay and (Muon)
    ns_dtype as they are: the saved groups carry the run's, and the flags given now are the ones that count
    (equal unless --override accepted new values)."""
    fresh = [(g["base_lr"], g["weight_decay"], g.get("ns_dtype")) for g in optimizer.param_groups]
    yield
    for group, (lr, weight_decay, ns_dtype) in zip(optimizer.param_groups, fresh, strict=True):
        group["base_lr"], group["weight_decay"] = lr, weight_decay
        if ns_dtype is not None:
            group["ns_dtype"] = ns_dtype


def set_lr_factor(optimizer: torch.optim.Optimizer, factor: float) -> None:
    """Each group's lr = its base_lr × factor (the factor from lr_at)."""
    for group in optimizer.param_groups:
        group["lr"] = group["base_lr"] * factor
