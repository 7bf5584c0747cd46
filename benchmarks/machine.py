"""What every benchmark prints about the machine: the CPU model and the extensions its ratios move with."""

import platform
from pathlib import Path

EXTENSIONS = ("avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16")


def cpu() -> str:
    """'model name (extensions)' from /proc/cpuinfo, or the platform's name where there is none (macOS, Windows)."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    name = next((line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")), "")
    flags = next((line.split(":", 1)[1].split() for line in info.splitlines() if line.startswith("flags")), [])
    ext = [x for x in EXTENSIONS if x in flags]
    return f"{name or platform.machine()} ({', '.join(ext) or 'no AVX2'})"
