"""A model folder in the release layout (SPEC §1), read from its headers: which tensors it holds, where,
with which dtype and shape, before a single tensor is read.

    config.json                       the official nesting (K3Config.from_hf reads it)
    model.safetensors                 one file, or
    model-00001-of-0000N.safetensors  shards, listed by model.safetensors.index.json ("weight_map")

A safetensors file is an 8-byte little-endian header length, a JSON header (name -> dtype, shape,
data_offsets) and the tensor bytes. Parsing the header ourselves gives every shape without
materialising a tensor, and lets a truncated file be named as such: its header promises more bytes
than the file holds.
"""

import json
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
SHARD_NAME = re.compile(r"^model-(\d+)-of-(\d+)\.safetensors$")
MAX_HEADER_BYTES = 100 << 20  # safetensors' own limit; a larger length means the file is not safetensors

# safetensors dtype codes -> torch dtypes (the ones a K3 checkpoint can hold)
DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}


class ModelFolderError(ValueError):
    """A model folder that is incomplete, damaged, or does not fit the model it is loaded into."""


@dataclass(frozen=True)
class TensorInfo:
    """One tensor as its file's header describes it."""

    file: str  # the shard's file name inside the folder
    dtype: str  # safetensors code: "BF16", "F32", "U8", ...
    shape: tuple[int, ...]

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def nbytes(self) -> int:
        n = DTYPES[self.dtype].itemsize
        for s in self.shape:
            n *= s
        return n


def read_header(path: Path) -> dict[str, TensorInfo]:
    """Name -> TensorInfo of one safetensors file, checking that the file holds every byte its header
    promises (a truncated download or copy fails here, not halfway through a load)."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ModelFolderError(f"{path}: {size} bytes, too short to be a safetensors file (truncated?)")
        (n,) = struct.unpack("<Q", head)
        if n > MAX_HEADER_BYTES:
            raise ModelFolderError(f"{path}: not a safetensors file (header length {n} bytes)")
        raw = f.read(n)
    if len(raw) < n:
        raise ModelFolderError(f"{path} is truncated: its header is {n} bytes but the file has {size} bytes in all")
    try:
        header = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ModelFolderError(f"{path}: the safetensors header is not valid JSON ({e})") from e
    if not isinstance(header, dict):
        raise ModelFolderError(f"{path}: the safetensors header is not a JSON object")
    header.pop("__metadata__", None)
    infos, end = {}, 0
    for name, entry in header.items():
        try:
            dtype, shape, (begin, stop) = entry["dtype"], tuple(entry["shape"]), entry["data_offsets"]
        except (KeyError, TypeError, ValueError) as e:
            raise ModelFolderError(f"{path}: malformed header entry for {name!r}: {entry!r}") from e
        if dtype not in DTYPES:
            raise ModelFolderError(f"{path}: {name} has dtype {dtype}, which k3 does not read ({sorted(DTYPES)})")
        info = TensorInfo(path.name, dtype, shape)
        if stop - begin != info.nbytes:
            raise ModelFolderError(
                f"{path}: {name} spans {stop - begin} bytes but {dtype} {list(shape)} needs {info.nbytes}"
            )
        infos[name] = info
        end = max(end, stop)
    have = size - 8 - n
    if have < end:
        raise ModelFolderError(
            f"{path} is truncated: its header describes {end} bytes of tensor data, the file "
            f"holds {have}; download or copy it again"
        )
    return infos


def _shard_label(name: str) -> str:
    m = SHARD_NAME.match(name)
    return f"shard {int(m[1])} of {int(m[2])} ({name})" if m else name


def _names(keys, limit: int = 8) -> str:
    keys = sorted(keys)
    more = f" and {len(keys) - limit} more" if len(keys) > limit else ""
    return ", ".join(keys[:limit]) + more


@dataclass
class ModelFolder:
    """The headers of a model folder: `tensors` maps every tensor name to where and what it is; `files`
    lists the weight files in the order they are read (shard order)."""

    path: Path
    config_dict: dict[str, Any]
    tensors: dict[str, TensorInfo]
    files: list[str]

    @classmethod
    def open(cls, path: str | Path) -> "ModelFolder":
        path = Path(path)
        if not path.is_dir():
            raise ModelFolderError(f"{path}: no such model folder")
        config_path = path / "config.json"
        if not config_path.is_file():
            raise ModelFolderError(
                f"{path}: no config.json; a model folder holds config.json and its weights "
                f"({SINGLE}, or shards listed by {INDEX})"
            )
        try:
            config_dict = json.loads(config_path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ModelFolderError(f"{config_path} is not valid JSON: {e}") from e
        if (path / INDEX).is_file():
            tensors, files = cls._read_index(path)
        elif (path / SINGLE).is_file():
            tensors, files = read_header(path / SINGLE), [SINGLE]
        else:
            shards = sorted(p.name for p in path.glob("*.safetensors"))
            if shards:
                raise ModelFolderError(
                    f"{path}: weight files {shards[:3]} but no {INDEX} to say which tensor is "
                    f"where; the index is part of a sharded model folder"
                )
            raise ModelFolderError(f"{path}: no weights ({SINGLE} or {INDEX})")
        return cls(path, config_dict, tensors, files)

    @staticmethod
    def _read_index(path: Path) -> tuple[dict[str, TensorInfo], list[str]]:
        try:
            index = json.loads((path / INDEX).read_text())
            weight_map = index["weight_map"]
            if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
                raise TypeError("weight_map must map tensor names to file names")
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as e:
            raise ModelFolderError(f"{path / INDEX}: not a safetensors index ({type(e).__name__}: {e})") from e
        by_file: dict[str, list[str]] = {}
        for name, file in weight_map.items():
            by_file.setdefault(file, []).append(name)
        for file, names in by_file.items():
            if not (path / file).is_file():
                what = "missing shard " + _shard_label(file) if SHARD_NAME.match(file) else f"missing file {file}"
                raise ModelFolderError(
                    f"{path}: {what}: the weight_map of {INDEX} places {len(names)} tensors "
                    f"there (e.g. {sorted(names)[0]})"
                )
        counts = {int(m[2]) for m in map(SHARD_NAME.match, by_file) if m}
        if len(counts) == 1:  # a numbered series: every shard of it must be listed
            n = counts.pop()
            listed = {int(m[1]) for m in map(SHARD_NAME.match, by_file) if m}
            absent = [i for i in range(1, n + 1) if i not in listed]
            if absent:
                first = f"model-{absent[0]:05d}-of-{n:05d}.safetensors"
                raise ModelFolderError(
                    f"{path}: missing shard {_shard_label(first)}: the weight_map of {INDEX} "
                    f"lists no tensor in shards {absent} of {n}"
                )
        tensors: dict[str, TensorInfo] = {}
        files = sorted(by_file, key=lambda f: (0, int(m[1])) if (m := SHARD_NAME.match(f)) else (1, f))
        for file in files:
            header = read_header(path / file)
            listed = set(by_file[file])
            absent = listed - set(header)
            if absent:
                raise ModelFolderError(
                    f"{path / file}: the weight_map places {_names(absent)} here, but the file does not hold them"
                )
            unlisted = set(header) - listed
            if unlisted:
                raise ModelFolderError(
                    f"{path / file} holds {_names(unlisted)}, which the weight_map of {INDEX} "
                    f"places elsewhere or not at all"
                )
            tensors.update(header)
        return tensors, files

    def names_in(self, file: str) -> list[str]:
        return [name for name, info in self.tensors.items() if info.file == file]
