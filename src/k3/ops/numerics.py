"""Precision helpers for the numerics that must not run in half precision (STYLE rule 6)."""

import torch


def at_least_fp32(x: torch.Tensor) -> torch.Tensor:
    """x in fp32 if it is fp16/bf16, unchanged otherwise (fp64 stays fp64, so tests can run in it)."""
    return x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
