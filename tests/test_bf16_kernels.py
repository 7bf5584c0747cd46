"""The C++ serving kernels on bfloat16 values (a bf16 model and pool, fp32 KDA states), each against float64
computed from the same bf16 numbers: at least as accurate as the PyTorch path they replace, which runs in bf16
too. The kernels keep every sum in fp32 and round once, so their error is one bf16 rounding of the result."""

from dataclasses import replace

import pytest
import torch

from k3 import K3Config
from k3.model.kda import KimiDeltaAttention
from k3.model.mla import GatedMLA
from k3.ops import cpu_library, mla_cpu, moe_cpu
from k3.ops.kda import cpu_kernel
from k3.serve.layout import PageLayout
from k3.serve.paged_cache import PagedMLALatents
from k3.serve.pool import PagePool
from tiny_models import PoolRows, kda_step_both_ways, tiny_model

pytestmark = pytest.mark.skipif(not cpu_library.load(), reason="k3's C++ library did not build here")
BF16 = torch.bfloat16


def error(x: torch.Tensor, exact: torch.Tensor) -> float:
    """The largest error of x against exact, relative to exact's largest value."""
    return ((x.double() - exact).abs().max() / exact.abs().max()).item()


def assert_as_accurate(kernel: torch.Tensor, torch_path: torch.Tensor, exact: torch.Tensor) -> None:
    """The kernel within 2× the PyTorch path's error, or within two bf16 roundings (2⁻⁷) where that is smaller."""
    assert exact.abs().max() > 0.05  # the comparison carries signal
    kernel_error, torch_error = error(kernel, exact), error(torch_path, exact)
    assert kernel_error <= max(2 * torch_error, 2**-7), (kernel_error, torch_error)


@pytest.mark.parametrize("T", [1, 5, 60])  # one row per expert (vdpbf16ps or oneDNN) up to ~15 (oneDNN above 16)
def test_moe_experts(monkeypatch, T):
    model = tiny_model(router_bias_std=0.3, routed_expert_hidden_size=96, moe_intermediate_size=64)
    moe = next(layer.block_sparse_moe for layer in model.model.layers if hasattr(layer, "block_sparse_moe"))
    with torch.no_grad():
        for p in moe.experts.parameters():
            p.normal_(std=0.3)
        moe.to(BF16)
        x = torch.randn(T, model.config.hidden_size, generator=torch.Generator().manual_seed(T)).to(BF16)
        routing = moe.gate(x)
        z = moe.routed_expert_down_proj(x)
        weights = [[ex.w1.weight for ex in moe.experts], [ex.w3.weight for ex in moe.experts]]
        weights.append([ex.w2.weight for ex in moe.experts])
        assert moe_cpu.usable(z, weights[0][0])
        got = moe_cpu.moe_experts(z, routing.experts_TK, routing.weights_TK, *weights, *moe.act)
        torch_path = moe.dispatch(z, routing)
        moe.double()
        exact = moe.dispatch(z.double(), routing)
    assert got.dtype == BF16
    assert_as_accurate(got, torch_path, exact)


@pytest.mark.parametrize("past", [[0], [5, 600, 33]])
def test_mla_paged_decode(monkeypatch, past):
    config = K3Config.from_preset("tiny", num_attention_heads=3, kv_lora_rank=24, qk_rope_head_dim=8)
    torch.manual_seed(0)
    mla = GatedMLA(config).to(BF16)
    layout = PageLayout.from_config(config, BF16)
    # the float64 reference pool with the same pages (only its latents are read)
    pools = {BF16: PagePool(layout, 200), torch.float64: PagePool(replace(layout, dtype=torch.float64), 200)}
    pools[BF16].storage.normal_()
    pools[torch.float64].latents().copy_(pools[BF16].latents())
    P = pools[BF16].layout.page_tokens
    tables = torch.zeros(len(past), max(n // P + 1 for n in past), dtype=torch.long)
    used = 0
    for b, n in enumerate(past):
        tables[b, : n // P + 1] = torch.arange(used, used + n // P + 1) * 3 % 200  # scattered pages
        used += n // P + 1
    lengths = torch.tensor(past)
    x = torch.randn(len(past), 1, config.hidden_size).to(BF16)
    index = config.layer_types.count("mla") - 1
    with torch.no_grad():
        q_nope, q_pe = mla.queries(x)
        c_kv, k_pe = mla.latents(x)

        def attend(pool, *inputs):
            cache = PagedMLALatents(pool, index, tables, lengths, config.kv_lora_rank)
            return mla.attend(*inputs, cache)

        before = pools[BF16].storage.clone()
        assert mla_cpu.usable(q_nope, pools[BF16].latents())
        got = attend(pools[BF16], q_nope, q_pe, c_kv, k_pe)
        written = pools[BF16].storage.clone()
        pools[BF16].storage.copy_(before)
        monkeypatch.setattr(mla_cpu, "usable", lambda *a: False)
        torch_path = attend(pools[BF16], q_nope, q_pe, c_kv, k_pe)
        assert torch.equal(written, pools[BF16].storage)  # the same latents in the same slots
        mla.double()
        exact = attend(pools[torch.float64], q_nope.double(), q_pe.double(), c_kv.double(), k_pe.double())
    assert got.dtype == BF16
    assert_as_accurate(got, torch_path, exact)


def test_kda_conv_recurrent_step(monkeypatch):
    """bf16 inputs and conv tails, fp32 states (a bf16 pool's): the state update and the output against float64."""
    config = K3Config.from_preset("tiny", kda_num_heads=3, kda_head_dim=24, gate_lower_bound=-5.0)
    torch.manual_seed(0)
    layer = KimiDeltaAttention(config)
    layer.reset_gate_parameters()
    layer.to(BF16)
    B, P, H, K = 3, 7, 3, 24
    C, w = 3 * H * K, config.short_conv_kernel_size
    rows = torch.tensor([4, 0, 6])

    states = torch.randn(P, H, K, K)
    convs = torch.randn(P, C, w - 1).to(BF16)
    qkv = torch.randn(B, 1, C).to(BF16)
    g_raw, beta_raw = torch.randn(B, 1, H, K).to(BF16), torch.randn(B, 1, H).to(BF16)
    assert cpu_kernel.conv_step_usable(qkv, states, convs)
    inputs = (qkv, g_raw, beta_raw)
    (got, fast), (torch_path, slow) = kda_step_both_ways(layer, inputs, states, convs, rows, monkeypatch)
    with torch.no_grad():
        exact_rows = PoolRows(states.double(), convs.double(), rows)
        layer.double()
        exact = layer.mix(qkv.double(), g_raw.double(), beta_raw.double(), exact_rows)
    assert got.dtype == BF16 and fast.states.dtype == torch.float32
    assert_as_accurate(got, torch_path, exact)
    assert_as_accurate(fast.states, slow.states, exact_rows.states)
    assert torch.equal(fast.convs, slow.convs)  # the tails are shifted bf16 values, not computed
