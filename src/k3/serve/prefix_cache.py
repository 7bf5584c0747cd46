"""Prefix caching (SPEC §3): reuse the MLA latents and KDA state of a prompt prefix computed before.

Prompts are hashed in chained units of `hash_block_tokens` tokens (a multiple of the page's P tokens, so a
unit is whole latent pages); the hash of unit i covers every token before it, so equal hashes mean
equal prefixes. Two kinds of pool pages are cached, each under a key in the pool:
- ("lat", h, j): the j-th latent page of the unit whose chained hash is h. Latents are per token, so
  any run of cached units from the start can be reused as is.
- ("checkpoint", h, layer): one KDA layer's state (S and conv tails) after the unit h. KDA state
  summarises the whole prefix and cannot be rebuilt from latents, so a hit resumes at the deepest
  checkpoint and recomputes from there; latents past it are not used.

A checkpoint's life, one path: the scheduler ends prefill pieces at `checkpoint_positions` and
`reserve_checkpoint`s n_kda pages for each in the step's plan; the forward fills them with the state
as it passes the position (k3.serve.paged_cache.PagedKDAState); `commit_checkpoint` then caches them
(or the pages are released if the forward failed).

Every cached page lives in the pool's one LRU. A unit or checkpoint is only usable while all its pages
are there, so the eviction of any one of them drops the whole group.
"""

import hashlib
import struct
import weakref
from collections.abc import Hashable, Iterator
from dataclasses import dataclass, fields

import torch

from k3.serve.pool import OutOfPages, PagePool
from k3.serve.sequence import Sequence

_ROOT = 0  # the "previous hash" of unit 0


def chain_hash(prev: int, tokens: list[int]) -> int:
    """64-bit hash of one unit after a prefix whose hash is `prev`: blake2b over prev's 8 bytes and the
    token ids as little-endian int64, so the same prefix gives the same key in every process (Python's
    hash() is salted per process)."""
    h = hashlib.blake2b(prev.to_bytes(8, "little"), digest_size=8)
    h.update(struct.pack(f"<{len(tokens)}q", *tokens))
    return int.from_bytes(h.digest(), "little")


def iter_unit_hashes(token_ids: list[int], hash_block_tokens: int) -> Iterator[int]:
    """The chained hashes of every full unit of token_ids, lazily (a lookup usually stops at its first
    miss); a trailing partial unit is not hashed."""
    prev, B = _ROOT, hash_block_tokens
    for start in range(0, len(token_ids) - B + 1, B):
        prev = chain_hash(prev, token_ids[start : start + B])
        yield prev


def unit_hashes(token_ids: list[int], hash_block_tokens: int) -> list[int]:
    return list(iter_unit_hashes(token_ids, hash_block_tokens))


@dataclass
class PrefixMatch:
    """What the cache holds for a prompt; computed without touching refcounts.

    latent_tokens: prompt tokens (whole units) whose latents are cached.
    resume_tokens: where prefill can resume — the deepest checkpoint ≤ latent_tokens and < prompt length.
    latent_pages: the cached latent pages of the units below resume_tokens, in token order.
    checkpoint_pages: the checkpoint at resume_tokens, one page per KDA layer in layer order (None at 0).
    unit_hashes: the hashes of the units below resume_tokens, so acquire() can tell a stale match.
    """

    latent_tokens: int
    resume_tokens: int
    latent_pages: list[int]
    checkpoint_pages: list[int] | None
    unit_hashes: tuple[int, ...] = ()


