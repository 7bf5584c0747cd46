"""`k3 export --format gguf`: one GGUF file that llama.cpp's `kimi-k3` architecture loads (text only).

Written with the `gguf` package (llama.cpp's own writer, the optional extra `k3[gguf]`), under the names and
forms llama.cpp's K3 loader reads (`src/models/kimi-k3.cpp`):
- metadata `kimi-k3.*`: the widths, the layer pattern as a per-layer KV-head count (1 on MLA layers, which
  llama.cpp serves as one latent head; 0 marks a KDA layer), KDA, MLA, MoE, SiTU and AttnRes sizes;
- per-layer tensors `blk.{i}.*`; the routed experts stacked [E, out, in]; `kv_b_proj` split per head into
  attn_k_b [H, rank, nope] (transposed, for the absorbed query) and attn_v_b [H, v, rank]; A_log stored as
  −exp(A_log); each AttnRes RMSNorm gain multiplied into its pseudo-query (llama.cpp keeps only the product);
  a low-rank KDA output gate multiplied out into the full-rank one llama.cpp reads;
- the tokenizer and chat template (k3.hub.gguf_vocab).

A GGUF shape lists the fastest axis first, the reverse of torch's: a Linear weight (out, in) is written as it
is and read as {in, out}. Storage (`--outtype`):
    f32     every tensor float32: llama.cpp then computes what k3 computes, to float32 rounding
    bf16    matrices bfloat16; vectors, norms, conv taps and the router stay float32 (what llama.cpp's
            kernels and its own converter keep in float32)
    mxfp4   as bf16, with the routed experts in ggml's MXFP4 blocks: the release's storage. The 4-bit codes
            and scales are those of k3's MXFP4 packing, bit for bit; llama.cpp multiplies them with
            activations it rounds to 8 bits (Q8_0), which is not the function k3 computes (docs/checkpoints.md)
A QAT model (expert_quantization="mxfp4") computes with MXFP4 expert weights: f32 and bf16 write those
weights, dequantised, not the latent fp32 ones.

The file is written beside its destination under a hidden name, fsynced, then renamed into place.
"""

import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from k3.config import K3Config
from k3.formats.files import fsync_path
from k3.hub.folder import ModelFolderError
from k3.hub.layout import UNBUILT_PARTS

ARCH = "kimi-k3"
OUTTYPES = ("f32", "bf16", "mxfp4")
# llama_ftype values (gguf.LlamaFileType): what general.file_type says the file holds
FILE_TYPES = {"f32": 0, "bf16": 32, "mxfp4": 38}
MXFP4_BLOCK = 32  # values per ggml block_mxfp4: one E8M0 scale byte, then 16 bytes of E2M1 code pairs

# k3 name inside `model.layers.{i}.` -> llama.cpp name inside `blk.{i}.` (the ones that only move)
_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.f_a_proj.weight": "ssm_f_a.weight",
    "self_attn.f_b_proj.weight": "ssm_f_b.weight",
    "self_attn.b_proj.weight": "ssm_beta.weight",
    "self_attn.dt_bias": "ssm_dt.bias",
    "self_attn.o_norm.weight": "ssm_norm.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_a_proj.weight": "attn_q_a.weight",
    "self_attn.q_a_layernorm.weight": "attn_q_a_norm.weight",
    "self_attn.q_b_proj.weight": "attn_q_b.weight",
    "self_attn.kv_a_proj_with_mqa.weight": "attn_kv_a_mqa.weight",
    "self_attn.kv_a_layernorm.weight": "attn_kv_a_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    "block_sparse_moe.gate.weight": "ffn_gate_inp.weight",
    "block_sparse_moe.gate.e_score_correction_bias": "exp_probs_b.bias",
    "block_sparse_moe.routed_expert_down_proj.weight": "ffn_routed_down.weight",
    "block_sparse_moe.routed_expert_up_proj.weight": "ffn_routed_up.weight",
    "block_sparse_moe.routed_expert_norm.weight": "ffn_routed_norm.weight",
    "block_sparse_moe.shared_experts.gate_proj.weight": "ffn_gate_shexp.weight",
    "block_sparse_moe.shared_experts.up_proj.weight": "ffn_up_shexp.weight",
    "block_sparse_moe.shared_experts.down_proj.weight": "ffn_down_shexp.weight",
}
_TOP_NAMES = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}
_EXPERTS = {"w1": "ffn_gate_exps.weight", "w2": "ffn_down_exps.weight", "w3": "ffn_up_exps.weight"}
# AttnRes: the pseudo-query and the RMSNorm gain in front of it, fused into one score vector
_RES_SCORES = {"self_attention_res": "attn_res_score.weight", "mlp_res": "ffn_res_score.weight"}
_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")
_EXPERT = re.compile(r"block_sparse_moe\.experts\.(\d+)\.(w[123])\.weight")


