"""Gated Multi-head Latent Attention (SPEC §2.2), K3's global-attention layer.

    c_q = RMSNorm(W_DQ x)                     q = W_UQ c_q = [q_nope, q_pe] per head
    [c_kv, k_pe] = W_DKV x,  c_kv ← RMSNorm(c_kv)
    k_h = [W_UK,h c_kv, k_pe],  v_h = W_UV,h c_kv
    o_h = softmax(q_h · k_hᵀ / √d_qk, causal) v_h,   y = W_O (sigmoid(W_G x) ⊙ concat_h o_h)

No positional encoding: k_pe is the released layout's shared key part, used without rotation.
Only (c_kv, k_pe) is cached. Two paths, chosen by `config.mla_impl`, as in DeepSeek-V3:
"naive" materialises per-head k and v; "absorbed" folds W_UK into the query and applies W_UV after
the attention-weighted sum of cached latents, never building a per-head key or value; "auto" takes
whichever costs fewer FLOPs for the call's number of queries (absorbed for decoding).
"""

import torch
import torch.nn.functional as F
from torch import nn

from k3.config import K3Config
from k3.model.cache import GroupedLayerCache, MLALayerCache, causal_mask, sequence_mixing
from k3.model.norm import RMSNorm
from k3.ops import mla_cpu
from k3.ops.numerics import at_least_fp32


