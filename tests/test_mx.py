"""MX codecs (k3.quant.mx) against hand-computed codes and bytes, torch's own float8 casts, and round trips."""

import pytest
import torch

from k3.quant.mx import (
    FP4_E2M1,
    FP8_E4M3,
    FP8_E5M2,
    decode_table,
    dequantize_mx,
    e8m0_table,
    fake_quantize_mx,
    pack_mxfp4,
    quantize_mx,
    unpack_mxfp4,
)


def block(values: list[float]) -> list[float]:
    """One 32-value block: the given values, then zeros."""
    return values + [0.0] * (32 - len(values))


# Each case: a block's values, its expected E8M0 byte and its 16 expected packed bytes (low nibble = even column).
HAND_BLOCKS = {
    # amax 6: exponent floor(log2 6) − 2 = 0; every E2M1 value, then every midpoint (ties to the even code),
    # −5 → −4, 0.3 → 0.5 and −0.1 → −0 (code 0b1000: the sign survives rounding to zero)
    "every code and every tie": (
        block([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.5, -6, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5, -5, 0.3, -0.1]),
        127,
        [0x10, 0x32, 0x54, 0x76, 0xF9, 0x20, 0x42, 0x64, 0xE6, 0x81] + [0] * 6,
    ),
    # amax exactly 8 = 2^3: exponent 1, so 8 → 4 (code 6) and the rest are halved: 0.5 → 0.25 → 0 (tie),
    # 7 → 3.5 → 4 (tie), 2.5 → 1.25 → 1 (tie)
    "amax a power of two": (
        block([8, -8, 1, 3, 0.5, 7, 2.5, 6]),
        128,
        [0xE6, 0x31, 0x60, 0x52] + [0] * 12,
    ),
    # amax 7.9 just below 8: exponent 0, so 7.9 and 5.5 saturate to 6, −7 to −6 (OCP: no rounding up of the scale)
    "saturation": (block([7.9, -7, 5.5]), 127, [0xF7, 0x07] + [0] * 14),
    "all zero": (block([]), 0, [0] * 16),
}


@pytest.mark.parametrize("name", list(HAND_BLOCKS))
def test_pack_hand_computed_blocks(name):
    values, scale_byte, packed_bytes = HAND_BLOCKS[name]
    packed, scale = pack_mxfp4(torch.tensor([values], dtype=torch.float64))
    assert scale.tolist() == [[scale_byte]]
    assert packed.tolist() == [packed_bytes]


def test_rows_and_blocks_are_independent():
    """Two rows of two blocks each: every block keeps its own scale and bytes."""
    names = list(HAND_BLOCKS)
    rows = [HAND_BLOCKS[names[0]][0] + HAND_BLOCKS[names[1]][0], HAND_BLOCKS[names[2]][0] + HAND_BLOCKS[names[3]][0]]
    packed, scale = pack_mxfp4(torch.tensor(rows))
    assert scale.tolist() == [[127, 128], [127, 0]]
    assert packed[0, 16:].tolist() == HAND_BLOCKS[names[1]][2]
    assert packed[1, :16].tolist() == HAND_BLOCKS[names[2]][2]


def test_unpack_hand_computed_bytes():
    """0x76 = codes 6 (low, 4.0) and 7 (high, 6.0); 0xF9 = codes 9 (−0.5) and 15 (−6); scale 129 = ×4."""
    packed = torch.tensor([[0x76, 0xF9] + [0] * 14], dtype=torch.uint8)
    w = unpack_mxfp4(packed, torch.tensor([[129]], dtype=torch.uint8))
    assert w[0, :4].tolist() == [16.0, 24.0, -2.0, -24.0]
    assert w.dtype == torch.float32 and w.shape == (1, 32)


def test_fp4_decode_table():
    assert decode_table(FP4_E2M1).tolist() == [0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6]
    assert torch.signbit(decode_table(FP4_E2M1)[8])


def test_tiny_values_clamp_the_scale_at_2_pow_minus_127():
    """amax 2^-126 wants exponent −128, clamped to −127 (byte 0): values are then divided by 2^-127 and
    their small bits round away inside E2M1. fp32 subnormal inputs."""
    x = torch.tensor([block([2.0**-126, 2.0**-129, 3 * 2.0**-129, -(2.0**-127), 2.0**-140])], dtype=torch.float32)
    codes, scale = quantize_mx(x)
    assert scale.tolist() == [[0]]
    assert codes[0, :5].tolist() == [4, 0, 2, 10, 0]  # 2, 0.25 → 0, 0.75 → 1, −1, 2^-13 → 0
    assert dequantize_mx(codes, scale)[0, :5].tolist() == [2.0**-126, 0, 2.0**-127, -(2.0**-127), 0]


