"""K3Config: the one configuration of the model, its presets, and the official config.json layout.

Field names follow the released HF config where one exists (SPEC §1). The layer pattern — which
layers are KDA or MLA, which FFNs are dense, where AttnRes blocks end — is derived here and only here.

The config.json layout. `to_hf()` writes the released nesting: the multimodal wrapper's keys at the top
(`architectures: ["KimiK3ForConditionalGeneration"]`, `model_type: "kimi_k3"`) and the text model under
`text_config` (`KimiLinearForCausalLM`, with `linear_attn_config` and `quantization_config` inside it).
The vision part (`vision_config`, MoonViT-V2, and the top-level `media_placeholder_token_id`) is a
`VisionConfig` in `K3Config.vision_config` (None: a text-only model); `from_preset("k3").to_hf()` is the
released config.json's text and vision parts. A config read by `from_hf` writes back the file it
came from: the same nesting (or the flat text-only layout), `quantization_config` where it was found,
every key k3 does not interpret, and the same key order, so `to_hf(from_hf(x)) == x`; a field the file
did not have is written only once its value differs from the default. k3's own switches (`residual`,
`mla_impl`, `expert_quantization`) go under a top-level `"k3"` key, only when they are not the defaults.

Released keys that select a computation k3 implements one way only (the router's activation, grouped
top-k, the top-k method, multi-token-prediction layers, dense layers between MoE layers, separate KV
heads) are checked: another value is a ConfigError naming the key and the values k3 supports, never a
silent difference. Keys that change nothing k3 computes are kept as they are. That includes
`rope_theta` / `rope_scaling`: K3 is NoPE (`mla_use_nope` must be true), so under the released semantics
no rotary embedding is built whatever they say; KDA has no positions either.

A key the file lacks never takes K3's value for the field: `k3.absent_keys` says what each absent key means
under the public code that reads the file (K3's extensions read as off, Kimi Linear's computation), or refuses
the file naming the key where the public codes disagree. So a Kimi Linear config.json (`model_type:
kimi_linear`, the flat layout transformers writes) reads as Kimi Linear, the second model family k3 builds.
"""

import copy
import json
from dataclasses import MISSING, asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from k3.absent_keys import (
    KIMI_LINEAR_LATENT_NORM_EPS,
    REQUIRED,
    SITU_SCALES,
    SPELLINGS,
    file_key,
    has_k3_keys,
    resolve_absent,
)


class ConfigError(ValueError):
    """A K3Config field has a value the model cannot be built with."""


# expert_quantization's values (and k3 train --qat's): None, full precision, or "mxfp4"
EXPERT_QUANTIZATIONS = (None, "mxfp4")


# Keys of the official text_config.linear_attn_config block and the K3Config field each maps to.
_LINEAR_ATTN_KEYS = {
    "num_heads": "kda_num_heads",
    "head_dim": "kda_head_dim",
    "short_conv_kernel_size": "short_conv_kernel_size",
    "gate_lower_bound": "gate_lower_bound",
    "use_full_rank_gate": "use_full_rank_gate",
}
# k3's own switches; not part of the released format, written under "k3" so a round trip keeps them.
_K3_ONLY = ("residual", "mla_impl", "expert_quantization", "mla_latent_norm_eps")

# The released config.json around what K3Config interprets: the wrapper's keys, and text_config keys that
# K3Config has no field for, with their released values. A config made in k3 writes these.
RELEASED_TOP: dict[str, Any] = {"architectures": ["KimiK3ForConditionalGeneration"], "model_type": "kimi_k3"}
RELEASED_TEXT: dict[str, Any] = {
    "architectures": ["KimiLinearForCausalLM"],
    "model_type": "kimi_linear",
    "dtype": "bfloat16",
    "moe_router_activation_func": "sigmoid",
    "topk_method": "noaux_tc",
    "use_grouped_topk": True,
    "num_expert_group": 1,
    "topk_group": 1,
    "moe_layer_freq": 1,
    "num_nextn_predict_layers": 0,
}
# The released weights' storage (SPEC §1): routed experts MXFP4-packed by compressed-tensors (E2M1 codes,
# one E8M0 uint8 scale per 32 inputs), activations unquantised; the ignore list keeps attention, shared
# experts, the dense MLP, lm_head, the vision tower and the projector in bf16. The weights entry is
# compressed-tensors' own serialisation of its weight-only MXFP4 scheme.
RELEASED_QUANTIZATION_CONFIG: dict[str, Any] = {
    "quant_method": "compressed-tensors",
    "format": "mxfp4-pack-quantized",
    "quantization_status": "compressed",
    "config_groups": {
        "group_0": {
            "targets": ["Linear"],
            "weights": {
                "num_bits": 4,
                "type": "float",
                "symmetric": True,
                "group_size": 32,
                "strategy": "group",
                "block_structure": None,
                "dynamic": False,
                "actorder": None,
                "scale_dtype": "torch.uint8",
                "zp_dtype": "torch.uint8",
                "observer": "minmax",
                "observer_kwargs": {},
            },
            "input_activations": None,
            "output_activations": None,
            "format": "mxfp4-pack-quantized",
        }
    },
    "ignore": [
        "re:.*self_attn.*",
        "re:.*shared_experts.*",
        r"re:.*\.mlp\.(gate|up|down)_proj$",
        "re:.*lm_head$",
        "re:vision_tower.*",
        "re:mm_projector.*",
    ],
    "kv_cache_scheme": None,
}