def require_gguf():
    """The `gguf` module, or an ImportError that says how to install it."""
    try:
        import gguf
    except ImportError as e:
        message = "k3 export --format gguf needs the `gguf` package: pip install 'k3[gguf]'"
        raise ImportError(message, name="gguf") from e
    return gguf


def check_exportable(config: K3Config, outtype: str) -> None:
    """Raise ModelFolderError when llama.cpp's kimi-k3 cannot compute what this config computes."""
    if outtype not in OUTTYPES:
        raise ModelFolderError(f"--outtype {outtype!r}: choose one of {', '.join(OUTTYPES)}")
    if config.kda_num_heads != config.num_attention_heads:
        raise ModelFolderError(
            f"kda_num_heads = {config.kda_num_heads} and num_attention_heads = {config.num_attention_heads}: "
            "llama.cpp's kimi-k3 reads one head count for KDA and MLA layers; they must be equal"
        )
    if config.routed_expert_hidden_size is None or config.mla_latent_norm_eps is not None:
        raise ModelFolderError(
            "a Kimi Linear model (full-width experts, or MLA latent norms with their own eps): llama.cpp's "
            "kimi-k3 computes K3's latent experts and norms; k3 writes no GGUF for its kimi-linear architecture"
        )
    if config.hidden_act != "situ":
        raise ModelFolderError(f"hidden_act = {config.hidden_act!r}: llama.cpp's kimi-k3 computes SiTU-GLU only")
    widths = {"routed_expert_hidden_size": config.routed_expert_hidden_size}
    widths["moe_intermediate_size"] = config.moe_intermediate_size
    odd = {k: v for k, v in widths.items() if v % MXFP4_BLOCK}
    if outtype == "mxfp4" and odd:
        raise ModelFolderError(
            f"--outtype mxfp4 packs the routed experts' inputs in blocks of {MXFP4_BLOCK}, but "
            + ", ".join(f"{k} = {v}" for k, v in odd.items())
            + f" is not a multiple of {MXFP4_BLOCK}; export with --outtype f32 or bf16"
        )


def gguf_hparams(config: K3Config) -> dict[str, Any]:
    """The `kimi-k3.*` metadata, keys without the architecture prefix. Python int -> uint32, float -> float32,
    bool -> bool, list -> array of uint32 (how llama.cpp's loader asks for each)."""
    mla = set(config.mla_layers)
    hparams: dict[str, Any] = {
        "context_length": config.max_position_embeddings,
        "embedding_length": config.hidden_size,
        "block_count": config.num_hidden_layers,
        "feed_forward_length": config.intermediate_size,
        "vocab_size": config.vocab_size,
        "attention.head_count": config.num_attention_heads,
        "attention.head_count_kv": [1 if i in mla else 0 for i in range(config.num_hidden_layers)],
        "attention.layer_norm_rms_epsilon": float(config.rms_norm_eps),
        "attention.kv_lora_rank": config.kv_lora_rank,
        # served as one head over the latent: keys are [latent, k_pe], values the latent
        "attention.key_length": config.kv_lora_rank + config.qk_rope_head_dim,
        "attention.value_length": config.kv_lora_rank,
        "attention.key_length_mla": config.qk_nope_head_dim + config.qk_rope_head_dim,
        "attention.value_length_mla": config.v_head_dim,
        # NoPE: the "rope" part of the key is shared across heads and never rotated
        "rope.dimension_count": config.qk_rope_head_dim,
        "ssm.conv_kernel": config.short_conv_kernel_size,
        "kda.head_dim": config.kda_head_dim,
        "expert_count": config.num_experts,
        "expert_used_count": config.num_experts_per_token,
        "expert_feed_forward_length": config.moe_intermediate_size,
        "expert_shared_count": config.num_shared_experts,
        "expert_latent_length": config.routed_expert_hidden_size,
        "leading_dense_block_count": config.first_k_dense_replace,
        "expert_weights_scale": float(config.routed_scaling_factor),
        "expert_weights_norm": bool(config.moe_renormalize),
        "expert_gating_func": 2,  # sigmoid (gguf.ExpertGatingFuncType.SIGMOID), k3's router
        "activation.situ_beta": float(config.activation_situ_beta),
        "activation.situ_linear_beta": float(config.activation_situ_linear_beta),
        # 0: the plain residual stream (k3's residual="standard")
        "attn_res.block_size": config.attn_res_block_size if config.residual == "attnres" else 0,
    }
    if config.q_lora_rank is not None:
        hparams["attention.q_lora_rank"] = config.q_lora_rank
    if config.gate_lower_bound is not None:  # absent: Kimi Linear's unbounded softplus gate
        hparams["kda.gate_lower_bound"] = float(config.gate_lower_bound)
    return hparams


