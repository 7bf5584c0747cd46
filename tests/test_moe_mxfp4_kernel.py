"""k3_cpu::moe_experts_mxfp4 (the routed experts computed from MXFP4-packed bytes, csrc/moe_experts_mxfp4_cpu.cpp)
and its PyTorch path k3::moe_experts_mxfp4 against LatentMoE.dispatch over k3.quant.MXFP4Linear experts, the
reference: float64 and float32, MXFP8 inputs on and off, decoding-sized calls (weights decoded in registers) and
prefill-sized ones (decoded tiles and BLAS), special values, and the operator's errors."""

import pytest
import torch

from k3.model.moe import LatentMoE, moe_experts_mxfp4
from k3.model.quantization import pack_experts
from k3.ops import cpu_library, moe_cpu
from tiny_models import tiny_model

needs_kernel = pytest.mark.skipif(not cpu_library.load(), reason="k3's C++ library did not build here")


def packed_moe(seed: int = 0) -> LatentMoE:
    """A float64 LatentMoE of a tiny model with latent 96 and expert width 64 (3 and 2 MX blocks), packed."""
    model = tiny_model(seed, router_bias_std=0.3, routed_expert_hidden_size=96, moe_intermediate_size=64)
    moe = next(layer.block_sparse_moe for layer in model.model.layers if hasattr(layer, "block_sparse_moe"))
    with torch.no_grad():  # weights of unit-scale outputs (init's are ~1e-4): every comparison carries signal
        for p in [*moe.experts.parameters(), moe.routed_expert_down_proj.weight]:
            p.normal_(std=0.3)
    pack_experts(moe)
    return moe


@pytest.fixture(scope="module")
def moe():
    return packed_moe()


def routed(moe: LatentMoE, T: int, dtype: torch.dtype, seed: int = 0, scale: float = 1.0):
    """(z, routing) for T random tokens: the experts' inputs and the router's choice."""
    x = torch.randn(T, moe.gate.weight.shape[1], dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        routing = moe.gate(x)
        z = (moe.routed_expert_down_proj(x) * scale).to(dtype)
    return z, routing


def both(moe: LatentMoE, z: torch.Tensor, routing, quantization: str | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(the operator's u, LatentMoE.dispatch's u) for the same inputs, in z's dtype."""
    moe.quantization = quantization
    moe.to(z.dtype)
    try:
        with torch.no_grad():
            want = moe.dispatch(z, routing)
            got = moe_experts_mxfp4(
                z,
                routing.experts_TK,
                routing.weights_TK.to(z.dtype),
                moe.handle,
                *moe.act,
                quantization == "mxfp4",
            )
    finally:
        moe.quantization = None
        moe.double()
    return got, want


@pytest.mark.parametrize("kernel", [pytest.param(True, marks=needs_kernel), False])
@pytest.mark.parametrize("quantization", [None, "mxfp4"])
def test_equals_the_dispatch_in_float64(moe, monkeypatch, kernel, quantization):
    """Token counts from one (each expert's rows decoded in registers) to 120 (~30 rows per expert, past the 16
    decoded in registers: decoded tiles and BLAS), SiTU and SwiGLU: the same values up to the order of the sums."""
    if not kernel:
        monkeypatch.setattr(moe_cpu, "usable_packed", lambda *a: False)
    monkeypatch.setattr(moe, "act", moe.act)
    for T, act in [(1, "situ"), (3, "situ"), (17, "silu"), (120, "situ")]:
        moe.act = (act, *moe.act[1:])
        z, routing = routed(moe, T, torch.float64, seed=T)
        got, want = both(moe, z, routing, quantization)
        assert want.abs().max() > 0.1  # the comparison carries signal
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


@needs_kernel
def test_float32_within_rounding(moe):
    """In float32 the kernel's sums run in another order than BLAS's; with MXFP8 inputs a hidden activation
    that lands next to a rounding boundary may round the other way, one E4M3 step of one value."""
    z, routing = routed(moe, 3, torch.float32, seed=1)
    torch.testing.assert_close(*both(moe, z, routing, None), rtol=1e-5, atol=1e-5)
    z, routing = routed(moe, 100, torch.float32, seed=1)
    torch.testing.assert_close(*both(moe, z, routing, None), rtol=1e-5, atol=1e-5)
    got, want = both(moe, z, routing, "mxfp4")
    close = torch.isclose(got, want, rtol=1e-5, atol=1e-5)
    assert close.float().mean() > 0.97, close.float().mean()
    torch.testing.assert_close(got, want, rtol=0.05, atol=0.05 * want.abs().max().item())


@needs_kernel
def test_special_inputs_as_the_reference(moe):
    """A token whose input holds NaN or inf becomes NaN with MXFP8 inputs (its blocks' scale is NaN), a token
    of tiny values goes through the smallest scales (2^-127 and subnormal elements), a huge one saturates."""
    z, routing = routed(moe, 6, torch.float64, seed=2)
    z[0, 5], z[1, 40] = float("nan"), float("inf")
    z[2] *= 1e-40
    z[3] *= 1e30
    got, want = both(moe, z, routing, "mxfp4")
    assert want[:2].isnan().all() and want[2:].isfinite().all()
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-300, equal_nan=True)


@needs_kernel
def test_a_nan_scale_byte_makes_its_block_nan():
    """Scale byte 0xFF is NaN (OCP): every output that reads the block is NaN, in both."""
    moe = packed_moe(seed=3)
    z, routing = routed(moe, 8, torch.float64, seed=3)
    e = routing.experts_TK[0, 0]
    moe.experts[e].w2.weight_scale[4, 1] = 0xFF  # output channel 4 of token 0's first expert's down projection
    got, want = both(moe, z, routing, None)
    assert want[0, 4].isnan() and not want[:, 5].isnan().any()
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12, equal_nan=True)