# text_config keys whose value selects a computation k3 implements one way only: the values k3 computes
# the same as, and what k3 does. DeepSeek's spelling of a key is checked like the key.
_ONE_WAY: dict[str, tuple[tuple[Any, ...], str]] = {
    "moe_router_activation_func": (("sigmoid",), "k3's router scores experts with a sigmoid"),
    "topk_method": (
        ("noaux_tc",),
        "k3 picks experts by score + e_score_correction_bias and weights them by the unbiased score",
    ),
    "num_nextn_predict_layers": ((0,), "k3 builds no multi-token-prediction layers"),
    "moe_layer_freq": ((1,), "every layer from first_k_dense_replace on is a MoE layer in k3"),
    "attention_bias": ((False,), "k3's MLA projections have no bias"),
    "attention_dropout": ((0, 0.0), "k3 applies no attention dropout"),
}
_ALIASES = {"scoring_func": "moe_router_activation_func", "n_group": "num_expert_group"}


# The released vision_config (MoonViT-V2): the keys VisionConfig has no field for, with their released values.
# Those in _VISION_ONE_WAY select a computation k3 implements one way only and are checked; the others
# (the video pooling `merge_type`, `init_pos_emb_time`, the attention kernel) change nothing an image computes.
RELEASED_VISION: dict[str, Any] = {
    "_attn_implementation": "flash_attention_2",
    "activation_func": "gelu_pytorch_tanh",
    "attn_bias": False,
    "init_pos_emb_time": 4,
    "linear_bias": False,
    "merge_type": "sd2_tpool",
    "mlp_type": "mlp2",
    "mm_projector_type": "patchmergerv2",
    "norm_type": "rmsnorm",
    "patch_embed_proj_bias": False,
    "pos_emb_interpolation_mode": "bilinear",
    "pos_emb_type": "divided_fixed",
    "projector_hidden_act": "gelu",
}
_VISION_ONE_WAY = {
    key: RELEASED_VISION[key]
    for key in (
        "activation_func",
        "attn_bias",
        "linear_bias",
        "mlp_type",
        "mm_projector_type",
        "norm_type",
        "patch_embed_proj_bias",
        "pos_emb_interpolation_mode",
        "projector_hidden_act",
    )
}
_VISION_TOP = ("media_placeholder_token_id",)  # vision fields the release keeps at the top level


