"""Runs the model over the page pool: one forward per engine step for every sequence in it, prefill
chunks of any lengths and single decode tokens alike.

The step is a packed batch (k3.model.cache.PackedLayerCache): the sequences' new tokens one after
another in a (1, ΣT) row, those of equal length adjacent, so every projection, norm and expert runs
once over all of them and only the convolution, recurrence and attention run per group of equal
lengths (all decodes form one group). Each group's cache is an adapter over the pool, so the same
layer code serves the plain cache and the paged one:
- `PagedKDAState`: the `state` / `conv` of one KDA layer for B sequences are rows of the pool's KDA
  views, one page per sequence and layer (gathered on read, written back in place on assignment).
- `PagedMLALatents`: one MLA layer's latents live in each sequence's latent pages, P tokens a page;
  `append` writes the new tokens into their slots and returns every sequence's latents padded to the
  longest, with the mask that hides the padding and keeps attention causal.
"""

from dataclasses import dataclass

import torch

from k3.model.cache import PackedLayerCache
from k3.model.model import K3Model
from k3.serve.pool import PagePool


class PagedKDAState:
    """KDALayerCache's interface for one KDA layer of B sequences; rows (B,) index the pool's pages.

    snapshot = (which, pages): also write rows `which` of every new state into those pages, a copy of
    the state at this point of the forward (a prefix-cache checkpoint, taken without another pass).
    """

    def __init__(self, pool: PagePool, rows: torch.Tensor, snapshot: tuple[torch.Tensor, torch.Tensor] | None = None):
        self.pool, self.rows, self.snapshot = pool, rows, snapshot

    @property
    def state(self) -> torch.Tensor:  # (B, H, K, V)
        return self.pool.kda_states()[self.rows]

    @state.setter
    def state(self, value: torch.Tensor) -> None:
        self._write(self.pool.kda_states(), value)

    @property
    def conv(self) -> torch.Tensor:  # (B, 2HK + HV, kernel − 1)
        return self.pool.kda_conv()[self.rows]

    @conv.setter
    def conv(self, value: torch.Tensor) -> None:
        self._write(self.pool.kda_conv(), value)

    def _write(self, view: torch.Tensor, value: torch.Tensor) -> None:
        value = value.to(view.dtype)
        view.index_copy_(0, self.rows, value)
        if self.snapshot is not None:
            which, pages = self.snapshot
            view.index_copy_(0, pages, value[which])


