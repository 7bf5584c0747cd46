"""KDA state rollback after verification (SPEC §3): the states of a verify row go back to just after its
last accepted token, without recomputing the prefix.

A verify row runs k + 1 tokens (the last token and k proposals) through every KDA layer from the state
in the pool; only the first n (n − 1 accepted proposals) may stay. Two ways, chosen by `mode`, both
leaving the pool exactly as if the row had been given those n tokens only:

- "replay": the layer runs the k + 1 tokens at once (the chunked form). The state and conv tail before
  them and the layer's per-token inputs (qkv before the convolution, gate and beta logits: a few hundred
  values a token) are kept; a row that rejected something gets its old state back and the layer's
  mixing is re-run over its n accepted tokens only (rows grouped by n). Cost: the kept inputs, plus one
  mixing call per distinct n, only when a proposal was rejected.
- "snapshot": the layer runs the tokens one at a time (the recurrent step, in place) and the state
  and conv tail after each is copied aside (k + 1 states of H·K·V fp32 per row and layer); the rollback
  writes back the copy after token n. Cost: k + 1 mixing calls per layer and the copies, every step.

benchmarks/spec_decode.py measures both: "snapshot" was faster on this CPU at batch 1 and 8, 1.10-1.23x (the replay's
second chunked pass costs more than the per-token calls; docs/benchmarks.md), and its kept state does not
depend, to the last bit, on the rejected tokens, so it is the default.
"""

from collections import defaultdict
from collections.abc import Callable

import torch

from k3.model.cache import KDALayerCache
from k3.serve.pool import PagePool

ROLLBACK_MODES = ("replay", "snapshot")


class VerifyKDAState:
    """One KDA layer's cache for a group of verify rows (rows (B,) index the pool's state pages); the
    interface of k3.serve.paged_cache.PagedKDAState, plus `verify` (run the mixing, keeping what the
    rollback needs) and `rollback`. seqs: the rows' requests, which `rollback`'s counts are keyed by."""

    def __init__(self, pool: PagePool, rows: torch.Tensor, seqs: list, mode: str = "snapshot"):
        if mode not in ROLLBACK_MODES:
            raise ValueError(f"rollback mode must be one of {ROLLBACK_MODES}, got {mode!r}")
        self.pool, self.rows, self.seqs, self.mode = pool, rows, seqs, mode
        self.kept: dict = {}

    @property
    def state(self) -> torch.Tensor:  # (B, H, K, V)
        return self.pool.kda_states()[self.rows]

    @state.setter
    def state(self, value: torch.Tensor) -> None:
        self.pool.kda_states().index_copy_(0, self.rows, value.to(self.pool.layout.state_dtype))

    @property
    def conv(self) -> torch.Tensor:  # (B, 2HK + HV, kernel − 1)
        return self.pool.kda_conv()[self.rows]

    @conv.setter
    def conv(self, value: torch.Tensor) -> None:
        self.pool.kda_conv().index_copy_(0, self.rows, value.to(self.pool.storage.dtype))

    def update_state(self, step: Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor]) -> torch.Tensor:
        return step(self.pool.kda_states(), self.rows)

    def verify(self, mix: Callable[..., torch.Tensor], *parts: torch.Tensor) -> torch.Tensor:
        """mix(*parts, self) over the rows' (B, k + 1, ...) inputs, keeping what `rollback` needs."""
        T = parts[0].shape[1]
        if self.mode == "replay":
            self.kept = dict(mix=mix, parts=parts, state=self.state, conv=self.conv)
            return mix(*parts, self)
        states, convs, outs = [], [], []
        for t in range(T):
            outs.append(mix(*(x[:, t : t + 1] for x in parts), self))
            states.append(self.state)
            convs.append(self.conv)
        self.kept = dict(states=torch.stack(states, 1), convs=torch.stack(convs, 1))  # (B, T, ...)
        return torch.cat(outs, dim=1)

    def rollback(self, accepted: dict) -> None:
        """Rows whose request kept n < k + 1 of its tokens (accepted[seq] = n) get the state after token n."""
        T = self.kept["parts"][0].shape[1] if self.mode == "replay" else self.kept["states"].shape[1]
        by_n: dict[int, list[int]] = defaultdict(list)
        for i, seq in enumerate(self.seqs):
            if accepted[seq] < T:
                by_n[accepted[seq]].append(i)
        for n, idx in by_n.items():
            rows_i = torch.tensor(idx, device=self.rows.device)
            rows = self.rows[rows_i]
            if self.mode == "snapshot":
                state, conv = self.kept["states"][rows_i, n - 1], self.kept["convs"][rows_i, n - 1]
            else:
                cache = KDALayerCache(self.kept["state"][rows_i].clone(), self.kept["conv"][rows_i])
                self.kept["mix"](*(x[rows_i, :n] for x in self.kept["parts"]), cache)
                state, conv = cache.state, cache.conv
            self.pool.kda_states().index_copy_(0, rows, state.to(self.pool.layout.state_dtype))
            self.pool.kda_conv().index_copy_(0, rows, conv.to(self.pool.storage.dtype))
        self.kept = {}
