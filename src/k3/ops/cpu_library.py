"""k3's C++ CPU kernels as one library: built on first use, cached, and loaded once per process.

The library holds every C++ operator k3 has for the CPU: the chunked KDA op's forward and backward and the
KDA decoding step (k3.ops.kda.cpu_kernel, ops/kda/csrc), the routed experts of a MoE layer for a serving
step, dense or MXFP4-packed (k3.ops.moe_cpu), and MLA's decoding attention over the page pool (k3.ops.mla_cpu;
both in ops/csrc).
It is built with torch's cpp_extension (g++ with OpenMP, -O3 -march=native)
into `$K3_CACHE_DIR/kernels` (default `~/.cache/k3/kernels`), once per source, torch version, Python and CPU;
a second process loads the built library in well under a second. Where it cannot be built (no compiler, a
read-only home), `load()` is False with the reason, and each caller runs its PyTorch reference.
"""

import functools
import hashlib
import platform
import shutil
import struct
import sys
import time
import warnings
from pathlib import Path

import torch

from k3.ops.compile_cache import cache_root

_OPS = Path(__file__).parent
# included by the sources, so part of the build's key
HEADERS = [_OPS / "csrc" / "moe_dispatch.h", _OPS / "csrc" / "blas.h"]
SOURCES = [
    _OPS / "kda" / "csrc" / "chunk_kda_cpu.cpp",  # k3_kda::chunk_fwd, k3_kda::chunk_bwd
    _OPS / "kda" / "csrc" / "recurrent_kda_cpu.cpp",  # k3_kda::recurrent_step
    _OPS / "csrc" / "moe_experts_cpu.cpp",  # k3_cpu::moe_experts
    _OPS / "csrc" / "moe_experts_mxfp4_cpu.cpp",  # k3_cpu::moe_experts_mxfp4
    _OPS / "csrc" / "mla_decode_cpu.cpp",  # k3_cpu::mla_paged_decode
]
NAME = "k3_cpu"


def cache_dir() -> Path:
    return cache_root() / "kernels"


def cpu_signature() -> str:
    """What -march=native compiles for: the CPU model and its flags (machines differ between sessions)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        wanted = [line for line in lines if line.startswith(("model name", "flags", "Features", "CPU part"))]
        return "\n".join(sorted(set(wanted)))
    except OSError:
        return platform.processor()


def _key() -> str:
    parts = [*(p.read_bytes() for p in SOURCES + HEADERS), torch.__version__.encode(), sys.version.encode()]
    parts.append(cpu_signature().encode())
    return hashlib.sha256(b"\0".join(parts)).hexdigest()[:16]


def _flags() -> list[str]:
    flags = ["-O3", "-fopenmp"]
    # -march=native is what makes the channel loops AVX2/AVX-512; the build is keyed by the CPU it ran on
    if platform.machine() in ("x86_64", "AMD64", "aarch64", "arm64"):
        flags.append("-march=native")
    return flags


# Why the kernel is not in use (None once it is loaded), and how long the build or load took.
_status: dict[str, object] = {"reason": "not loaded yet", "seconds": None, "built": None}


def _libraries(build: Path) -> dict[str, int]:
    """The built libraries in a build folder and their modification times: what tells a build from a load."""
    return {p.name: p.stat().st_mtime_ns for p in build.glob("*.so")}


def _truncated(library: Path) -> bool:
    """Whether a cached ELF library ends before its section headers do (a build killed mid-write, a disk error):
    dlopen of such a file can die with SIGBUS instead of raising, so it is checked before loading."""
    data = library.read_bytes()
    if len(data) < 64:
        return True
    if data[:4] != b"\x7fELF" or data[4] != 2:  # not a 64-bit ELF (another platform): the loader judges it
        return False
    shoff, shentsize, shnum = int.from_bytes(data[40:48], "little"), *struct.unpack_from("<HH", data, 58)
    return len(data) < shoff + shentsize * shnum


def _build_and_load(build: Path, key: str) -> None:
    from torch.utils import cpp_extension

    build.mkdir(parents=True, exist_ok=True)
    cpp_extension.load(
        name=f"{NAME}_{key}",
        sources=[str(p) for p in SOURCES],
        extra_cflags=_flags(),
        extra_ldflags=["-fopenmp"],
        build_directory=str(build),
        is_python_module=False,
        verbose=False,
    )


STALE_LOCK_S = 300  # a build takes ~20 s: a build lock older than this was left by a killed build
NO_LOAD = "does-not-load.txt"  # written where a freshly built library does not load, so no start rebuilds it


@functools.cache
def load() -> bool:
    """Build (or find) and load the library once per process; False, with the reason in _status, if it cannot."""
    key = _key()
    build = cache_dir() / f"{NAME}_{key}"
    if (build / NO_LOAD).exists():
        _status["reason"] = f"{(build / NO_LOAD).read_text().strip()} (remove {build} to try again)"
        return False
    lock = build / "lock"  # torch's cpp_extension waits on it without a timeout
    if lock.exists() and time.time() - lock.stat().st_mtime > STALE_LOCK_S:
        lock.unlink(missing_ok=True)
    if any(_truncated(p) for p in build.glob("*.so")) and not lock.exists():
        shutil.rmtree(build, ignore_errors=True)  # built again below
    before = _libraries(build)
    start = time.perf_counter()
    try:
        try:
            _build_and_load(build, key)
        except OSError:
            if not before:
                raise
            # a cached library that does not load (a disk error, another torch build): build it again once
            shutil.rmtree(build, ignore_errors=True)
            try:
                _build_and_load(build, key)
            except OSError as error:
                (build / NO_LOAD).write_text(f"the C++ kernel built but does not load ({str(error).strip()})")
                raise
    except Exception as error:  # no compiler, no OpenMP, a read-only home: the reference path still works
        reason = str(error).strip().splitlines()
        _status["reason"] = f"the C++ kernel did not build or load ({reason[-1] if reason else type(error).__name__})"
        warnings.warn(f"k3: the C++ CPU kernels are not used: {_status['reason']}", RuntimeWarning, stacklevel=3)
        return False
    _status.update(reason=None, seconds=time.perf_counter() - start, built=_libraries(build) != before)
    return True


def status() -> dict[str, object]:
    """reason (None once loaded), seconds (the build or load), built (whether this process built it)."""
    load()
    return dict(_status)
