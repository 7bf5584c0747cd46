"""The paged pool: layout arithmetic, views into one storage tensor, and the allocator's semantics."""

import dataclasses
import random

import pytest
import torch

from k3.config import K3Config
from k3.serve.layout import PageLayout
from k3.serve.pool import OutOfPages, PagePool


def layout(preset: str) -> PageLayout:
    return PageLayout.from_config(K3Config.from_preset(preset))


# ---- layout numbers, by hand ---------------------------------------------------------------------
def test_layout_tiny():
    # 5 layers, MLA at 4 and 5; H = 2, K = V = 16, kernel 4; latent 16 + 8
    L = layout("tiny")
    assert (L.n_kda, L.n_mla, L.kda_heads, L.kda_head_dim, L.conv_width, L.latent_dim) == (3, 2, 2, 16, 3, 24)
    assert L.state_elems == 2 * 16 * 16 == 512
    assert L.conv_elems == 3 * (2 * 2 * 16 + 2 * 16) == 288
    assert L.page_tokens == 17  # ceil(800 / (2 · 24)): the fewest tokens whose latents hold a state
    assert L.page_elems == 17 * 48 == 816 and L.bytes_per_page == 3264
    assert L.state_padding == 816 - 800 == 16
    assert L.latent_pages(0) == 0 and L.latent_pages(1) == 1 and L.latent_pages(17) == 1 and L.latent_pages(18) == 2
    assert L.request_pages(8192) == 3 + 482  # ceil(8192 / 17)
    assert L.request_padding(8192) == 3 * 16 + (482 * 17 - 8192) * 48 and L.request_padding(17) == 3 * 16


def test_layout_small():
    # 9 layers, MLA at 4, 8, 9; H = 4, K = V = 64, kernel 4; latent 64 + 16
    L = layout("small")
    assert (L.n_kda, L.n_mla, L.latent_dim) == (6, 3, 80)
    assert L.state_elems == 4 * 64 * 64 == 16384
    assert L.conv_elems == 3 * (3 * 4 * 64) == 2304
    assert L.page_tokens == 78  # ceil(18688 / 240)
    assert L.page_elems == 78 * 240 == 18720
    assert L.state_padding == 18720 - 18688 == 32
    assert L.request_pages(8192) == 6 + 106  # ceil(8192 / 78) = 106


def test_layout_k3():
    # 93 layers, MLA every 4th and the last: 24 MLA, 69 KDA; H = 96, K = V = 128, kernel 4; latent 512 + 64
    L = layout("k3")
    assert (L.n_kda, L.n_mla, L.latent_dim) == (69, 24, 576)
    assert L.state_elems + L.conv_elems == 96 * 128 * 128 + 3 * (3 * 96 * 128) == 1_683_456
    assert L.page_tokens == 122  # ceil(1_683_456 / (24 · 576))
    assert L.page_elems == 122 * 13_824 == 1_686_528
    assert L.state_padding == 1_686_528 - 1_683_456 == 3_072
    assert L.bytes_per_page == 6_746_112
    assert L.request_pages(8192) == 69 + 68  # ceil(8192 / 122) = 68


def test_layout_wide_latents_and_no_mla():
    # one token of latents larger than a KDA state: a page is one token, the state page mostly padding
    L = PageLayout.from_config(K3Config.from_preset("tiny", kv_lora_rank=512))
    assert (L.page_tokens, L.page_elems, L.state_padding) == (1, 2 * 520, 2 * 520 - 800)
    L = PageLayout.from_config(K3Config.from_preset("tiny", full_attn_layers=()))
    assert (L.n_mla, L.page_tokens, L.latent_pages(1000), L.request_pages(1000)) == (0, 0, 0, 5)
    assert L.page_elems == 800 and L.state_padding == 0