@dataclass
class VisionConfig:
    """MoonViT-V2, the native-resolution vision encoder, and its 2x2 patch-merging projector (SPEC §2.10).

    Field names are the released `vision_config` keys; the defaults are the release's (401M in the tower).
    `extra_hf` carries the keys k3 does not interpret and the file's key order, as K3Config.extra_hf does."""

    patch_size: int = 14
    vt_hidden_size: int = 1024
    vt_num_hidden_layers: int = 27
    vt_num_attention_heads: int = 12
    qkv_hidden_size: int = 1536  # attention width: heads x head dim (128), wider than the tower
    vt_intermediate_size: int = 4096
    init_pos_emb_height: int = 64  # the learned position table, interpolated to each image's patch grid
    init_pos_emb_width: int = 64
    merge_kernel_size: tuple[int, int] = (2, 2)
    mm_hidden_size: int = 1024  # the projector's input width: the tower's
    text_hidden_size: int = 7168  # the projector's output width: the language model's
    projector_ln_eps: float = 1e-5
    media_placeholder_token_id: int = 163605  # the token each image token replaces in the LM's input
    extra_hf: dict[str, Any] = field(
        default_factory=lambda: {"vision": copy.deepcopy(RELEASED_VISION)}, repr=False, compare=False
    )

    def __post_init__(self) -> None:
        self.merge_kernel_size = tuple(int(k) for k in self.merge_kernel_size)
        for f in fields(self):
            value = getattr(self, f.name)
            least = 0 if f.name == "media_placeholder_token_id" else 1
            if f.type is int and (not isinstance(value, int) or isinstance(value, bool) or value < least):
                self._fail(f.name, "must be a positive integer" if least else "must be a token id (>= 0)")
        if len(self.merge_kernel_size) != 2 or min(self.merge_kernel_size) < 1:
            self._fail("merge_kernel_size", "must be two positive integers (rows, columns)")
        if self.qkv_hidden_size % self.vt_num_attention_heads:
            heads = self.vt_num_attention_heads
            self._fail("qkv_hidden_size", f"must be a multiple of vt_num_attention_heads ({heads})")
        if self.head_dim % 4:
            self._fail(
                "qkv_hidden_size",
                f"gives a head dim of {self.head_dim}; 2-D rotary positions need a multiple "
                "of 4 (half the pairs for rows, half for columns)",
            )
        if self.mm_hidden_size != self.vt_hidden_size:
            self._fail("mm_hidden_size", f"must equal vt_hidden_size ({self.vt_hidden_size}): the projector reads it")
        if not self.projector_ln_eps > 0:
            self._fail("projector_ln_eps", "must be positive")
        for key, value in self.extra_hf.get("vision", {}).items():
            if key in _VISION_ONE_WAY and value != _VISION_ONE_WAY[key]:
                raise ConfigError(
                    f"config.json vision_config.{key} = {value!r}: k3's MoonViT-V2 implements "
                    f"{_VISION_ONE_WAY[key]!r} only"
                )

    def _fail(self, name: str, why: str) -> None:
        raise ConfigError(f"VisionConfig.{name} = {getattr(self, name)!r}: {why}")

    @property
    def head_dim(self) -> int:
        return self.qkv_hidden_size // self.vt_num_attention_heads

    @property
    def merged_patches(self) -> int:
        """Patches merged into one LM token (4 for 2x2)."""
        return self.merge_kernel_size[0] * self.merge_kernel_size[1]

    @classmethod
    def from_hf(cls, vision: dict[str, Any], top: dict[str, Any]) -> "VisionConfig":
        """From the released `vision_config` dict and the top-level keys (media_placeholder_token_id is popped
        from `top`); a missing key takes the release's value."""
        if not isinstance(vision, dict):
            raise TypeError("vision_config must be a JSON object")
        vision = copy.deepcopy(vision)
        order = list(vision)
        names = {f.name for f in fields(cls)} - {"extra_hf", *_VISION_TOP}
        kwargs = {k: vision.pop(k) for k in list(vision) if k in names}
        top_keys = [k for k in _VISION_TOP if k in top]
        kwargs.update({k: top.pop(k) for k in top_keys})
        return cls(**kwargs, extra_hf={"vision": vision, "order": order, "top": top_keys})

    def to_hf(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """(vision_config, top-level keys): a field is written when the file had it, or changed, or always for
        a config made in k3; keys in the file's order (alphabetical, the release's, for one made in k3)."""
        order = self.extra_hf.get("order")
        vision = dict(self.extra_hf.get("vision", {}))
        for f in fields(self):
            if f.name in ("extra_hf", *_VISION_TOP):
                continue
            value = getattr(self, f.name)
            if order is None or f.name in order or value != f.default:
                vision[f.name] = list(value) if isinstance(value, tuple) else value
        vision = _ordered(vision, order) if order is not None else dict(sorted(vision.items()))
        top = {
            k: getattr(self, k)
            for k in _VISION_TOP
            if order is None or k in self.extra_hf.get("top", ()) or getattr(self, k) != _VISION_DEFAULTS[k]
        }
        return copy.deepcopy(vision), top


def _released_extras() -> dict[str, Any]:
    """extra_hf of a config made in k3: the released layout around the fields."""
    return {
        "nested": True,
        "top": copy.deepcopy(RELEASED_TOP),
        "text": copy.deepcopy(RELEASED_TEXT),
        "linear_attn": {},
        "quantization_in": "text",
    }


def _ordered(d: dict[str, Any], order: list[str]) -> dict[str, Any]:
    """d with the keys named in `order` first, in that order, then the others as they are."""
    return {**{k: d[k] for k in order if k in d}, **{k: v for k, v in d.items() if k not in order}}


@dataclass
class K3Config:
    # vocabulary and width
    vocab_size: int = 163840
    hidden_size: int = 7168
    num_hidden_layers: int = 93
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 1048576
    rms_norm_eps: float = 1e-5
    initializer_range: float = 0.02
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    pad_token_id: int | None = None
    # Gated MLA (global attention); NoPE: the "rope" dims are a shared key part with no rotation
    num_attention_heads: int = 96
    q_lora_rank: int | None = 1536
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    mla_use_nope: bool = True
    mla_use_output_gate: bool = True
    # 1-based indices of the MLA layers; None derives K3's pattern (every 4th layer and the last one)
    full_attn_layers: tuple[int, ...] | None = None
    # KDA (linear attention)
    kda_num_heads: int = 96
    kda_head_dim: int = 128
    short_conv_kernel_size: int = 4
    gate_lower_bound: float | None = -5.0
    use_full_rank_gate: bool = True
    # feed-forward: dense SiTU-GLU in the first layers, LatentMoE after
    hidden_act: str = "situ"
    activation_situ_beta: float = 4.0
    activation_situ_linear_beta: float = 25.0
    intermediate_size: int = 33792
    first_k_dense_replace: int = 1
    num_experts: int = 896
    num_experts_per_token: int = 16
    num_shared_experts: int = 2
    # the routed experts' latent width; None: full-width experts reading and writing hidden_size directly, with
    # no down/up projection (Kimi Linear's and DeepSeek's MoE)
    routed_expert_hidden_size: int | None = 3584
    moe_intermediate_size: int = 3072
    latent_moe_use_norm: bool = True
    moe_renormalize: bool = True
    routed_scaling_factor: float = 1.0
    # Block Attention Residuals across depth; None: no blocks (only with residual "standard")
    attn_res_block_size: int | None = 12
    # k3 switches: "attnres" or the plain-residual ablation "standard"; MLA "naive", "absorbed" or
    # "auto" (per call, the one with fewer FLOPs: absorbed when decoding)
    residual: str = "attnres"
    mla_impl: str = "auto"
    # "mxfp4": routed experts compute with MXFP4 weights and MXFP8 (E4M3) inputs, fake-quantised in training
    # (quantisation-aware training) and packed in serving (SPEC §2.8, k3.quant.qat); None: full precision
    expert_quantization: str | None = None
    # eps of MLA's q and kv latent RMSNorms; None: rms_norm_eps, as K3's code. Kimi Linear's code builds them
    # with a fixed 1e-6, which from_hf sets for a Kimi Linear config (k3.absent_keys)
    mla_latent_norm_eps: float | None = None
    # the vision encoder and projector (None: a text-only model); written as the top-level vision_config
    vision_config: VisionConfig | None = None
    # carried through unchanged: how the weights are stored (compressed-tensors; None: unquantised), and
    # the official file's layout and the keys k3 does not interpret (see to_hf)
    quantization_config: dict[str, Any] | None = None
    extra_hf: dict[str, Any] = field(default_factory=_released_extras, repr=False, compare=False)

    def __post_init__(self) -> None:
        self._validate()
        if self.full_attn_layers is None:
            # K3's pattern: three KDA then one MLA, and one more MLA closing the stack.
            L = self.num_hidden_layers
            self.full_attn_layers = tuple(sorted(set(range(4, L + 1, 4)) | {L}))
        self.full_attn_layers = tuple(int(i) for i in self.full_attn_layers)

    # ---- validation -------------------------------------------------------------------------
    def _fail(self, name: str, why: str) -> None:
        raise ConfigError(f"K3Config.{name} = {getattr(self, name)!r}: {why}")

    def _validate(self) -> None:
        positive = [
            "vocab_size",
            "hidden_size",
            "num_hidden_layers",
            "num_attention_heads",
            "kv_lora_rank",
            "qk_nope_head_dim",
            "v_head_dim",
            "kda_num_heads",
            "kda_head_dim",
            "short_conv_kernel_size",
            "intermediate_size",
            "num_experts",
            "num_experts_per_token",
            "moe_intermediate_size",
            "max_position_embeddings",
        ]
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                self._fail(name, "must be a positive integer")
        for name in ("qk_rope_head_dim", "num_shared_experts", "first_k_dense_replace"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                self._fail(name, "must be a non-negative integer")
        if self.q_lora_rank is not None and (not isinstance(self.q_lora_rank, int) or self.q_lora_rank <= 0):
            self._fail("q_lora_rank", "must be a positive integer, or None for a plain q projection")
        for name, none_means in (
            ("routed_expert_hidden_size", "full-width experts"),
            ("attn_res_block_size", "no AttnRes blocks"),
        ):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value <= 0):
                self._fail(name, f"must be a positive integer, or None for {none_means}")
        if self.routed_expert_hidden_size is None and self.latent_moe_use_norm:
            self._fail("latent_moe_use_norm", "normalises the experts' latent, but routed_expert_hidden_size is None")
        if self.residual == "attnres" and self.attn_res_block_size is None:
            self._fail("residual", "Block AttnRes needs attn_res_block_size; set it, or residual = 'standard'")
        if self.mla_latent_norm_eps is not None and not self.mla_latent_norm_eps > 0:
            self._fail("mla_latent_norm_eps", "must be positive, or None for rms_norm_eps")
        if self.num_experts_per_token > self.num_experts:
            self._fail("num_experts_per_token", f"must be at most num_experts = {self.num_experts}")
        if self.first_k_dense_replace > self.num_hidden_layers:
            self._fail("first_k_dense_replace", f"must be at most num_hidden_layers = {self.num_hidden_layers}")
        if self.gate_lower_bound is not None and not (-5.0 <= self.gate_lower_bound < 0):
            self._fail("gate_lower_bound", "must be in [-5, 0) (KDA's chunked form is proven safe there), or None")
        if self.hidden_act not in ("situ", "silu"):
            self._fail("hidden_act", "must be 'situ' (K3) or 'silu' (SwiGLU)")
        for name in ("activation_situ_beta", "activation_situ_linear_beta", "rms_norm_eps", "routed_scaling_factor"):
            if not getattr(self, name) > 0:
                self._fail(name, "must be positive")
        if self.residual not in ("attnres", "standard"):
            self._fail("residual", "must be 'attnres' (Block Attention Residuals) or 'standard'")
        if self.mla_impl not in ("naive", "absorbed", "auto"):
            self._fail("mla_impl", "must be 'naive' (per-head k, v), 'absorbed' (latent only) or 'auto'")
        if self.expert_quantization not in EXPERT_QUANTIZATIONS:
            self._fail(
                "expert_quantization",
                "must be None (full precision) or 'mxfp4' (MXFP4 expert weights, MXFP8 expert inputs)",
            )
        widths = (self.expert_width, self.moe_intermediate_size)
        if self.expert_quantization and any(w % 32 for w in widths):
            self._fail(
                "expert_quantization",
                f"quantises routed experts in MX blocks of 32 along their inputs, but "
                f"their widths are {widths[0]} ({'latent' if self.routed_expert_hidden_size else 'model'}) "
                f"and {widths[1]} (hidden); both "
                f"must be multiples of 32",
            )
        if not self.mla_use_nope:
            self._fail("mla_use_nope", "must be True: K3 has no positional encoding and k3 implements no RoPE")
        L = self.num_hidden_layers
        if self.full_attn_layers is not None:
            layers = self.full_attn_layers
            if sorted(set(layers)) != list(layers) or not all(1 <= i <= L for i in layers):
                self._fail("full_attn_layers", f"must be strictly increasing 1-based layer numbers in [1, {L}]")
        self._validate_released_keys((self.extra_hf or {}).get("text", {}))
        v = self.vision_config
        if v is not None and v.text_hidden_size != self.hidden_size:
            raise ConfigError(
                f"VisionConfig.text_hidden_size = {v.text_hidden_size}: the projector writes into the "
                f"language model, whose hidden_size is {self.hidden_size}; make them equal"
            )
        if v is not None and v.media_placeholder_token_id >= self.vocab_size:
            raise ConfigError(
                f"VisionConfig.media_placeholder_token_id = {v.media_placeholder_token_id} is outside "
                f"the vocabulary of {self.vocab_size} tokens"
            )

    def _validate_released_keys(self, text: dict[str, Any]) -> None:
        """text_config keys K3Config has no field for, whose value would make the released model compute
        something k3 does not (module docstring)."""

        def fail(key: str, why: str) -> None:
            raise ConfigError(f"config.json text_config.{key} = {text[key]!r}: {why}")

        for key, value in text.items():
            name = _ALIASES.get(key, key)
            if name in _ONE_WAY and value not in _ONE_WAY[name][0]:
                supported, what = _ONE_WAY[name]
                fail(key, f"{what}; supported: {' or '.join(map(repr, supported))}")
        group_key = "n_group" if "n_group" in text else "num_expert_group"
        groups, chosen = text.get(group_key, 1), text.get("topk_group", 1)
        if text.get("use_grouped_topk", True) is not False and chosen < groups:
            # experts chosen only within the best topk_group of the groups; when every group is kept it is
            # plain top-k, which is what k3 computes
            fail(
                group_key,
                f"grouped top-k keeping topk_group = {chosen} of {groups} expert groups is not "
                "implemented in k3; supported: topk_group = num_expert_group (1 in the release: plain "
                "top-k), or use_grouped_topk = false",
            )
        if "num_key_value_heads" in text and text["num_key_value_heads"] != self.num_attention_heads:
            fail(
                "num_key_value_heads",
                f"K3's MLA has one key and value per query head; supported: "
                f"num_attention_heads = {self.num_attention_heads}",
            )

    # ---- the layer pattern, derived in one place -------------------------------------------
    @property
    def mla_layers(self) -> tuple[int, ...]:
        """0-based indices of the Gated MLA layers; every other layer is KDA."""
        return tuple(i - 1 for i in self.full_attn_layers)

    @property
    def layer_types(self) -> tuple[str, ...]:
        """'kda' or 'mla' for each layer, 0-based."""
        mla = set(self.mla_layers)
        return tuple("mla" if i in mla else "kda" for i in range(self.num_hidden_layers))

    @property
    def ffn_types(self) -> tuple[str, ...]:
        """'dense' for the first first_k_dense_replace layers, 'moe' after."""
        return tuple("dense" if i < self.first_k_dense_replace else "moe" for i in range(self.num_hidden_layers))

    @property
    def attn_res_blocks(self) -> tuple[tuple[int, int], ...]:
        """[start, end) layer ranges of the AttnRes blocks; the last one may be shorter. Under standard residuals
        (or attn_res_block_size None) there are no blocks."""
        n, L = self.attn_res_block_size, self.num_hidden_layers
        if n is None or self.residual != "attnres":
            return ()
        return tuple((s, min(s + n, L)) for s in range(0, L, n))

    @property
    def expert_width(self) -> int:
        """The width a routed expert reads and writes: the latent, or hidden_size for full-width experts."""
        return self.hidden_size if self.routed_expert_hidden_size is None else self.routed_expert_hidden_size

    @property
    def family(self) -> str:
        """'k3', or 'kimi_linear' when the config.json this config writes has none of K3's keys: which public
        code reads it, and so which release's layout an export follows (k3.hub.export)."""
        text = self.to_hf()
        text = text.get("text_config", text)
        return "k3" if has_k3_keys(text, text.get("linear_attn_config") or {}) else "kimi_linear"

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    def describe(self) -> str:
        """One line per layer: index (1-based), attention kind, FFN kind, AttnRes block."""
        block_of = {i: f"  block {b + 1}" for b, (s, e) in enumerate(self.attn_res_blocks) for i in range(s, e)}
        return "\n".join(
            f"{i + 1:>3}  {a.upper():<3}  {f:<5}{block_of.get(i, '')}"
            for i, (a, f) in enumerate(zip(self.layer_types, self.ffn_types, strict=True))
        )

    # ---- presets ----------------------------------------------------------------------------
    @classmethod
    def from_preset(cls, name: str, **overrides: Any) -> "K3Config":
        if name not in PRESETS:
            raise ConfigError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}")
        return cls(**{**copy.deepcopy(PRESETS[name]), **overrides})

    # ---- the official config.json ----------------------------------------------------------
    @classmethod
    def from_hf(cls, source: str | Path | dict[str, Any]) -> "K3Config":
        """Read the official layout: a config.json path (or its folder), or the parsed dict."""
        try:
            return cls._from_hf(source)
        except ConfigError:
            raise
        except (TypeError, AttributeError, ValueError) as e:  # a JSON document that is not this layout
            where = "the given dict" if isinstance(source, dict) else str(source)
            raise ConfigError(f"{where} is not a K3 config.json ({type(e).__name__}: {e})") from e

    @classmethod
    def _from_hf(cls, source: str | Path | dict[str, Any]) -> "K3Config":
        if isinstance(source, dict):
            top = copy.deepcopy(source)
        else:
            path = Path(source)
            path = path / "config.json" if path.is_dir() else path
            try:
                top = json.loads(path.read_text())
            except (OSError, json.JSONDecodeError) as e:
                raise ConfigError(f"cannot read a config from {path}: {e}") from e
        if not isinstance(top, dict):
            raise ConfigError(f"a config.json holds a JSON object, got {type(top).__name__}")
        nested = "text_config" in top
        text = top["text_config"] if nested else top
        if not isinstance(text, dict) or not isinstance(text.get("linear_attn_config") or {}, dict):
            raise TypeError("text_config and its linear_attn_config must be JSON objects")  # see from_hf
        order = {
            "top": list(top) if nested else [],
            "text": list(text),
            "linear_attn": list(text.get("linear_attn_config") or {}),
        }
        if nested:
            del top["text_config"]
        k3_keys = has_k3_keys(text, text.get("linear_attn_config") or {})  # which public code reads the file
        lin = text.pop("linear_attn_config", None) or {}
        kwargs: dict[str, Any] = {}
        for key, name in _LINEAR_ATTN_KEYS.items():
            if key in lin:
                kwargs[name] = lin.pop(key)
        if "full_attn_layers" in lin:
            kwargs["full_attn_layers"] = tuple(lin.pop("full_attn_layers"))
        kda_layers = lin.pop("kda_layers", None)
        for key in list(text):
            if key in _TEXT_FIELDS:
                kwargs[key] = text.pop(key)
        k3_own = (top if nested else text).pop("k3", {})
        kwargs.update({k: v for k, v in k3_own.items() if k in _K3_ONLY})
        if nested and "vision_config" in top:
            kwargs["vision_config"] = VisionConfig.from_hf(top.pop("vision_config"), top)
        quantization_in = "text"
        if nested and "quantization_config" in top:
            if "quantization_config" in kwargs:
                raise ConfigError("quantization_config is both at the top level and in text_config: keep one")
            kwargs["quantization_config"] = top.pop("quantization_config")
            quantization_in = "top"
        absent, missing = resolve_absent(kwargs, text, _READ_FIELDS)
        if missing:
            raise ConfigError(
                f"config.json has no {', '.join(file_key(n) for n in missing)}: the public codes read an absent "
                f"{'key' if len(missing) == 1 else 'one'} differently ("
                + "; ".join(f"{n}: {REQUIRED.get(n, _SITU_WHY)}" for n in missing)
                + "), so k3 will not guess; give the value (docs/checkpoints.md lists what every absent key means)"
            )
        kwargs.update(absent)
        kwargs.setdefault("residual", "attnres" if kwargs["attn_res_block_size"] is not None else "standard")
        kwargs.setdefault("mla_latent_norm_eps", None if k3_keys else KIMI_LINEAR_LATENT_NORM_EPS)
        kwargs["extra_hf"] = {
            "nested": nested,
            "top": top if nested else {},
            "text": text,
            "linear_attn": lin,
            "quantization_in": quantization_in,
            "order": order,
        }
        # other spellings of fields, and transformers' layer lists: checked against the fields here, then written
        # from them by to_hf (a config holds one value per field, so a changed field cannot disagree with them)
        spelled = {k: text.pop(k) for k in list(text) if k in SPELLINGS or k in _LAYER_LISTS}
        kwargs["extra_hf"]["spelled"] = list(spelled)
        config = cls(**kwargs)
        _check_spellings(config, spelled)
        if kda_layers is not None:
            expected = [i + 1 for i, t in enumerate(config.layer_types) if t == "kda"]
            if list(kda_layers) != expected:
                raise ConfigError(
                    f"linear_attn_config.kda_layers {list(kda_layers)} is not the complement of full_attn_layers "
                    f"{[i + 1 for i in config.mla_layers]}: every layer must be exactly one kind"
                )
        return config

    def to_hf(self) -> dict[str, Any]:
        """The official config.json as a dict: the released nesting for a config made in k3, the layout it
        was read from otherwise (module docstring)."""
        extra = self.extra_hf or {}
        order = extra.get("order")  # the file's keys, in its order; None for a config made in k3
        nested = extra.get("nested", True)
        home = "top" if nested else "text"  # where the wrapper-level keys ("k3") live

        def had(section: str, key: str) -> bool:
            return order is not None and key in order[section]

        # keys that spell a field another way, or derive from one, hold its value now (a changed field is not
        # left disagreeing with them); a field is then written where its absence would read as another value
        text = self._respelled(dict(extra.get("text", {})))
        meaning, _ = resolve_absent({"hidden_act": self.hidden_act}, text, _READ_FIELDS)
        meaning.update(resolve_absent({}, text, ["hidden_act"])[0])
        # SiTU's scales, unread under SwiGLU, keep the dataclass's values there (k3.absent_keys)
        meaning.update({n: _DEFAULTS[n] for n in SITU_SCALES if self.hidden_act != "situ"})

        def keep(section: str, key: str, name: str) -> bool:
            """Written always for a config made in k3; else if the file had it, or its absence would mean
            another value (a required field always)."""
            value = getattr(self, name)
            return order is None or had(section, key) or name not in meaning or value != meaning[name]

        lin = dict(extra.get("linear_attn", {}))
        for key, name in _LINEAR_ATTN_KEYS.items():
            if keep("linear_attn", key, name):
                lin[key] = getattr(self, name)
        if order is None or had("linear_attn", "kda_layers"):
            lin["kda_layers"] = [i + 1 for i, t in enumerate(self.layer_types) if t == "kda"]
        if order is None or had("linear_attn", "full_attn_layers"):
            lin["full_attn_layers"] = [i + 1 for i in self.mla_layers]
        for name in sorted(_TEXT_FIELDS - {"quantization_config"}, key=_FIELD_ORDER.index):
            if keep("text", name, name):
                text[name] = getattr(self, name)
        if order is None or had("text", "num_key_value_heads"):
            text["num_key_value_heads"] = self.num_attention_heads  # MLA: a key and a value per query head
        if order is None or had("text", "linear_attn_config") or lin:
            text["linear_attn_config"] = _ordered(lin, order["linear_attn"] if order else [])
        top = dict(extra.get("top", {})) if nested else text
        quant_section = "top" if nested and extra.get("quantization_in") == "top" else "text"
        if self.quantization_config is not None or had(quant_section, "quantization_config"):
            (top if quant_section == "top" else text)["quantization_config"] = self.quantization_config
        # what each switch's absence means for the file written (module docstring of k3.absent_keys)
        implied = {
            "residual": "attnres" if self.attn_res_block_size is not None else "standard",
            "mla_impl": "auto",
            "expert_quantization": None,
            "mla_latent_norm_eps": None if has_k3_keys(text, lin) else KIMI_LINEAR_LATENT_NORM_EPS,
        }
        # a switch that defaults to None is written only when set (or its absence would mean a value), so older
        # k3 sections read back unchanged
        k3_own = {
            name: getattr(self, name)
            for name in _K3_ONLY
            if _DEFAULTS[name] is not None or getattr(self, name) is not None or getattr(self, name) != implied[name]
        }
        if any(getattr(self, name) != implied[name] for name in _K3_ONLY) or had(home, "k3"):
            top["k3"] = k3_own
        text = _ordered(text, order["text"] if order else [])
        if not nested:
            if self.vision_config is not None:
                raise ConfigError(
                    "a vision model's config.json nests the text model under text_config; this one "
                    "was read from the flat text-only layout, which has no place for vision_config"
                )
            return copy.deepcopy(text)
        vision = None
        if self.vision_config is not None:
            vision, vision_top = self.vision_config.to_hf()
            top.update(vision_top)
        top["text_config"] = text
        if vision is not None:
            top["vision_config"] = vision
        return copy.deepcopy(_ordered(top, order["top"] if order else []))

    def _respelled(self, text: dict[str, Any]) -> dict[str, Any]:
        """A file's other text_config keys, with the other spellings of fields (k3.absent_keys.SPELLINGS) and
        transformers' layer lists it had, from the fields as they are now."""
        lists = _layer_lists(self)
        for key in (self.extra_hf or {}).get("spelled", ()):
            text[key] = lists[key] if key in lists else getattr(self, SPELLINGS[key])
        return text

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_hf(), indent=2) + "\n")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# Fields read from and written to text_config; the linear_attn_config ones, the derived layer lists and
# k3's own switches have their own places.
_TEXT_FIELDS = {f.name for f in fields(K3Config)} - {
    "extra_hf",
    "full_attn_layers",
    "vision_config",
    *_LINEAR_ATTN_KEYS.values(),
    *_K3_ONLY,
}
_DEFAULTS = {f.name: f.default for f in fields(K3Config) if f.default is not MISSING}
# every field a config.json holds a key for, in the dataclass's order (what from_hf reads or resolves)
_READ_FIELDS = [
    f.name for f in fields(K3Config) if f.name in _TEXT_FIELDS | {"full_attn_layers", *_LINEAR_ATTN_KEYS.values()}
]
_SITU_WHY = "read under hidden_act 'situ', which has no public default for it"


