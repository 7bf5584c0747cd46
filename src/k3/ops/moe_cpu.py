"""The routed experts of a serving step on k3's C++ CPU library (csrc/moe_experts_cpu.cpp, `k3_cpu::moe_experts`):
what k3.model.moe's `moe_experts` operator runs on the CPU where the library loads (k3.ops.cpu_library); its
PyTorch path, LatentMoE.dispatch's, is the reference and the fallback."""

import functools

import torch

from k3.ops import cpu_library


def usable(z: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether the kernel runs experts on inputs like z with weights like w: CPU, fp32 or fp64, one dtype. Plain
    comparisons and a cached load, so a compiled graph reads the answer once while tracing."""
    return z.device.type == "cpu" and z.dtype in (torch.float32, torch.float64) and w.dtype == z.dtype and _loaded()


@torch.compiler.assume_constant_result  # read once while tracing: the build and the load stay out of a graph
def _loaded() -> bool:
    if not cpu_library.load():
        return False
    _register_fake()
    return True


@functools.cache
def _register_fake() -> None:
    """The operator's fake kernel, so that a compiled graph calls k3_cpu::moe_experts as one node."""

    @torch.library.register_fake("k3_cpu::moe_experts")
    def _(z, experts, weights, w1, w3, w2, act, beta1, beta2):
        return torch.empty_like(z)


def moe_experts(
    z_TL: torch.Tensor,
    experts_TK: torch.Tensor,
    weights_TK: torch.Tensor,
    w1: list[torch.Tensor],
    w3: list[torch.Tensor],
    w2: list[torch.Tensor],
    act: str,
    beta1: float,
    beta2: float,
) -> torch.Tensor:
    """u_TL (T, L) = Σ_k weights_tk · Expert_{experts_tk}(z_t), expert e's weights w1[e], w3[e] (I, L) and w2[e]
    (L, I); act "situ" (β₁, β₂) or "silu"."""
    return torch.ops.k3_cpu.moe_experts(
        z_TL.contiguous(),
        experts_TK.to(torch.int64).contiguous(),
        weights_TK.to(z_TL.dtype).contiguous(),
        [w.contiguous() for w in w1],
        [w.contiguous() for w in w3],
        [w.contiguous() for w in w2],
        act,
        float(beta1),
        float(beta2),
    )
