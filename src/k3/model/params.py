"""Parameter, FLOP and cache accounting of a K3 configuration (SPEC §1), printed by `k3 params`.

The counts come from the model itself: `K3Model(config)` is built on the meta device (no memory, no
init) and every parameter is classified by its released checkpoint name into exactly one component.
An unknown name is an error, so a new module cannot silently fall out of the totals.

    active   = every parameter, except that each MoE layer's routed experts count k/E of their total
    FLOPs    = 2 · active matmul weights (input embedding excluded: it is a lookup; lm_head included)
             + MLA attention over `context` tokens + KDA state updates
    MLA      ≈ 2 · H · (qk_head_dim + v_head_dim) · context per layer and token (q·kᵀ scores, then p·v)
    KDA      ≈ 7 · H · K · V per layer and token: decay (1), kᵀS (2), rank-1 write (2), Sᵀq (2)

The LatentMoE saving is shown against a MoE with the same experts at full width, computed from the
config (no second model): w1, w3 of [moe_intermediate_size, hidden_size], w2 the transpose, and no
latent down/up projection or latent norm.
"""

import re
from collections import defaultdict
from typing import Any

import torch

from k3.config import K3Config
from k3.model.model import K3Model

COMPONENTS = (
    "embeddings",
    "lm_head",
    "kda_attention",
    "mla_attention",
    "dense_ffn",
    "routed_experts",
    "shared_experts",
    "latent_projections",
    "router",
    "attn_res",
    "norms",
    "vision_tower",
    "mm_projector",
)
# The vision encoder and projector run once per image, not per text token: in the total, not in `active`.
_PER_IMAGE = {"vision_tower", "mm_projector"}
DEFAULT_CONTEXT = 8192  # the first context stage of pre-training (SPEC §2.9)
BF16_BYTES, FP32_BYTES = 2, 4
KDA_STATE_FLOPS_PER_HKV = 7  # recurrent step per head: Diag(α)S 1·KV, kᵀS 2·KV, S += k·(β(v − kᵀS))ᵀ 2·KV, Sᵀq 2·KV

_LAYER = r"model\.layers\.(?P<layer>\d+)\."
_MOE = _LAYER + r"block_sparse_moe\."
_GLU = r"(gate_proj|up_proj|down_proj)\.weight"
# Attention parameter names of the released checkpoint, per layer kind (SPEC §1); the KDA low-rank
# output gate (g_a_proj/g_b_proj) and the MLA plain q projection cover the configs' other switches.
_ATTN_NAMES = {
    "kda": {
        "q_proj",
        "k_proj",
        "v_proj",
        "q_conv1d",
        "k_conv1d",
        "v_conv1d",
        "f_a_proj",
        "f_b_proj",
        "b_proj",
        "g_proj",
        "g_a_proj",
        "g_b_proj",
        "o_norm",
        "o_proj",
        "A_log",
        "dt_bias",
    },
    "mla": {
        "q_proj",
        "q_a_proj",
        "q_a_layernorm",
        "q_b_proj",
        "kv_a_proj_with_mqa",
        "kv_a_layernorm",
        "kv_b_proj",
        "g_proj",
        "o_proj",
    },
}
# (component, full-match pattern). The patterns are disjoint; classify() checks exactly one matches.
_RULES = [
    ("embeddings", re.compile(r"model\.embed_tokens\.weight")),
    ("lm_head", re.compile(r"lm_head\.weight")),
    ("attention", re.compile(_LAYER + r"self_attn\.(?P<attn>[A-Za-z_0-9]+?)(\.weight)?")),
    ("dense_ffn", re.compile(_LAYER + r"mlp\." + _GLU)),
    ("routed_experts", re.compile(_MOE + r"experts\.\d+\.w[123]\.weight")),
    ("shared_experts", re.compile(_MOE + r"shared_experts\." + _GLU)),
    ("latent_projections", re.compile(_MOE + r"routed_expert_(down_proj|up_proj|norm)\.weight")),
    ("router", re.compile(_MOE + r"gate\.weight")),
    ("attn_res", re.compile(_LAYER + r"(self_attention|mlp)_res_(proj|norm)\.weight")),
    ("attn_res", re.compile(r"model\.output_attn_res_(proj|norm)\.weight")),
    ("norms", re.compile(_LAYER + r"(input_layernorm|post_attention_layernorm)\.weight")),
    ("norms", re.compile(r"model\.norm\.weight")),
    ("vision_tower", re.compile(r"vision_tower\.(patch_embed|encoder)\..+")),
    ("mm_projector", re.compile(r"mm_projector\.(proj\.\d+|post_norm)\.weight")),
]
_MOE_ONLY = {"routed_experts", "shared_experts", "latent_projections", "router"}


