"""The compute dtype by capability: `dtype="auto"` picks bfloat16 where this machine runs bf16 matmuls faster.

CPUs differ by orders of magnitude here: an AMD Zen 3 without AVX512-BF16 ran bf16 matmuls 80-400× slower
than fp32 (no native instruction: every product is converted), a Zen 4 with AVX512-BF16 ran them ~2.7× faster
and an Intel Xeon with AMX 5-7× faster. So the choice is measured, never assumed:

- on a CPU, bf16 needs a native bf16 dot product in the CPU's flags (`avx512_bf16` or `amx_bf16`) and a
  measured bf16 matmul rate at least `SPEEDUP`× the fp32 one, on a (64 × 1024) · (1024 × 1024) product (a
  decode batch through a projection); the rates are measured once per machine, torch version and thread count
  and kept in `$K3_CACHE_DIR/compute_dtype.json` (default `~/.cache/k3`), so a later start decides the same way
  without measuring;
- on CUDA, bf16 where the device supports it (`torch.cuda.is_bf16_supported()`).

What runs in bf16 is the weights and activations; KDA's recurrent state, the norms' statistics, the softmax,
the experts' and attention's sums stay fp32 (the pool keeps KDA states in fp32 whatever its dtype). At batch 1
a bf16 product is a matrix-vector product, where bf16 saves memory traffic but oneDNN's kernels may not gain:
`DtypeChoice.reason` says what was measured, and docs/serving.md what that means for latency.
"""

import functools
import hashlib
import json
import os
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from k3.ops.compile_cache import cache_root
from k3.ops.cpu_library import cpu_signature

SPEEDUP = 1.5  # bf16 must measure at least this much faster than fp32 to be chosen
SHAPE = (64, 1024, 1024)  # (m, k, n) of the measured product
NAMES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64, "float16": torch.float16}
CHOICES = ("auto", "float32", "bfloat16")  # what --dtype offers (k3 serve, k3 generate)
NATIVE_BF16 = ("avx512_bf16", "amx_bf16")  # x86 flags of a bf16 dot-product instruction


@dataclass(frozen=True)
class DtypeChoice:
    """What `dtype` resolved to, and why (the measured rates in GFLOP/s where it was measured)."""

    dtype: torch.dtype
    reason: str
    fp32_gflops: float | None = None
    bf16_gflops: float | None = None

    def __str__(self) -> str:
        return f"{str(self.dtype).removeprefix('torch.')} ({self.reason})"


def parse_dtype(value: "str | torch.dtype") -> "torch.dtype | str":
    """A dtype as users write it: "auto", a name ("bfloat16", "bf16", "float32", "fp32", ...) or a torch.dtype;
    a ValueError naming the choices otherwise."""
    if isinstance(value, torch.dtype):
        if value not in NAMES.values():
            raise ValueError(f"dtype {value} is not one of {', '.join(NAMES)}")
        return value
    name = {"bf16": "bfloat16", "fp32": "float32", "fp64": "float64", "fp16": "float16", "half": "float16"}.get(
        str(value), str(value)
    )
    if name == "auto":
        return "auto"
    if name not in NAMES:
        raise ValueError(f"dtype must be auto or one of {', '.join(NAMES)}, got {value!r}")
    return NAMES[name]


def resolve_dtype(value: "str | torch.dtype", device: "str | torch.device" = "cpu") -> DtypeChoice:
    """`value` as a DtypeChoice: "auto" decided for `device` (module docstring), anything else as given."""
    dtype = parse_dtype(value)
    if dtype != "auto":
        return DtypeChoice(dtype, "as asked")
    device = torch.device(device)
    if device.type == "cuda":
        if torch.cuda.is_bf16_supported():
            return DtypeChoice(torch.bfloat16, "auto: the CUDA device supports bf16")
        return DtypeChoice(torch.float32, "auto: the CUDA device does not support bf16")
    if device.type != "cpu":
        return DtypeChoice(torch.float32, f"auto: no measurement for {device.type}, fp32")
    flags = _cpu_flags()
    if flags is not None and not flags & set(NATIVE_BF16):
        return DtypeChoice(torch.float32, f"auto: this CPU lists no native bf16 instruction ({', '.join(NATIVE_BF16)})")
    fp32, bf16 = matmul_rates()
    ratio = bf16 / fp32
    verdict = "≥" if ratio >= SPEEDUP else "<"
    reason = (
        f"auto: bf16 matmul {bf16:.0f} GFLOP/s = {ratio:.2f}× fp32's {fp32:.0f} {verdict} {SPEEDUP}× "
        f"({torch.get_num_threads()} threads)"
    )
    return DtypeChoice(torch.bfloat16 if ratio >= SPEEDUP else torch.float32, reason, fp32, bf16)


def _cpu_flags() -> set[str] | None:
    """The CPU's flags from /proc/cpuinfo, or None where it cannot be read (then only the measurement decides)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return None


def _cache_file() -> Path:
    return cache_root() / "compute_dtype.json"


@functools.cache
def matmul_rates() -> tuple[float, float]:
    """(fp32, bf16) GFLOP/s of SHAPE's product on this CPU with the current thread count: read from the cache
    file when this machine, torch version and thread count were measured before, else measured (~0.5 s)."""
    machine = hashlib.sha256(cpu_signature().encode()).hexdigest()[:16]
    key = f"cpu {machine}, torch {torch.__version__}, {torch.get_num_threads()} threads, {SHAPE}"
    path = _cache_file()
    try:
        known = json.loads(path.read_text())
    except (OSError, ValueError):
        known = {}
    if not isinstance(known, dict):
        known = {}
    entry = known.get(key)
    if isinstance(entry, dict) and {"fp32_gflops", "bf16_gflops"} <= entry.keys():
        return float(entry["fp32_gflops"]), float(entry["bf16_gflops"])
    rates = _measure(torch.float32), _measure(torch.bfloat16)
    known[key] = {"fp32_gflops": rates[0], "bf16_gflops": rates[1]}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(known, indent=1))
        tmp.replace(path)  # whole or not at all: a concurrent start reads the old file or the new one
    except OSError:
        pass  # a read-only home: measured again next time
    return rates


def _measure(dtype: torch.dtype, reps: int = 5) -> float:
    """GFLOP/s of SHAPE's product in dtype: the median of `reps` timings of enough products to take ~20 ms."""
    m, k, n = SHAPE
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(m, k, generator=gen).to(dtype), torch.randn(k, n, generator=gen).to(dtype)
    a @ b  # oneDNN builds its kernel on the first call
    start = time.perf_counter()
    a @ b
    once = max(time.perf_counter() - start, 1e-6)
    count = max(1, min(200, int(0.02 / once)))
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        for _ in range(count):
            a @ b
        times.append((time.perf_counter() - start) / count)
    return 2 * m * k * n / statistics.median(times) / 1e9