def test_large_scales():
    """amax 2^127 (fp32's largest binade) → exponent 125, byte 252; float64 amax 2^200 would need 198 and is
    clamped to 127 (byte 254), its elements saturating at 6."""
    codes, scale = quantize_mx(torch.tensor([block([2.0**127, -3 * 2.0**125])], dtype=torch.float32))
    assert scale.tolist() == [[252]] and codes[0, :2].tolist() == [6, 13]
    assert dequantize_mx(codes, scale)[0, :2].tolist() == [2.0**127, -3 * 2.0**125]
    codes, scale = quantize_mx(torch.tensor([block([2.0**200, 2.0**127])], dtype=torch.float64))
    assert scale.tolist() == [[254]] and codes[0, :2].tolist() == [7, 2]
    w = dequantize_mx(codes, scale, dtype=torch.float64)
    assert w[0, :2].tolist() == [6 * 2.0**127, 2.0**127]
    assert dequantize_mx(codes, scale, dtype=torch.float32)[0, 0] == float("inf")  # past fp32's range


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_value_makes_its_block_nan(bad):
    """A NaN or ±inf anywhere in a block → scale byte 0xFF, codes 0, the whole block NaN; other blocks
    are untouched."""
    x = torch.tensor([block([1.0, bad, 3.0]) + block([1.0, 2.0])])
    packed, scale = pack_mxfp4(x)
    assert scale.tolist() == [[0xFF, 126]]  # the second block: amax 2 → exponent −1
    assert packed[0, :16].tolist() == [0] * 16
    w = unpack_mxfp4(packed, scale)
    assert torch.isnan(w[0, :32]).all()
    assert w[0, 32:34].tolist() == [1.0, 2.0]
    assert torch.isnan(fake_quantize_mx(x)[0, :32]).all()


def test_e8m0_table():
    t = e8m0_table()
    assert t[127] == 1 and t[0] == 2.0**-127 and t[254] == 2.0**127 and torch.isnan(t[255])
    assert e8m0_table(torch.float32)[0] == 2.0**-127  # a subnormal, exact in fp32


@pytest.mark.parametrize(("fmt", "torch_dtype"), [(FP8_E4M3, torch.float8_e4m3fn), (FP8_E5M2, torch.float8_e5m2)])
def test_fp8_decode_table_matches_torch(fmt, torch_dtype):
    ours = decode_table(fmt)
    theirs = torch.arange(256, dtype=torch.uint8).view(torch_dtype).double()
    assert torch.equal(torch.isnan(ours), torch.isnan(theirs))
    assert torch.equal(ours.nan_to_num(0.0), theirs.nan_to_num(0.0))


@pytest.mark.parametrize(("fmt", "torch_dtype"), [(FP8_E4M3, torch.float8_e4m3fn), (FP8_E5M2, torch.float8_e5m2)])
def test_fp8_elements_match_torch_casts(fmt, torch_dtype):
    """Divided by k3's block scale, clamped to ±max, torch's float8 cast (round to nearest even) gives the
    same byte as k3's encoder for values over 30 binades, subnormals included."""
    torch.manual_seed(0)
    x = torch.randn(64, 256) * torch.logspace(-12, 12, 256)
    codes, scale = quantize_mx(x, fmt)
    v = x.double().unflatten(-1, (-1, 32)) / e8m0_table()[scale.long()][..., None]
    expected = v.clamp(-fmt.max, fmt.max).float().to(torch_dtype).view(torch.uint8).flatten(-2)
    assert torch.equal(codes, expected)


