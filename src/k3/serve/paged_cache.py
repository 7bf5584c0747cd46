"""The model's cache over the page pool for one step: the plan's pieces packed in one (1, ΣT) row.

The pieces' tokens go one after another, those of equal phase and length adjacent, so every
projection, norm and expert runs once over all of them; only the sequence mixing (convolution,
recurrence, attention) runs per group of equal lengths (all decodes form one group), through
`PackedLayerCache.mix`, the protocol k3.model.cache.GroupedLayerCache. Each group's cache is an
adapter over the pool with the interface of the plain caches, so the layers need no serving code, and a
`mix` that runs the layer's mixing on the group's rows:
- `PagedKDAState` (k3.serve.kda_state): the `state` / `conv` of one KDA layer for B sequences are rows of
  the pool's KDA views, also written into the pages of the KDA checkpoints the plan asks for; for proposal
  rows (speculative decoding) it keeps what returning them to their last accepted token needs.
- `PagedMLALatents`: one MLA layer's latents live in each sequence's latent pages, P tokens a page;
  `append` writes the new tokens into their slots and returns every sequence's latents padded to the
  longest, with the mask that hides the padding and keeps attention causal.
"""

from collections.abc import Callable, Sequence
from itertools import accumulate, pairwise

import torch

from k3.config import K3Config
from k3.model.cache import GroupedLayerCache, causal_mask
from k3.serve.kda_state import PagedKDAState
from k3.serve.plan import DecodeRow, PrefillPiece, ProposalRow
from k3.serve.pool import PagePool

Piece = PrefillPiece | DecodeRow | ProposalRow


class PagedMLALatents:
    """MLALayerCache's interface for one MLA layer of B sequences with their own lengths and page tables."""

    def __init__(
        self,
        pool: PagePool,
        mla_index: int,
        tables: torch.Tensor,
        past: torch.Tensor,
        rank: int,
        first_page: int | None = None,
    ):
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

    def decode_pages(self) -> tuple[torch.Tensor, int, torch.Tensor, torch.Tensor]:
        """(the pool's latents (pages, P, n_mla, ·), this MLA layer's index, page tables (B, W), tokens cached (B,)):
        where a one-token step may write its latent and attend in place (GatedMLA.attend)."""
        return self.pool.latents(), self.mla_index, self.tables, self.past

    def mix(self, mix: Callable[..., torch.Tensor], *parts: torch.Tensor) -> torch.Tensor:
        return mix(*parts, self)

    def attention_mask(self, T: int, device: torch.device) -> torch.Tensor | None:
        """(B, T, L): query i of sequence b sits at past_b + i and sees keys 0 … past_b + i. None for one
        sequence and one new token: it sees every key."""
        if T == 1 and len(self.past) == 1:
            return None
        query_pos = self.past[:, None] + torch.arange(T, device=device)[None]  # (B, T)
        return causal_mask(query_pos, int(self.past.max()) + T)


def _progression(rows: list[int]) -> tuple[int, int] | None:
    """(first, step) if rows = first + step·i with step ≥ 1 (any single row), else None."""
    step = rows[1] - rows[0] if len(rows) > 1 else 1
    if step < 1 or any(b - a != step for a, b in pairwise(rows)):
        return None
    return rows[0], step