def gguf_tensors(
    state: dict[str, torch.Tensor], config: K3Config, outtype: str
) -> Iterator[tuple[str, torch.Tensor, str]]:
    """(llama.cpp name, tensor, storage) for every tensor of a K3Model state_dict; storage is 'f32', 'bf16'
    or 'mxfp4' (then the tensor is the (E, out, in) float weight to pack). Every name is placed or refused."""
    mla = set(config.mla_layers)
    experts: dict[tuple[int, str], dict[int, torch.Tensor]] = {}
    res: dict[str, torch.Tensor] = {}
    low_rank_gate: dict[int, dict[str, torch.Tensor]] = {}
    unknown = []
    for name, t in state.items():
        t = t.detach().cpu()
        if name.startswith(UNBUILT_PARTS):
            continue  # the vision tower and projector: llama.cpp's kimi-k3 is text only
        if name in _TOP_NAMES:
            yield _stored(_TOP_NAMES[name], t, outtype)
            continue
        if name == "lm_head.weight":
            yield _stored("output.weight", t, outtype)
            continue
        if name.startswith("model.output_attn_res_"):
            res[name.removeprefix("model.output_attn_res_")] = t
            continue
        m = _LAYER.fullmatch(name)
        if m is None:
            unknown.append(name)
            continue
        i, rest = int(m[1]), m[2]
        blk = f"blk.{i}."
        if (e := _EXPERT.fullmatch(rest)) is not None:
            experts.setdefault((i, e[2]), {})[int(e[1])] = t
        elif rest in _LAYER_NAMES:
            yield _stored(blk + _LAYER_NAMES[rest], t, outtype)
        elif rest in ("self_attn.q_conv1d.weight", "self_attn.k_conv1d.weight", "self_attn.v_conv1d.weight"):
            channels, _, width = t.shape  # (C, 1, w) -> GGUF {w, 1, C, 1}
            which = rest.removeprefix("self_attn.")[0]  # q, k or v
            yield _stored(blk + f"ssm_conv1d_{which}.weight", t.reshape(1, channels, 1, width), outtype)
        elif rest == "self_attn.A_log":
            yield _stored(blk + "ssm_a", -torch.exp(t.double()[: config.kda_num_heads]), outtype)
        elif rest == "self_attn.g_proj.weight":
            yield _stored(blk + ("attn_gate.weight" if i in mla else "ssm_g.weight"), t, outtype)
        elif rest in ("self_attn.g_a_proj.weight", "self_attn.g_b_proj.weight"):
            low_rank_gate.setdefault(i, {})[rest.removeprefix("self_attn.g_")[0]] = t  # "a" or "b"
        elif rest == "self_attn.kv_b_proj.weight":
            H, nope, v = config.num_attention_heads, config.qk_nope_head_dim, config.v_head_dim
            k_b, v_b = t.view(H, nope + v, config.kv_lora_rank).split([nope, v], dim=1)
            yield _stored(blk + "attn_k_b.weight", k_b.transpose(1, 2).contiguous(), outtype)
            yield _stored(blk + "attn_v_b.weight", v_b.contiguous(), outtype)
        elif rest.startswith(tuple(_RES_SCORES)) and rest.endswith(("_norm.weight", "_proj.weight")):
            res[f"{i}.{rest}"] = t
        else:
            unknown.append(name)
    if unknown:
        raise ModelFolderError(f"tensors with no place in llama.cpp's kimi-k3: {', '.join(sorted(unknown)[:8])}")
    for i, parts in sorted(low_rank_gate.items()):
        # g_b(g_a(x)) = (W_b W_a) x: one full-rank (H·V, d) matrix, multiplied in float64
        yield _stored(f"blk.{i}.ssm_g.weight", parts["b"].double() @ parts["a"].double(), outtype)
    for (i, which), by_expert in sorted(experts.items()):
        stacked = torch.stack([by_expert[e] for e in range(config.num_experts)])
        if config.expert_quantization == "mxfp4" and outtype != "mxfp4":
            stacked = _mxfp4_roundtrip(stacked)  # what a QAT model's experts compute with
        yield f"blk.{i}.{_EXPERTS[which]}", stacked, "mxfp4" if outtype == "mxfp4" else _float(outtype)
    for i in range(config.num_hidden_layers) if config.residual == "attnres" else ():
        for part, gguf_name in _RES_SCORES.items():
            yield _stored(f"blk.{i}.{gguf_name}", _res_score(res, f"{i}.{part}"), outtype)
    if config.residual == "attnres":
        yield _stored("output_res_score.weight", _res_score(res, ""), outtype)
    if "lm_head.weight" not in state:  # tied: llama.cpp's kimi-k3 reads a head of its own
        yield _stored("output.weight", state["model.embed_tokens.weight"].detach().cpu(), outtype)