def test_fp8_hand_computed():
    """E4M3: amax 500 → exponent floor(log2 500) − 8 = 0; 500 saturates to 448 (0x7E); in [16, 32) the ulp is 2,
    so 17 ties to 16 (0x58) and 19 to 20 (0x5A). E5M2: 57344 is the largest finite (0x7B), −1 is 0xBC."""
    codes, scale = quantize_mx(torch.tensor([block([500, 17, 19, -448])]), FP8_E4M3)
    assert scale.tolist() == [[127]] and codes[0, :4].tolist() == [0x7E, 0x58, 0x5A, 0xFE]
    codes, scale = quantize_mx(torch.tensor([block([57344, -1, 60000])]), FP8_E5M2)
    assert scale.tolist() == [[127]] and codes[0, :3].tolist() == [0x7B, 0xBC, 0x7B]
    assert FP8_E4M3.emax == 8 and FP8_E5M2.emax == 15 and FP4_E2M1.emax == 2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("fmt", [FP4_E2M1, FP8_E4M3, FP8_E5M2])
def test_round_trip_and_dtypes(dtype, fmt):
    """unpack(pack(w)) is fake_quantize(w), bitwise, in w's dtype; the codes depend on the values only."""
    torch.manual_seed(1)
    w = (torch.randn(16, 128) * torch.logspace(-3, 3, 128)).to(dtype)
    fq = fake_quantize_mx(w, fmt)
    assert fq.dtype == dtype and fq.shape == w.shape
    codes, scale = quantize_mx(w, fmt)
    codes64, scale64 = quantize_mx(w.double(), fmt)
    assert torch.equal(codes, codes64) and torch.equal(scale, scale64)
    if fmt is FP4_E2M1:
        assert torch.equal(unpack_mxfp4(*pack_mxfp4(w), dtype=dtype), fq)
    assert torch.equal(fake_quantize_mx(fq, fmt), fq)  # already on the grid: quantising again changes nothing
    rel = ((fq.double() - w.double()).norm() / w.double().norm()).item()
    assert rel < {FP4_E2M1: 0.15, FP8_E4M3: 0.04, FP8_E5M2: 0.08}[fmt]


def test_pack_of_unpack_is_identity_for_canonical_bytes():
    """Bytes whose every block holds a code of magnitude 4 or 6 (what the OCP scale rule always produces,
    −0 codes included) come back unchanged: a loaded release can be written out byte for byte."""
    g = torch.Generator().manual_seed(2)
    packed = torch.randint(0, 256, (8, 64), dtype=torch.uint8, generator=g)
    big_codes = torch.tensor([0x06, 0x07, 0x0E, 0x0F], dtype=torch.uint8)  # ±4, ±6 in the low nibble
    packed[:, ::16] = big_codes[torch.randint(0, 4, (8, 4), generator=g)]  # one per 16-byte block
    scale = torch.randint(0, 255, (8, 4), dtype=torch.uint8, generator=g)  # every finite scale, 2^-127 .. 2^127
    assert ((packed & 0x0F) == 8).any()  # −0 codes present
    repacked, rescale = pack_mxfp4(unpack_mxfp4(packed, scale, torch.float64))
    assert torch.equal(repacked, packed) and torch.equal(rescale, scale)


def test_errors():
    with pytest.raises(ValueError, match="multiple of the MX block size 32"):
        pack_mxfp4(torch.zeros(4, 48))
    with pytest.raises(TypeError, match="float16, bfloat16, float32 or float64"):
        pack_mxfp4(torch.zeros(4, 32, dtype=torch.int32))
    with pytest.raises(ValueError, match="2-D weight"):
        pack_mxfp4(torch.zeros(2, 4, 32))
    packed, scale = pack_mxfp4(torch.randn(4, 64))
    with pytest.raises(TypeError, match="must be uint8"):
        unpack_mxfp4(packed.float(), scale)
    with pytest.raises(ValueError, match=r"weight_scale of shape \[4, 2\]"):
        unpack_mxfp4(packed, scale[:, :1])
    with pytest.raises(ValueError, match="multiple of 32"):
        unpack_mxfp4(packed[:, :24], scale)
    with pytest.raises(ValueError, match="4-bit"):
        dequantize_mx(torch.full((1, 32), 16, dtype=torch.uint8), torch.zeros(1, 1, dtype=torch.uint8))
    with pytest.raises(TypeError, match="dequantize to"):
        unpack_mxfp4(packed, scale, dtype=torch.int8)


# The independent oracle: compressed-tensors defines `mxfp4-pack-quantized`; its compressor must read k3's
# bytes as k3 does and write k3's bytes from k3's scales. Skipped when it is not installed (see docs/quantization.md).


