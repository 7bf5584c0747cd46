"""The chunked KDA op's C++ CPU kernel (csrc/chunk_kda_cpu.cpp): built on first use, cached, and called through
two torch.library operators, `k3_kda::chunk_fwd` and `k3_kda::chunk_bwd`, with fake kernels so that torch.compile
sees each as one node.

The kernel computes what chunk.py / chunk_bwd.py compute (they stay the reference, and the fallback where no C++
compiler is found), with each chunk's element-wise passes fused while its rows are in cache and its small
matmuls sent straight to BLAS. It is built once per source, torch version and CPU with torch's
cpp_extension (g++ with OpenMP, -O3 -march=native) into `$K3_CACHE_DIR/kernels` (default
`~/.cache/k3/kernels`); a second process loads the built library in well under a second.

K3_KDA_CPU_KERNEL=off selects the reference; the default, auto, uses the kernel where it builds and says why
not where it does not (`k3 env`).
"""

import functools
import hashlib
import os
import platform
import shutil
import struct
import sys
import time
import warnings
from pathlib import Path

import torch

from k3.ops.kda.chunk_terms import sequence_chunks
from k3.ops.kda.inputs import pad_time

ENV_VAR = "K3_KDA_CPU_KERNEL"
CHOICES = ("auto", "off")
# the chunked op's forward and backward, and the decoding step (k3_kda::recurrent_step, fused_recurrent.py's)
SOURCES = [Path(__file__).parent / "csrc" / name for name in ("chunk_kda_cpu.cpp", "recurrent_kda_cpu.cpp")]
ROW_BLOCK = 16  # the kernel's row block (BS): chunk sizes must be multiples of it


def cache_dir() -> Path:
    return Path(os.environ.get("K3_CACHE_DIR", Path.home() / ".cache" / "k3")) / "kernels"


def _cpu_signature() -> str:
    """What -march=native compiles for: the CPU model and its flags (machines differ between sessions)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        wanted = [line for line in lines if line.startswith(("model name", "flags", "Features", "CPU part"))]
        return "\n".join(sorted(set(wanted)))
    except OSError:
        return platform.processor()


def _key() -> str:
    parts = [*(p.read_bytes() for p in SOURCES), torch.__version__.encode(), sys.version.encode()]
    parts.append(_cpu_signature().encode())
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
        name=f"k3_kda_cpu_{key}",
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
def _load() -> bool:
    """Build (or find) and load the library once per process; False, with the reason in _status, if it cannot."""
    key = _key()
    build = cache_dir() / f"chunk_kda_cpu_{key}"
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
        warnings.warn(f"k3: KDA runs on its PyTorch reference path: {_status['reason']}", RuntimeWarning, stacklevel=3)
        return False
    _status.update(reason=None, seconds=time.perf_counter() - start, built=_libraries(build) != before)
    _register_fakes()
    return True


def _register_fakes() -> None:
    @torch.library.register_fake("k3_kda::chunk_fwd")
    def _(q, k, v, g, beta, scale, chunk_size, h0, seq_first, seq_last, num_seqs, keep_starts):
        B, T, H, K = q.shape
        V = v.shape[-1]
        starts = q.new_empty(B * H if keep_starts else 0, T // chunk_size, K, V)
        return v.new_empty(v.shape), q.new_empty(num_seqs, H, K, V), starts

    @torch.library.register_fake("k3_kda::recurrent_step")
    def _(q, k, v, g, beta, A_log, dt_bias, scale, lower_bound, l2norm, gate, beta_sigmoid, neg_eigval, states, rows):
        return v.new_empty(v.shape)

    @torch.library.register_fake("k3_kda::chunk_bwd")
    def _(q, k, v, g, beta, starts, do, dfinal, scale, chunk_size, seq_first, seq_last, num_seqs):
        H, K = q.shape[2:]
        new = [x.new_empty(x.shape) for x in (q, k, v, g, beta)]
        return (*new, q.new_empty(num_seqs, H, K, v.shape[-1]))


def choice() -> str:
    value = os.environ.get(ENV_VAR, "auto")
    if value not in CHOICES:
        raise ValueError(f"{ENV_VAR} must be one of {CHOICES}, got {value!r}")
    return value


# torch.compile reads these once while tracing (the build, the file reads and the environment stay out of the graph)
@torch.compiler.assume_constant_result
def _enabled() -> bool:
    return choice() == "auto" and _load()


@torch.compiler.assume_constant_result
def _loaded() -> bool:
    return _load()


def usable(x: torch.Tensor, chunk_size: int) -> bool:
    """Whether the kernel runs a chunked call on tensors like x (prepared: fp32 or fp64 on the CPU)."""
    if x.device.type != "cpu" or x.dtype not in (torch.float32, torch.float64) or chunk_size % ROW_BLOCK:
        return False
    return _enabled()


def describe() -> str:
    """One line for `k3 env`: which implementation the torch path's chunked KDA uses on the CPU, and why."""
    try:
        if choice() == "off":
            return f"PyTorch reference ({ENV_VAR}=off)"
    except ValueError as error:
        return f"error: {error}"
    if not _load():
        return f"PyTorch reference: {_status['reason']}"
    how = "built" if _status["built"] else "loaded"
    return f"C++ kernel ({how} in {_status['seconds']:.1f} s; cache {cache_dir()})"


