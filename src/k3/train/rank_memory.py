"""Per-rank training memory of a configuration under expert parallelism `ep` and data parallelism `dp` (FSDP2),
printed by `k3 params --ep N --dp M`: what one GPU holds, by part, from the model's own parameter list.

The layout is the one k3.train.parallelize builds: the routed experts split over EP groups of `ep` ranks (a rank
holds ⌈E/ep⌉ experts of every MoE layer), everything else sharded by FSDP2 over all `dp` ranks (`--dp ddp`
would keep a full copy per rank instead). Bytes per parameter, as FSDP2's GPU policy trains:

    weights        fp32 sharded master copy (4 B); bf16 copies are gathered one sublayer at a time (transient)
    gradients      fp32 (4 B), reduce-scattered to the same shards
    optimiser      Muon: one fp32 momentum (4 B); AdamW: two fp32 moments (8 B) (k3.train.optim assigns them)
    expert copy    what inference or a QAT forward keeps of the routed experts: bf16 (2 B) or MXFP4
                   (4-bit codes + one E8M0 byte per 32: 0.53125 B)
    activations    with per-sublayer activation checkpointing, each sublayer's input is kept (bf16, hidden
                   size, 2 sublayers × layers per token), plus the working set of the one MoE sublayer being
                   recomputed: each token's k latent rows in and out and the expert's gate, up and product
                   (bf16), on the rank that runs them (balanced routing: k rows per token per rank)
Nothing else is counted (no allocator slack, no communication buffers, no KDA chunk intermediates).
"""

import math
from typing import Any

import torch

from k3.config import K3Config
from k3.model.model import K3Model
from k3.model.params import classify, human
from k3.train.optim import assign

FP32, BF16 = 4, 2
MXFP4_BYTES = 0.5 + 1 / 32  # two E2M1 codes per byte, one E8M0 scale per 32 values
GB = 1e9


def rank_memory(config: K3Config, ep: int, dp: int, micro_batch_tokens: int = 8192) -> dict[str, Any]:
    """The per-rank bytes of each part (module docstring) for EP = ep over dp FSDP ranks."""
    if ep < 1 or dp < 1 or micro_batch_tokens < 1:
        raise ValueError(f"--ep, --dp and the micro-batch must be positive, got {ep}, {dp}, {micro_batch_tokens}")
    if dp % ep:
        raise ValueError(f"--dp {dp} must be a multiple of --ep {ep}: the EP groups tile the data-parallel ranks")
    with torch.device("meta"):
        model = K3Model(config)
    plan = assign(model)
    E = config.num_experts
    per_rank_experts = math.ceil(E / ep)
    routed = {"muon": 0, "adamw": 0}
    rest = {"muon": 0, "adamw": 0}
    for name, p in model.named_parameters():
        component = classify(name, config)[0] if name.startswith(("model.", "lm_head")) else "other"
        (routed if component == "routed_experts" else rest)[plan[name].algo] += p.numel()
    routed_params = sum(routed.values()) * per_rank_experts / E
    rest_params = sum(rest.values()) / dp
    opt = (routed["muon"] * FP32 + routed["adamw"] * 2 * FP32) * per_rank_experts / E
    opt += (rest["muon"] * FP32 + rest["adamw"] * 2 * FP32) / dp
    d, L, I, k = (
        config.hidden_size,
        config.expert_width,
        config.moe_intermediate_size,
        (config.num_experts_per_token),
    )
    kept = 2 * config.num_hidden_layers * d * BF16 * micro_batch_tokens
    moe_live = micro_batch_tokens * k * (2 * L + 3 * I) * BF16
    parts = {
        "routed_experts_fp32": routed_params * FP32,
        "replicated_fp32_shard": rest_params * FP32,
        "gradients_fp32": (routed_params + rest_params) * FP32,
        "optimizer_fp32": opt,
        "activations": kept + moe_live,
    }
    return {
        "ep": ep,
        "dp": dp,
        "micro_batch_tokens": micro_batch_tokens,
        "experts_per_rank": per_rank_experts,
        "expert_split_even": E % ep == 0,
        "routed_params_per_rank": routed_params,
        "replicated_params_per_rank": rest_params,
        "expert_copy_bf16": routed_params * BF16,
        "expert_copy_mxfp4": routed_params * MXFP4_BYTES,
        "parts": parts,
        "total": sum(parts.values()),
    }


def format_rank_memory(m: dict[str, Any]) -> str:
    p = m["parts"]
    uneven = "" if m["expert_split_even"] else " (uneven: the fullest ranks)"
    rows = [
        (f"routed experts, {m['experts_per_rank']} per MoE layer{uneven}, fp32", p["routed_experts_fp32"]),
        ("non-expert parameters, fp32 FSDP shard", p["replicated_fp32_shard"]),
        ("gradients, fp32", p["gradients_fp32"]),
        ("optimiser state (Muon momentum, AdamW moments), fp32", p["optimizer_fp32"]),
        (f"activations at {m['micro_batch_tokens']:,} tokens, checkpointed per sublayer", p["activations"]),
    ]
    lines = [f"Training memory per rank at EP = {m['ep']}, FSDP over {m['dp']} ranks (k3.train.rank_memory):"]
    lines += [f"  {name:<66} {value / GB:>8.1f} GB" for name, value in rows]
    lines.append(f"  {'total':<66} {m['total'] / GB:>8.1f} GB")
    lines.append(
        f"  routed expert copy for the forward: bf16 {m['expert_copy_bf16'] / GB:.1f} GB, MXFP4 "
        f"{m['expert_copy_mxfp4'] / GB:.1f} GB ({human(m['routed_params_per_rank'])} parameters)"
    )
    return "\n".join(lines)