# ---- views ------------------------------------------------------------------------------------------
def test_views_write_through_at_the_right_offsets():
    L = layout("tiny")
    pool = PagePool(L, 4)
    assert pool.storage.shape == (4, 816) and not pool.storage.any()
    S, conv, lat = pool.kda_states(), pool.kda_conv(), pool.latents()
    assert S.shape == (4, 2, 16, 16) and conv.shape == (4, 96, 3) and lat.shape == (4, 17, 2, 24)
    for view in (S, conv, lat):
        assert view.untyped_storage().data_ptr() == pool.storage.untyped_storage().data_ptr()

    S[1, 1, 2, 3] = 1.0  # value 1·256 + 2·16 + 3 of page 1
    assert pool.storage[1, 256 + 32 + 3] == 1.0 and pool.storage.count_nonzero() == 1
    conv[2, 5, 1] = 2.0  # after S: value 512 + 5·3 + 1 of page 2
    assert pool.storage[2, 512 + 15 + 1] == 2.0 and pool.storage.count_nonzero() == 2
    lat[3, 4, 1, 7] = 3.0  # token slot 4, layer 1: 4·(2·24) + 1·24 + 7 of page 3
    assert pool.storage[3, 192 + 24 + 7] == 3.0 and pool.storage.count_nonzero() == 3


def test_scratch_is_reused_and_bounded():
    pool = PagePool(layout("tiny"), 8)  # 8 × 816 values; a quarter is 1632
    a = pool.scratch(1000)
    a.fill_(1.0)
    b = pool.scratch(600)
    assert b.data_ptr() == a.data_ptr() and b.numel() == 600 and not pool.storage.any()  # reused, not the pages
    big = pool.scratch(5000)  # over a quarter of the pool: a tensor of its own, not kept
    assert big.numel() == 5000 and pool.scratch(1000).data_ptr() == a.data_ptr()


def test_page_regions():
    """S and conv come first in a state page, the rest is padding; latents fill a page exactly and
    run on across consecutive pages as one token per row; pages are disjoint."""
    L = layout("small")
    pool = PagePool(L, 3)
    pool.kda_states()[1] = 1
    pool.kda_conv()[1] += 2  # disjoint from S: no value gets 3
    row = pool.storage[1]
    assert row[: L.page_elems - L.state_padding].unique().tolist() == [1.0, 2.0] and not row[-L.state_padding :].any()
    assert not pool.storage[0].any() and not pool.storage[2].any()
    pool.storage.zero_()
    pool.latents()[2] = 1
    assert pool.storage[2].eq(1).all() and L.latent_elems == L.page_elems
    assert not pool.storage[:2].any()
    rows = pool.latent_rows()  # token slot p·P + t of layer m is latents()[p, t, m]
    pool.latents()[1, L.page_tokens - 1, 2, 5] = 7.0
    assert rows[2 * L.page_tokens - 1, 2, 5] == 7.0 and rows.shape == (3 * L.page_tokens, 3, 80)


# ---- allocator ---------------------------------------------------------------------------------------
def small_pool(n: int = 8) -> PagePool:
    return PagePool(layout("tiny"), n)


def test_allocate_retain_release():
    pool = small_pool()
    a = pool.allocate(3)
    assert a == [0, 1, 2] and all(pool.refcount(p) == 1 for p in a)
    assert (pool.num_free, pool.num_used, pool.num_evictable, pool.available()) == (5, 3, 0, 5)
    assert pool.allocate(0) == []
    pool.retain(a[:2])
    assert [pool.refcount(p) for p in a] == [2, 2, 1]
    pool.release(a)
    assert [pool.refcount(p) for p in a] == [1, 1, 0] and pool.num_free == 6
    pool.release([a[0], a[1]])
    assert pool.num_free == 8 and pool.num_used == 0
    pool.check()
    b = pool.allocate(2)
    pool.retain([b[0], b[0]])  # duplicates count twice
    assert pool.refcount(b[0]) == 3
    pool.release([b[0], b[0], b[0], b[1]])
    assert pool.num_free == 8
    pool.check()