def _res_score(res: dict[str, torch.Tensor], prefix: str) -> torch.Tensor:
    """w · RMSNorm_γ(v) = (w ⊙ γ) · v̂: the gain and the pseudo-query as one (d,) vector, in float64."""
    prefix = prefix + "_" if prefix else ""
    return res[prefix + "norm.weight"].double() * res[prefix + "proj.weight"].double().flatten()


def _float(outtype: str) -> str:
    return "f32" if outtype == "f32" else "bf16"


def _stored(name: str, t: torch.Tensor, outtype: str) -> tuple[str, torch.Tensor, str]:
    """Vectors, norms, the router and the conv taps stay float32: llama.cpp's element-wise kernels, its
    short convolution and k3's router (scores in fp32) want them so; matrices take the out type."""
    keep_f32 = (
        t.dim() <= 1
        or name.endswith(("_norm.weight", ".bias", "ffn_gate_inp.weight"))
        or ".ssm_conv1d_" in name
        or name.endswith("ssm_a")
    )
    return name, t, "f32" if keep_f32 else _float(outtype)


def _mxfp4_roundtrip(w: torch.Tensor) -> torch.Tensor:
    from k3.quant.mx import pack_mxfp4, unpack_mxfp4

    return torch.stack([unpack_mxfp4(*pack_mxfp4(e)) for e in w])


