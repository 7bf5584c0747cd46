"""`k3 export`: a model folder in the release layout (SPEC §1) from a run, step or model folder.

    config.json                  K3Config.to_hf() (official nesting) with the top-level architecture and
                                 the dtype of the tensors written; with MXFP4, the release's
                                 quantization_config inside text_config
    model.safetensors            or model-0000i-of-0000N.safetensors + model.safetensors.index.json
    generation_config.json       eos / pad / bos token ids
    tokenizer.json               the run's byte-level BPE, and tokenizer_config.json for HF loaders

A Kimi Linear model (K3Config.family "kimi_linear": its config.json has none of K3's keys) is written in
Kimi Linear's layout instead: its config.json flat as it was read (`KimiLinearForCausalLM`, `model_type:
kimi_linear`, prefix `model` only) and A_log as [1, 1, num_heads, 1]; transformers' KimiLinearForCausalLM
reads that folder.

Tensors keep the dtype they have in the model (fp32 for k3 runs), except A_log, written padded to the
released 128 values (K3) or in Kimi Linear's shape, and routed experts under --quantize mxfp4, written
packed. The folder is written beside its destination under a hidden name, fsynced, then renamed into
place: a failed export leaves nothing behind and an existing folder untouched (with force, it is replaced
only once the new one is complete).
"""

import copy
import json
import os
import re
import shutil
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from k3.config import RELEASED_QUANTIZATION_CONFIG, K3Config
from k3.formats.files import fsync_path
from k3.hub.folder import INDEX, SINGLE, ModelFolderError
from k3.hub.layout import EXPERT_WEIGHT, release_name
from k3.model.names import RELEASED_A_LOG_SIZE

ARCHITECTURES = {"language_model": "KimiK3ForConditionalGeneration", "model": "KimiK3ForCausalLM"}
KIMI_LINEAR_ARCHITECTURE = "KimiLinearForCausalLM"  # K3Config.family "kimi_linear": transformers' class
MODEL_TYPE = "kimi_k3"
QUANTIZE_FORMATS = (None, "mxfp4")  # how routed experts are written: dense, or packed as the release (MXFP4)


def mxfp4_quantization_config() -> dict[str, Any]:
    """The release's quantization_config (compressed-tensors MXFP4 on the routed experts only)."""
    return copy.deepcopy(RELEASED_QUANTIZATION_CONFIG)