def test_errors_change_nothing():
    pool = small_pool()
    a = pool.allocate(2)
    with pytest.raises(ValueError, match="double free: page 5 is free"):
        pool.release([5])
    with pytest.raises(ValueError, match="double free"):
        pool.release([a[0], a[0]])  # one reference, released twice
    assert pool.refcount(a[0]) == 1  # the checked release did not half-apply
    with pytest.raises(ValueError, match="is free"):
        pool.retain([a[0], 7])
    assert pool.refcount(a[0]) == 1
    with pytest.raises(ValueError, match="not in this pool"):
        pool.release([-1])
    with pytest.raises(ValueError, match="not in this pool"):
        pool.retain([8])
    with pytest.raises(ValueError, match="cannot allocate"):
        pool.allocate(-1)
    with pytest.raises(ValueError, match="not in use"):
        pool.set_key(6, "k")
    with pytest.raises(ValueError, match="None"):
        pool.set_key(a[0], None)
    pool.set_key(a[0], "k")
    pool.set_key(a[0], "k")  # same key again is fine
    with pytest.raises(ValueError, match="already cached under 'k'"):
        pool.set_key(a[0], "other")
    pool.release(a)
    with pytest.raises(ValueError, match="double free: page 0 is evictable"):
        pool.release([a[0]])
    pool.check()


def test_out_of_pages_allocates_nothing():
    pool = small_pool()
    used = pool.allocate(4)
    pool.set_key(used[0], "k0")
    pool.release(used[:2])  # one evictable, one free
    with pytest.raises(OutOfPages, match=r"need 7 pages .* 6 are available \(5 free \+ 1 evictable\)") as e:
        pool.allocate(7)
    assert (e.value.need, e.value.free, e.value.evictable) == (7, 5, 1)
    assert isinstance(e.value, RuntimeError)
    assert (pool.num_free, pool.num_evictable, pool.num_used) == (5, 1, 2)
    assert pool.key(used[0]) == "k0"
    pool.check()
    assert len(pool.allocate(6)) == 6 and pool.available() == 0


def test_cached_pages_and_lru_eviction():
    pool = small_pool(6)
    evicted = []
    pool.on_evict = lambda page, key: evicted.append((page, key, pool.key(page), pool.refcount(page)))
    pages = pool.allocate(6)
    for p in pages:
        pool.set_key(p, f"h{p}")
    assert pool.key(0) == "h0" and pool.available() == 0
    # release order 3, 1, 4, 0: the LRU is least recently released first
    for p in (3, 1, 4, 0):
        pool.release([p])
    assert (pool.num_evictable, pool.num_free, pool.num_used) == (4, 0, 2)
    pool.check()
    pool.retain([1])  # a prefix hit: 1 is used again and never evicted while retained
    assert pool.refcount(1) == 1 and pool.num_evictable == 3
    pool.release([1])  # now the most recently released
    got = pool.allocate(2)
    assert got == [3, 4]
    # the callback sees the page already out of the cache: no key, refcount 1
    assert evicted == [(3, "h3", None, 1), (4, "h4", None, 1)]
    assert pool.key(3) is None and pool.key(0) == "h0"
    pool.check()
    pool.release([5])  # keyed: evictable, the most recent
    pool.drop_key(5)  # forgetting the key frees it, without on_evict
    assert pool.num_free == 1 and len(evicted) == 2
    assert pool.allocate(1) == [5] and len(evicted) == 2  # free pages go before evictable ones
    assert pool.allocate(1) == [0] and evicted[-1][:2] == (0, "h0")
    assert pool.allocate(1) == [1] and evicted[-1][:2] == (1, "h1")
    pool.check()
    pool.drop_key(2)  # a used page loses its key and stays used; dropping again is a no-op
    pool.drop_key(2)
    assert pool.refcount(2) == 1 and pool.key(2) is None
    pool.release(range(6))
    assert pool.num_free == 6
    pool.check()


