"""Prefix cache: chained unit hashes, latent and checkpoint registration, matching, whole-group eviction,
exact counters, and a hit that resumes from a KDA checkpoint giving the logits of an uncached forward."""

import dataclasses

import pytest
import torch

from k3 import K3Config
from k3.serve.layout import PageLayout
from k3.serve.model_runner import ModelRunner
from k3.serve.plan import StepPlan, decode_row, prefill_piece
from k3.serve.pool import PagePool
from k3.serve.prefix_cache import PrefixCache, PrefixCacheStats, chain_hash, unit_hashes
from k3.serve.sampling import SamplingParams
from k3.serve.scheduler import Scheduler, SchedulerConfig
from k3.serve.sequence import Sequence
from tiny_models import tiny_model

# the tiny preset with a 9-dim k_pe: 2 MLA layers × 25 values × 16 tokens fill the 800-value KDA state
# exactly, so a page is 16 tokens and the units below are round numbers; 3 KDA layers
TINY16 = dict(qk_rope_head_dim=9)
LAYOUT = PageLayout.from_config(K3Config.from_preset("tiny", **TINY16))
assert LAYOUT.page_tokens == 16
BLOCK = 32  # two latent pages a unit


def tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, 512, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def computed(pool: PagePool, seq: Sequence, n: int) -> None:
    """Pretend seq has computed its first n tokens: give it state and latent pages (no model)."""
    if not seq.state_pages:
        seq.state_pages = pool.allocate(LAYOUT.n_kda)
    grow(pool, seq, n)
    seq.num_computed_tokens = n


def grow(pool: PagePool, seq: Sequence, n: int) -> None:
    """Give seq enough latent pages for n tokens (what the scheduler does)."""
    need = LAYOUT.latent_pages(n) - len(seq.latent_pages)
    if need > 0:
        seq.latent_pages += pool.allocate(need)


def free(pool: PagePool, seq: Sequence) -> None:
    pool.release(seq.latent_pages + seq.state_pages)
    seq.latent_pages, seq.state_pages = [], []


def stats(**counts: int) -> PrefixCacheStats:
    return PrefixCacheStats(**counts)


def checkpoint(cache: PrefixCache, seq: Sequence, position: int) -> None:
    """A checkpoint's life without a model: reserve its pages, fill them with seq's state as the forward
    would when it passes `position` (seq's state is taken to be that state), commit."""
    pages = cache.reserve_checkpoint(seq, position)
    if pages is not None:
        cache.pool.storage[pages] = cache.pool.storage[seq.state_pages]
        cache.commit_checkpoint(seq, position, pages)


def test_hashes_are_chained_and_stable():
    a, b = tokens(40, 0), tokens(40, 1)
    assert unit_hashes(a, 16) == unit_hashes(list(a), 16) and len(unit_hashes(a, 16)) == 2  # full units only
    # the same unit after different prefixes is a different key; a shared prefix gives shared keys
    assert unit_hashes(a[:16] + b[16:32], 16)[1] != unit_hashes(b[:32], 16)[1]
    assert unit_hashes(a[:16] + b[16:], 16)[0] == unit_hashes(a, 16)[0]
    assert unit_hashes(a[:16] + b[16:], 16)[1] != unit_hashes(a, 16)[1]
    # blake2b, not the per-process salted hash(): these values hold in every process
    assert chain_hash(0, [1, 2, 3]) == 16958249009808338657
    assert unit_hashes(list(range(8)), 4) == [2141542520064864664, 15377408733496924908]


def test_bad_arguments():
    pool = PagePool(LAYOUT, 8)
    for block in (0, -16, 24):
        with pytest.raises(ValueError, match="positive multiple of the page's 16 tokens"):
            PrefixCache(pool, block)
    with pytest.raises(ValueError, match="checkpoint_interval_tokens = 48"):
        PrefixCache(pool, 32, checkpoint_interval_tokens=48)
    cache = PrefixCache(pool, 16)
    seq = Sequence("s", tokens(40, 0))
    computed(pool, seq, 24)
    for position in (0, 24, 48):  # 24 is no unit boundary; 48 is past the sequence's 40 tokens
        with pytest.raises(ValueError, match="positive multiple of hash_block_tokens = 16"):
            cache.reserve_checkpoint(seq, position)
    with pytest.raises(ValueError, match="no latents computed"):
        cache.acquire(seq, cache.match(seq.prompt_token_ids))


