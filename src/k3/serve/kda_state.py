"""One KDA layer's state over the page pool for a group of B rows of a step: the one class the packed step
gives a KDA layer, for prefill pieces, decode rows and proposal rows alike.

`state` / `conv` are rows of the pool's KDA views, one page per sequence and layer (gathered on read,
written back in place on assignment); a decode step updates them where they lie (`update_state`). Two
things a group may add:

- checkpoint: also write the new state of some rows into the pages the prefix cache reserved for a KDA
  checkpoint, the state at that point of the forward, so a checkpoint costs no extra pass.
- rollback (speculative decoding, SPEC §3): a group of proposal rows runs k + 1 tokens (the last token and
  k proposals) through the layer from the state in the pool; after verification only the first n of them
  (n − 1 accepted proposals) may stay. `mix` keeps what `rollback` needs to leave the pool exactly as if the
  row had been given those n tokens only, without recomputing the prefix, in one of two modes:
  - "replay": the layer runs the k + 1 tokens at once (the chunked form). The state and conv tail before
    them and the layer's per-token inputs (qkv before the convolution, gate and beta logits: a few hundred
    values a token) are kept; a row that rejected something gets its old state back and the layer's mixing
    is re-run over its n accepted tokens only (rows grouped by n). Cost: the kept inputs, plus one mixing
    call per distinct n, only when a proposal was rejected.
  - "snapshot": the layer runs the tokens one at a time (the recurrent step, in place) and the state and
    conv tail after each is copied aside (k + 1 states of H·K·V fp32 per row and layer); the rollback writes
    back the copy after token n. Cost: k + 1 mixing calls per layer and the copies, every step.

benchmarks/spec_decode.py measures both: "snapshot" was faster on this CPU at batch 1 and 8, 1.10-1.23x (the
replay's second chunked pass costs more than the per-token calls; docs/benchmarks.md), and its kept state
does not depend, to the last bit, on the rejected tokens, so it is the default.
"""

from collections import defaultdict
from collections.abc import Callable

import torch

from k3.model.cache import KDALayerCache
from k3.serve.pool import PagePool

ROLLBACK_MODES = ("replay", "snapshot")


class PagedKDAState:
    """KDALayerCache's interface for one KDA layer of B sequences; rows (B,) index the pool's state pages.

    checkpoint = (which, pages): also write rows `which` of every new state into those pages.
    progression = (first, step) when rows = first + step·i (one sequence, or requests admitted together):
    the rows are then a strided view of the pool, updated with no index at all.
    rollback: None, or the mode ("replay", "snapshot") of a group of proposal rows, whose requests are
    `seqs` (what `rollback`'s counts are keyed by).
    """

    def __init__(
        self,
        pool: PagePool,
        rows: torch.Tensor,
        checkpoint: tuple[torch.Tensor, torch.Tensor] | None = None,
        progression: tuple[int, int] | None = None,
        rollback: str | None = None,
        seqs: list | None = None,
    ):
        if rollback is not None and rollback not in ROLLBACK_MODES:
            raise ValueError(f"rollback mode must be one of {ROLLBACK_MODES}, got {rollback!r}")
        if rollback is not None and (seqs is None or checkpoint is not None):
            raise ValueError("proposal rows need their requests (seqs) and take no checkpoint")
        self.pool, self.rows, self.checkpoint, self.progression = pool, rows, checkpoint, progression
        self.rollback_mode, self.seqs = rollback, seqs
        self.kept: dict = {}  # what the rollback needs, from `mix` to `rollback`

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

    def update_state(self, step: Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor]) -> torch.Tensor:
        """step(states, rows) updates the pool's state rows in place: rows in arithmetic progression as
        a strided view of them (no index; fla addresses such a view by its row stride), others as the
        pool and their row indices. Then the new states of the rows with a checkpoint are copied into
        its pages."""
        states = self.pool.kda_states()
        if self.progression is not None:
            first, stride = self.progression
            out = step(states[first : first + stride * (len(self.rows) - 1) + 1 : stride], None)
        else:
            out = step(states, self.rows)
        if self.checkpoint is not None:
            which, pages = self.checkpoint
            states.index_copy_(0, pages, states[self.rows[which]])
        return out

    def decode_rows(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """Where a one-token step may update the states and conv tails in place: the pool's KDA views and
        these rows; None where a checkpoint also needs the new state (the step then goes through `state`)."""
        if self.checkpoint is not None:
            return None
        return self.pool.kda_states(), self.pool.kda_conv(), self.rows

    def _write(self, view: torch.Tensor, value: torch.Tensor) -> None:
        value = value.to(view.dtype)
        view.index_copy_(0, self.rows, value)
        if self.checkpoint is not None:
            which, pages = self.checkpoint
            view.index_copy_(0, pages, value[which])

    def mix(self, mix: Callable[..., torch.Tensor], *parts: torch.Tensor) -> torch.Tensor:
        """mix(*parts, self) over the rows' (B, T, ...) inputs; proposal rows keep what `rollback` needs."""
        if self.rollback_mode is None:
            return mix(*parts, self)
        if self.rollback_mode == "replay":
            # copies: inside a compiled step the parts are the graph's buffers, reused once the mixing returns
            kept = tuple(x.clone() for x in parts)
            self.kept = dict(mix=mix, parts=kept, state=self.state, conv=self.conv)
            return mix(*parts, self)
        states, convs, outs = [], [], []
        for t in range(parts[0].shape[1]):
            outs.append(mix(*(x[:, t : t + 1] for x in parts), self))
            states.append(self.state)
            convs.append(self.conv)
        self.kept = dict(states=torch.stack(states, 1), convs=torch.stack(convs, 1))  # (B, T, ...)
        return torch.cat(outs, dim=1)

    def rollback(self, accepted: dict) -> None:
        """Proposal rows whose request kept n < T of its tokens (accepted[seq] = n) get the state after token n."""
        T = self.kept["parts"][0].shape[1] if self.rollback_mode == "replay" else self.kept["states"].shape[1]
        by_n: dict[int, list[int]] = defaultdict(list)
        for i, seq in enumerate(self.seqs):
            if accepted[seq] < T:
                by_n[accepted[seq]].append(i)
        for n, idx in by_n.items():
            rows_i = torch.tensor(idx, device=self.rows.device)
            rows = self.rows[rows_i]
            if self.rollback_mode == "snapshot":
                state, conv = self.kept["states"][rows_i, n - 1], self.kept["convs"][rows_i, n - 1]
            else:
                cache = KDALayerCache(self.kept["state"][rows_i].clone(), self.kept["conv"][rows_i])
                self.kept["mix"](*(x[rows_i, :n] for x in self.kept["parts"]), cache)
                state, conv = cache.state, cache.conv
            self.pool.kda_states().index_copy_(0, rows, state.to(self.pool.layout.state_dtype))
            self.pool.kda_conv().index_copy_(0, rows, conv.to(self.pool.storage.dtype))
        self.kept = {}
