"""What a key absent from a config.json means: the table K3Config.from_hf fills a partial config from.

Two public codes read a `kimi_linear` text config: Kimi Linear's (transformers' native `KimiLinearForCausalLM`
since 5.23, and Moonshot's remote code `modeling_kimi.py` before it) and K3's, which extends it with keys of
its own. A K3Config field whose key the file lacks gets exactly one of (docs/checkpoints.md lists every field):

- PUBLIC_DEFAULTS: the value the public codes give it, so the computation is theirs;
- K3_EXTENSIONS, read as the feature off: the computation Kimi Linear's code does without the key, which is
  also what K3's code does when the key is absent;
- SPELLINGS: the value of another key the file holds for the same field (transformers' attribute_map names,
  DeepSeek's names, transformers' flattened copies of linear_attn_config);
- REQUIRED: none. Where the public codes' defaults disagree (each entry says how), guessing one would build
  another model than its checkpoint was trained as, so the key must be given.

Never K3's own value for a field K3 introduced: a Kimi Linear config read by k3 computes Kimi Linear.
"""

from typing import Any

# Read as the public codes read an absent key; the same value in Kimi Linear's remote code and in transformers.
PUBLIC_DEFAULTS: dict[str, Any] = {
    "vocab_size": 163840,
    "tie_word_embeddings": False,
    "max_position_embeddings": 1048576,  # transformers' default; caps a request's length, changes no logit
    "initializer_range": 0.02,  # initialisation only
    "num_attention_heads": 32,
    "q_lora_rank": None,  # a plain q_proj, no query LoRA
    # transformers' MLA has no rotary embedding whatever the file says; the remote code's default (false)
    # would rotate, but its only released config sets true. A file with false is refused (K3Config).
    "mla_use_nope": True,
    "hidden_act": "silu",
    "moe_renormalize": True,
    "quantization_config": None,  # unquantised weights
}
# The public defaults of the special token ids differ (1 / 2 / 0 in the remote code, 163584 / 163586 / 163839
# in transformers); no logit depends on them, and k3 assumes no id rather than either.
NO_ID = ("bos_token_id", "eos_token_id", "pad_token_id")

# K3's extensions of Kimi Linear, absent: off, i.e. Kimi Linear's computation.
K3_EXTENSIONS: dict[str, Any] = {
    "gate_lower_bound": None,  # the unbounded gate −exp(A_log)·softplus(f + dt_bias)
    "use_full_rank_gate": False,  # the low-rank output gate g_a_proj -> g_b_proj
    "mla_use_output_gate": False,  # no sigmoid gate on MLA's output
    "routed_expert_hidden_size": None,  # full-width experts: no latent down/up projection
    "latent_moe_use_norm": False,  # no RMSNorm in a latent
    "attn_res_block_size": None,  # no Block Attention Residuals: standard residuals
}
# SiTU's two scales: read only under hidden_act "situ", where they are required (below); under SwiGLU no
# computation reads them and they keep the dataclass's values, written back only once changed.
SITU_SCALES = ("activation_situ_beta", "activation_situ_linear_beta")
# linear_attn_config's K3 keys (the rest of K3_EXTENSIONS sits in text_config itself)
LINEAR_ATTN_EXTENSIONS = ("gate_lower_bound", "use_full_rank_gate")

# No public default to follow: the codes disagree, as said (Kimi Linear's remote code / transformers).
REQUIRED: dict[str, str] = {
    "hidden_size": "4096 / 2304",
    "num_hidden_layers": "32 / 27",
    "rms_norm_eps": "1e-6 / 1e-5",
    "kv_lora_rank": "None, no MLA / 512",
    "qk_nope_head_dim": "None / 128",
    "qk_rope_head_dim": "None / 64",
    "v_head_dim": "None / 128",
    "intermediate_size": "11008 / 9216",
    "first_k_dense_replace": "0 / 1",
    "num_experts": "None, no MoE / 256",
    "num_experts_per_token": "None / 8",
    "num_shared_experts": "0 / 1",
    "moe_intermediate_size": "None / 1024",
    "routed_scaling_factor": "1.0 / 2.446",
    "full_attn_layers": "required / every 4th layer from the 5th",
    "kda_num_heads": "required / 32",
    "kda_head_dim": "required / 128",
    "short_conv_kernel_size": "required / 4",
}

