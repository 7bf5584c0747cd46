"""Per-request decoding state of the whole model (SPEC §2.1, §2.2).

KDA layers keep a fixed-size state: S (H, K, V) in fp32 and the last kernel−1 inputs of each short
convolution. MLA layers keep, per past token, the normalised latent c_kv (kv_lora_rank values) and
the shared key part k_pe (qk_rope_head_dim values, no rotation): nothing per head.

The layers use a small protocol, whatever the cache: KDA reads and assigns `state` / `conv` and decodes
through `update_state` (the recurrent step writes the state where it lives), MLA calls `append` and
`attention_mask`. A GroupedLayerCache (the serving engine's packed step, whose page-table
adapters live in k3.serve.paged_cache) additionally runs a layer's sequence mixing per group.
"""

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from k3.config import K3Config


def causal_mask(query_positions: torch.Tensor, num_keys: int) -> torch.Tensor:
    """(B, T) absolute positions of the queries -> (B, T, num_keys) bool, True where a query may see a key:
    key j is visible to a query at position p when j <= p. The one causal mask of the model and the engine."""
    return torch.arange(num_keys, device=query_positions.device) <= query_positions[..., None]


@dataclass
class KDALayerCache:
    # (B, H, K, V) fp32; a decode step (one token, no autograd) updates it in place: clone it to keep a copy
    state: torch.Tensor | None = None
    conv: torch.Tensor | None = None  # the last kernel−1 inputs of the q, k, v convolutions: (B, 2HK + HV, kernel−1)

    def update_state(self, step: Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor]) -> torch.Tensor | None:
        """step(states, rows) updates the state in place and returns its output; here states is the
        (B, H, K, V) state itself and rows None. Returns None, without calling step, when there is no
        state yet (the first call of a sequence runs the chunked form instead)."""
        return None if self.state is None else step(self.state, None)

    def decode_rows(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None:
        """Where a one-token step may update the state and conv tail in place: (states (B, H, K, V), conv tails
        (B, 2HK + HV, kernel−1), None), or None before the first call."""
        return None if self.state is None or self.conv is None else (self.state, self.conv, None)


@dataclass
class MLALayerCache:
    latent: torch.Tensor | None = None  # (B, L, kv_lora_rank)
    k_pe: torch.Tensor | None = None  # (B, L, qk_rope_head_dim)

    @property
    def length(self) -> int:
        return 0 if self.latent is None else self.latent.shape[1]

    def attention_mask(self, T: int, device: torch.device) -> torch.Tensor | None:
        """(1, T, L): the T newest tokens see every cached one and each other causally (every row of
        the batch has the same length here). None for T = 1: the one new token sees every key."""
        if T == 1:
            return None
        L = self.length
        return causal_mask(torch.arange(L - T, L, device=device)[None], L)

    def decode_pages(self) -> None:
        """A paged cache's pool, layer, page tables and lengths, for attention in place (k3.serve.paged_cache);
        this cache keeps its latents in tensors of its own, so None."""
        return None

    def append(self, latent: torch.Tensor, k_pe: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Add this step's (B, T, ·) entries; return everything cached so far."""
        if self.latent is not None:
            latent, k_pe = torch.cat([self.latent, latent], dim=1), torch.cat([self.k_pe, k_pe], dim=1)
        self.latent, self.k_pe = latent, k_pe
        return latent, k_pe


class GroupedLayerCache(ABC):
    """The one thing a layer asks of a cache besides the plain ones above: a cache over several groups
    of sequences packed along T of a (1, ΣT) batch (the serving engine's step, k3.serve.paged_cache)
    runs the layer's sequence mixing per group itself. Each group's cache has the plain cache's
    interface (`state` / `conv` for KDA, `append` / `attention_mask` for MLA) with B = its rows."""

    @abstractmethod
    def mix(self, mix: Callable[..., torch.Tensor], *xs: torch.Tensor) -> torch.Tensor:
        """mix(*parts, group_cache) on each group's tokens as (rows, T_group, ...), re-packed to (1, ΣT, ...)."""


def sequence_mixing(cache, mix: Callable[..., torch.Tensor], *xs: torch.Tensor) -> torch.Tensor:
    """A layer's sequence mixing under its cache: mix(*xs, cache) for a plain cache or None; a
    GroupedLayerCache splits the tokens into its groups itself."""
    if isinstance(cache, GroupedLayerCache):
        return cache.mix(mix, *xs)
    return mix(*xs, cache)


@dataclass
class K3Cache:
    """One entry per layer, in layer order; `seq_len` tokens have been consumed so far."""

    layers: list[KDALayerCache | MLALayerCache] = field(default_factory=list)
    seq_len: int = 0

    @classmethod
    def empty(cls, config: K3Config) -> "K3Cache":
        return cls([MLALayerCache() if t == "mla" else KDALayerCache() for t in config.layer_types])

    def nbytes(self) -> dict[str, int]:
        """Bytes held, split into KDA states (incl. conv tails) and MLA latents."""
        out = {"kda": 0, "mla": 0}
        for layer in self.layers:
            if isinstance(layer, KDALayerCache):
                tensors = [layer.state, layer.conv]
                out["kda"] += sum(t.numel() * t.element_size() for t in tensors if t is not None)
            elif layer.latent is not None:
                out["mla"] += sum(t.numel() * t.element_size() for t in (layer.latent, layer.k_pe))
        return out