def test_checkpoint_positions():
    cache = PrefixCache(PagePool(LAYOUT, 4), 16, checkpoint_interval_tokens=64)
    assert cache.checkpoint_positions(1) == [] and cache.checkpoint_positions(16) == []
    assert cache.checkpoint_positions(17) == [16] and cache.checkpoint_positions(64) == [48]
    assert cache.checkpoint_positions(65) == [64] and cache.checkpoint_positions(129) == [64, 128]
    assert cache.checkpoint_positions(200) == [64, 128, 192]
    assert cache.checkpoint_positions(210) == [64, 128, 192, 208]
    assert PrefixCache(PagePool(LAYOUT, 4), 16).checkpoint_positions(200) == [64, 128, 192]  # default: 4 units
    assert PrefixCache(PagePool(LAYOUT, 4), 16, 16).checkpoint_positions(50) == [16, 32, 48]


def test_commit_match_and_checkpoints():
    pool = PagePool(LAYOUT, 32)
    cache = PrefixCache(pool, BLOCK, checkpoint_interval_tokens=64)
    a = tokens(80, 0)
    A = Sequence("A", a)
    computed(pool, A, 64)
    pool.kda_states()[A.state_pages] = torch.arange(3.0)[:, None, None, None] + 1
    cache.commit_latents(A)
    checkpoint(cache, A, 64)
    checkpoint(cache, A, 64)
    computed(pool, A, 80)
    cache.commit_latents(A)  # 80 tokens are still two full units
    assert cache.num_units == 2 and cache.num_checkpoints == 1
    assert cache.stats == stats(units_committed=2, checkpoints_stored=1, checkpoints_existing=1)
    h = unit_hashes(a, BLOCK)
    assert [pool.key(p) for p in A.latent_pages] == [
        ("lat", h[0], 0),
        ("lat", h[0], 1),
        ("lat", h[1], 0),
        ("lat", h[1], 1),
        None,
    ]
    cache.check()
    pool.check()

    # a prompt sharing 72 tokens (two and a quarter units) matches two units and resumes at the checkpoint
    b = a[:72] + tokens(18, 1)
    refs = [pool.refcount(p) for p in range(pool.num_pages)]
    m = cache.match(b)
    assert (m.latent_tokens, m.resume_tokens, m.latent_pages) == (64, 64, A.latent_pages[:4])
    assert [pool.key(p) for p in m.checkpoint_pages] == [("checkpoint", h[1], layer) for layer in range(3)]
    assert [pool.refcount(p) for p in range(pool.num_pages)] == refs  # match changes nothing
    assert cache.match(a[:40] + tokens(40, 3)).latent_tokens == 32
    # a checkpoint at the prompt's end is useless: the last token's logits must still be computed
    m64 = cache.match(a[:64])
    assert (m64.latent_tokens, m64.resume_tokens, m64.latent_pages, m64.checkpoint_pages) == (64, 0, [], None)

    B = Sequence("B", b)
    assert cache.match(B) == m  # a Sequence: the same match, from its memoised hashes
    assert cache.match(Sequence("C", a[:64])) == m64
    cache.acquire(B, m)
    assert B.latent_pages == A.latent_pages[:4] and (B.num_computed_tokens, B.num_cached_tokens) == (64, 64)
    assert [pool.refcount(p) for p in B.latent_pages] == [2] * 4
    assert [pool.refcount(p) for p in m.checkpoint_pages] == [0] * 3  # copied, not held
    assert torch.equal(pool.storage[B.state_pages], pool.storage[A.state_pages])
    assert cache.stats == stats(
        queries=1,
        query_tokens=90,
        latent_hit_tokens=64,
        state_hit_tokens=64,
        units_committed=2,
        checkpoints_stored=1,
        checkpoints_existing=1,
    )

    # the same units computed privately by another sequence stay private
    C = Sequence("C", a)
    computed(pool, C, 80)
    cache.commit_latents(C)
    assert [pool.key(p) for p in C.latent_pages] == [None] * 5 and cache.stats.units_committed == 2

    # no page left for a checkpoint: skipped and counted, not raised
    D = Sequence("D", tokens(40, 2))
    computed(pool, D, 32)
    filler = pool.allocate(pool.available())  # evicts the unused checkpoint; the units are held by A, B, C
    checkpoint(cache, D, 32)
    assert cache.num_units == 2 and cache.num_checkpoints == 0
    assert (cache.stats.checkpoints_skipped, cache.stats.evicted_checkpoints, cache.stats.evicted_units) == (1, 1, 0)
    pool.release(filler)

    for seq in (A, B, C, D):
        free(pool, seq)
    cache.clear()
    cache.check()
    pool.check()
    assert pool.num_free == pool.num_pages