class PackedLayerCache(GroupedLayerCache):
    """One layer's cache for the packed step. groups[i] = (start, end, rows, cache): tokens start:end are
    `rows` sequences of (end − start) / rows tokens each, and `cache` (PagedKDAState or PagedMLALatents)
    serves those rows with B = rows."""

    def __init__(self, groups: list[tuple[int, int, int, PagedKDAState | PagedMLALatents]]):
        self.groups = groups

    def mix(self, mix: Callable[..., torch.Tensor], *xs: torch.Tensor) -> torch.Tensor:
        if len(self.groups) == 1:  # one group (a decode batch, one prefill piece): views, no slices or concatenation
            _, end, rows, sub = self.groups[0]
            out = sub.mix(mix, *(x.view(rows, end // rows, *x.shape[2:]) for x in xs))
            return out.reshape(1, end, *out.shape[2:])
        outs = []
        for start, end, rows, sub in self.groups:
            parts = [x[:, start:end].reshape(rows, (end - start) // rows, *x.shape[2:]) for x in xs]
            out = sub.mix(mix, *parts)
            outs.append(out.reshape(1, end - start, *out.shape[2:]))
        return torch.cat(outs, dim=1)


class PackedBatch:
    """A plan's pieces packed for one forward: what K3Model.forward takes as `cache` (`layers`, one
    PackedLayerCache per layer, and `seq_len`), with the (1, ΣT) token ids and where to read logits.

    Packed order: by (phase, num_tokens, proposal row), stable, so a request's later pieces follow its earlier
    ones, decodes stay together in plan order, and proposal rows form groups of their own (their KDA states
    are kept for a rollback, `rollback`). logits_at (n,): the last num_logits tokens of each sampled piece
    (one, or all of a proposal row's), in plan order, so the model's output rows are in plan.sampled's order.
    """

    def __init__(self, pool: PagePool, config: K3Config, pieces: Sequence[Piece], rollback: str = "snapshot"):
        self.pool, self.seq_len, self.rollback_mode = pool, 0, rollback
        device = pool.storage.device

        def key(p: Piece) -> tuple[int, int, bool]:
            return p.phase, p.num_tokens, isinstance(p, ProposalRow)

        order = sorted(range(len(pieces)), key=lambda i: key(pieces[i]))
        groups: list[list[Piece]] = []
        for i in order:
            p = pieces[i]
            if groups and key(groups[-1][0]) == key(p):
                groups[-1].append(p)
            else:
                groups.append([p])
        self.token_ids = torch.tensor([[t for i in order for t in pieces[i].token_ids]], device=device)
        # where each piece's last token lands in the packed row
        last = {i: n - 1 for i, n in zip(order, accumulate(pieces[i].num_tokens for i in order), strict=True)}
        self.logits_at = torch.tensor(
            [last[i] - p.num_logits + 1 + j for i, p in enumerate(pieces) if p.sample for j in range(p.num_logits)],
            device=device,
            dtype=torch.long,
        )
        self.rollback_states: list[PagedKDAState] = []  # the KDA states of proposal rows, every layer
        self.layers = self._layers(config, groups, device)

    def rollback(self, accepted: dict) -> None:
        """Every proposal row's KDA states and conv tails (all layers) back to just after its accepted tokens:
        accepted[seq] of its num_tokens tokens are computed (k3.serve.kda_state)."""
        for sub in self.rollback_states:
            sub.rollback(accepted)

    def _layers(self, config: K3Config, groups: list[list[Piece]], device: torch.device) -> list[PackedLayerCache]:
        per_group, pos = [], 0
        for group in groups:
            width = max(1, max(len(p.latent_pages) for p in group))
            tables = [list(p.latent_pages) + [0] * (width - len(p.latent_pages)) for p in group]
            pages = group[0].latent_pages
            one_run = len(group) == 1 and pages and pages == tuple(range(pages[0], pages[0] + len(pages)))
            filled = [(i, p.checkpoint_pages) for i, p in enumerate(group) if p.checkpoint_pages is not None]
            end = pos + len(group) * group[0].num_tokens
            per_group.append(
                dict(
                    range=(pos, end, len(group)),
                    proposal_seqs=[p.seq for p in group] if isinstance(group[0], ProposalRow) else None,
                    # (n_kda, rows), each layer's rows contiguous (what the decoding kernel reads)
                    kda_rows=torch.tensor([p.state_pages for p in group], device=device).t().contiguous(),
                    kda_progressions=[
                        _progression([p.state_pages[j] for p in group]) for j in range(len(group[0].state_pages))
                    ],
                    # rows within the group, and their (n_kda, ·) checkpoint pages
                    checkpoint=(
                        torch.tensor([i for i, _ in filled], device=device),
                        torch.tensor([pages for _, pages in filled], device=device).t(),
                    )
                    if filled
                    else None,
                    mla=dict(
                        tables=torch.tensor(tables, device=device),
                        rank=config.kv_lora_rank,
                        past=torch.tensor([p.start for p in group], device=device),
                        first_page=pages[0] if one_run else None,
                    ),
                )
            )
            pos = end
        layers, kda, mla = [], 0, 0
        for kind in config.layer_types:
            if kind == "kda":
                subs = [self._kda_state(g, kda) for g in per_group]
                self.rollback_states += [sub for sub in subs if sub.rollback_mode is not None]
                kda += 1
            else:
                subs = [PagedMLALatents(self.pool, mla, **g["mla"]) for g in per_group]
                mla += 1
            layers.append(PackedLayerCache([(*g["range"], sub) for g, sub in zip(per_group, subs, strict=True)]))
        return layers

    def _kda_state(self, group: dict, kda: int) -> PagedKDAState:
        """KDA layer `kda`'s state for one group: proposal rows in the batch's rollback mode, other rows with
        their checkpoint pages (if any) and their rows' progression."""
        rows = group["kda_rows"][kda]
        if group["proposal_seqs"] is not None:
            return PagedKDAState(self.pool, rows, rollback=self.rollback_mode, seqs=group["proposal_seqs"])
        which_pages = group["checkpoint"]  # (rows within the group, (n_kda, ·) pages) or None
        checkpoint = None if which_pages is None else (which_pages[0], which_pages[1][kda])
        return PagedKDAState(self.pool, rows, checkpoint, group["kda_progressions"][kda])