def test_from_budget():
    L = layout("tiny")  # 3264 bytes a page, a request needs at least 3 + 1 pages
    pool = PagePool.from_budget(L, 10 * 3264 + 3263)
    assert pool.num_pages == 10 and pool.storage.shape == (10, 816) and pool.storage.dtype == torch.float32
    assert PagePool.from_budget(L, 4 * 3264).num_pages == 4
    with pytest.raises(ValueError, match=r"holds 3 pages of 3264 bytes; one request needs at least 4 pages \(13056"):
        PagePool.from_budget(L, 4 * 3264 - 1)
    assert PagePool.from_budget(dataclasses.replace(L, dtype=torch.float64), 8 * 6528).num_pages == 8
    with pytest.raises(ValueError, match="at least one page"):
        PagePool(L, 0)


def test_capacity_and_describe():
    L = layout("tiny")
    pool = PagePool(L, 1000)
    c = pool.capacity(8192)
    assert c["pages"] == 1000 and c["page_bytes"] == 3264 and c["memory_bytes"] == 3_264_000
    assert c["page_tokens"] == 17 and c["state_padding"] == 16 and c["tokens"] == 17_000
    # 3 state pages + ceil(8192 / 17) = 482 latent pages; padding: 3 × 16 + 2 unused token slots × 48
    assert c["request_pages"] == 485 and c["requests_at_context"] == 2 and c["request_padding"] == 48 + 96
    assert pool.capacity(1024)["requests_at_context"] == 1000 // (3 + 61)
    text = pool.describe(contexts=(1024, 8192, 65536))
    for s in ("1,000 pages", "3.19 KiB", "P = 17 tokens", "2 MLA layers", "padding 16 values", "3 KDA state pages"):
        assert s in text, s
    assert "max 15 concurrent" in text and "max 2 concurrent" in text and "does not fit" in text


def test_k3_capacity_without_memory():
    """The full model's start-up numbers, computed on the meta device so nothing is allocated."""
    L = layout("k3")
    pool = PagePool.from_budget(L, 80 * 2**30, device="meta")
    assert pool.num_pages == 80 * 2**30 // 6_746_112 == 12_733
    c = pool.capacity(8192)
    assert c["request_pages"] == 137 and c["requests_at_context"] == 12_733 // 137 == 92
    assert pool.kda_states().shape == (12_733, 96, 128, 128) and pool.latents().shape == (12_733, 122, 24, 576)
    text = pool.describe()
    assert "12,733 pages" in text and "P = 122 tokens" in text and "69 KDA state pages" in text


# ---- randomized -----------------------------------------------------------------------------------
def test_random_operations():
    rng = random.Random(0)
    pool = PagePool(layout("tiny"), 64)
    keys: dict[object, int] = {}  # what a prefix cache would hold: key → page
    evictions = []

    def on_evict(page, key):
        assert keys.pop(key) == page
        pool.check()  # consistent mid-allocation
        evictions.append(key)

    pool.on_evict = on_evict
    held: list[list[int]] = []  # each entry: one request's references
    for step in range(600):
        op = rng.random()
        if op < 0.3:
            n = rng.randint(0, 12)
            if n > pool.available():
                with pytest.raises(OutOfPages):
                    pool.allocate(n)
            else:
                held.append(pool.allocate(n))
        elif op < 0.45 and keys:  # a prefix hit: share cached pages, used or evictable
            pages = rng.sample(sorted(keys.values()), k=min(len(keys), rng.randint(1, 4)))
            pool.retain(pages)
            held.append(pages)
        elif op < 0.75 and held:
            pool.release(held.pop(rng.randrange(len(held))))
        elif op < 0.9 and held:
            page = rng.choice([p for h in held for p in h] or [None])
            if page is not None and pool.key(page) is None:
                pool.set_key(page, ("h", step))
                keys[("h", step)] = page
        elif keys:
            key = rng.choice(sorted(keys, key=str))
            pool.drop_key(keys.pop(key))
        pool.check()
        assert {pool.key(p) for p in keys.values()} == set(keys)
    assert evictions, "the run never evicted: make it tighter"
    while held:
        pool.release(held.pop())
    pool.check()
    assert pool.num_used == 0 and pool.num_free + pool.num_evictable == 64
    assert pool.num_evictable == len(keys)
    for page in list(keys.values()):
        pool.drop_key(page)
    pool.check()
    assert pool.num_free == 64
