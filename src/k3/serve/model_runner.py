"""Runs the model over the page pool: a prefill chunk of one sequence, or one decode step for a batch
of sequences of different lengths.

The model's layers take a cache object per layer (k3.model.cache); here each is an adapter over the
pool, so the same layer code serves the plain cache and the paged one:
- `PagedKDAState`: the `state` / `conv` of one KDA layer for B sequences are rows of the pool's KDA
  views, one page per sequence and layer (gathered on read, written back in place on assignment).
- `PagedMLALatents`: one MLA layer's latents live in each sequence's latent pages, P tokens a page;
  `append` writes the new tokens into their slots and returns every sequence's latents padded to the
  longest, with the mask that hides the padding and keeps attention causal.
"""

import contextlib

import torch

from k3.model.mla import GatedMLA
from k3.model.model import K3Model
from k3.serve.pool import PagePool


class PagedKDAState:
    """KDALayerCache's interface for one KDA layer of B sequences; rows (B,) index the pool's pages."""

    def __init__(self, pool: PagePool, rows: torch.Tensor):
        self.pool, self.rows = pool, rows

    @property
    def state(self) -> torch.Tensor:  # (B, H, K, V)
        return self.pool.kda_states()[self.rows]

    @state.setter
    def state(self, value: torch.Tensor) -> None:
        self.pool.kda_states().index_copy_(0, self.rows, value.to(self.pool.storage.dtype))

    @property
    def conv(self) -> torch.Tensor:  # (B, 2HK + HV, kernel − 1)
        return self.pool.kda_conv()[self.rows]

    @conv.setter
    def conv(self, value: torch.Tensor) -> None:
        self.pool.kda_conv().index_copy_(0, self.rows, value.to(self.pool.storage.dtype))


class PagedMLALatents:
    """MLALayerCache's interface for one MLA layer of B sequences with their own lengths and page tables."""

    def __init__(self, pool: PagePool, mla_index: int, tables: torch.Tensor, past: torch.Tensor, rank: int):
        self.pool, self.mla_index, self.rank = pool, mla_index, rank
        self.tables = tables  # (B, pages) page ids, padded with page 0 past a sequence's own pages
        self.past = past  # (B,) tokens already cached per sequence
        self.T = 0

    def _slots(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, n) token positions -> the page and the slot in it of each."""
        P = self.pool.layout.page_tokens
        page_index = (positions // P).clamp(max=self.tables.shape[1] - 1)
        return self.tables.gather(1, page_index), positions % P

    def append(self, c_kv: torch.Tensor, k_pe: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write (B, T, ·) new entries at each sequence's next positions; return (B, L, ·) for all."""
        B, T, _ = c_kv.shape
        self.T = T
        latents = self.pool.latents()[:, self.mla_index]  # (pages, P, rank + rope)
        new = torch.arange(T, device=c_kv.device)[None] + self.past[:, None]  # (B, T)
        pages, slots = self._slots(new)
        latents[pages, slots] = torch.cat([c_kv, k_pe], dim=-1).to(latents.dtype)
        L = int(self.past.max()) + T
        pages, slots = self._slots(torch.arange(L, device=c_kv.device).expand(B, L))
        cached = latents[pages, slots].to(c_kv.dtype)  # (B, L, rank + rope); rows past their length are padding
        return cached[..., : self.rank], cached[..., self.rank :]

    def attention_mask(self, T: int, device: torch.device) -> torch.Tensor:
        """(B, T, L): query i of sequence b sits at past_b + i and sees keys 0 … past_b + i."""
        L = int(self.past.max()) + T
        query_pos = self.past[:, None] + torch.arange(T, device=device)[None]  # (B, T)
        return torch.arange(L, device=device)[None, None] <= query_pos[..., None]


class PagedCache:
    """What K3Model.forward takes as `cache`: one adapter per layer."""

    def __init__(self, layers: list):
        self.layers, self.seq_len = layers, 0


class ModelRunner:
    """model + pool. Sequences (k3.serve.sequence.Sequence) carry their pages: `state_pages` (one per
    KDA layer, in layer order) and `latent_pages` (enough for every token computed so far and this step)."""

    def __init__(self, model: K3Model, pool: PagePool):
        self.model, self.pool = model.eval(), pool
        self.config = model.config
        self.device = pool.storage.device
        self.mla = [m for m in model.modules() if isinstance(m, GatedMLA)]

    @contextlib.contextmanager
    def _mla_path(self, impl: str):
        """Prefill chunks materialise per-head keys and values once for many queries ("naive"); a decode
        step has one query per sequence, so it attends to the cached latents directly ("absorbed").
        The model is shared: its configured path is restored afterwards."""
        for m in self.mla:
            m.impl = impl
        try:
            yield
        finally:
            for m in self.mla:
                m.impl = self.config.mla_impl

    def _cache(self, seqs: list, past: list[int]) -> PagedCache:
        past_t = torch.tensor(past, device=self.device)
        width = max(1, max(len(s.latent_pages) for s in seqs))
        tables = torch.tensor([s.latent_pages + [0] * (width - len(s.latent_pages)) for s in seqs], device=self.device)
        layers, kda, mla = [], 0, 0
        for kind in self.config.layer_types:
            if kind == "kda":
                layers.append(
                    PagedKDAState(self.pool, torch.tensor([s.state_pages[kda] for s in seqs], device=self.device))
                )
                kda += 1
            else:
                layers.append(PagedMLALatents(self.pool, mla, tables, past_t, self.config.kv_lora_rank))
                mla += 1
        return PagedCache(layers)

    def reset_state(self, seq) -> None:
        """Zero a sequence's KDA state pages: a fresh request starts from S = 0 and empty conv tails."""
        rows = torch.tensor(seq.state_pages, device=self.device)
        self.pool.kda_states()[rows] = 0
        self.pool.kda_conv()[rows] = 0

    @torch.no_grad()
    def prefill(self, seq, num_tokens: int) -> torch.Tensor:
        """Compute the next num_tokens of seq's prompt into the pool; returns the last position's logits (vocab,)."""
        start = seq.num_computed_tokens
        if start == 0:
            self.reset_state(seq)
        ids = torch.tensor([seq.all_token_ids[start : start + num_tokens]], device=self.device)
        with self._mla_path("naive"):
            logits = self.model(ids, cache=self._cache([seq], [start])).logits[0, -1]
        seq.num_computed_tokens = start + num_tokens
        return logits

    @torch.no_grad()
    def decode(self, seqs: list) -> torch.Tensor:
        """One step for sequences whose every token but the last is computed; returns logits (B, vocab)."""
        ids = torch.tensor([[s.all_token_ids[-1]] for s in seqs], device=self.device)
        with self._mla_path("absorbed"):
            logits = self.model(ids, cache=self._cache(seqs, [s.num_tokens - 1 for s in seqs])).logits[:, -1]
        for s in seqs:
            s.num_computed_tokens = s.num_tokens
        return logits