class UnknownParameterError(ValueError):
    """A parameter name that no component of the released layout accounts for."""


def classify(name: str, config: K3Config) -> tuple[str, int | None]:
    """The component of one parameter name, and its 0-based layer (None for top-level parameters)."""
    hits = [(component, m) for component, pattern in _RULES if (m := pattern.fullmatch(name))]
    if len(hits) != 1:
        why = "no component matches it" if not hits else f"it matches {[c for c, _ in hits]}"
        raise UnknownParameterError(f"cannot account for parameter {name!r}: {why}; add it to k3.model.params")
    component, m = hits[0]
    layer = int(m["layer"]) if "layer" in m.groupdict() else None
    if layer is not None and layer >= config.num_hidden_layers:
        raise UnknownParameterError(f"{name!r}: layer {layer} >= num_hidden_layers = {config.num_hidden_layers}")
    if component == "attention":
        kind = config.layer_types[layer]
        if m["attn"] not in _ATTN_NAMES[kind]:
            raise UnknownParameterError(f"{name!r}: {m['attn']!r} is not a parameter of a {kind.upper()} layer")
        component = f"{kind}_attention"
    elif component == "dense_ffn" and config.ffn_types[layer] != "dense":
        raise UnknownParameterError(f"{name!r}: a dense FFN parameter in MoE layer {layer}")
    elif component in _MOE_ONLY and config.ffn_types[layer] != "moe":
        raise UnknownParameterError(f"{name!r}: a MoE parameter in dense layer {layer}")
    return component, layer


def count_parameters(config: K3Config) -> dict[str, dict[str, int]]:
    """Per component: `total` parameters, `active` per token, and `matmul`, the active parameters that
    are weights of a matmul or convolution (2 FLOPs each per token; norm gains and gate vectors are
    not). The input embedding gets no matmul count: it is a lookup. A tied lm_head counts once in
    total but still does its matmul."""
    with torch.device("meta"):
        model = K3Model(config)
    counts = {c: {"total": 0, "active": 0, "matmul": 0} for c in COMPONENTS}
    routed_by_layer: dict[int, int] = defaultdict(int)
    seen: set[int] = set()
    for name, p in model.named_parameters(remove_duplicate=False):
        component, layer = classify(name, config)
        n, shared = p.numel(), id(p) in seen
        seen.add(id(p))
        if component == "routed_experts":
            routed_by_layer[layer] += n
            counts[component]["total"] += n
            continue
        if component in _PER_IMAGE:
            counts[component]["total"] += n
            continue
        if not shared:
            counts[component]["total"] += n
            counts[component]["active"] += n
        if p.dim() >= 2 and component != "embeddings":
            counts[component]["matmul"] += n
    E, k = config.num_experts, config.num_experts_per_token
    moe_layers = {i for i, f in enumerate(config.ffn_types) if f == "moe"}
    if set(routed_by_layer) != moe_layers:
        raise UnknownParameterError(
            f"routed experts found in layers {sorted(routed_by_layer)}, MoE layers are {sorted(moe_layers)}"
        )
    for layer, n in routed_by_layer.items():
        if n % E:
            raise UnknownParameterError(f"layer {layer}: {n} routed-expert parameters do not split into {E} experts")
        counts["routed_experts"]["active"] += n // E * k  # k of the E equal experts run per token
    counts["routed_experts"]["matmul"] = counts["routed_experts"]["active"]
    total = sum(c["total"] for c in counts.values())
    if total != sum(p.numel() for p in model.parameters()):
        raise UnknownParameterError("the component totals do not add up to the model's parameter count")
    return counts