def parse_size(text: str) -> int:
    """'5GB' -> 5_000_000_000 bytes. Units: B, KB, MB, GB, TB (powers of 1000, as HF shards) and KiB, MiB,
    GiB (powers of 1024); a bare number is bytes."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)?\s*", text, flags=re.IGNORECASE)
    if not m:
        raise ValueError(f"shard size {text!r}: write a number of bytes with a unit, e.g. 5GB, 500MB, 2GiB")
    unit = (m[2] or "B").upper()
    power = "BKMGT".index(unit[0])
    n = int(float(m[1]) * (1024 if "I" in unit else 1000) ** power)
    if n < 1:
        raise ValueError(f"shard size {text!r} must be at least 1 byte")
    return n


def release_tensors(
    state: dict[str, torch.Tensor], config: K3Config, prefix: str = "model", quantize: str | None = None
) -> dict[str, torch.Tensor]:
    """A K3Model state_dict under the release's names and forms: prefix, padded A_log, and with
    quantize='mxfp4' the routed experts packed."""
    from k3.quant.mx import BLOCK_SIZE, pack_mxfp4

    if quantize not in QUANTIZE_FORMATS:
        raise ModelFolderError(f"quantize={quantize!r}: k3 writes only mxfp4 (or nothing)")
    kimi_linear = config.family == "kimi_linear"
    if kimi_linear and prefix != "model":
        raise ModelFolderError(f"prefix {prefix!r}: a Kimi Linear folder is text-only, prefix 'model'")
    out = {}
    for name, t in state.items():
        if config.tie_word_embeddings and name == "lm_head.weight":
            continue
        t = t.detach().cpu().contiguous()
        key = release_name(name, prefix)
        if name.endswith(".A_log") and kimi_linear:
            t = t.view(1, 1, -1, 1)  # Kimi Linear's shape
        elif name.endswith(".A_log") and t.shape[0] < RELEASED_A_LOG_SIZE:
            t = torch.cat([t, t.new_zeros(RELEASED_A_LOG_SIZE - t.shape[0])])
        if quantize == "mxfp4" and EXPERT_WEIGHT.search(name):
            if t.shape[1] % BLOCK_SIZE:
                raise ModelFolderError(f"{name} has {t.shape[1]} in-features; MXFP4 packs blocks of {BLOCK_SIZE}")
            base = key[: -len(".weight")]
            out[base + ".weight_packed"], out[base + ".weight_scale"] = pack_mxfp4(t)
            continue
        out[key] = t
    return out


def shard(tensors: dict[str, torch.Tensor], shard_size: int) -> list[dict[str, torch.Tensor]]:
    """Consecutive groups of at most shard_size bytes (a larger tensor gets a shard of its own)."""
    shards: list[dict[str, torch.Tensor]] = [{}]
    used = 0
    for name, t in tensors.items():
        n = t.numel() * t.element_size()
        if shards[-1] and used + n > shard_size:
            shards.append({})
            used = 0
        shards[-1][name] = t
        used += n
    return shards


def weights_dtype(tensors: dict[str, torch.Tensor]) -> torch.dtype:
    """The floating-point dtype holding most of the bytes of `tensors`: what config.json's `dtype` names (the
    release is bf16 with a few small fp32 tensors, A_log and dt_bias; packed uint8 experts are not counted)."""
    size: dict[torch.dtype, int] = {}
    for t in tensors.values():
        if t.is_floating_point():
            size[t.dtype] = size.get(t.dtype, 0) + t.numel() * t.element_size()
    if not size:
        raise ModelFolderError("no floating-point tensor to export: config.json's dtype would name nothing")
    return max(size, key=size.get)


def release_config(
    config: K3Config, prefix: str, quantize: str | None, eos_id: int | None, dtype: torch.dtype
) -> dict[str, Any]:
    """config.json: K3Config.to_hf() (the official nesting) with the architecture of the chosen layout, the
    `dtype` of the tensors written (`weights_dtype`; to_hf carries the release's bfloat16, which would tell
    a loader the wrong storage for k3's fp32 weights) and the quantization_config that matches them: the
    release's for MXFP4 experts (placed where to_hf places it: inside text_config for a config made in k3),
    none for dense ones."""
    config = replace(config, quantization_config=mxfp4_quantization_config() if quantize == "mxfp4" else None)
    if config.eos_token_id is None and eos_id is not None:
        config = replace(config, eos_token_id=eos_id)
    top = config.to_hf()
    top["architectures"] = [KIMI_LINEAR_ARCHITECTURE if config.family == "kimi_linear" else ARCHITECTURES[prefix]]
    top.setdefault("model_type", MODEL_TYPE)
    text = top.get("text_config", top)
    name = str(dtype).removeprefix("torch.")
    text["dtype"] = name
    for key in ("dtype", "torch_dtype"):  # transformers' spellings, new and old, where a read config had them
        for section in (top, text):
            if key in section:
                section[key] = name
    # Read by public converters (llama.cpp's among them); k3 computes exactly these.
    text.setdefault("num_key_value_heads", config.num_attention_heads)
    text.setdefault("moe_router_activation_func", "sigmoid")
    return top


def write_model_folder(
    tensors: dict[str, torch.Tensor],
    config_json: dict[str, Any],
    out: str | Path,
    tokenizer_path: Path | None = None,
    shard_size: int = 5 * 10**9,
    force: bool = False,
) -> Path:
    """Write release-named `tensors`, config.json and the tokenizer files to the folder `out`, atomically."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise ModelFolderError(f"{out} exists and is not a folder")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise ModelFolderError(f"{out} exists and is not empty; choose a new --out or pass --force to replace it")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        groups = shard(tensors, shard_size)
        if len(groups) == 1:
            save_file(groups[0], tmp / SINGLE, metadata={"format": "pt"})
        else:
            weight_map = {}
            for i, group in enumerate(groups, 1):
                file = f"model-{i:05d}-of-{len(groups):05d}.safetensors"
                save_file(group, tmp / file, metadata={"format": "pt"})
                weight_map.update(dict.fromkeys(group, file))
            total = sum(t.numel() * t.element_size() for t in tensors.values())
            index = {"metadata": {"total_size": total}, "weight_map": weight_map}
            (tmp / INDEX).write_text(json.dumps(index, indent=2) + "\n")
        (tmp / "config.json").write_text(json.dumps(config_json, indent=2) + "\n")
        text = config_json.get("text_config", config_json)
        generation = {k: text.get(k) for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
        (tmp / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
        if tokenizer_path is not None:
            _write_tokenizer(tokenizer_path, tmp, text.get("max_position_embeddings"))
        for f in tmp.iterdir():
            fsync_path(f)
        fsync_path(tmp)
        if out.is_dir():
            old = out.parent / f".{out.name}.old-{os.getpid()}"
            out.rename(old)  # only now, with the new folder complete, does the old one go
            tmp.rename(out)
            shutil.rmtree(old)
        else:
            tmp.rename(out)
        fsync_path(out.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def _write_tokenizer(path: Path, folder: Path, max_length: int | None) -> None:
    from k3.formats.tokenizer import EOS, K3Tokenizer

    tokenizer = K3Tokenizer.load(path)
    shutil.copyfile(path, folder / "tokenizer.json")
    pad = "<|pad|>"
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": EOS,
        "pad_token": pad if tokenizer.tok.token_to_id(pad) is not None else None,
        "bos_token": None,
        "model_max_length": max_length,
        "clean_up_tokenization_spaces": False,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


def export_model(
    source: str | Path,
    out: str | Path,
    shard_size: int = 5 * 10**9,
    quantize: str | None = None,
    prefix: str = "model",
    force: bool = False,
) -> Path:
    """A run, step or model folder -> a model folder in the release layout at `out`."""
    from k3.formats.tokenizer import K3Tokenizer
    from k3.hub.load import load_pretrained

    if prefix not in ARCHITECTURES:
        raise ModelFolderError(f"prefix {prefix!r}: choose 'model' (text-only) or 'language_model' (the release's)")
    source, out = Path(source), Path(out)
    if out.resolve() == source.resolve() or out.resolve() in source.resolve().parents:
        raise ModelFolderError(f"--out {out} holds the source {source}; write the export elsewhere")
    if out.is_dir() and any(out.iterdir()) and not force:  # before the (possibly long) load
        raise ModelFolderError(f"{out} exists and is not empty; choose a new --out or pass --force to replace it")
    pretrained = load_pretrained(source)
    if pretrained.config.vision_config is not None and prefix != "language_model":
        raise ModelFolderError(
            f"{source} has a vision tower: its folder is the release's multimodal layout, "
            f"prefix 'language_model' (--prefix language_model)"
        )
    eos = K3Tokenizer.load(pretrained.tokenizer_path).eos_id if pretrained.tokenizer_path else None
    tensors = release_tensors(pretrained.model.state_dict(), pretrained.config, prefix, quantize)
    config_json = release_config(pretrained.config, prefix, quantize, eos, weights_dtype(tensors))
    return write_model_folder(tensors, config_json, out, pretrained.tokenizer_path, shard_size, force)
