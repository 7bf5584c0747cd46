"""Per-request decoding state of the whole model (SPEC §2.1, §2.2).

KDA layers keep a fixed-size state: S (H, K, V) in fp32 and the last kernel−1 inputs of each short
convolution. MLA layers keep, per past token, the normalised latent c_kv (kv_lora_rank values) and
the shared key part k_pe (qk_rope_head_dim values, no rotation): nothing per head.
"""

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from k3.config import K3Config


@dataclass
class KDALayerCache:
    # (B, H, K, V) fp32; a decode step (one token, no autograd) updates it in place: clone it to keep a snapshot
    state: torch.Tensor | None = None
    conv: torch.Tensor | None = None  # the last kernel−1 inputs of the q, k, v convolutions: (B, 2HK + HV, kernel−1)


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
        return torch.ones(T, L, dtype=torch.bool, device=device).tril(L - T)[None]

    def append(self, latent: torch.Tensor, k_pe: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Add this step's (B, T, ·) entries; return everything cached so far."""
        if self.latent is not None:
            latent, k_pe = torch.cat([self.latent, latent], dim=1), torch.cat([self.k_pe, k_pe], dim=1)
        self.latent, self.k_pe = latent, k_pe
        return latent, k_pe


@dataclass
class PackedLayerCache:
    """One layer's cache for a packed batch, as a serving engine runs it: B == 1 and the sequences'
    new tokens one after another, those of equal length next to each other. Token-wise work (every
    projection, norm, FFN) runs once over all of them; only the sequence mixing (convolution,
    recurrence, attention) runs per group.

    groups[i] = (start, end, rows, cache): tokens start:end are `rows` sequences of (end − start) / rows
    tokens each, and `cache` serves those rows like a KDALayerCache or MLALayerCache with B = rows.
    """

    groups: list[tuple[int, int, int, object]]


def for_each_group(cache, mix: Callable[..., torch.Tensor], *xs: torch.Tensor) -> torch.Tensor:
    """mix(*xs, cache) -> (B, T, ...) for a plain cache (or None); for a PackedLayerCache, mix on each
    group's tokens reshaped to (rows, tokens per row, ...) with that group's cache, re-packed in order."""
    if not isinstance(cache, PackedLayerCache):
        return mix(*xs, cache)
    outs = []
    for start, end, rows, sub in cache.groups:
        parts = [x[:, start:end].reshape(rows, (end - start) // rows, *x.shape[2:]) for x in xs]
        out = mix(*parts, sub)
        outs.append(out.reshape(1, end - start, *out.shape[2:]))
    return torch.cat(outs, dim=1)


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