def _require() -> None:
    if not _loaded():
        raise RuntimeError(f"k3's KDA CPU kernel is not available: {_status['reason']}")


def step_usable(q: torch.Tensor, v: torch.Tensor, states: torch.Tensor) -> bool:
    """Whether the kernel runs a decoding step (one token per sequence, states updated in place) on these: CPU,
    one dtype (fp32 or fp64) throughout, as many value heads as key heads, each state a contiguous block."""
    if q.device.type != "cpu" or q.dtype not in (torch.float32, torch.float64) or v.shape[2] != q.shape[2]:
        return False
    if states.dtype != q.dtype or states.dim() != 4 or not states[0].is_contiguous():
        return False
    return _enabled()


def recurrent_step(q, k, v, g, beta, A_log, dt_bias, scale, flags, states, rows) -> torch.Tensor:
    """fused_recurrent_kda's decoding step on the kernel: q, k, g (B, 1, H, K), v (B, 1, H, V), beta (B, 1, H),
    the raw inputs its flags describe; states (P, H, K, V) updated in place at rows (B,), or (B, H, K, V) with
    rows None. Returns o (B, 1, H, V)."""
    _require()
    dt = q.dtype

    def param(x: torch.Tensor | None) -> torch.Tensor | None:
        return None if x is None else x.detach().to(dt).reshape(-1).contiguous()

    o = torch.ops.k3_kda.recurrent_step(
        *(x.select(1, 0).to(dt) for x in (q, k, v, g, beta)),
        param(A_log) if flags.use_gate_in_kernel else None,
        param(dt_bias) if flags.use_gate_in_kernel else None,
        float(scale),
        flags.lower_bound,
        flags.use_qk_l2norm_in_kernel,
        flags.use_gate_in_kernel,
        flags.use_beta_sigmoid_in_kernel,
        flags.allow_neg_eigval,
        states,
        None if rows is None else rows.to(torch.int64).contiguous(),
    )
    return o.unsqueeze(1)


def _padded(x: torch.Tensor, T: int) -> torch.Tensor:
    """x (B, T0, ...) zero-padded in time to T (inputs.pad_time: neutral tokens), contiguous."""
    return (pad_time(x, T) if x.shape[1] != T else x).contiguous()


def _sequences(seq_chunks, NC: int, B: int, device) -> tuple[torch.Tensor | None, torch.Tensor | None, int]:
    """The operators' view of chunk_terms.sequence_chunks: per chunk, the packed sequence that starts / ends there
    (−1 elsewhere; None, None for one sequence per batch row), and the number of sequences."""
    if seq_chunks is None:
        return None, None, B
    _, starting, ending, _ = sequence_chunks(seq_chunks, NC, None, B, 0, 0, 0)
    first, last = (torch.full((NC,), -1, dtype=torch.int64, device=device) for _ in range(2))
    for out, at in ((first, starting), (last, ending)):
        out[list(at)] = torch.tensor(list(at.values()), dtype=torch.int64, device=device)
    return first, last, len(seq_chunks)


def chunk_fwd(q, k, v, g, beta, scale, initial_state, chunk_size, seq_chunks=None, keep_starts=True):
    """chunk.chunk_kda_fwd's contract, on the kernel: o (B, T, H, V), final (N, H, K, V), starts (B·H, NC, K, V)."""
    _require()
    B, T, H, K = q.shape
    C = chunk_size
    NC = -(-T // C)
    padded = [_padded(x, NC * C) for x in (q, k, v, g, beta)]
    first, last, N = _sequences(seq_chunks, NC, B, q.device)
    h0 = None if initial_state is None else initial_state.to(q.dtype).reshape(N, H, K, -1).contiguous()
    o, final, starts = torch.ops.k3_kda.chunk_fwd(*padded, float(scale), C, h0, first, last, N, keep_starts)
    return (o[:, :T] if NC * C != T else o), final, (starts if keep_starts else None)


def chunk_bwd(q, k, v, g, beta, starts, do, dfinal, scale, chunk_size, seq_chunks):
    """chunk_bwd.chunk_kda_bwd's contract, on the kernel: dq, dk, dv, dg, dβ in the inputs' shapes and dh0."""
    _require()
    B, T, H, K = q.shape
    C = chunk_size
    NC = starts.shape[1]
    padded = [_padded(x, NC * C) for x in (q, k, v, g, beta, do.to(q.dtype))]
    first, last, N = _sequences(seq_chunks, NC, B, q.device)
    dfinal = None if dfinal is None else dfinal.to(q.dtype).reshape(N, H, K, -1).contiguous()
    *grads, dh0 = torch.ops.k3_kda.chunk_bwd(
        *padded[:5], starts.contiguous(), padded[5], dfinal, float(scale), C, first, last, N
    )
    if NC * C != T:
        grads = [x[:, :T] for x in grads]
    return (*grads, dh0)
