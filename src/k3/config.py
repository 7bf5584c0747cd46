"""K3Config: the one configuration of the model, its presets, and the official config.json layout.

Field names follow the released HF config where one exists (SPEC §1). The layer pattern — which
layers are KDA or MLA, which FFNs are dense, where AttnRes blocks end — is derived here and only here.
"""

import copy
import json
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any


class ConfigError(ValueError):
    """A K3Config field has a value the model cannot be built with."""


# Keys of the official text_config.linear_attn_config block and the K3Config field each maps to.
_LINEAR_ATTN_KEYS = {
    "num_heads": "kda_num_heads",
    "head_dim": "kda_head_dim",
    "short_conv_kernel_size": "short_conv_kernel_size",
    "gate_lower_bound": "gate_lower_bound",
    "use_full_rank_gate": "use_full_rank_gate",
}
# k3's own switches; not part of the released format, written under "k3" so a round trip keeps them.
_K3_ONLY = ("residual", "mla_impl")


@dataclass
class K3Config:
    # vocabulary and width
    vocab_size: int = 163840
    hidden_size: int = 7168
    num_hidden_layers: int = 93
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 1048576
    rms_norm_eps: float = 1e-6
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
    routed_expert_hidden_size: int = 3584
    moe_intermediate_size: int = 3072
    latent_moe_use_norm: bool = True
    moe_renormalize: bool = True
    routed_scaling_factor: float = 1.0
    # Block Attention Residuals across depth
    attn_res_block_size: int = 12
    # k3 switches: "attnres" or the plain-residual ablation "standard"; MLA "naive", "absorbed" or
    # "auto" (per call, the one with fewer FLOPs: absorbed when decoding)
    residual: str = "attnres"
    mla_impl: str = "auto"
    # carried through unchanged: quantisation and keys of the official file k3 does not interpret
    quantization_config: dict[str, Any] | None = None
    extra_hf: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

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
            "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "kv_lora_rank",
            "qk_nope_head_dim", "v_head_dim", "kda_num_heads", "kda_head_dim", "short_conv_kernel_size",
            "intermediate_size", "num_experts", "num_experts_per_token", "routed_expert_hidden_size",
            "moe_intermediate_size", "attn_res_block_size", "max_position_embeddings",
        ]  # fmt: skip
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
        if not self.mla_use_nope:
            self._fail("mla_use_nope", "must be True: K3 has no positional encoding and k3 implements no RoPE")
        L = self.num_hidden_layers
        if self.full_attn_layers is not None:
            layers = self.full_attn_layers
            if sorted(set(layers)) != list(layers) or not all(1 <= i <= L for i in layers):
                self._fail("full_attn_layers", f"must be strictly increasing 1-based layer numbers in [1, {L}]")

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
        """[start, end) layer ranges of the AttnRes blocks; the last one may be shorter."""
        n, L = self.attn_res_block_size, self.num_hidden_layers
        return tuple((s, min(s + n, L)) for s in range(0, L, n))

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    def describe(self) -> str:
        """One line per layer: index (1-based), attention kind, FFN kind, AttnRes block."""
        block_of = {i: b for b, (s, e) in enumerate(self.attn_res_blocks) for i in range(s, e)}
        return "\n".join(
            f"{i + 1:>3}  {a.upper():<3}  {f:<5}  block {block_of[i] + 1}"
            for i, (a, f) in enumerate(zip(self.layer_types, self.ffn_types, strict=True))
        )

    # ---- presets ----------------------------------------------------------------------------
    @classmethod
    def from_preset(cls, name: str, **overrides: Any) -> "K3Config":
        if name not in PRESETS:
            raise ConfigError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}")
        return cls(**{**PRESETS[name], **overrides})

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
        text = top.pop("text_config", None)
        nested = text is not None
        text = copy.deepcopy(text) if nested else top
        kwargs: dict[str, Any] = {}
        names = {f.name for f in fields(cls)} - {"extra_hf", "full_attn_layers", *_LINEAR_ATTN_KEYS.values()}
        lin = text.pop("linear_attn_config", None) or {}
        for key, name in _LINEAR_ATTN_KEYS.items():
            if key in lin:
                kwargs[name] = lin.pop(key)
        if "full_attn_layers" in lin:
            kwargs["full_attn_layers"] = tuple(lin.pop("full_attn_layers"))
        kda_layers = lin.pop("kda_layers", None)
        for key in list(text):
            if key in names:
                kwargs[key] = text.pop(key)
        k3_own = (top if nested else text).pop("k3", {})
        kwargs.update({k: v for k, v in k3_own.items() if k in _K3_ONLY})
        if nested and "quantization_config" in top:
            kwargs["quantization_config"] = top.pop("quantization_config")
        kwargs["extra_hf"] = {"nested": nested, "top": top if nested else {}, "text": text, "linear_attn": lin}
        config = cls(**kwargs)
        if kda_layers is not None:
            expected = [i + 1 for i, t in enumerate(config.layer_types) if t == "kda"]
            if list(kda_layers) != expected:
                raise ConfigError(
                    f"linear_attn_config.kda_layers {list(kda_layers)} is not the complement of full_attn_layers "
                    f"{[i + 1 for i in config.mla_layers]}: every layer must be exactly one kind"
                )
        return config

    def to_hf(self) -> dict[str, Any]:
        """The official layout: text_config with linear_attn_config, quantization_config at the top."""
        extra = self.extra_hf or {}
        own = {f.name: getattr(self, f.name) for f in fields(self)}
        lin = dict(extra.get("linear_attn", {}))
        lin.update({key: own.pop(name) for key, name in _LINEAR_ATTN_KEYS.items()})
        lin["kda_layers"] = [i + 1 for i, t in enumerate(self.layer_types) if t == "kda"]
        lin["full_attn_layers"] = [i + 1 for i in self.mla_layers]
        own.pop("full_attn_layers")
        own.pop("extra_hf")
        quant = own.pop("quantization_config")
        k3_own = {name: own.pop(name) for name in _K3_ONLY}
        text = {**extra.get("text", {}), **own, "linear_attn_config": lin}
        nested = extra.get("nested", True)
        top = dict(extra.get("top", {})) if nested else text
        if nested:
            top["text_config"] = text
        if quant is not None:
            top["quantization_config"] = quant
        top["k3"] = k3_own
        return top

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_hf(), indent=2) + "\n")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


PRESETS: dict[str, dict[str, Any]] = {
    # The released 2.8T configuration (SPEC §1): the dataclass defaults.
    "k3": {},
    # Tens of millions of parameters with K3's structure, for training on a laptop CPU.
    "small": dict(
        vocab_size=8192, hidden_size=256, num_hidden_layers=9, num_attention_heads=4, q_lora_rank=128,
        kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32, kda_num_heads=4,
        kda_head_dim=64, intermediate_size=768, num_experts=16, num_experts_per_token=2, num_shared_experts=1,
        routed_expert_hidden_size=128, moe_intermediate_size=256, attn_res_block_size=3,
        max_position_embeddings=65536,
    ),
    # For tests: forward in milliseconds.
    "tiny": dict(
        vocab_size=512, hidden_size=64, num_hidden_layers=5, num_attention_heads=2, q_lora_rank=32,
        kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, kda_num_heads=2,
        kda_head_dim=16, intermediate_size=128, num_experts=8, num_experts_per_token=2, num_shared_experts=1,
        routed_expert_hidden_size=32, moe_intermediate_size=32, attn_res_block_size=2,
        max_position_embeddings=4096,
    ),
}  # fmt: skip