def test_reserve_checkpoint_looks_at_its_own_unit():
    """A sequence whose later unit has a checkpoint (and whose unit hashes are all memoised, as the
    scheduler's match() leaves them) still reserves one for an earlier unit."""
    pool = PagePool(LAYOUT, 32)
    cache = PrefixCache(pool, BLOCK, checkpoint_interval_tokens=BLOCK)
    a = tokens(70, 0)
    A = Sequence("A", a)
    computed(pool, A, 64)
    checkpoint(cache, A, 64)
    B = Sequence("B", list(a))
    cache.match(B)  # memoises both unit hashes of B
    computed(pool, B, 32)
    pages = cache.reserve_checkpoint(B, 32)
    assert pages is not None and cache.stats.checkpoints_existing == 0
    cache.commit_checkpoint(B, 32, pages)
    assert cache.num_checkpoints == 2 and cache.reserve_checkpoint(B, 64) is None
    assert cache.stats.checkpoints_existing == 1
    cache.check()
    pool.check()


def test_eviction_drops_whole_groups():
    pool = PagePool(LAYOUT, 12)
    cache = PrefixCache(pool, BLOCK, checkpoint_interval_tokens=BLOCK)
    A = Sequence("A", tokens(70, 0))
    computed(pool, A, 64)
    cache.commit_latents(A)
    checkpoint(cache, A, 64)
    free(pool, A)  # LRU: checkpoint (3 pages), unit 0 (2), unit 1 (2); 5 pages free
    assert (pool.num_free, pool.num_evictable) == (5, 7)
    # one allocate evicts both pages of unit 0 after all three of the checkpoint; its siblings, evicted in
    # the same call, must not be freed under it
    filler = pool.allocate(10)
    assert (cache.num_units, cache.num_checkpoints) == (1, 0)
    assert cache.stats == stats(units_committed=2, checkpoints_stored=1, evicted_units=1, evicted_checkpoints=1)
    m = cache.match(A.prompt_token_ids)
    assert (m.latent_tokens, m.resume_tokens) == (0, 0)  # unit 1 is cached but unreachable
    pool.release(filler[:1])
    pool.allocate(2)  # one free page, then evicts one page of unit 1: its sibling is freed with it
    assert cache.stats.evicted_units == 2 and (pool.num_evictable, pool.num_free) == (0, 1)
    cache.check()
    pool.check()


def test_eviction_of_a_foreign_key_is_an_error():
    pool = PagePool(LAYOUT, 2)
    PrefixCache(pool, 16)
    (page,) = pool.allocate(1)
    pool.set_key(page, "someone else's")
    pool.release([page])
    with pytest.raises(RuntimeError, match="never set"):
        pool.allocate(2)


