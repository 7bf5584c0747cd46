"""Which implementation runs a KDA call: fla's Triton kernels or k3's PyTorch code.

One named switch, as in nanochat: the `backend` argument, else the K3_KDA_BACKEND environment
variable, else "auto". "auto" takes fla only where fla can compute what was asked: inputs on CUDA,
a tested fla version, not float64 (Triton has no fp64 path), and for the recurrent form no gradient
(fla's `fused_recurrent_kda` has no backward). Everywhere else it takes the torch path, which is always
available and can be forced, which is how tests compare the two. Asking for "fla" explicitly where it
cannot compute the call raises instead of silently doing something else.

The fla kernels are reached only through `kernels()`, the seam the tests use to install a stand-in
that enforces fla's input contract on a CPU (`use_kernels`).
"""

import contextlib
import functools
import importlib.metadata
import importlib.util
import os
import warnings
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import torch

BACKENDS = ("auto", "torch", "fla")
ENV_VAR = "K3_KDA_BACKEND"
# The fla releases whose KDA signatures and input contracts k3's dispatch was checked against
# (pyproject.toml's `cuda` extra pins the same range). Older releases swallow flags they do not
# know through **kwargs, e.g. use_beta_sigmoid_in_kernel, and compute a different function.
FLA_TESTED = ((0, 6, 0), (0, 7, 0))  # [low, high)


class KernelContractError(RuntimeError):
    """Inputs that break fla's kernel contract reached it: a k3 dispatch bug, never a user error."""


def fla_version() -> str | None:
    """The installed flash-linear-attention version, or None."""
    try:
        return importlib.metadata.version("flash-linear-attention")
    except importlib.metadata.PackageNotFoundError:
        return None


def _parse(version: str) -> tuple[int, ...]:
    parts = []
    for piece in version.split(".")[:3]:
        digits = "".join(ch for ch in piece if ch.isdigit()) or "0"
        parts.append(int(digits))
        if not piece.isdigit():
            break
    return tuple(parts + [0] * (3 - len(parts)))


def fla_version_tested(version: str | None) -> bool:
    return version is not None and FLA_TESTED[0] <= _parse(version) < FLA_TESTED[1]


def _range() -> str:
    lo, hi = (".".join(map(str, v)) for v in FLA_TESTED)
    return f">={lo},<{hi}"


@functools.cache
def fla_kda() -> ModuleType | None:
    """fla.ops.kda, or None when it (or Triton) is not importable or its version is untested; an
    untested version is reported once with a warning and the torch path is used."""
    version = fla_version()
    if version is None:
        return None
    if not fla_version_tested(version):
        warnings.warn(
            f"flash-linear-attention {version} is outside the range k3 is tested with ({_range()}); KDA runs on "
            f"k3's PyTorch path. Install flash-linear-attention{_range()} for fla's kernels.",
            RuntimeWarning,
            stacklevel=2,
        )
        return None
    try:
        import fla.ops.kda as mod
    except Exception:  # ImportError, or Triton failing to find a GPU driver at import time
        return None
    return mod


# A stand-in for fla's kernels (tests only) and the device type it accepts.
_override: tuple[ModuleType, str] | None = None


@contextlib.contextmanager
def use_kernels(module: ModuleType, device_type: str = "cpu") -> Iterator[None]:
    """Route k3's fla dispatch to `module` (with fla.ops.kda's functions and
    `fused_recurrent.fused_recurrent_kda_fwd`) for tensors on `device_type`. Tests install a stand-in
    that checks fla's input contract this way, so the dispatch is exercised without a GPU."""
    global _override
    previous, _override = _override, (module, device_type)
    try:
        yield
    finally:
        _override = previous


def kernels() -> ModuleType | None:
    """The fla.ops.kda module the dispatch calls (or the tests' stand-in), None without one."""
    return _override[0] if _override is not None else fla_kda()


def kernel_device_type() -> str:
    return _override[1] if _override is not None else "cuda"


def resolve(backend: str | None, x: torch.Tensor, needs_grad: bool = False, op: str = "chunk_kda") -> str:
    """'torch' or 'fla' for a call whose inputs live where x lives.

    needs_grad: the call must be differentiable (autograd is recording and an input requires grad);
    only op 'fused_recurrent_kda' lacks a backward in fla."""
    choice = backend if backend is not None else os.environ.get(ENV_VAR, "auto")
    if choice not in BACKENDS:
        source = "backend" if backend is not None else ENV_VAR
        raise ValueError(f"{source} must be one of {BACKENDS}, got {choice!r}")
    if choice == "torch":
        return "torch"
    reason = _why_not_fla(x, needs_grad and op == "fused_recurrent_kda", op)
    if choice == "auto":
        return "torch" if reason else "fla"
    if reason:
        source = "backend='fla'" if backend is not None else f"{ENV_VAR}=fla"
        raise ValueError(f"{source} cannot run {op} here: {reason}; use backend 'auto' or 'torch'")
    return "fla"


def _why_not_fla(x: torch.Tensor, needs_grad: bool, op: str) -> str | None:
    device_type = kernel_device_type()
    if x.device.type != device_type:
        return f"fla's Triton kernels run on {device_type} tensors and these are on {x.device}"
    if kernels() is None:
        version = fla_version()
        if version is None:
            return "flash-linear-attention is not installed (pip install 'k3[cuda]')"
        if not fla_version_tested(version):
            return f"flash-linear-attention {version} is outside the tested range {_range()}"
        return f"fla.ops.kda {version} does not import (Triton or the GPU driver is missing)"
    if x.dtype == torch.float64:
        return "float64 inputs (Triton has no fp64 kernels; the torch path computes them in fp64)"
    if needs_grad:
        return f"gradients were asked for and fla's {op} has no backward"
    return None


def describe(device: torch.device | str) -> str:
    """The backend 'auto' picks for fp32 inputs on `device`, with the reason when it is the torch path;
    for `k3 env`. Never raises: a K3_KDA_BACKEND that cannot apply is reported as such."""
    x = torch.empty(0, device=device)
    try:
        chosen = resolve(None, x)
    except ValueError as error:
        return f"error: {error}"
    if chosen == "fla":
        return f"fla {fla_version()} (Triton)"
    why = _why_not_fla(x, False, "chunk_kda")
    return "torch" + (f" ({why})" if why and os.environ.get(ENV_VAR, "auto") == "auto" else "")


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


def on_device(x: torch.Tensor) -> contextlib.AbstractContextManager:
    """Make x's CUDA device current while a kernel is launched (Triton launches on the current device,
    not on the tensors'); a no-op elsewhere."""
    return torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext()
