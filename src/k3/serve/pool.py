"""One paged pool (SPEC §3): every request's decoding state lives in equal-size pages of one tensor.

Pages are laid out by k3.serve.layout.PageLayout: P tokens of latents for every MLA layer, or one
KDA layer's state. A latent page has no padding, so the pool read as (pages·P, n_mla, latent_dim)
rows is one token per row, and a request whose latent pages are consecutive has each MLA layer's
latents as one strided view, read in place. Capacity is printed at start-up rather than discovered
by running out.

One allocator hands out pages with reference counts (a cached prefix is shared by many requests)
and one LRU policy reclaims pages that are cached under a key but no longer used by any request.
"""

from collections import Counter, OrderedDict
from collections.abc import Callable, Hashable, Iterable

import torch

from k3.serve.layout import PageLayout


class OutOfPages(RuntimeError):
    """More pages were asked for than are free or evictable; nothing was allocated."""

    def __init__(self, need: int, free: int, evictable: int):
        self.need, self.free, self.evictable = need, free, evictable
        super().__init__(
            f"need {need} pages but only {free + evictable} are available ({free} free + {evictable} evictable); "
            "release requests or give the pool more memory"
        )


class PagePool:
    """`num_pages` pages of `layout.page_elems` values (of `layout.dtype`) in one tensor allocated once,
    and their allocator.

    Every page is exactly one of: free; used (refcount ≥ 1); evictable (refcount 0 but cached under a
    key, kept until the space is needed, least recently released first). The bookkeeping is plain
    Python with O(1) work per page; only the storage is a tensor.
    """

    def __init__(self, layout: PageLayout, num_pages: int, device: torch.device | str = "cpu"):
        if num_pages < 1:
            raise ValueError(f"a page pool needs at least one page, got num_pages = {num_pages}")
        self.layout, self.num_pages = layout, num_pages
        self.storage = torch.zeros(num_pages, layout.page_elems, device=device, dtype=layout.dtype)  # (N, page_elems)
        self._refcount = [0] * num_pages
        self._free = list(range(num_pages - 1, -1, -1))  # a stack: pop() hands out page 0 first
        self._lru: OrderedDict[int, None] = OrderedDict()  # evictable pages, least recently released first
        self._keys: dict[int, Hashable] = {}
        self._released_at: dict[int, int] = {}  # when each evictable page was released; check() verifies LRU order
        self._clock = 0
        self.on_evict: Callable[[int, Hashable], None] | None = None
        self._scratch = self.storage.new_empty(0)
        self._views: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}  # name -> (the storage it views, the view)

    @classmethod
    def from_budget(cls, layout: PageLayout, memory_bytes: int, device: torch.device | str = "cpu") -> "PagePool":
        """As many pages as fit in `memory_bytes`; at least one request (at context 1) must fit."""
        page_bytes = layout.bytes_per_page
        minimum = layout.request_pages(1)
        if memory_bytes // page_bytes < minimum:
            raise ValueError(
                f"a memory budget of {memory_bytes} bytes holds {memory_bytes // page_bytes} pages of {page_bytes} "
                f"bytes; one request needs at least {minimum} pages ({minimum * page_bytes} bytes): raise the budget"
            )
        return cls(layout, memory_bytes // page_bytes, device=device)

    def scratch(self, numel: int) -> torch.Tensor:
        """A reusable 1-D buffer of `numel` values in the pool's dtype, for the model runner's gathers of
        cached latents; its contents are overwritten by each user. Kept (grown, never shrunk) up to a
        quarter of the pool's size, so its memory stays a bounded share of what the budget printed;
        a larger request gets a tensor of its own."""
        if numel > self.storage.numel() // 4:
            return self.storage.new_empty(numel)
        if self._scratch.numel() < numel:
            self._scratch = self.storage.new_empty(numel)
        return self._scratch[:numel]

    def _view(self, name: str, build: Callable[[], torch.Tensor]) -> torch.Tensor:
        """A view of the storage, made once (each layer of each step asks for them: a few ops apiece)."""
        kept = self._views.get(name)
        if kept is None or kept[0] is not self.storage:
            kept = self._views[name] = (self.storage, build())
        return kept[1]

    def kda_states(self) -> torch.Tensor:
        """(N, H, K, V) in layout.state_dtype (fp32 whatever the pool's dtype): S of the KDA layer whose
        state a page holds, the page's first bytes. Each row is contiguous; rows are a page apart."""
        return self._view("kda_states", self._kda_states)

    def _kda_states(self) -> torch.Tensor:
        L = self.layout
        S = self.storage[:, : L.state_elems]
        if S.dtype != L.state_dtype:
            S = S.view(L.state_dtype)  # a 16-bit pool: pairs of values read as one fp32 number
        return S.view(self.num_pages, L.kda_heads, L.kda_head_dim, L.kda_head_dim)

    def kda_conv(self) -> torch.Tensor:
        """(N, 2HK + HV, kernel−1): the conv tail stored right after S."""
        L = self.layout
        return self._view(
            "kda_conv",
            lambda: self.storage[:, L.state_elems : L.state_elems + L.conv_elems].view(
                self.num_pages, L.conv_channels, L.conv_width
            ),
        )

    def latents(self) -> torch.Tensor:
        """(N, P, n_mla, latent_dim): token t of a request sits in its latent page t // P at slot t % P.

        Overlaps kda_states() of the same page: a page holds either a KDA state or latents, never both."""
        L = self.layout
        return self._view("latents", lambda: self.storage.view(self.num_pages, L.page_tokens, L.n_mla, L.latent_dim))

    def latent_rows(self) -> torch.Tensor:
        """(N·P, n_mla, latent_dim): the latents one token slot per row, across page boundaries (a latent
        page has no padding), so consecutive pages are one run of rows."""
        L = self.layout
        return self.storage.view(self.num_pages * L.page_tokens, L.n_mla, L.latent_dim)

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_evictable(self) -> int:
        return len(self._lru)

    @property
    def num_used(self) -> int:
        return self.num_pages - len(self._free) - len(self._lru)

    def available(self) -> int:
        """Pages an allocate() can hand out now: free ones, then cached ones nobody uses."""
        return len(self._free) + len(self._lru)

    def refcount(self, page: int) -> int:
        return self._refcount[page]

    def key(self, page: int) -> Hashable | None:
        return self._keys.get(page)

    def allocate(self, n: int) -> list[int]:
        """n pages with refcount 1: free pages first, then the least recently released cached pages
        (on_evict(page, key) is called for each). Raises OutOfPages, allocating nothing, if n > available."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} pages")
        if n > self.available():
            raise OutOfPages(n, len(self._free), len(self._lru))
        pages = [self._free.pop() for _ in range(min(n, len(self._free)))]
        for page in pages:
            self._refcount[page] = 1
        while len(pages) < n:
            # on_evict may drop the keys of sibling pages (a checkpoint is evicted whole), which moves
            # them from the LRU to the free list: take those before evicting anything more
            if self._free:
                page = self._free.pop()
                self._refcount[page] = 1
                pages.append(page)
                continue
            page, _ = self._lru.popitem(last=False)
            key = self._keys.pop(page)
            del self._released_at[page]
            self._refcount[page] = 1
            pages.append(page)
            # the page is already used and keyless when the callback runs: the pool is consistent
            if self.on_evict is not None:
                self.on_evict(page, key)
        return pages

    def retain(self, pages: Iterable[int]) -> None:
        """One more reference to each page (a shared prefix); an evictable page leaves the LRU."""
        pages = self._pages(pages)
        for page in pages:
            if self._refcount[page] == 0 and page not in self._lru:
                raise ValueError(f"page {page} is free: only a used or cached page can be retained")
        for page in pages:
            if self._refcount[page] == 0:
                del self._lru[page]
                del self._released_at[page]
            self._refcount[page] += 1

    def release(self, pages: Iterable[int]) -> None:
        """One reference less to each page. At 0 a page with a key becomes evictable (most recent at the
        LRU's end), one without becomes free. Releasing more references than a page holds raises
        ValueError (a double free) and changes nothing."""
        pages = self._pages(pages)
        for page, times in Counter(pages).items():
            if times > self._refcount[page]:
                state = "evictable" if page in self._lru else "free" if self._refcount[page] == 0 else "used"
                raise ValueError(
                    f"double free: page {page} is {state} with refcount {self._refcount[page]}, released {times}×"
                )
        for page in pages:
            self._refcount[page] -= 1
            if self._refcount[page] == 0:
                if page in self._keys:
                    self._lru[page] = None
                    self._clock += 1
                    self._released_at[page] = self._clock
                else:
                    self._free.append(page)

    def set_key(self, page: int, key: Hashable) -> None:
        """Mark a used page as cached under `key` (the prefix cache's hash), so that on its last release
        it is kept until the space is needed. A page has at most one key."""
        self._pages([page])
        if key is None:
            raise ValueError("a cache key cannot be None: key() returns None for a page without one")
        if self._refcount[page] == 0:
            raise ValueError(f"page {page} is not in use: only a page holding data can be cached")
        old = self._keys.get(page)
        if old is not None and old != key:
            raise ValueError(f"page {page} is already cached under {old!r}; drop_key it before caching it as {key!r}")
        self._keys[page] = key

    def drop_key(self, page: int) -> None:
        """Forget the page's key (a no-op without one); an evictable page becomes free, on_evict not called."""
        self._pages([page])
        if self._keys.pop(page, None) is not None and page in self._lru:
            del self._lru[page]
            del self._released_at[page]
            self._free.append(page)

    def _pages(self, pages: Iterable[int]) -> list[int]:
        pages = list(pages)
        for page in pages:
            # a negative index would silently name another page
            if not 0 <= page < self.num_pages:
                raise ValueError(f"page {page} is not in this pool of {self.num_pages} pages")
        return pages

    def check(self) -> None:
        """Assert the allocator's invariants: the pages are partitioned into free, used and evictable;
        refcounts and keys agree with that; the LRU is in release order."""
        free, lru = set(self._free), set(self._lru)
        assert len(free) == len(self._free), "a page is on the free list twice"
        assert not free & lru, f"pages both free and evictable: {sorted(free & lru)}"
        for page, count in enumerate(self._refcount):
            assert count >= 0, f"page {page} has refcount {count}"
            if count == 0:
                assert (page in free) != (page in lru), f"unused page {page} is neither free nor evictable"
            else:
                assert page not in free and page not in lru, f"page {page} is used but listed as free or evictable"
        assert all(self._refcount[p] == 0 and p in self._keys for p in lru), "an evictable page is used or keyless"
        assert not free & self._keys.keys(), f"free pages with keys: {sorted(free & self._keys.keys())}"
        stamps = [self._released_at[p] for p in self._lru]
        assert stamps == sorted(stamps) and self._released_at.keys() == lru, "LRU out of release order"
        assert self.num_free + self.num_evictable + self.num_used == self.num_pages

    def capacity(self, context: int) -> dict:
        """Page arithmetic for requests at `context` tokens; padding is counted in values."""
        L = self.layout
        page_bytes = L.page_elems * self.storage.element_size()
        per_request = L.request_pages(context)
        return {
            "pages": self.num_pages,
            "page_bytes": page_bytes,
            "memory_bytes": self.num_pages * page_bytes,
            "page_tokens": L.page_tokens,
            "state_padding": L.state_padding,  # per KDA state page
            "context": context,
            "request_pages": per_request,  # n_kda state pages + latent pages
            "request_padding": L.request_padding(context),
            "requests_at_context": self.num_pages // per_request,
            "tokens": self.num_pages * L.page_tokens,  # latent tokens if the pool held no KDA states
        }

    def describe(self, contexts: Iterable[int] = (1024, 8192, 131072, 1048576)) -> str:
        """A few lines for start-up: memory, pages, P, padding, and max concurrent requests per context."""
        L, cap = self.layout, self.capacity(1)
        pad = f"{L.state_padding:,} values ({L.state_padding / L.page_elems:.1%})"
        lines = [
            f"page pool: {self.num_pages:,} pages × {_size(cap['page_bytes'])} = {_size(cap['memory_bytes'])} "
            f"({self.storage.dtype}, {self.storage.device})",
            f"  page = P = {L.page_tokens} tokens × {L.n_mla} MLA layers × {L.latent_dim} latent values; "
            f"or one KDA layer's state: {L.state_elems:,} (S, {L.state_dtype}) + {L.conv_elems:,} (conv) values, "
            f"padding {pad}",
            f"  request = {L.n_kda} KDA state pages + ceil(tokens / {L.page_tokens}) latent pages; "
            f"{cap['tokens']:,} latent tokens in all",
        ]
        for context in contexts:
            c = self.capacity(context)
            lines.append(
                f"  context {context:>9,}: {c['request_pages']:>6,} pages/request "
                f"(padding {_size(c['request_padding'] * self.storage.element_size())}), "
                + (f"max {c['requests_at_context']:,} concurrent" if c["requests_at_context"] else "does not fit")
            )
        return "\n".join(lines)


def _size(n: int) -> str:
    """Bytes in the largest binary unit below 1024 of it (up to GiB)."""
    if n < 1024:
        return f"{n} B"
    exp = min(3, (n.bit_length() - 1) // 10)
    return f"{n / 1024**exp:.2f} {('KiB', 'MiB', 'GiB')[exp - 1]}"
