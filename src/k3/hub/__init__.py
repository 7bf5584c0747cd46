"""Model folders in the release layout: reading them (`load_pretrained`, `load_for_inference`), writing
them (`export_model`, `k3 export`), and a GGUF file for llama.cpp (`export_gguf`, `k3 export --format gguf`).
Shared by serving and training; owned by neither."""

from k3.hub.export import export_model, parse_size, release_tensors
from k3.hub.folder import ModelFolder, ModelFolderError, TensorInfo, read_header
from k3.hub.gguf import export_gguf
from k3.hub.load import (
    Pretrained,
    ReadStats,
    folder_kind,
    load_for_inference,
    load_model_folder,
    load_pretrained,
    load_tokenizer,
)

__all__ = [
    "ModelFolder",
    "ModelFolderError",
    "Pretrained",
    "ReadStats",
    "TensorInfo",
    "export_gguf",
    "export_model",
    "folder_kind",
    "load_for_inference",
    "load_model_folder",
    "load_pretrained",
    "load_tokenizer",
    "parse_size",
    "read_header",
    "release_tensors",
]