def _moe_shapes(config: K3Config) -> dict[str, int]:
    """Per MoE layer, from the config: routed experts latent and at full width, and the latent path."""
    d, L, I, E = config.hidden_size, config.expert_width, config.moe_intermediate_size, config.num_experts
    latent = config.routed_expert_hidden_size is not None  # full-width experts have no latent path
    return {
        "layers": config.ffn_types.count("moe"),
        "expert_latent": 3 * L * I,  # w1, w3: (I, L); w2: (L, I)
        "expert_full": 3 * d * I,  # the same expert reading and writing the full width d
        "latent_matmul": 2 * d * L if latent else 0,  # routed_expert_down_proj (L, d) and routed_expert_up_proj (d, L)
        "latent_norm": L if latent and config.latent_moe_use_norm else 0,  # routed_expert_norm gain
        "k": config.num_experts_per_token,
        "E": E,
    }


def flops_per_token(config: K3Config, matmul_params: int, context: int) -> dict[str, int]:
    """Forward FLOPs per token: weights, MLA attention over `context` cached tokens, KDA state update."""
    n_mla, n_kda = config.layer_types.count("mla"), config.layer_types.count("kda")
    H, Hk, K = config.num_attention_heads, config.kda_num_heads, config.kda_head_dim
    mla = n_mla * 2 * H * (config.qk_head_dim + config.v_head_dim) * context
    kda = n_kda * KDA_STATE_FLOPS_PER_HKV * Hk * K * K  # V = K in KDA
    matmul = 2 * matmul_params
    return {"matmul": matmul, "mla_attention": mla, "kda_state": kda, "total": matmul + mla + kda}


def cache_bytes(config: K3Config) -> dict[str, Any]:
    """Decode memory: MLA cache per token (bf16) beside a plain multi-head cache of the same heads, and
    the KDA state per sequence (fp32 S plus the bf16 conv tails of q, k and v)."""
    n_mla, n_kda = config.layer_types.count("mla"), config.layer_types.count("kda")
    H, Hk, K = config.num_attention_heads, config.kda_num_heads, config.kda_head_dim
    mla = n_mla * (config.kv_lora_rank + config.qk_rope_head_dim) * BF16_BYTES
    mha = n_mla * (H * config.qk_head_dim + H * config.v_head_dim) * BF16_BYTES
    tails = (config.short_conv_kernel_size - 1) * (2 * Hk * K + Hk * K)
    kda = n_kda * (Hk * K * K * FP32_BYTES + tails * BF16_BYTES)
    return {
        "mla_bytes_per_token": mla,
        "mha_bytes_per_token": mha,
        "mha_over_mla": mha / mla if mla else None,
        "kda_state_bytes_per_sequence": kda,
        "kda_state_in_mla_tokens": kda / mla if mla else None,
    }


def param_report(config: K3Config, context: int = DEFAULT_CONTEXT) -> dict[str, Any]:
    """Everything `k3 params` prints, as one JSON-ready dict (integers, a few ratios)."""
    if not isinstance(context, int) or context < 0:
        raise ValueError(f"context = {context!r}: must be a non-negative number of tokens")
    counts = count_parameters(config)
    total = sum(c["total"] for c in counts.values())
    active = sum(c["active"] for c in counts.values())
    embed = counts["embeddings"]["active"]
    matmul = sum(c["matmul"] for c in counts.values())
    flops = flops_per_token(config, matmul, context)

    s = _moe_shapes(config)
    routed_total = counts["routed_experts"]["total"]
    latent_total = counts["latent_projections"]["total"]
    if routed_total != s["layers"] * s["E"] * s["expert_latent"] or latent_total != s["layers"] * (
        s["latent_matmul"] + s["latent_norm"]
    ):
        raise UnknownParameterError("the model's LatentMoE shapes differ from the config-derived ones in params.py")
    full_total, full_active = s["layers"] * s["E"] * s["expert_full"], s["layers"] * s["k"] * s["expert_full"]
    plain_total = total - routed_total - latent_total + full_total
    plain_active = active - counts["routed_experts"]["active"] - latent_total + full_active
    plain_matmul = matmul - counts["routed_experts"]["matmul"] - counts["latent_projections"]["matmul"] + full_active

    layers = config.layer_types
    return {
        "context": context,
        "layers": {
            "total": config.num_hidden_layers,
            "kda": layers.count("kda"),
            "mla": layers.count("mla"),
            "mla_layer_numbers": list(config.full_attn_layers),
            "dense_ffn": config.ffn_types.count("dense"),
            "moe": config.ffn_types.count("moe"),
            "attn_res_blocks": len(config.attn_res_blocks) if config.residual == "attnres" else 0,
        },
        "components": {name: {"total": c["total"], "active": c["active"]} for name, c in counts.items()},
        "total": total,
        "active": active,
        "active_without_embedding": active - embed,
        "active_matmul": matmul,
        "flops_per_token": flops,
        "cache": cache_bytes(config),
        "non_latent_moe": {
            "routed_experts_total": full_total,
            "routed_experts_active": full_active,
            "total": plain_total,
            "active": plain_active,
            "active_without_embedding": plain_active - embed,
            "flops_per_token": flops_per_token(config, plain_matmul, context),
            "total_saved": plain_total - total,
            "active_saved": plain_active - active,
        },
    }