def mxfp4_blocks(w: torch.Tensor) -> np.ndarray:
    """(E, out, in) float -> ggml block_mxfp4 bytes (E, out, in/32 · 17): per block of 32 inputs the E8M0
    scale byte, then 16 bytes whose byte j holds input j (low nibble) and input j + 16 (high nibble). The
    codes and scales are k3's MXFP4 packing (k3.quant.mx.pack_mxfp4, the release's); only their order moves."""
    from k3.quant.mx import pack_mxfp4

    E, out, n_in = w.shape
    packed, scale = pack_mxfp4(w.reshape(E * out, n_in))  # (R, in/2): input 2j low, 2j+1 high
    codes = torch.stack((packed & 0x0F, packed >> 4), dim=-1).reshape(E * out, n_in // MXFP4_BLOCK, MXFP4_BLOCK)
    half = MXFP4_BLOCK // 2
    pairs = codes[..., :half] | (codes[..., half:] << 4)
    blocks = torch.cat([scale.unsqueeze(-1), pairs], dim=-1)
    return blocks.reshape(E, out, -1).numpy()


def _array(t: torch.Tensor, storage: str) -> tuple[np.ndarray, Any]:
    """The bytes to write and the ggml type name (None: plain float32, typed by numpy)."""
    if storage == "mxfp4":
        return mxfp4_blocks(t.float()), "MXFP4"
    t = t.to(torch.float32).contiguous()
    if storage == "bf16":
        return t.to(torch.bfloat16).view(torch.uint8).numpy(), "BF16"
    return t.numpy(), None


def write_gguf(
    state: dict[str, torch.Tensor],
    config: K3Config,
    out: str | Path,
    outtype: str = "f32",
    tokenizer_path: Path | None = None,
    name: str | None = None,
    force: bool = False,
) -> Path:
    """Write the model (and its tokenizer) as one GGUF file at `out`, atomically."""
    from k3.hub.gguf_vocab import gguf_vocab

    gguf = require_gguf()
    check_exportable(config, outtype)
    out = Path(out)
    if out.is_dir():
        raise ModelFolderError(f"{out} is a folder; --out names the .gguf file to write")
    if out.exists() and not force:
        raise ModelFolderError(f"{out} exists; choose a new --out or pass --force to replace it")
    if tokenizer_path is None:
        raise ModelFolderError("the source has no tokenizer.json; a GGUF file must carry its tokenizer")
    vocab = gguf_vocab(tokenizer_path, config)  # before the weights: a tokenizer problem fails fast
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    writer = _writer(gguf)(tmp, ARCH)
    try:
        if name:
            writer.add_name(name)
        writer.add_file_type(FILE_TYPES[outtype])
        if outtype == "mxfp4":
            writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
        for key, value in gguf_hparams(config).items():
            _add(writer, gguf, f"{ARCH}.{key}", value)
        for key, value in vocab.items():
            _add(writer, gguf, key, value)
        for tensor_name, t, storage in gguf_tensors(state, config, outtype):
            data, ggml_type = _array(t, storage)
            raw = getattr(gguf.GGMLQuantizationType, ggml_type) if ggml_type else None
            writer.add_tensor(tensor_name, data, raw_dtype=raw)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        fsync_path(tmp)
        tmp.replace(out)
        fsync_path(out.parent)
    except BaseException:
        writer.close()
        tmp.unlink(missing_ok=True)
        raise
    return out


def _add(writer, gguf, key: str, value: Any) -> None:
    V = gguf.GGUFValueType
    if isinstance(value, bool):
        writer.add_bool(key, value)
    elif isinstance(value, int):
        writer.add_uint32(key, value)
    elif isinstance(value, float):
        writer.add_float32(key, value)
    elif isinstance(value, str):
        writer.add_string(key, value)
    elif isinstance(value, tuple):  # (values, element type): token types are int32, counts uint32
        values, kind = value
        writer.add_key_value(key, list(values), V.ARRAY, sub_type=getattr(V, kind))
    elif isinstance(value, list):
        sub = V.STRING if value and isinstance(value[0], str) else V.UINT32
        writer.add_key_value(key, value, V.ARRAY, sub_type=sub)
    else:
        raise TypeError(f"metadata {key}: no GGUF type for {type(value).__name__}")


def _writer(gguf):
    """gguf.GGUFWriter that also writes an empty array of a given element type. GGUF allows one and
    llama.cpp reads one (a byte-level BPE with no merges, as `k3 init` makes, has an empty merge list,
    and llama.cpp refuses a gpt2 tokenizer whose merge list is missing), but the writer refuses it."""

    class Writer(gguf.GGUFWriter):
        def _pack_val(self, val, vtype, add_vtype, sub_type=None):
            if vtype == gguf.GGUFValueType.ARRAY and sub_type is not None and len(val) == 0:
                head = self._pack("I", vtype) if add_vtype else b""
                return head + self._pack("I", sub_type) + self._pack("Q", 0)
            return super()._pack_val(val, vtype, add_vtype, sub_type)

    return Writer


def export_gguf(source: str | Path, out: str | Path, outtype: str = "f32", force: bool = False) -> Path:
    """A run, step or model folder -> one GGUF file at `out` for llama.cpp."""
    from k3.hub.load import load_pretrained

    require_gguf()
    out = Path(out)
    if outtype not in OUTTYPES:
        raise ModelFolderError(f"--outtype {outtype!r}: choose one of {', '.join(OUTTYPES)}")
    if out.exists() and not force and not out.is_dir():  # before the (possibly long) load
        raise ModelFolderError(f"{out} exists; choose a new --out or pass --force to replace it")
    pretrained = load_pretrained(source)
    check_exportable(pretrained.config, outtype)
    state = pretrained.model.state_dict()
    return write_gguf(state, pretrained.config, out, outtype, pretrained.tokenizer_path, Path(source).name, force)