def oracle_weight(dtype: torch.dtype) -> torch.Tensor:
    """(6, 160): random blocks over 24 binades plus the hand-computed blocks (every tie, a power-of-two amax,
    saturation, an all-zero block, −0.1 → −0) and their negations; no input is −0.0."""
    torch.manual_seed(5)
    w = torch.randn(6, 160, dtype=torch.float64) * torch.logspace(-12, 12, 160, base=2, dtype=torch.float64)
    hand = torch.tensor([v for v, _, _ in HAND_BLOCKS.values()], dtype=torch.float64).flatten()
    w[4, :128], w[5, :128] = hand, 0.0 - hand  # 0.0 − 0.0 is +0.0
    return w.to(dtype)


@pytest.fixture
def mxfp4_compressor():
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors.mxfp4.base import MXFP4PackedCompressor
    from compressed_tensors.quantization import QuantizationScheme
    from compressed_tensors.quantization.quant_scheme import PRESET_SCHEMES

    return MXFP4PackedCompressor, QuantizationScheme(targets=["Linear"], **PRESET_SCHEMES["MXFP4A16"])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_oracle_decompresses_k3_bytes_to_k3_weights(mxfp4_compressor, dtype):
    compressor, scheme = mxfp4_compressor
    packed, scale = pack_mxfp4(oracle_weight(dtype))
    theirs = compressor.decompress({"weight_packed": packed, "weight_scale": scale}, scheme)["weight"]
    assert theirs.dtype == torch.bfloat16  # its decompression always yields bf16
    assert torch.equal(theirs, unpack_mxfp4(packed, scale, torch.bfloat16))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_oracle_compresses_with_k3_scales_to_k3_bytes(mxfp4_compressor, dtype):
    """Given k3's scales, it writes k3's bytes from the original weights (same rounding, ties, saturation,
    −0 for a negative value that rounds to zero) and, from k3's dequantised weights, k3's bytes except that
    it writes an input −0.0 as +0 (it takes the sign from torch.sign, which is +0 for −0.0), so its own
    round trip turns code 0b1000 into 0b0000 where k3's keeps it."""
    compressor, scheme = mxfp4_compressor
    w = oracle_weight(dtype)
    packed, scale = pack_mxfp4(w)
    float_scale = e8m0_table(torch.float32)[scale.long()]
    theirs = compressor.compress({"weight": w, "weight_scale": float_scale}, scheme)
    assert torch.equal(theirs["weight_scale"], scale)
    assert torch.equal(theirs["weight_packed"], packed)
    theirs = compressor.compress({"weight": unpack_mxfp4(packed, scale, dtype), "weight_scale": float_scale}, scheme)
    assert torch.equal(theirs["weight_scale"], scale)
    low, high = packed & 0x0F, packed >> 4
    assert ((low == 8) | (high == 8)).any()  # −0 codes are there, so the difference is exercised
    plus_zero = torch.where(low == 8, 0, low) | torch.where(high == 8, 0, high) << 4
    assert torch.equal(theirs["weight_packed"], plus_zero.to(torch.uint8))


def test_oracle_scale_rule_rounds_amax_up_past_1_75(mxfp4_compressor):
    """Its observer's scale (calculate_qparams) is k3's (OCP) scale except when a block's amax has a
    significand of at least 1.75: it then rounds amax up to the next power of two first, one binade higher
    (amax 7 → scale 2, so 7 → 3.5 → 4, where OCP gives scale 1 and 7 → 6)."""
    _, scheme = mxfp4_compressor
    from compressed_tensors.compressors.mx_utils import compress_mx_scale
    from compressed_tensors.quantization.utils.helpers import calculate_qparams

    w = oracle_weight(torch.float32)
    blocks = w.unflatten(-1, (-1, 32))
    float_scale, _ = calculate_qparams(blocks.amin(-1), blocks.amax(-1), scheme.weights)
    theirs = compress_mx_scale(float_scale, torch.uint8)
    _, ours = pack_mxfp4(w)
    amax = blocks.abs().amax(-1).double()
    significand = torch.frexp(amax).mantissa * 2  # amax = significand · 2^e, significand in [1, 2)
    assert torch.equal(theirs.int() - ours.int(), (significand >= 1.75).int())
    assert ((significand >= 1.75) & (amax > 0)).any() and (significand < 1.75).any()
    assert ours[4, 3] == theirs[4, 3] == 0  # the all-zero block: byte 0 (2^-127) in both
