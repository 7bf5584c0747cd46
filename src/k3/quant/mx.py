"""OCP Microscaling (MX v1.0) block formats, and the MXFP4 packing of the released K3 checkpoint.

A block is 32 consecutive values of the last (reduction) dimension. They share one E8M0 scale X (a bare
power of two, byte s meaning 2^(s − 127)) and each keeps a small float element P_i (FP4 E2M1, FP8 E4M3
or FP8 E5M2):

    X   = 2^(floor(log2 max_i |v_i|) − emax_elem)          (the OCP rule: amax lands in [2^emax, 2^(emax+1)))
    P_i = RNE_elem(v_i / X), saturated to ±max_elem        v_i ≈ X · P_i

Choices the spec leaves to the implementation, fixed here (docs/quantization.md):
- an all-zero block gets the smallest scale, 2^-127 (byte 0x00): floor(log2 0) = −inf is clamped to E8M0's
  range like any other too-small exponent. The shared exponent is clamped to −127..127; below −127 the
  elements lose their small bits (rounded in the element format), above 127 (only float64 input ≥ 2^129
  gets there) they saturate.
- a block holding a NaN or ±inf gets the NaN scale (byte 0xFF) and all-zero element codes, so the whole
  block dequantises to NaN (OCP: a NaN scale makes every value of its block NaN). No error is raised, so
  fake quantisation inside a training step behaves like any other op on a non-finite tensor.
- a negative value that rounds to zero keeps its sign (code 0b1000, −0), as an IEEE conversion does.

Every step is exact arithmetic in float64 (power-of-two scalings, frexp for exponents, torch.round for
ties-to-even), so the codes do not depend on the input dtype's rounding: the codec is its own reference.
"""

from dataclasses import dataclass
from functools import cache

import torch

BLOCK_SIZE = 32
E8M0_BIAS = 127
E8M0_NAN = 0xFF
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


@dataclass(frozen=True)
class ElementFormat:
    """A sign-exponent-mantissa element format. Codes whose magnitude would exceed `max` are special:
    NaN, or ±inf when `has_inf` and the mantissa field is zero (E5M2's IEEE-style top exponent)."""

    name: str
    exponent_bits: int
    mantissa_bits: int
    bias: int
    max: float  # largest finite magnitude
    has_inf: bool = False

    @property
    def emax(self) -> int:
        """Exponent of the largest normal binade: floor(log2 max)."""
        return int(self.max).bit_length() - 1

    @property
    def emin(self) -> int:
        """Exponent of the smallest normal binade; subnormals share its ulp."""
        return 1 - self.bias

    @property
    def bits(self) -> int:
        return 1 + self.exponent_bits + self.mantissa_bits


FP4_E2M1 = ElementFormat("fp4_e2m1", exponent_bits=2, mantissa_bits=1, bias=1, max=6.0)
FP8_E4M3 = ElementFormat("fp8_e4m3", exponent_bits=4, mantissa_bits=3, bias=7, max=448.0)
FP8_E5M2 = ElementFormat("fp8_e5m2", exponent_bits=5, mantissa_bits=2, bias=15, max=57344.0, has_inf=True)


def _pow2(e: torch.Tensor) -> torch.Tensor:
    """Exact float64 2^e for integer e in the normal range, built from the bits (exp2 is not guaranteed
    exact on every backend)."""
    return ((e.to(torch.int64) + 1023) << 52).view(torch.float64)