_LAYER_LISTS = ("layer_types", "mlp_layer_types")


def _check_spellings(config: K3Config, spelled: dict[str, Any]) -> None:
    """A file's other spellings of fields, and transformers' layer lists, must say what the fields say."""
    lists = _layer_lists(config)
    for key, value in spelled.items():
        if key in lists:
            name = "full_attn_layers" if key == "layer_types" else "first_k_dense_replace"
            if value != lists[key]:
                raise ConfigError(
                    f"config.json text_config.{key} = {value!r}: transformers builds the layers from it, and it "
                    f"disagrees with {file_key(name)} = {getattr(config, name)!r}, which k3 builds them from "
                    f"(that is {lists[key]})"
                )
        elif value != getattr(config, SPELLINGS[key]):
            raise ConfigError(
                f"config.json text_config.{key} = {value!r}: k3 reads {file_key(SPELLINGS[key])} "
                f"(= {getattr(config, SPELLINGS[key])!r}); set that key instead, or the two to the same value"
            )


def _layer_lists(config: K3Config) -> dict[str, list[str]]:
    """transformers' per-layer lists for a config: `layer_types` (attention) and `mlp_layer_types` (FFN)."""
    return {
        "layer_types": ["full_attention" if t == "mla" else "linear_attention" for t in config.layer_types],
        "mlp_layer_types": ["dense" if t == "dense" else "sparse" for t in config.ffn_types],
    }