# Other keys a file may hold one field's value under: the field reads it when its own key is absent, and the two
# must agree when both are present (K3Config checks). Key -> field.
SPELLINGS: dict[str, str] = {
    "model_max_length": "max_position_embeddings",  # transformers' attribute_map, and the remote code's name
    "num_local_experts": "num_experts",  # transformers' attribute_map
    "n_routed_experts": "num_experts",  # DeepSeek's names
    "num_experts_per_tok": "num_experts_per_token",
    "n_shared_experts": "num_shared_experts",
    "norm_topk_prob": "moe_renormalize",
    "linear_num_heads": "kda_num_heads",  # transformers' flattened copies of linear_attn_config
    "linear_head_dim": "kda_head_dim",
    "linear_conv_kernel_dim": "short_conv_kernel_size",
}

# Where each field's key sits in the file when not in the text config itself, for messages.
FILE_KEYS = {
    "kda_num_heads": "linear_attn_config.num_heads",
    "kda_head_dim": "linear_attn_config.head_dim",
    "short_conv_kernel_size": "linear_attn_config.short_conv_kernel_size",
    "gate_lower_bound": "linear_attn_config.gate_lower_bound",
    "use_full_rank_gate": "linear_attn_config.use_full_rank_gate",
    "full_attn_layers": "linear_attn_config.full_attn_layers",
}

# The eps of MLA's q and kv latent RMSNorms in Kimi Linear's code (both public ones build them with the norm's
# default eps, not rms_norm_eps); K3's code uses rms_norm_eps.
KIMI_LINEAR_LATENT_NORM_EPS = 1e-6


def file_key(name: str) -> str:
    """The key a field is read from: its name, or its place in linear_attn_config."""
    return FILE_KEYS.get(name, name)


def has_k3_keys(text: dict[str, Any], linear_attn: dict[str, Any]) -> bool:
    """Whether a text config is K3's (it has a key of K3's extensions) rather than Kimi Linear's: which public
    code reads it, and so what the keys no file carries (the MLA latent norms' eps) mean."""
    text_keys = set(K3_EXTENSIONS) - set(LINEAR_ATTN_EXTENSIONS) | set(SITU_SCALES)
    return any(k in text for k in text_keys) or any(k in linear_attn for k in LINEAR_ATTN_EXTENSIONS)


def layers_from_types(text: dict[str, Any]) -> dict[str, Any]:
    """full_attn_layers and first_k_dense_replace from transformers' `layer_types` / `mlp_layer_types` lists,
    for a file that has those and not the released keys (transformers builds its layers from the lists)."""
    out: dict[str, Any] = {}
    types = text.get("layer_types")
    if isinstance(types, list):
        out["full_attn_layers"] = tuple(i + 1 for i, t in enumerate(types) if t == "full_attention")
    mlp = text.get("mlp_layer_types")
    if isinstance(mlp, list):
        out["first_k_dense_replace"] = next((i for i, t in enumerate(mlp) if t != "dense"), len(mlp))
    return out


def resolve_absent(given: dict[str, Any], text: dict[str, Any], names: list[str]) -> tuple[dict[str, Any], list[str]]:
    """For each field in `names` that `given` lacks: its value by the table above (returned in the first dict),
    or its name in the second list when it is REQUIRED and no other key holds it. `text` is the file's text config
    keys that are not fields (other spellings, transformers' layer lists), read only."""
    values: dict[str, Any] = {}
    missing: list[str] = []
    derived = layers_from_types(text)
    for name in names:
        if name in given:
            continue
        spelled = [key for key, field in SPELLINGS.items() if field == name and key in text]
        if spelled:
            values[name] = text[spelled[0]]
        elif name in derived:
            values[name] = derived[name]
        elif name in PUBLIC_DEFAULTS:
            values[name] = PUBLIC_DEFAULTS[name]
        elif name in K3_EXTENSIONS:
            values[name] = K3_EXTENSIONS[name]
        elif name in NO_ID:
            values[name] = None
        elif name in SITU_SCALES:
            if given.get("hidden_act", PUBLIC_DEFAULTS["hidden_act"]) == "situ":
                missing.append(name)
        elif name in REQUIRED:
            missing.append(name)
    return values, missing
