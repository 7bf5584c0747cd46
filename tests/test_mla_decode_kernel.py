"""MLA's decoding attention over the page pool on the C++ kernel (k3_cpu::mla_paged_decode, k3.ops.mla_cpu)
against its reference, GatedMLA's absorbed path over the gathered latents, in float64: outputs and the pool's
bytes after the step, for sequences of odd lengths spread over scattered pages, one of them several of the
kernel's 256-token chunks long; and its refusals."""

import shutil

import pytest
import torch

from k3 import K3Config
from k3.model.mla import GatedMLA
from k3.ops import mla_cpu
from k3.serve.layout import PageLayout
from k3.serve.paged_cache import PagedMLALatents
from k3.serve.pool import PagePool

pytestmark = pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None, reason="no C++ compiler")


def setup(past: list[int], seed: int = 0):
    config = K3Config.from_preset("tiny", num_attention_heads=3, kv_lora_rank=24, qk_rope_head_dim=8)
    torch.manual_seed(seed)
    mla = GatedMLA(config).double()
    layout = PageLayout.from_config(config, torch.float64)
    pool = PagePool(layout, 200)
    pool.storage.normal_()
    P = layout.page_tokens
    gen = torch.Generator().manual_seed(seed)
    pages = torch.randperm(200, generator=gen)
    width = max(n // P + 1 for n in past)
    tables = torch.zeros(len(past), width, dtype=torch.long)
    used = 0
    for b, n in enumerate(past):
        tables[b, : n // P + 1] = pages[used : used + n // P + 1]
        used += n // P + 1
    return config, mla, pool, tables, torch.tensor(past)


@pytest.mark.parametrize("past", [[0], [5, 600, 33], [256, 255]])
def test_kernel_equals_the_absorbed_path_over_gathered_latents(monkeypatch, past):
    config, mla, pool, tables, lengths = setup(past)
    B, H = len(past), config.num_attention_heads
    x = torch.randn(B, 1, config.hidden_size, dtype=torch.float64)
    q_nope, q_pe = mla.queries(x)
    c_kv, k_pe = mla.latents(x)
    index = config.layer_types.count("mla") - 1  # the last MLA layer
    before = pool.storage.clone()
    with torch.no_grad():
        cache = PagedMLALatents(pool, index, tables, lengths, config.kv_lora_rank)
        assert mla_cpu.usable(q_nope, cache.decode_pages()[0])
        got = mla.attend(q_nope, q_pe, c_kv, k_pe, cache)
        got_pool = pool.storage.clone()
        pool.storage.copy_(before)
        monkeypatch.setattr(mla_cpu, "usable", lambda *a: False)
        want = mla.attend(q_nope, q_pe, c_kv, k_pe, PagedMLALatents(pool, index, tables, lengths, config.kv_lora_rank))
    assert got.shape == want.shape == (B, 1, H, config.v_head_dim)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    assert torch.equal(got_pool, pool.storage)  # the new latents written into the same slots, nothing else
    assert not torch.equal(got_pool, before)


def test_kernel_refuses_a_page_outside_the_pool():
    config, mla, pool, tables, lengths = setup([40])
    tables[0, 0] = 10_000
    x = torch.randn(1, 1, config.hidden_size, dtype=torch.float64)
    q_nope, q_pe = mla.queries(x)
    c_kv, k_pe = mla.latents(x)
    with torch.no_grad(), pytest.raises(RuntimeError, match="page 10000 is outside the pool"):
        mla_cpu.paged_decode(
            q_nope[:, 0], q_pe[:, 0], c_kv[:, 0], k_pe[:, 0], mla.kv_b_proj.weight, pool.latents(), 0, tables,
            lengths, mla.scale,
        )  # fmt: skip