class PagedMLALatents:
    """MLALayerCache's interface for one MLA layer of B sequences with their own lengths and page tables."""

    def __init__(self, pool: PagePool, mla_index: int, tables: torch.Tensor, past: torch.Tensor, rank: int,
                 first_page: int | None = None):  # fmt: skip
        self.pool, self.mla_index, self.rank = pool, mla_index, rank
        self.tables = tables  # (B, pages) page ids, padded with page 0 past a sequence's own pages
        self.past = past  # (B,) tokens already cached per sequence
        # B = 1 and the pages are first_page, first_page + 1, …: the latents are read in place
        self.first_page = first_page

    def _slots(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, n) token positions -> the page and the slot in it of each."""
        P = self.pool.layout.page_tokens
        page_index = (positions // P).clamp(max=self.tables.shape[1] - 1)
        return self.tables.gather(1, page_index), positions % P

    def append(self, c_kv: torch.Tensor, k_pe: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write (B, T, ·) new entries at each sequence's next positions; return (B, L, ·) for all."""
        B, T, _ = c_kv.shape
        latents = self.pool.latents()[:, :, self.mla_index]  # (pages, P, rank + rope)
        new = torch.arange(T, device=c_kv.device)[None] + self.past[:, None]  # (B, T)
        pages, slots = self._slots(new)
        latents[pages, slots] = torch.cat([c_kv, k_pe], dim=-1).to(latents.dtype)
        P, L = self.pool.layout.page_tokens, int(self.past.max()) + T
        if self.first_page is not None:
            # one run of pages: a strided view of the pool, no copy (rows n_mla·latent_dim apart)
            start = self.first_page * P
            cached = self.pool.latent_rows()[start : start + L, self.mla_index].unsqueeze(0)
        else:
            # read whole pages (P rows each), not token by token, into a buffer kept across steps: a
            # fresh multi-MB tensor per layer and step costs page faults
            n = -(-L // P)
            idx = self.tables[:, :n].flatten()
            buf = self.pool.scratch(len(idx) * latents[0].numel()).view(len(idx), *latents.shape[1:])
            cached = torch.index_select(latents, 0, idx, out=buf).view(B, n * P, -1)[:, :L]
        cached = cached.to(c_kv.dtype)  # (B, L, rank + rope); rows past their length are padding
        return cached[..., : self.rank], cached[..., self.rank :]

    def attention_mask(self, T: int, device: torch.device) -> torch.Tensor | None:
        """(B, T, L): query i of sequence b sits at past_b + i and sees keys 0 … past_b + i. None for one
        sequence and one new token: it sees every key."""
        if T == 1 and len(self.past) == 1:
            return None
        L = int(self.past.max()) + T
        query_pos = self.past[:, None] + torch.arange(T, device=device)[None]  # (B, T)
        return torch.arange(L, device=device)[None, None] <= query_pos[..., None]


@dataclass
class _Piece:
    """One sequence's tokens start … start + num_tokens − 1 in a step; `phase` orders the pieces of
    one sequence."""

    seq: object
    start: int
    num_tokens: int
    phase: int
    snapshot: list[int] | None


class PagedCache:
    """What K3Model.forward takes as `cache`: one PackedLayerCache per layer."""

    def __init__(self, layers: list[PackedLayerCache]):
        self.layers, self.seq_len = layers, 0


class ModelRunner:
    """model + pool. Sequences (k3.serve.sequence.Sequence) carry their pages: `state_pages` (one per
    KDA layer, in layer order) and `latent_pages` (enough for every token computed so far and this step)."""

    def __init__(self, model: K3Model, pool: PagePool):
        self.model, self.pool = model.eval(), pool
        self.config = model.config
        self.device = pool.storage.device

    def _cache(self, groups: list[list[_Piece]]) -> PagedCache:
        """groups: pieces of equal phase and length, in packed order -> one adapter per group and layer."""
        dev = self.device
        per_group, pos = [], 0
        for group in groups:
            seqs = [p.seq for p in group]
            width = max(1, max(len(s.latent_pages) for s in seqs))
            tables = [s.latent_pages + [0] * (width - len(s.latent_pages)) for s in seqs]
            pages = seqs[0].latent_pages
            one_run = len(seqs) == 1 and pages and pages == list(range(pages[0], pages[0] + len(pages)))
            snap = [(i, p.snapshot) for i, p in enumerate(group) if p.snapshot is not None]
            end = pos + len(group) * group[0].num_tokens
            per_group.append(dict(
                range=(pos, end, len(group)),
                kda_rows=torch.tensor([s.state_pages for s in seqs], device=dev).t(),  # (n_kda, rows)
                # rows within the group, and their (n_kda, ·) checkpoint pages
                snapshot=(torch.tensor([i for i, _ in snap], device=dev),
                          torch.tensor([pages for _, pages in snap], device=dev).t()) if snap else None,
                mla=dict(tables=torch.tensor(tables, device=dev), rank=self.config.kv_lora_rank,
                         past=torch.tensor([p.start for p in group], device=dev),
                         first_page=pages[0] if one_run else None),
            ))  # fmt: skip
            pos = end
        layers, kda, mla = [], 0, 0
        for kind in self.config.layer_types:
            if kind == "kda":
                subs = [
                    PagedKDAState(self.pool, g["kda_rows"][kda],
                                  (g["snapshot"][0], g["snapshot"][1][kda]) if g["snapshot"] else None)
                    for g in per_group
                ]  # fmt: skip
                kda += 1
            else:
                subs = [PagedMLALatents(self.pool, mla, **g["mla"]) for g in per_group]
                mla += 1
            layers.append(PackedLayerCache([(*g["range"], sub) for g, sub in zip(per_group, subs, strict=True)]))
        return PagedCache(layers)

    def reset_state(self, seqs: list) -> None:
        """Zero the sequences' KDA state pages: a fresh request starts from S = 0 and empty conv tails."""
        if not seqs:
            return
        rows = torch.tensor([p for s in seqs for p in s.state_pages], device=self.device)
        self.pool.kda_states()[rows] = 0
        self.pool.kda_conv()[rows] = 0

    @torch.no_grad()
    def run(self, prefill: list[tuple], decode: list) -> torch.Tensor:
        """One forward for the whole step.

        prefill: (seq, num_tokens) or (seq, num_tokens, snapshot_pages) items, each computing the next
        num_tokens of seq's prompt; several items of one sequence continue each other in list order
        (they run one after another inside each layer). snapshot_pages: n_kda pages that receive the
        sequence's KDA state (and conv tails) after the item. decode: sequences whose every token but
        the last is computed.
        Returns logits (len(prefill) + len(decode), vocab): each prefill item's last position, then each decode.
        """
        work, next_start, phase = [], {}, {}
        for seq, n, *snapshot in prefill:
            start = next_start.get(id(seq), seq.num_computed_tokens)
            work.append(_Piece(seq, start, n, phase.get(id(seq), 0), snapshot[0] if snapshot else None))
            next_start[id(seq)], phase[id(seq)] = start + n, phase.get(id(seq), 0) + 1
        work += [_Piece(s, s.num_tokens - 1, 1, 0, None) for s in decode]
        if not work:
            return torch.empty(0, self.config.vocab_size, device=self.device)
        self.reset_state([p.seq for p in work if p.start == 0])
        # later pieces of a sequence after earlier ones; equal lengths adjacent (stable, so the decodes
        # stay in order); remember where each item went
        order = sorted(range(len(work)), key=lambda i: (work[i].phase, work[i].num_tokens))
        groups: list[list[_Piece]] = []
        for i in order:
            p = work[i]
            if groups and (groups[-1][0].phase, groups[-1][0].num_tokens) == (p.phase, p.num_tokens):
                groups[-1].append(p)
            else:
                groups.append([p])
        ids = [t for i in order for t in work[i].seq.token_ids(work[i].start, work[i].start + work[i].num_tokens)]
        ends = torch.tensor([work[i].num_tokens for i in order], device=self.device).cumsum(0) - 1  # last tokens
        # each MLA layer takes the model's configured path; the default, "auto", picks per group
        # (latent-space attention for decodes, per-head keys and values for long prefill chunks)
        logits = self.model(torch.tensor([ids], device=self.device), cache=self._cache(groups), logits_at=ends).logits[
            0
        ]
        for p in work:
            p.seq.num_computed_tokens = max(p.seq.num_computed_tokens, p.start + p.num_tokens)
        back = torch.empty(len(order), dtype=torch.long, device=self.device)
        back[torch.tensor(order, device=self.device)] = torch.arange(len(order), device=self.device)
        return logits[back]

    def prefill(self, seq, num_tokens: int) -> torch.Tensor:
        """Compute the next num_tokens of seq's prompt into the pool; returns the last position's logits (vocab,)."""
        return self.run([(seq, num_tokens)], [])[0]

    def decode(self, seqs: list) -> torch.Tensor:
        """One step for sequences whose every token but the last is computed; returns logits (B, vocab)."""
        return self.run([], seqs)