class Harness:
    """What the scheduler does for one sequence, driven by hand: admit through the cache, prefill in chunks
    ending at checkpoint positions (reserving each checkpoint in the chunk's plan; the forward fills it and
    Scheduler.complete commits it and the latents), then greedy decode; every logit is checked against an
    uncached forward of the same tokens."""

    def __init__(self, num_pages: int):
        self.model = tiny_model(**TINY16)
        self.pool = PagePool(dataclasses.replace(LAYOUT, dtype=torch.float64), num_pages)
        self.pool.storage.fill_(7.0)  # stale data must not leak into a request
        self.runner = ModelRunner(self.model, self.pool)
        self.cache = PrefixCache(self.pool, BLOCK, checkpoint_interval_tokens=64)
        self.scheduler = Scheduler(SchedulerConfig(), self.pool, self.cache)

    def step(self, plan: StepPlan) -> torch.Tensor:
        """The engine's step for a plan made by hand: run, then complete (progress, checkpoints, latents)."""
        logits = self.runner.run(plan)
        self.scheduler.complete(plan)
        return logits[0]

    @torch.no_grad()
    def reference(self, seq: Sequence) -> torch.Tensor:
        return self.model(torch.tensor([seq.all_token_ids])).logits[0, -1]

    def run(self, name: str, prompt: list[int], decode_steps: int) -> Sequence:
        seq = Sequence(name, prompt, SamplingParams(max_tokens=16))
        self.cache.acquire(seq, self.cache.match(prompt))
        ends = [p for p in self.cache.checkpoint_positions(len(prompt)) if p > seq.num_computed_tokens]
        for end in [*ends, len(prompt)]:
            grow(self.pool, seq, end)
            pages = self.cache.reserve_checkpoint(seq, end) if end < len(prompt) else None
            piece = prefill_piece(seq, seq.num_computed_tokens, end, checkpoint_pages=pages)
            logits = self.step(StepPlan([dataclasses.replace(piece, sample=True)]))
        for _ in range(decode_steps + 1):
            assert torch.allclose(logits, self.reference(seq), rtol=0, atol=1e-9)
            if seq.num_output_tokens == decode_steps:
                break
            seq.append_token(int(logits.argmax()))
            grow(self.pool, seq, seq.num_tokens)
            logits = self.step(StepPlan(decode=[decode_row(seq)]))
        self.cache.check()
        self.pool.check()
        return seq


def test_hit_resumes_from_checkpoint_and_matches_uncached():
    h = Harness(num_pages=32)
    cache, pool = h.cache, h.pool
    a = tokens(112, 0)  # three and a half units
    b = a[:96] + tokens(24, 1)  # A's first three units, then its own
    assert cache.checkpoint_positions(112) == [64, 96]

    A = h.run("A", a, decode_steps=0)
    assert cache.stats == stats(queries=1, query_tokens=112, units_committed=3, checkpoints_stored=2)

    m = cache.match(b)
    assert (m.latent_tokens, m.resume_tokens, m.latent_pages) == (96, 96, A.latent_pages[:6])
    B = h.run("B", b, decode_steps=6)
    assert B.latent_pages[:6] == A.latent_pages[:6] and B.num_cached_tokens == 96
    assert cache.stats == stats(
        queries=2, query_tokens=232, latent_hit_tokens=96, state_hit_tokens=96, units_committed=3, checkpoints_stored=2
    )
    free(pool, A)
    free(pool, B)

    # resume at the interval checkpoint: C shares two units; the hit moves that checkpoint to the LRU's end
    C = h.run("C", a[:64] + tokens(30, 2), decode_steps=3)
    assert C.num_cached_tokens == 64
    free(pool, C)
    assert cache.stats == stats(
        queries=3,
        query_tokens=326,
        latent_hit_tokens=160,
        state_hit_tokens=160,
        units_committed=3,
        checkpoints_stored=2,
    )

    # pressure: the LRU head is now the checkpoint at 96; evicting one of its pages drops all three
    pool.release(pool.allocate(pool.num_free + 1))
    assert cache.num_checkpoints == 1 and cache.stats.evicted_checkpoints == 1 and cache.stats.evicted_units == 0
    m = cache.match(b)
    assert (m.latent_tokens, m.resume_tokens) == (96, 64)  # latents still there, state from the earlier checkpoint
    B2 = h.run("B2", b, decode_steps=6)
    assert pool.key(B2.latent_pages[4]) is None  # recomputed unit 2 is cached already: B2's copy stays private
    assert cache.stats == stats(
        queries=4,
        query_tokens=446,
        latent_hit_tokens=256,
        state_hit_tokens=224,
        units_committed=3,
        checkpoints_stored=3,
        evicted_checkpoints=1,
    )
    free(pool, B2)

    # evict everything in one allocate: whole groups go, and the next prompt starts from scratch, still exact
    pool.release(pool.allocate(pool.available()))
    assert (cache.num_units, cache.num_checkpoints) == (0, 0)
    assert (cache.stats.evicted_units, cache.stats.evicted_checkpoints) == (3, 3)
    B3 = h.run("B3", b, decode_steps=2)
    assert B3.num_cached_tokens == 0 and cache.stats.state_hit_tokens == 224 and cache.stats.units_committed == 6

    free(pool, B3)
    cache.clear()
    pool.check()
    assert pool.num_free == pool.num_pages
