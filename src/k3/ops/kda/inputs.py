"""Checking and preparing KDA inputs, shared by the chunked and the recurrent entry points.

Layouts follow fla.ops.kda: q, k (B, T, H, K); v (B, T, HV, V); g (B, T, HV, K); beta (B, T, HV);
states (N, HV, K, V) with N = B, or the number of packed sequences when cu_seqlens is given.
HV is a multiple of H (grouped value heads).
"""

import itertools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from k3.ops.kda.gate import check_lower_bound, kda_gate, l2norm


@dataclass(frozen=True)
class KDAFlags:
    """The in-kernel options of fla's KDA entry points; the torch path applies them up front."""

    use_qk_l2norm_in_kernel: bool = False
    use_gate_in_kernel: bool = False
    use_beta_sigmoid_in_kernel: bool = False
    allow_neg_eigval: bool = False
    safe_gate: bool = False
    lower_bound: float | None = None


def _shape(x: torch.Tensor) -> str:
    return str(list(x.shape))


def check_inputs(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None,
    cu_seqlens: torch.Tensor | None,
    flags: KDAFlags,
    A_log: torch.Tensor | None,
    dt_bias: torch.Tensor | None,
    cu_seqlens_cpu: torch.Tensor | None = None,
) -> None:
    """Raise ValueError naming the offending tensor and the shape, dtype or device it should have."""
    named = {"q": q, "k": k, "v": v, "g": g, "beta": beta}
    for name, x in named.items():
        if not isinstance(x, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
        if not x.is_floating_point():
            raise ValueError(f"{name} must be a floating-point tensor, got dtype {x.dtype}")
    if q.dim() != 4:
        raise ValueError(f"q must be [B, T, H, K] (4 dims), got shape {_shape(q)}")
    B, T, H, K = q.shape
    if k.shape != q.shape:
        raise ValueError(f"k must have the shape of q [B, T, H, K] = {_shape(q)}, got {_shape(k)}")
    if v.dim() != 4 or v.shape[:2] != q.shape[:2]:
        raise ValueError(f"v must be [B, T, HV, V] = [{B}, {T}, HV, V], got shape {_shape(v)}")
    HV, V = v.shape[2], v.shape[3]
    if H == 0 or HV % H:
        raise ValueError(f"v's head count HV = {HV} must be a positive multiple of q's H = {H}")
    if g.shape != (B, T, HV, K):
        raise ValueError(f"g must be [B, T, HV, K] = {[B, T, HV, K]}, got shape {_shape(g)}")
    if beta.shape != (B, T, HV):
        raise ValueError(f"beta must be [B, T, HV] = {[B, T, HV]}, got shape {_shape(beta)}")
    devices = {x.device for x in named.values()}
    if len(devices) > 1:
        raise ValueError(f"q, k, v, g, beta must be on one device, got {sorted(map(str, devices))}")

    N = B
    if cu_seqlens is not None:
        if B != 1:
            raise ValueError(f"with cu_seqlens the batch must be packed into B = 1, got B = {B}")
        if cu_seqlens.dim() != 1 or cu_seqlens.dtype not in (torch.int32, torch.int64) or len(cu_seqlens) < 2:
            raise ValueError(
                f"cu_seqlens must be a 1-D int32/int64 tensor [N+1], got {cu_seqlens.dtype} {_shape(cu_seqlens)}"
            )
        if cu_seqlens.device != q.device:
            raise ValueError(f"cu_seqlens must be on q's device {q.device}, got {cu_seqlens.device}")
        cpu_copy = cu_seqlens_cpu
        if cpu_copy is not None and (cpu_copy.device.type != "cpu" or cpu_copy.shape != cu_seqlens.shape):
            raise ValueError(
                f"cu_seqlens_cpu must be cu_seqlens's copy on the CPU, shape {_shape(cu_seqlens)}; got "
                f"{_shape(cu_seqlens_cpu)} on {cu_seqlens_cpu.device}"
            )
        bounds = (cu_seqlens if cu_seqlens_cpu is None else cu_seqlens_cpu).tolist()
        if bounds[0] != 0 or bounds[-1] != T or any(b > a for a, b in zip(bounds[1:], bounds[:-1], strict=True)):
            raise ValueError(f"cu_seqlens must rise from 0 to T = {T} without decreasing, got {bounds}")
        N = len(bounds) - 1
    elif cu_seqlens_cpu is not None:
        raise ValueError("cu_seqlens_cpu is the CPU copy of cu_seqlens: pass cu_seqlens too")
    if initial_state is not None and initial_state.device != q.device:
        raise ValueError(f"initial_state must be on q's device {q.device}, got {initial_state.device}")
    if initial_state is not None and initial_state.shape != (N, HV, K, V):
        what = "number of sequences" if cu_seqlens is not None else "batch size"
        raise ValueError(
            f"initial_state must be [N, HV, K, V] = {[N, HV, K, V]} (N = {what}), got {_shape(initial_state)}"
        )

    check_lower_bound(flags.lower_bound)
    if flags.allow_neg_eigval and not flags.use_beta_sigmoid_in_kernel:
        raise ValueError("allow_neg_eigval=True needs use_beta_sigmoid_in_kernel=True (beta becomes 2·sigmoid)")
    if flags.use_gate_in_kernel:
        if A_log is None and flags.lower_bound is None:
            raise ValueError("use_gate_in_kernel=True needs A_log (or a lower_bound for the bounded gate)")
        if flags.safe_gate and flags.lower_bound is None:
            raise ValueError("safe_gate=True with use_gate_in_kernel=True needs lower_bound in [-5, 0)")
        for name, x in (("A_log", A_log), ("dt_bias", dt_bias)):
            if x is not None and x.device != q.device:
                raise ValueError(f"{name} must be on q's device {q.device}, got {x.device}")
        if A_log is not None and A_log.numel() != HV:
            raise ValueError(f"A_log must have HV = {HV} elements, got shape {_shape(A_log)}")
        if dt_bias is not None and dt_bias.numel() != HV * K:
            raise ValueError(f"dt_bias must have HV*K = {HV * K} elements, got shape {_shape(dt_bias)}")


def compute_dtype(*xs: torch.Tensor | None) -> torch.dtype:
    """fp64 when any input is fp64 (the tests' reference precision), fp32 otherwise: bf16 and fp16
    inputs are upcast, the state and the decay products never live in half precision."""
    return torch.float64 if any(x is not None and x.dtype == torch.float64 for x in xs) else torch.float32


def prepare(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None,
    flags: KDAFlags,
    A_log: torch.Tensor | None,
    dt_bias: torch.Tensor | None,
) -> tuple[torch.Tensor, ...]:
    """Apply the in-kernel flags in PyTorch, expand q/k to the value heads, cast to the compute dtype.

    Returns q, k, v, g, beta, initial_state with q, k: (B, T, HV, K).
    """
    dt = compute_dtype(q, k, v, g, beta, initial_state)
    q, k, v, g, beta = (x.to(dt) for x in (q, k, v, g, beta))
    if flags.use_qk_l2norm_in_kernel:
        q, k = l2norm(q), l2norm(k)
    if flags.use_gate_in_kernel:
        g = kda_gate(g, A_log, dt_bias, flags.lower_bound).to(dt)
    if flags.use_beta_sigmoid_in_kernel:
        # no product by 1.0 in the usual case: it was one more pass and fresh tensor, and a MulBackward
        beta = torch.sigmoid(beta) * 2.0 if flags.allow_neg_eigval else torch.sigmoid(beta)
    groups = v.shape[2] // q.shape[2]
    if groups > 1:
        q, k = q.repeat_interleave(groups, dim=2), k.repeat_interleave(groups, dim=2)
    h0 = None if initial_state is None else initial_state.to(dt)
    return q, k, v, g, beta, h0


def seq_bounds(cu_seqlens: torch.Tensor) -> list[tuple[int, int]]:
    """[(start, end)] token ranges of the packed sequences."""
    b = cu_seqlens.tolist()
    return list(itertools.pairwise(b))


def pad_time(x: torch.Tensor, T: int) -> torch.Tensor:
    """Zero-pad dim 1 of (B, t, ...) to length T. Zeros are neutral for KDA: g = 0 keeps the state,
    β = 0 and k = 0 write nothing."""
    return F.pad(x, (0, 0) * (x.dim() - 2) + (0, T - x.shape[1]))