_FIELD_ORDER = [f.name for f in fields(K3Config)]
_VISION_DEFAULTS = {f.name: f.default for f in fields(VisionConfig) if f.default is not MISSING}

PRESETS: dict[str, dict[str, Any]] = {
    # The released 2.8T configuration (SPEC §1): the dataclass defaults, and the released weights' storage
    # format (the smaller presets describe unquantised weights, as k3 trains them).
    "k3": {"quantization_config": RELEASED_QUANTIZATION_CONFIG, "vision_config": VisionConfig()},
    # Tens of millions of parameters with K3's structure, for training on a laptop CPU.
    "small": dict(
        vocab_size=8192,
        hidden_size=256,
        num_hidden_layers=9,
        num_attention_heads=4,
        q_lora_rank=128,
        kv_lora_rank=64,
        qk_nope_head_dim=32,
        qk_rope_head_dim=16,
        v_head_dim=32,
        kda_num_heads=4,
        kda_head_dim=64,
        intermediate_size=768,
        num_experts=16,
        num_experts_per_token=2,
        num_shared_experts=1,
        routed_expert_hidden_size=128,
        moe_intermediate_size=256,
        attn_res_block_size=3,
        max_position_embeddings=65536,
    ),
    # For tests: forward in milliseconds.
    "tiny": dict(
        vocab_size=512,
        hidden_size=64,
        num_hidden_layers=5,
        num_attention_heads=2,
        q_lora_rank=32,
        kv_lora_rank=16,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        kda_num_heads=2,
        kda_head_dim=16,
        intermediate_size=128,
        num_experts=8,
        num_experts_per_token=2,
        num_shared_experts=1,
        routed_expert_hidden_size=32,
        moe_intermediate_size=32,
        attn_res_block_size=2,
        max_position_embeddings=4096,
    ),
    # A few million parameters with a MoonViT-V2 tower, trained from scratch on generated images in minutes on
    # a CPU (`k3 train --preset small-vl`, docs/vision.md). The trainer sets the vocabulary and the placeholder
    # token's id from the tokenizer it builds.
    "small-vl": dict(
        vocab_size=512,
        hidden_size=192,
        num_hidden_layers=5,
        num_attention_heads=4,
        q_lora_rank=96,
        kv_lora_rank=48,
        qk_nope_head_dim=32,
        qk_rope_head_dim=16,
        v_head_dim=32,
        kda_num_heads=4,
        kda_head_dim=48,
        intermediate_size=512,
        num_experts=8,
        num_experts_per_token=2,
        num_shared_experts=1,
        routed_expert_hidden_size=96,
        moe_intermediate_size=192,
        attn_res_block_size=2,
        max_position_embeddings=4096,
        vision_config=VisionConfig(
            vt_hidden_size=128,
            vt_num_hidden_layers=4,
            vt_num_attention_heads=4,
            qkv_hidden_size=128,
            vt_intermediate_size=384,
            init_pos_emb_height=16,
            init_pos_emb_width=16,
            mm_hidden_size=128,
            text_hidden_size=192,
            media_placeholder_token_id=0,
        ),
    ),
}