def human(n: float) -> str:
    """2779123456789 -> '2.779T'; 27648 -> '27.6K'."""
    for scale, unit in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if abs(n) >= scale:
            return f"{n / scale:.4g}{unit}"
    return f"{n:g}"


def format_report(report: dict[str, Any], source: str) -> str:
    """The readable form of `param_report`: component | total | active, then FLOPs and memory."""
    lay, fl, cache, plain = report["layers"], report["flops_per_token"], report["cache"], report["non_latent_moe"]
    numbers = [str(i) for i in lay["mla_layer_numbers"]]
    mla_numbers = ", ".join(numbers if len(numbers) <= 6 else [*numbers[:3], "…", *numbers[-2:]])
    lines = [
        f"K3 parameters: {source}",
        f"layers: {lay['total']} = {lay['kda']} KDA + {lay['mla']} MLA (MLA at {mla_numbers}); "
        f"{lay['dense_ffn']} dense FFN + {lay['moe']} MoE; {lay['attn_res_blocks']} AttnRes blocks",
        "",
        f"{'component':<20} {'total':>17} {'':>8}  {'active':>17}",
    ]
    rows = [(name, c["total"], c["active"]) for name, c in report["components"].items()]
    rows += [("total", report["total"], report["active"])]
    for i, (name, total, active) in enumerate(rows):
        if i == len(rows) - 1:
            lines.append("-" * 75)
        lines.append(f"{name:<20} {total:>17,} {human(total):>8}  {active:>17,} {human(active):>8}")
    a_wo = report["active_without_embedding"]
    lines += [
        f"{'active without the input embedding (a lookup)':<56} {a_wo:>,} {human(a_wo):>8}",
        "",
        f"FLOPs per token at context {report['context']:,} (forward):",
        f"  weights      2 × {report['active_matmul']:,} active matmul parameters = {human(fl['matmul'])}",
        f"  MLA          {lay['mla']} layers × 2·H·(qk_head_dim + v_head_dim)·context = {human(fl['mla_attention'])}",
        f"  KDA state    {lay['kda']} layers × {KDA_STATE_FLOPS_PER_HKV}·H·K·V = {human(fl['kda_state'])}",
        f"  total        {human(fl['total'])}",
        "",
        "Decode memory:",
        f"  MLA cache    {cache['mla_bytes_per_token']:,} bytes/token ({lay['mla']} layers × "
        "(kv_lora_rank + qk_rope_head_dim) × 2 B)",
    ]
    if cache["mha_over_mla"] is not None:
        lines += [
            f"  MHA cache    {cache['mha_bytes_per_token']:,} bytes/token for the same heads "
            f"({cache['mha_over_mla']:.1f}× the MLA cache)",
        ]
    lines.append(
        f"  KDA state    {cache['kda_state_bytes_per_sequence']:,} bytes/sequence ({lay['kda']} layers × "
        f"(H·K·V fp32 + conv tails bf16))"
    )
    if cache["kda_state_in_mla_tokens"] is not None:
        lines.append(f"               = the MLA cache of {cache['kda_state_in_mla_tokens']:,.0f} tokens")
    if report["components"]["latent_projections"]["total"] == 0:  # full-width experts already (Kimi Linear's)
        return "\n".join(lines)
    lines += [
        "",
        "The same experts at full width (no latent, no down/up projection):",
        f"  total        {plain['total']:>19,} {human(plain['total']):>8}   LatentMoE saves "
        f"{human(plain['total_saved'])}",
        f"  active       {plain['active']:>19,} {human(plain['active']):>8}   LatentMoE saves "
        f"{human(plain['active_saved'])}",
        f"  FLOPs/token  {plain['flops_per_token']['total']:>19,} {human(plain['flops_per_token']['total']):>8}   "
        f"vs {human(fl['total'])} with LatentMoE",
    ]
    return "\n".join(lines)
