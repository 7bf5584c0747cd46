"""Where k3 keeps what it compiles, across runs: `$K3_CACHE_DIR` (default `~/.cache/k3`), with the C++ library in
`kernels/` (k3.ops.cpu_library) and Inductor's generated code in `inductor/` (the compiled serving and training
steps). Inductor's FX graph cache keys its entries by the graph, the code and the torch version, so a second run of
the same model skips code generation and the C++ build (Dynamo still traces)."""

import os
import shutil
from pathlib import Path


def cache_root() -> Path:
    """$K3_CACHE_DIR, or ~/.cache/k3."""
    return Path(os.environ.get("K3_CACHE_DIR", Path.home() / ".cache" / "k3"))


def use_inductor_cache(cache_dir: Path | None = None) -> Path:
    """Point Inductor at cache_dir (default: cache_root()/inductor) unless TORCHINDUCTOR_CACHE_DIR already says
    where; returns the folder, created."""
    cache_dir = Path(cache_dir) if cache_dir is not None else cache_root() / "inductor"
    cache_dir.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(cache_dir))
    return cache_dir


def compiler_missing() -> str | None:
    """Why Inductor cannot build CPU code here (no C++ compiler on PATH), or None."""
    if any(shutil.which(cxx) for cxx in (os.environ.get("CXX", "g++"), "g++", "c++", "clang++")):
        return None
    return "Inductor needs a C++ compiler (g++ or clang++) to compile for the CPU, and none is on PATH"
