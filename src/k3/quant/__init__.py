"""Quantisation: OCP microscaling (MX) codecs, the MXFP4-packed expert weight of the release, and the
quantisers of quantisation-aware training (MXFP4 weights, MXFP8 inputs). Below the model: nothing here
imports k3.model; the helpers that walk a model (pack_experts, set_expert_quantization, ...) are
k3.model.quantization's."""

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
from k3.quant.packed_experts import MXFP4Linear, PackedExpertTrainingError
from k3.quant.qat import fake_quantize, fake_quantize_ste

__all__ = [
    "BLOCK_SIZE",
    "FP4_E2M1",
    "FP8_E4M3",
    "FP8_E5M2",
    "ElementFormat",
    "MXFP4Linear",
    "PackedExpertTrainingError",
    "check_packed_mxfp4",
    "dequantize_mx",
    "fake_quantize",
    "fake_quantize_mx",
    "fake_quantize_ste",
    "pack_mxfp4",
    "quantize_mx",
    "unpack_mxfp4",
]
