"""The routed experts of a serving step on k3's C++ CPU library: what k3.model.moe's `moe_experts` and
`moe_experts_mxfp4` operators run on the CPU where the library loads (k3.ops.cpu_library). Dense weights go to
`k3_cpu::moe_experts` (csrc/moe_experts_cpu.cpp), MXFP4-packed ones to `k3_cpu::moe_experts_mxfp4`
(csrc/moe_experts_mxfp4_cpu.cpp), which reads the packed bytes as they are. The PyTorch path, LatentMoE.dispatch's,
is the reference and the fallback."""

import functools

import torch

from k3.ops import cpu_library

DTYPES = (torch.float32, torch.float64, torch.bfloat16)  # the dense kernel's (bf16: ATen's matmul, fp32 sums)


def usable(z: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether the kernel runs experts on inputs like z with weights like w: CPU, fp32, fp64 or bf16, one dtype.
    Plain comparisons and a cached load, so a compiled graph reads the answer once while tracing."""
    return z.device.type == "cpu" and z.dtype in DTYPES and w.dtype == z.dtype and _loaded()


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

    @torch.library.register_fake("k3_cpu::moe_experts_mxfp4")
    def _(z, experts, weights, p1, s1, p3, s3, p2, s2, act, beta1, beta2, quantize_inputs):
        return torch.empty_like(z)

    @torch.library.register_fake("k3_cpu::moe_experts_mxfp4_layer")
    def _(z, experts, weights, handle, act, beta1, beta2, quantize_inputs):
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


def usable_packed(z: torch.Tensor) -> bool:
    """Whether the MXFP4 kernel runs experts on inputs like z: CPU, fp32 or fp64 (the packed bytes are uint8)."""
    return z.device.type == "cpu" and z.dtype in (torch.float32, torch.float64) and _loaded()


def moe_experts_mxfp4(
    z_TL: torch.Tensor,
    experts_TK: torch.Tensor,
    weights_TK: torch.Tensor,
    packed: list[list[torch.Tensor]],
    act: str,
    beta1: float,
    beta2: float,
    quantize_inputs: bool,
) -> torch.Tensor:
    """moe_experts for MXFP4-packed experts: packed holds six lists (w1's bytes and scales, w3's, w2's), one
    tensor per expert each, as k3.quant.MXFP4Linear keeps them; quantize_inputs: every expert matmul reads its
    input as MXFP8 E4M3 (expert_quantization "mxfp4")."""
    return torch.ops.k3_cpu.moe_experts_mxfp4(
        z_TL.contiguous(),
        experts_TK.to(torch.int64).contiguous(),
        weights_TK.to(z_TL.dtype).contiguous(),
        *packed,  # as MXFP4Linear holds them, contiguous (the kernel checks)
        act,
        float(beta1),
        float(beta2),
        bool(quantize_inputs),
    )


def set_packed_experts(handle: int, packed: list[list[torch.Tensor]]) -> bool:
    """Keep a layer's packed experts (moe_experts_mxfp4's six lists) in the kernel under `handle`, for
    `k3_cpu::moe_experts_mxfp4_layer`, which a compiled graph calls with the handle alone; replaces what the
    handle held. False (nothing kept) where the kernel does not run: the tensors are not on the CPU, or the
    library did not load."""
    if packed[0][0].device.type != "cpu" or not _loaded():
        return False
    torch.ops.k3_cpu.set_packed_experts(handle, *packed)
    return True


def drop_packed_experts(handle: int) -> None:
    """Release what set_packed_experts kept under `handle` (nothing if it holds nothing)."""
    if cpu_library.load():
        torch.ops.k3_cpu.drop_packed_experts(handle)