@dataclass
class PrefixCacheStats:
    """Exact counters: a prefix cache that silently stops hitting is a bug (SPEC §3)."""

    queries: int = 0  # acquire() calls (admissions); match() alone is a free probe
    query_tokens: int = 0  # tokens of the sequences admitted
    latent_hit_tokens: int = 0  # tokens whose latents were cached
    state_hit_tokens: int = 0  # tokens skipped: resumed from a checkpoint (≤ latent hits)
    units_committed: int = 0  # units whose latent pages were registered
    checkpoints_stored: int = 0
    checkpoints_existing: int = 0  # a checkpoint reserved or committed where one exists: nothing to do
    checkpoints_skipped: int = 0  # no pages for the copy
    evicted_units: int = 0
    evicted_checkpoints: int = 0

    def as_dict(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


class PrefixCache:
    """Chained-hash prefix cache over a PagePool; installs itself as the pool's on_evict.

    The scheduler's protocol: `match` a waiting sequence (free, any number of times), `acquire` it on
    admission, end prefill pieces at `checkpoint_positions` with pages from `reserve_checkpoint`, then
    `commit_checkpoint` and `commit_latents` after the step's forward. A sequence is hashed over
    all_token_ids (after a recompute its earlier output is prefix too); its hashes are memoised per
    sequence object, held weakly, since its tokens are only ever appended.
    """

    def __init__(self, pool: PagePool, hash_block_tokens: int, checkpoint_interval_tokens: int | None = None):
        L = pool.layout
        if L.n_mla == 0:
            raise ValueError("this model has no MLA layer: prefix caching here is keyed by latent pages")
        block, interval = hash_block_tokens, checkpoint_interval_tokens
        if block <= 0 or block % L.page_tokens:
            raise ValueError(
                f"hash_block_tokens = {block} must be a positive multiple of the page's {L.page_tokens} tokens, "
                "so a unit is whole latent pages"
            )
        interval = 4 * block if interval is None else interval
        if interval <= 0 or interval % block:
            raise ValueError(
                f"checkpoint_interval_tokens = {interval} must be a positive multiple of hash_block_tokens = {block}"
            )
        self.pool, self.hash_block_tokens, self.checkpoint_interval_tokens = pool, block, interval
        self.pages_per_unit = block // L.page_tokens
        self.stats = PrefixCacheStats()
        self._units: dict[int, list[int]] = {}  # unit hash -> its latent pages
        self._checkpoints: dict[int, list[int]] = {}  # hash of the unit ending at the checkpoint -> n_kda pages
        # unit hashes of each sequence's tokens so far; tokens only ever get appended, so they stay valid
        self._seq_hashes: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        pool.on_evict = self._on_evict

    def checkpoint_positions(self, prompt_len: int) -> list[int]:
        """Sorted token positions after which prefill fills a KDA checkpoint: every checkpoint_interval_tokens,
        and the last unit boundary strictly below prompt_len (so that an identical prompt resumes
        there and still computes its last token, whose logits it needs)."""
        last = (prompt_len - 1) // self.hash_block_tokens * self.hash_block_tokens
        positions = set(range(self.checkpoint_interval_tokens, last + 1, self.checkpoint_interval_tokens))
        if last > 0:
            positions.add(last)
        return sorted(positions)

    def match(self, tokens: list[int] | Sequence) -> PrefixMatch:
        """Walk the chained unit hashes of a prompt (token ids, or a Sequence: all its tokens, with the
        hashes memoised, so a scheduler can probe a long waiting prompt every step for free) while their
        latents are cached; resume at the deepest checkpoint below that. Changes no refcount, LRU order
        or counter."""
        if isinstance(tokens, Sequence):
            num_tokens = tokens.num_tokens
            all_hashes = iter(self._hashes(tokens, num_tokens // self.hash_block_tokens))
        else:
            num_tokens, all_hashes = len(tokens), iter_unit_hashes(tokens, self.hash_block_tokens)
        hashes = []
        for h in all_hashes:
            if h not in self._units:
                break
            hashes.append(h)
        resume_units = 0
        for n in range(len(hashes), 0, -1):
            if n * self.hash_block_tokens < num_tokens and hashes[n - 1] in self._checkpoints:
                resume_units = n
                break
        used = hashes[:resume_units]
        return PrefixMatch(
            latent_tokens=len(hashes) * self.hash_block_tokens,
            resume_tokens=resume_units * self.hash_block_tokens,
            latent_pages=[page for h in used for page in self._units[h]],
            checkpoint_pages=list(self._checkpoints[used[-1]]) if used else None,
            unit_hashes=tuple(used),
        )

    def acquire(self, seq: Sequence, match: PrefixMatch) -> None:
        """Admit seq (no latent pages, nothing computed) at match.resume_tokens: share the matched latent
        pages, give seq its n_kda state pages if it has none, and copy the checkpoint's state into them.
        Raises OutOfPages (changing nothing) if the state pages do not fit, RuntimeError if the match went
        stale (its pages were evicted since match(): match again)."""
        if seq.latent_pages or seq.num_computed_tokens:
            raise ValueError(f"acquire needs a sequence with no latents computed, got {seq!r}")
        live = [page for h in match.unit_hashes for page in self._units.get(h, ())]
        if live != match.latent_pages or (
            match.unit_hashes and self._checkpoints.get(match.unit_hashes[-1]) != match.checkpoint_pages
        ):
            raise RuntimeError("stale prefix match: its pages were evicted after match(); call match() again")
        checkpoint = match.checkpoint_pages or []
        # retained first, so that allocating the state pages cannot evict what is about to be used
        self.pool.retain(match.latent_pages + checkpoint)
        try:
            state_pages = seq.state_pages or self.pool.allocate(self.pool.layout.n_kda)
        except OutOfPages:
            self.pool.release(match.latent_pages + checkpoint)
            raise
        if checkpoint:
            self._copy_pages(checkpoint, state_pages)
        # released right after the copy: a hit moves the checkpoint to the LRU's recent end
        self.pool.release(checkpoint)
        seq.latent_pages, seq.state_pages = list(match.latent_pages), state_pages
        seq.num_computed_tokens = seq.num_cached_tokens = match.resume_tokens
        s = self.stats
        s.queries += 1
        s.query_tokens += seq.num_tokens
        s.latent_hit_tokens += match.latent_tokens
        s.state_hit_tokens += match.resume_tokens

    def commit_latents(self, seq: Sequence) -> None:
        """Register the latent pages of every full unit seq has computed, unless that unit is cached
        already (then seq's copy stays private). Pages of a full unit are never written again."""
        # a verify step may have computed tokens a stop string then cut from the output: only existing ones count
        n_units = min(seq.num_computed_tokens, seq.num_tokens) // self.hash_block_tokens
        hashes = self._hashes(seq, n_units)
        ppu = self.pages_per_unit
        if len(seq.latent_pages) < n_units * ppu:
            raise ValueError(f"{seq!r} has {len(seq.latent_pages)} latent pages for {n_units} computed units")
        for i, h in enumerate(hashes[:n_units]):
            if h in self._units:
                continue
            pages = seq.latent_pages[i * ppu : (i + 1) * ppu]
            for j, page in enumerate(pages):
                self.pool.set_key(page, ("lat", h, j))
            self._units[h] = pages
            self.stats.units_committed += 1

    def reserve_checkpoint(self, seq: Sequence, position: int) -> list[int] | None:
        """n_kda fresh pages to receive seq's KDA state after `position` tokens (a positive multiple of
        hash_block_tokens): the model runner fills them in the forward that computes that position, then
        commit_checkpoint caches them. None, counted, when that checkpoint exists or no pages are left."""
        if position <= 0 or position % self.hash_block_tokens or position > seq.num_tokens:
            raise ValueError(
                f"a checkpoint must be at a positive multiple of hash_block_tokens = {self.hash_block_tokens} "
                f"within the sequence; got position {position} for {seq!r}"
            )
        if self._unit_hash(seq, position) in self._checkpoints:
            self.stats.checkpoints_existing += 1
            return None
        try:
            return self.pool.allocate(self.pool.layout.n_kda)
        except OutOfPages:
            self.stats.checkpoints_skipped += 1
            return None

    def commit_checkpoint(self, seq: Sequence, position: int, pages: list[int]) -> None:
        """Cache reserved pages, now holding the state after `position` tokens, as that checkpoint."""
        h = self._unit_hash(seq, position)
        if h in self._checkpoints:  # another sequence stored the same checkpoint in the meantime
            self.pool.release(pages)
            self.stats.checkpoints_existing += 1
            return
        for layer, page in enumerate(pages):
            self.pool.set_key(page, ("checkpoint", h, layer))
        self._checkpoints[h] = pages
        self.pool.release(pages)
        self.stats.checkpoints_stored += 1

    def clear(self) -> None:
        """Forget everything: every cached page loses its key (unused ones become free)."""
        for page in [p for group in (self._units, self._checkpoints) for pages in group.values() for p in pages]:
            self.pool.drop_key(page)
        self._units.clear()
        self._checkpoints.clear()

    @property
    def num_units(self) -> int:
        return len(self._units)

    @property
    def num_checkpoints(self) -> int:
        return len(self._checkpoints)

    def check(self) -> None:
        """Assert that every page the cache lists is in the pool under the key the cache gave it."""
        for kind, group in (("lat", self._units), ("checkpoint", self._checkpoints)):
            for h, pages in group.items():
                for i, page in enumerate(pages):
                    assert self.pool.key(page) == (kind, h, i), f"page {page} is not cached as {(kind, h, i)}"

    def _hashes(self, seq: Sequence, n_units: int) -> list[int]:
        """The first n_units unit hashes of seq's tokens, extending the memo only as far as needed."""
        hashes = self._seq_hashes.setdefault(seq, [])
        if len(hashes) < n_units:
            B = self.hash_block_tokens
            prev = hashes[-1] if hashes else _ROOT
            for i in range(len(hashes), n_units):
                prev = chain_hash(prev, seq.token_ids(i * B, (i + 1) * B))
                hashes.append(prev)
        return hashes

    def _unit_hash(self, seq: Sequence, position: int) -> int:
        """The hash of the unit of seq ending at `position` tokens (a unit boundary)."""
        return self._hashes(seq, position // self.hash_block_tokens)[-1 + position // self.hash_block_tokens]

    def _copy_pages(self, src: list[int], dst: list[int]) -> None:
        """Copy whole pages: a KDA page is S then the conv tail, with no padding."""
        storage = self.pool.storage
        storage.index_copy_(0, torch.tensor(dst, device=storage.device), storage[src])

    def _on_evict(self, page: int, key: Hashable) -> None:
        """The pool reclaimed `page`: drop the unit or checkpoint it belonged to, all pages at once."""
        kind, h = key[:2] if isinstance(key, tuple) and len(key) == 3 else (None, None)
        group = {"lat": self._units, "checkpoint": self._checkpoints}.get(kind)
        if group is None or page not in group.get(h, ()):
            raise RuntimeError(f"the pool evicted page {page} under key {key!r}, which the prefix cache never set")
        for other in group.pop(h):
            # in use by a sequence: just no longer shared; evictable: free now (allocate() takes the
            # pages its on_evict frees before evicting more)
            if other != page:
                self.pool.drop_key(other)
        if kind == "lat":
            self.stats.evicted_units += 1
        else:
            self.stats.evicted_checkpoints += 1
