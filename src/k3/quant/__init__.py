"""Quantisation: OCP microscaling (MX) codecs, the MXFP4-packed routed experts of the release, and
quantisation-aware training of the routed experts (MXFP4 weights, MXFP8 inputs)."""

from k3.quant.mx import (
    BLOCK_SIZE,
    FP4_E2M1,
    FP8_E4M3,
    FP8_E5M2,
    ElementFormat,
    check_packed_mxfp4,
    dequantize_mx,
    fake_quantize_mx,
    pack_mxfp4,
    quantize_mx,
    unpack_mxfp4,
)
from k3.quant.packed_experts import (
    MXFP4Linear,
    PackedExpertTrainingError,
    allocate_packed_experts,
    pack_experts,
    routed_expert_bytes,
    routed_expert_numel,
    unpack_experts,
)
from k3.quant.qat import fake_quantize, fake_quantize_ste, set_expert_quantization

__all__ = [
    "BLOCK_SIZE",
    "FP4_E2M1",
    "FP8_E4M3",
    "FP8_E5M2",
    "ElementFormat",
    "MXFP4Linear",
    "PackedExpertTrainingError",
    "allocate_packed_experts",
    "check_packed_mxfp4",
    "dequantize_mx",
    "fake_quantize",
    "fake_quantize_mx",
    "fake_quantize_ste",
    "pack_experts",
    "pack_mxfp4",
    "quantize_mx",
    "routed_expert_bytes",
    "routed_expert_numel",
    "set_expert_quantization",
    "unpack_experts",
    "unpack_mxfp4",
]