class GatedMLA(nn.Module):
    """x (B, T, d) -> (B, T, d). Parameter names follow the released checkpoint (`self_attn.*`)."""

    def __init__(self, config: K3Config):
        super().__init__()
        d, H = config.hidden_size, config.num_attention_heads
        self.H, self.nope, self.rope, self.v_dim = (
            H,
            config.qk_nope_head_dim,
            config.qk_rope_head_dim,
            config.v_head_dim,
        )
        self.rank = config.kv_lora_rank
        self.impl = config.mla_impl
        self.scale = config.qk_head_dim**-0.5
        # the latents' norms: rms_norm_eps in K3's code, a fixed 1e-6 in Kimi Linear's (K3Config.mla_latent_norm_eps)
        eps = config.rms_norm_eps if config.mla_latent_norm_eps is None else config.mla_latent_norm_eps
        if config.q_lora_rank is None:
            self.q_proj = nn.Linear(d, H * config.qk_head_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(d, config.q_lora_rank, bias=False)
            self.q_a_layernorm = RMSNorm(config.q_lora_rank, eps)
            self.q_b_proj = nn.Linear(config.q_lora_rank, H * config.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(d, self.rank + self.rope, bias=False)
        self.kv_a_layernorm = RMSNorm(self.rank, eps)
        self.kv_b_proj = nn.Linear(self.rank, H * (self.nope + self.v_dim), bias=False)
        if config.mla_use_output_gate:
            self.g_proj = nn.Linear(d, H * self.v_dim, bias=False)
        self.o_proj = nn.Linear(H * self.v_dim, d, bias=False)

    def queries(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x (B, T, d) -> q_nope (B, T, H, nope), q_pe (B, T, H, rope)."""
        B, T, _ = x.shape
        q = self.q_proj(x) if hasattr(self, "q_proj") else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        return q.view(B, T, self.H, -1).split([self.nope, self.rope], dim=-1)

    def latents(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x (B, T, d) -> c_kv (B, T, rank) normalised, k_pe (B, T, rope): what the cache keeps."""
        c_kv, k_pe = self.kv_a_proj_with_mqa(x).split([self.rank, self.rope], dim=-1)
        return self.kv_a_layernorm(c_kv), k_pe

    def forward(self, x: torch.Tensor, cache: MLALayerCache | GroupedLayerCache | None = None) -> torch.Tensor:
        B, T, _ = x.shape
        q_nope, q_pe = self.queries(x)
        c_kv, k_pe = self.latents(x)
        o = sequence_mixing(cache, self.attend, q_nope, q_pe, c_kv, k_pe)  # (B, T, H, v)
        if hasattr(self, "g_proj"):
            o = o * torch.sigmoid(self.g_proj(x).view(B, T, self.H, self.v_dim))
        return self.o_proj(o.reshape(B, T, self.H * self.v_dim))

    def attend(self, q_nope, q_pe, c_kv, k_pe, cache: MLALayerCache | None) -> torch.Tensor:
        """This call's T queries against the cached latents and their own: o (B, T, H, v)."""
        # mask None: causal over this call's T tokens, which for T = 1 (a decode step whose rows all have
        # the same length) means every key is seen, so a cache returns None then and nothing is masked
        mask = None
        if cache is not None and q_nope.shape[1] == 1 and self.use_absorbed(1) and not torch.is_grad_enabled():
            # decoding over a serving pool on the CPU: the latent written and attended to in place, one C++ call
            # (the path below, over the gathered latents, is its reference)
            where = cache.decode_pages()
            if where is not None and mla_cpu.usable(q_nope, where[0]):
                o = mla_cpu.paged_decode(
                    q_nope[:, 0], q_pe[:, 0], c_kv[:, 0], k_pe[:, 0], self.kv_b_proj.weight, *where, self.scale
                )
                return o.unsqueeze(1)
        if cache is not None:
            c_kv, k_pe = cache.append(c_kv, k_pe)  # (B, L, ·): every cached token plus these T
            mask = cache.attention_mask(q_nope.shape[1], q_nope.device)  # (B or 1, T, L), or None
        attend = self.absorbed if self.use_absorbed(q_nope.shape[1]) else self.naive
        return attend(q_nope, q_pe, c_kv, k_pe, mask)

    def use_absorbed(self, T: int) -> bool:
        """'auto' picks the path with fewer FLOPs for T queries over L keys, per head:
        naive L·r·(nope + v) to expand the latents + T·L·(nope + rope + v) to attend;
        absorbed T·L·(2r + rope) to attend in latent space (its per-query projections are negligible).
        So absorbed wins for T·(2r − nope − v) < r·(nope + v): T < 64 for the small preset, < 171 for K3."""
        if self.impl != "auto":
            return self.impl == "absorbed"
        return T * (2 * self.rank - self.nope - self.v_dim) < self.rank * (self.nope + self.v_dim)

    def naive(self, q_nope, q_pe, c_kv, k_pe, mask: torch.Tensor | None) -> torch.Tensor:
        B, _, H, _ = q_nope.shape
        L = c_kv.shape[1]
        kv = self.kv_b_proj(c_kv).view(B, L, H, self.nope + self.v_dim)
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)
        k = torch.cat([k_nope, k_pe.unsqueeze(2).expand(B, L, H, self.rope)], dim=-1)
        q = torch.cat([q_nope, q_pe], dim=-1)
        pad = q.shape[-1] - self.v_dim
        if q.device.type == "cpu" and pad > 0:
            # values zero-padded to the queries' width: the CPU's flash kernel needs one head width for q, k and
            # v and otherwise SDPA takes its math path, which materialises every score (2.4x slower on a 2K
            # chunk over 4K keys); the padded output columns are zeros and are dropped
            v = F.pad(v, (0, pad))
        o = F.scaled_dot_product_attention(
            q.transpose(1, 2),
            k.transpose(1, 2),
            v.transpose(1, 2),
            attn_mask=None if mask is None else mask[:, None],
            is_causal=mask is None and q.shape[1] > 1,
            scale=self.scale,
        )
        return o.transpose(1, 2)[..., : self.v_dim]

    def absorbed(self, q_nope, q_pe, c_kv, k_pe, mask: torch.Tensor | None) -> torch.Tensor:
        B, T, H, _ = q_nope.shape
        L = c_kv.shape[1]
        w = self.kv_b_proj.weight.view(H, self.nope + self.v_dim, self.rank)
        w_uk, w_uv = w[:, : self.nope], w[:, self.nope :]  # (H, nope, rank), (H, v, rank)
        q_lat = torch.einsum("bthn,hnr->bthr", q_nope, w_uk)  # the query, moved into latent space
        # (B, T·H, ·) @ (B, ·, L): every head and query against the cached latents in one matmul each,
        # reading c_kv and k_pe where they lie (transposed views, no copies of the long cache)
        # (the scale is applied to the T·H queries rather than the T·H·L scores)
        scores = (q_lat * self.scale).reshape(B, T * H, self.rank) @ c_kv.transpose(1, 2)
        if self.rope:
            scores = scores.baddbmm_((q_pe * self.scale).reshape(B, T * H, self.rope), k_pe.transpose(1, 2))
        scores = at_least_fp32(scores.view(B, T, H, L))
        if mask is None and T > 1:
            mask = causal_mask(torch.arange(L - T, L, device=scores.device)[None], L)
        if mask is not None:
            scores = scores.masked_fill(~mask[:, :, None], float("-inf"))
        p = torch.softmax(scores, dim=-1).to(c_kv.dtype)
        ctx = p.view(B, T * H, L) @ c_kv  # attention-weighted latents (B, T·H, rank)
        return torch.einsum("bthr,hvr->bthv", ctx.view(B, T, H, self.rank), w_uv)
