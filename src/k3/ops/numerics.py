"""Precision helpers for the numerics that must not run in half precision (STYLE rule 6)."""

import torch


def at_least_fp32(x: torch.Tensor) -> torch.Tensor:
    """x in fp32 if it is fp16/bf16, unchanged otherwise (fp64 stays fp64, so tests can run in it)."""
    return x.float() if x.dtype in (torch.float16, torch.bfloat16) else x


def inverse_norm(xf: torch.Tensor, eps: float, mean: bool = False) -> torch.Tensor:
    """(..., D) -> (..., 1): 1/sqrt(Σx² + eps), or 1/sqrt(mean(x²) + eps) with mean=True (RMSNorm's).
    vector_norm reads x once and allocates no x² (half the time of pow + sum on a CPU); squaring the
    norm costs one rounding."""
    sq = torch.linalg.vector_norm(xf, dim=-1, keepdim=True).square_()
    return (sq.div_(xf.shape[-1]) if mean else sq).add_(eps).rsqrt_()