@needs_kernel
def test_errors_name_what_is_wrong(moe):
    z, routing = routed(moe, 3, torch.float64)
    packed = moe.packed_buffers()

    def call(z=z, experts=routing.experts_TK, packed=packed):
        return torch.ops.k3_cpu.moe_experts_mxfp4(z, experts, routing.weights_TK, *packed, "situ", 4.0, 25.0, True)

    with pytest.raises(RuntimeError, match="expert id 8 is outside the 8 experts"):
        call(experts=torch.full_like(routing.experts_TK, 8))
    with pytest.raises(RuntimeError, match="float32 or float64"):
        call(z=z.half())
    bad = [list(group) for group in packed]
    bad[4][2] = bad[4][2][:, :-1].contiguous()  # expert 2's w2 bytes one column short
    with pytest.raises(RuntimeError, match="expert 2's w2 must be contiguous uint8 bytes"):
        call(packed=bad)
    with pytest.raises(RuntimeError, match="one tensor per expert"):
        call(packed=[packed[0], packed[1][:-1], *packed[2:]])  # one scale tensor missing


@needs_kernel
def test_a_layer_named_by_its_handle(moe):
    """k3_cpu::moe_experts_mxfp4_layer (what a compiled graph calls) computes with the tensors kept under the
    layer's handle; a copy of the layer gets its own handle and computes with its own bytes; a collected layer's
    tensors are dropped."""
    import copy
    import gc

    z, routing = routed(moe, 5, torch.float64, seed=4)
    w = routing.weights_TK.to(z.dtype)

    def by_handle(layer):
        return torch.ops.k3_cpu.moe_experts_mxfp4_layer(z, routing.experts_TK, w, layer.handle, *layer.act, False)

    want = torch.ops.k3_cpu.moe_experts_mxfp4(z, routing.experts_TK, w, *moe.packed_buffers(), *moe.act, False)
    torch.testing.assert_close(by_handle(moe), want, rtol=0, atol=0)
    twin = copy.deepcopy(moe)
    for ex in twin.experts:
        ex.w2.weight_scale.add_(1)  # every down projection doubled
    assert twin.handle != moe.handle
    torch.testing.assert_close(by_handle(twin), 2 * want, rtol=0, atol=0)
    torch.testing.assert_close(by_handle(moe), want, rtol=0, atol=0)
    gone = twin.handle
    del twin
    gc.collect()
    with pytest.raises(RuntimeError, match=f"no packed experts are set for layer handle {gone}"):
        torch.ops.k3_cpu.moe_experts_mxfp4_layer(z, routing.experts_TK, w, gone, *moe.act, False)
