"""Quantisation-aware training of the routed experts (SPEC §2.8): MXFP4 weights, MXFP8 (E4M3) inputs.

    Expert(z) = W2q · act(W1q · zq, W3q · zq)q        Wq = MXFP4(W)   xq = MXFP8_E4M3(x)   (blocks of 32
                                                                                           along the reduction)

in the forward pass; the backward passes every gradient straight through each quantiser (d xq / d x = 1).
The master weights stay what they are (fp32 on CPU). LatentMoE.experts_forward applies this when the
model's config says `expert_quantization="mxfp4"`, for dense experts (training: the weights are fake-quantised
on every forward) and for MXFP4-packed ones (serving: the weights are the packed bytes, dequantised), so a
QAT model and its packed export compute the same function, bitwise: the fake-quantised weight equals
dequant(pack(W)) value for value, and the inputs go through the same quantiser in both.

`fake_quantize` here is a faster route to exactly `k3.quant.mx.fake_quantize_mx` (tested bitwise on values
spanning every binade, subnormals, ties, saturation, ±0, NaN and inf): instead of the codec's float64
encode to codes and decode back, it rounds each value to its element grid in place, in float32 (float64 for
float64), reading exponents from the bits. Every step is exact there: the block scale and the element ulp
are powers of two, a value divided by the scale stays inside float32's range, adding 2^(binade + 23 − m)
rounds to m mantissa bits (ties to even) and subtracting it is exact, and the element times its scale (down
to 2^-136 for E4M3 at the smallest scale) is a float32 value, normal or subnormal.
"""

import torch

from k3.quant.mx import BLOCK_SIZE, E8M0_BIAS, FP4_E2M1, FP8_E4M3, ElementFormat, _check_blocks, _check_float
from k3.quant.packed_experts import MXFP4Linear

WEIGHT_FORMAT = FP4_E2M1
INPUT_FORMAT = FP8_E4M3


# float dtype -> (the integer type of its bits, mantissa bits, exponent bias)
FLOAT_BITS = {torch.float32: (torch.int32, 23, 127), torch.float64: (torch.int64, 52, 1023)}


def fake_quantize(x: torch.Tensor, fmt: ElementFormat) -> torch.Tensor:
    """x (..., N), N a multiple of 32 -> the same shape and dtype: each value replaced by its MX
    quantise-dequantise in `fmt` (bitwise k3.quant.mx.fake_quantize_mx; module docstring)."""
    _check_float(x, "fake_quantize input")
    _check_blocks(x.shape[-1] if x.dim() else 0, f"fake_quantize input of shape {list(x.shape)}")
    compute = torch.float64 if x.dtype == torch.float64 else torch.float32
    int_type, mantissa, bias = FLOAT_BITS[compute]
    blocks = x.to(compute).unflatten(-1, (-1, BLOCK_SIZE))  # (..., N/32, 32)
    magnitude = blocks.abs()
    amax = magnitude.amax(-1, keepdim=True)  # (..., N/32, 1); NaN propagates: one isfinite catches NaN and inf
    # floor(log2 amax) is the exponent field minus the bias; a zero or subnormal amax reads lower than
    # -127 - emax and is clamped to the smallest scale, which is the codec's rule for both
    shared = ((amax.view(int_type) >> mantissa) - (bias + fmt.emax)).clamp(-E8M0_BIAS, E8M0_BIAS)
    inverse = ((bias - shared) << mantissa).view(compute)  # 2^-shared, a normal number for every finite x
    # 2^shared (2^-127 is a float32 subnormal). A NaN or ±inf in the block makes its scale NaN, so the whole
    # block dequantises to NaN, as the codec's NaN scale byte does.
    scale = torch.where(shared > -bias, (shared + bias) << mantissa, 1 << (mantissa - 1)).view(compute)
    scale = torch.where(torch.isfinite(amax), scale, torch.nan)
    a = (magnitude * inverse).clamp(max=fmt.max)  # exact; saturated first (max is on the grid)
    # Round to the element grid: adding 2^(e + mantissa - m), e the value's binade (subnormals: emin's), leaves
    # exactly the grid's bits, rounded to nearest, ties to even; subtracting it back is exact.
    binade = (a.view(int_type) >> mantissa).clamp(min=fmt.emin + bias)
    magic = ((binade + (mantissa - fmt.mantissa_bits)) << mantissa).view(compute)
    q = torch.copysign((a + magic) - magic, blocks) * scale  # −0 stays −0
    return q.flatten(-2).to(x.dtype)


class _StraightThrough(torch.autograd.Function):
    """y = fake_quantize(x), dy/dx = 1."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, fmt: ElementFormat) -> torch.Tensor:
        return fake_quantize(x, fmt)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def fake_quantize_ste(x: torch.Tensor, fmt: ElementFormat) -> torch.Tensor:
    """fake_quantize with a straight-through gradient (the identity) for quantisation-aware training."""
    return _StraightThrough.apply(x, fmt)


def quantized_input(x: torch.Tensor) -> torch.Tensor:
    """x (..., N) -> its MXFP8 E4M3 fake quantisation, straight-through: what an expert's matmul reads."""
    return fake_quantize_ste(x, INPUT_FORMAT)


def quantized_weight(layer: torch.nn.Module) -> torch.Tensor:
    """(out, in) the MXFP4 weight an expert projection computes with: a packed layer's dequantised bytes
    (k3.quant.MXFP4Linear) or a dense layer's weight fake-quantised, straight-through to the master weight.
    The two are equal value for value when the bytes are pack_mxfp4 of the weight."""
    if isinstance(layer, MXFP4Linear):
        return layer.weight
    return fake_quantize_ste(layer.weight, WEIGHT_FORMAT)