def decode_table(fmt: ElementFormat, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """(2^bits,) the value of every element code, from the bit layout: sign, E, M →
    (−1)^sign · (E == 0 ? M · 2^(emin − m) : (1 + M / 2^m) · 2^(E − bias))."""
    return _decode_table(fmt, dtype).clone()


@cache  # dequantisation runs per expert per forward: build each table once, never hand the cached one out
def _decode_table(fmt: ElementFormat, dtype: torch.dtype) -> torch.Tensor:
    m = fmt.mantissa_bits
    values = []
    for code in range(1 << fmt.bits):
        sign = -1.0 if code >> (fmt.bits - 1) else 1.0
        E, M = (code >> m) & ((1 << fmt.exponent_bits) - 1), code & ((1 << m) - 1)
        magnitude = M * 2.0 ** (fmt.emin - m) if E == 0 else (1 + M / 2**m) * 2.0 ** (E - fmt.bias)
        if magnitude > fmt.max:
            magnitude = float("inf") if fmt.has_inf and M == 0 else float("nan")
        values.append(sign * magnitude)
    return torch.tensor(values, dtype=torch.float64).to(dtype)


def e8m0_table(dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """(256,) the value of every E8M0 scale byte: 2^(s − 127), and NaN for 0xFF."""
    return _e8m0_table(dtype).clone()


@cache
def _e8m0_table(dtype: torch.dtype) -> torch.Tensor:
    table = _pow2(torch.arange(256) - E8M0_BIAS)
    table[E8M0_NAN] = float("nan")
    return table.to(dtype)


def _check_float(x: torch.Tensor, what: str) -> None:
    if x.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{what} must be float16, bfloat16, float32 or float64, got {x.dtype}")


def _check_blocks(n: int, what: str) -> None:
    if n == 0 or n % BLOCK_SIZE:
        raise ValueError(
            f"{what}: the last dimension ({n}) must be a positive multiple of the MX block size "
            f"{BLOCK_SIZE}; pad the reduction dimension or leave this tensor unquantised"
        )


def encode_elements(v: torch.Tensor, fmt: ElementFormat) -> torch.Tensor:
    """float64 values already divided by their block scale -> uint8 element codes, rounded to nearest
    (ties to even) and saturated to ±fmt.max. NaN is not expected here (blocks holding one are zeroed)."""
    m = fmt.mantissa_bits
    a = v.abs().clamp(max=fmt.max)  # saturate first: max is on the grid, so rounding cannot exceed it
    exp = (torch.frexp(a).exponent - 1).clamp(min=fmt.emin)  # a = 1.f · 2^exp; subnormals use emin
    n = torch.round(a * _pow2(m - exp))  # integer significand in units of the binade's ulp, ties to even
    carry = n == (2 << m)  # rounded up into the next binade
    exp = exp + carry
    n = torch.where(carry, 1 << m, n).to(torch.int64)
    normal = n >= (1 << m)
    E = torch.where(normal, exp + fmt.bias, 0)
    M = torch.where(normal, n - (1 << m), n)
    sign = torch.signbit(v).to(torch.int64)
    return (sign << (fmt.bits - 1) | E << m | M).to(torch.uint8)


def quantize_mx(x: torch.Tensor, fmt: ElementFormat = FP4_E2M1) -> tuple[torch.Tensor, torch.Tensor]:
    """x (..., N) float, N a multiple of 32 -> (codes (..., N) uint8, one element code per byte;
    scales (..., N/32) uint8 E8M0)."""
    _check_float(x, "quantize_mx input")
    _check_blocks(x.shape[-1] if x.dim() else 0, f"quantize_mx input of shape {list(x.shape)}")
    blocks = x.to(torch.float64).unflatten(-1, (-1, BLOCK_SIZE))  # (..., N/32, 32)
    amax = blocks.abs().amax(-1)  # NaN propagates, so one test below catches NaN and inf
    finite = torch.isfinite(amax)
    shared = (torch.frexp(amax).exponent - 1 - fmt.emax).clamp(-E8M0_BIAS, E8M0_BIAS)
    shared = torch.where(amax > 0, shared, -E8M0_BIAS)  # all-zero block: the smallest scale
    shared = torch.where(finite, shared, 0)
    v = torch.where(finite[..., None], blocks * _pow2(-shared)[..., None], 0.0)
    codes = encode_elements(v, fmt).flatten(-2)
    scales = torch.where(finite, shared + E8M0_BIAS, E8M0_NAN).to(torch.uint8)
    return codes, scales


def dequantize_mx(
    codes: torch.Tensor, scales: torch.Tensor, fmt: ElementFormat = FP4_E2M1, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """codes (..., N) uint8, scales (..., N/32) uint8 -> (..., N) in dtype. Computed in float32 (float64
    for a float64 result): an element times a power of two from 2^-127 to 2^127 is exact there, so the
    result is the exact value rounded once into dtype (±inf past its range)."""
    if codes.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise TypeError(f"MX codes and scales must be uint8, got {codes.dtype} and {scales.dtype}")
    if dtype not in FLOAT_DTYPES:
        raise TypeError(f"dequantize to float16, bfloat16, float32 or float64, not {dtype}")
    _check_blocks(codes.shape[-1] if codes.dim() else 0, f"MX codes of shape {list(codes.shape)}")
    if scales.shape != (*codes.shape[:-1], codes.shape[-1] // BLOCK_SIZE):
        raise ValueError(
            f"MX scales of shape {list(scales.shape)} do not match codes of shape "
            f"{list(codes.shape)}: expected one scale per {BLOCK_SIZE} codes"
        )
    if fmt.bits < 8 and bool((codes >> fmt.bits).any()):
        raise ValueError(f"{fmt.name} codes are {fmt.bits}-bit: a byte above {(1 << fmt.bits) - 1} is not a code")
    compute = torch.float64 if dtype == torch.float64 else torch.float32
    values = _decode_table(fmt, compute).to(codes.device)[codes.long()].unflatten(-1, (-1, BLOCK_SIZE))
    scale = _e8m0_table(compute).to(scales.device)[scales.long()]
    return (values * scale[..., None]).flatten(-2).to(dtype)


def fake_quantize_mx(x: torch.Tensor, fmt: ElementFormat = FP4_E2M1) -> torch.Tensor:
    """x (..., N) -> the same shape and dtype, every value replaced by its MX quantise-dequantise."""
    codes, scales = quantize_mx(x, fmt)
    return dequantize_mx(codes, scales, fmt, x.dtype)


def pack_mxfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight (out, in) float, in a multiple of 32 -> (weight_packed (out, in/2) uint8, weight_scale
    (out, in/32) uint8): the release's `mxfp4-pack-quantized` tensors. Byte j of a row holds column 2j
    in its low nibble and column 2j + 1 in its high nibble; an E2M1 code is sign (bit 3), exponent
    (bits 2..1), mantissa (bit 0); a scale byte s means 2^(s − 127)."""
    _check_float(weight, "pack_mxfp4 weight")
    if weight.dim() != 2:
        raise ValueError(f"pack_mxfp4 takes a 2-D weight (out, in), got shape {list(weight.shape)}")
    codes, scales = quantize_mx(weight, FP4_E2M1)
    return (codes[:, 0::2] | codes[:, 1::2] << 4).contiguous(), scales


def check_packed_mxfp4(weight_packed: torch.Tensor, weight_scale: torch.Tensor) -> None:
    """Raise TypeError/ValueError unless the two tensors are a well-formed (out, in/2) + (out, in/32) pair."""
    if weight_packed.dtype != torch.uint8 or weight_scale.dtype != torch.uint8:
        raise TypeError(
            f"weight_packed and weight_scale must be uint8, got {weight_packed.dtype} and {weight_scale.dtype}"
        )
    if weight_packed.dim() != 2 or weight_scale.dim() != 2:
        raise ValueError(
            f"weight_packed and weight_scale must be 2-D, got shapes {list(weight_packed.shape)} "
            f"and {list(weight_scale.shape)}"
        )
    out, half = weight_packed.shape
    if half % (BLOCK_SIZE // 2) or weight_scale.shape != (out, 2 * half // BLOCK_SIZE):
        raise ValueError(
            f"weight_packed {list(weight_packed.shape)} holds a weight of shape [{out}, {2 * half}], "
            f"which needs in-features a multiple of {BLOCK_SIZE} and weight_scale of shape "
            f"[{out}, {2 * half // BLOCK_SIZE}], got {list(weight_scale.shape)}"
        )


def unpack_mxfp4(
    weight_packed: torch.Tensor, weight_scale: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """weight_packed (out, in/2) uint8, weight_scale (out, in/32) uint8 -> weight (out, in) in dtype."""
    check_packed_mxfp4(weight_packed, weight_scale)
    if dtype not in FLOAT_DTYPES:
        raise TypeError(f"dequantize to float16, bfloat16, float32 or float64, not {dtype}")
    # The same products as dequantize_mx on the unpacked nibbles, but one lookup per byte (both of its
    # values at once): this runs per expert per forward.
    compute = torch.float64 if dtype == torch.float64 else torch.float32
    values = _byte_pairs(compute).to(weight_packed.device)[weight_packed.long()]  # (out, in/2, 2)
    scale = _e8m0_table(compute).to(weight_scale.device)[weight_scale.long()]  # (out, in/32)
    return (values.view(weight_packed.shape[0], -1, BLOCK_SIZE) * scale[..., None]).flatten(-2).to(dtype)


@cache
def _byte_pairs(dtype: torch.dtype) -> torch.Tensor:
    """(256, 2) the two E2M1 values of every packed byte: low nibble (even column), high nibble (odd)."""
    table, byte = _decode_table(FP4_E2M1, dtype), torch.arange(256)
    return torch.stack((table[byte & 0x0F], table[byte >> 4]), dim=-1)
