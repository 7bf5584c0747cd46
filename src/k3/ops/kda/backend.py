"""Which implementation runs a KDA call: fla's Triton kernels or k3's PyTorch code.

One named switch, as in nanochat: the `backend` argument, else the K3_KDA_BACKEND environment
variable, else "auto" (fla when the inputs are on CUDA and fla imports, torch otherwise). The torch
path is always available and can be forced, which is how tests compare the two.
"""

import functools
import importlib.util
import os
from pathlib import Path

import torch

BACKENDS = ("auto", "torch", "fla")
ENV_VAR = "K3_KDA_BACKEND"


@functools.cache
def fla_kda():
    """fla.ops.kda, or None when it (or Triton) is not importable."""
    try:
        import fla.ops.kda as mod
    except Exception:  # ImportError, or Triton failing to find a GPU driver at import time
        return None
    return mod


def resolve(backend: str | None, x: torch.Tensor) -> str:
    """'torch' or 'fla' for inputs living where x lives."""
    choice = backend if backend is not None else os.environ.get(ENV_VAR, "auto")
    if choice not in BACKENDS:
        source = "backend" if backend is not None else ENV_VAR
        raise ValueError(f"{source} must be one of {BACKENDS}, got {choice!r}")
    if choice == "auto":
        return "fla" if x.is_cuda and fla_kda() is not None else "torch"
    if choice == "fla":
        if not x.is_cuda:
            raise ValueError(f"backend 'fla' runs Triton kernels on CUDA tensors; these are on {x.device}")
        if fla_kda() is None:
            raise ValueError("backend 'fla' needs flash-linear-attention (pip install flash-linear-attention)")
    return choice


@functools.cache
def fla_naive():
    """fla's pure-PyTorch KDA references (fla/ops/kda/naive.py: naive_recurrent_kda, naive_chunk_kda),
    loaded from the file so that Triton, which `import fla.ops` pulls in, is not needed. None when
    flash-linear-attention or einops is not installed. Tests and benchmarks compare against these."""
    spec = importlib.util.find_spec("fla")
    if spec is None or not spec.submodule_search_locations or importlib.util.find_spec("einops") is None:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / "ops" / "kda" / "naive.py"
    if not path.exists():
        return None
    naive_spec = importlib.util.spec_from_file_location("fla_kda_naive", path)
    module = importlib.util.module_from_spec(naive_spec)
    naive_spec.loader.exec_module(module)
    return module
