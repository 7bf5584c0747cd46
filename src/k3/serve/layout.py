"""What one page of the pool holds (SPEC §3), derived from the model config and the pool's dtype.

A page holds P tokens of MLA latents for every MLA layer, token-major (P, n_mla, latent_dim), with P
the smallest number of tokens whose latents are at least one KDA layer's decoding state: S (H, K, V)
fp32 followed by the conv tail (2HK + HV, kernel−1). So a KDA state fits one page (the rest of a
state page is padding) and a latent page has no padding. A request at context T takes n_kda state
pages plus ceil(T / P) latent pages: capacity is plain arithmetic on the page count.
"""

from dataclasses import dataclass

import torch

from k3.config import K3Config


@dataclass(frozen=True)
class PageLayout:
    """What a page holds, derived from the model config and the pool's dtype.

    Sizes are counted in values of the pool's dtype (`dtype`). The KDA state S is always kept in
    `state_dtype`: fp32, or fp64 for an fp64 pool, never half precision, because the recurrence
    accumulates it over every token; in a bf16/fp16 pool it takes two storage values per number
    (the page's bytes are read as fp32). The conv tail and the MLA latents are in the pool's dtype.

    P = ceil(kda_elems / (n_mla · latent_dim)) tokens of latents for all MLA layers, and
    page_elems = P · n_mla · latent_dim, where kda_elems = state_elems + (kernel−1)·(2·H·K + H·V) is one
    KDA layer's decoding state; the rest of a state page is padding. Without MLA layers a page is one
    state. P is rounded up so that page_elems is whole fp32 numbers.
    """

    page_elems: int
    n_kda: int
    n_mla: int
    kda_heads: int  # H
    kda_head_dim: int  # K (= V)
    conv_width: int  # kernel − 1: the inputs a short convolution must remember
    latent_dim: int  # kv_lora_rank + qk_rope_head_dim: c_kv then k_pe, one row per token and MLA layer
    page_tokens: int  # P; 0 when the model has no MLA layer
    dtype: torch.dtype = torch.float32  # the pool's storage: latents and conv tails

    @classmethod
    def from_config(cls, config: K3Config, dtype: torch.dtype = torch.float32) -> "PageLayout":
        if not dtype.is_floating_point:
            raise ValueError(f"a page pool holds floating-point values, got {dtype}")
        H, K = config.kda_num_heads, config.kda_head_dim
        width = config.short_conv_kernel_size - 1
        ratio = _state_ratio(dtype)
        kda_elems = H * K * K * ratio + width * (2 * H * K + H * K)
        n_mla = config.layer_types.count("mla")
        latent_dim = config.kv_lora_rank + config.qk_rope_head_dim
        if n_mla:
            P = -(-kda_elems // (n_mla * latent_dim))
            while P * n_mla * latent_dim % ratio:
                P += 1
            page_elems = P * n_mla * latent_dim
        else:
            P, page_elems = 0, -(-kda_elems // ratio) * ratio
        return cls(
            page_elems=page_elems,
            n_kda=len(config.layer_types) - n_mla,
            n_mla=n_mla,
            kda_heads=H,
            kda_head_dim=K,
            conv_width=width,
            latent_dim=latent_dim,
            page_tokens=P,
            dtype=dtype,
        )

    @property
    def state_dtype(self) -> torch.dtype:
        """fp32, or fp64 in an fp64 pool: the dtype of every KDA state S."""
        return torch.float64 if self.dtype == torch.float64 else torch.float32

    @property
    def state_elems(self) -> int:
        """Storage values S (H, K, V) takes at the start of a KDA page: H·K·V, twice that in a half pool."""
        return self.kda_heads * self.kda_head_dim**2 * _state_ratio(self.dtype)

    @property
    def conv_channels(self) -> int:
        """2HK + HV: the q, k and v channels of the short convolutions."""
        return 3 * self.kda_heads * self.kda_head_dim

    @property
    def conv_elems(self) -> int:
        """conv_width·(2HK + HV): the conv tail after S in a KDA page."""
        return self.conv_width * self.conv_channels

    @property
    def latent_elems(self) -> int:
        """P·n_mla·latent_dim: a whole latent page."""
        return self.page_tokens * self.n_mla * self.latent_dim

    @property
    def state_padding(self) -> int:
        """Values of a KDA state page that hold nothing (a latent page has no padding)."""
        return self.page_elems - self.state_elems - self.conv_elems

    @property
    def bytes_per_page(self) -> int:
        return self.page_elems * self.dtype.itemsize

    def latent_pages(self, tokens: int) -> int:
        """ceil(tokens / P): pages holding `tokens` tokens of latents for every MLA layer."""
        return -(-tokens // self.page_tokens) if self.n_mla else 0

    def request_pages(self, tokens: int) -> int:
        """Pages one request at context `tokens` occupies: one per KDA layer plus its latent pages."""
        return self.n_kda + self.latent_pages(tokens)

    def request_padding(self, tokens: int) -> int:
        """Values a request at context `tokens` reserves but does not fill: the padding of its state
        pages plus the unused token slots of its last latent page."""
        unused = self.latent_pages(tokens) * self.page_tokens - tokens if self.n_mla else 0
        return self.n_kda * self.state_padding + unused * self.n_mla * self.latent_dim


def _state_ratio(dtype: torch.dtype) -> int:
    """Storage values per state number: 2 for a 16-bit pool (an fp32 number is two of them), else 1."""
    return max(1, 4 // dtype.itemsize) if dtype.itemsize < 4 else 1
