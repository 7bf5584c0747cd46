"""The draft model for speculative decoding (SPEC §3): one decoder layer on the big model's features.

    g₀ = W_f [RMSNorm(b_low) ; RMSNorm(b_mid) ; RMSNorm(b_high)]       the big model at position t
    xⱼ = W_in [RMSNorm(E tokenⱼ) ; RMSNorm(gⱼ)]                         j = 0 … k−1
    hⱼ = layer(xⱼ) (Gated MLA over the chain so far, then SiTU-GLU)    gⱼ₊₁ = hⱼ (its own hidden, fed forward)
    qⱼ = softmax(lm_head(RMSNorm(hⱼ)))                                 the draft's distribution of token t+2+j

token₀ is the token the big model produced from position t, tokenⱼ (j ≥ 1) the draft's own proposal
j−1. E and lm_head are the big model's, shared and frozen (never saved with the draft). Two modes of
the same size: "chain" (the seed's design, k autoregressive steps) and "block" (all k proposals in one
forward: token₀ then a learned mask embedding at every later slot, g₀ at each, causal attention).

The layer attends only over the current chain (≤ k tokens), not over the request's history: the big
model's block summaries at t already summarise the whole prefix. So the draft keeps no state between
engine steps (nothing to roll back, nothing for the prefix cache to checkpoint) and its cache is the
chain's latents, at most k·(kv_lora_rank + rope) values per request, a transient tensor of one step.
"""

import torch
from torch import nn

from k3.config import K3Config
from k3.model.cache import MLALayerCache
from k3.model.mla import GatedMLA
from k3.model.norm import RMSNorm
from k3.model.situ import GatedMLP
from k3.spec.features import feature_blocks

MODES = ("chain", "block")
DEFAULT_NUM_SPECULATIVE_TOKENS = 7


class DraftModel(nn.Module):
    """One decoder layer proposing up to `num_speculative_tokens` tokens from the big model's features.

    config: the big model's K3Config (the layer has its widths). Call `attach(big_model)` before use:
    it shares the big model's embedding and LM head without making them the draft's parameters.
    """

    def __init__(
        self, config: K3Config, mode: str = "chain", num_speculative_tokens: int = DEFAULT_NUM_SPECULATIVE_TOKENS
    ):
        super().__init__()
        if mode not in MODES:
            raise ValueError(f"draft mode must be one of {MODES}, got {mode!r}")
        if not isinstance(num_speculative_tokens, int) or num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be an int >= 1, got {num_speculative_tokens!r}")
        d, eps = config.hidden_size, config.rms_norm_eps
        self.config, self.mode, self.num_speculative_tokens = config, mode, num_speculative_tokens
        self.feature_blocks = feature_blocks(config)
        self.feature_norms = nn.ModuleList(RMSNorm(d, eps) for _ in self.feature_blocks)
        self.feature_proj = nn.Linear(len(self.feature_blocks) * d, d, bias=False)
        self.token_norm = RMSNorm(d, eps)
        self.hidden_norm = RMSNorm(d, eps)
        self.input_proj = nn.Linear(2 * d, d, bias=False)
        self.input_layernorm = RMSNorm(d, eps)
        self.self_attn = GatedMLA(config)
        self.post_attention_layernorm = RMSNorm(d, eps)
        self.mlp = GatedMLP(
            d,
            config.intermediate_size,
            config.hidden_act,
            config.activation_situ_beta,
            config.activation_situ_linear_beta,
        )
        self.norm = RMSNorm(d, eps)
        if mode == "block":
            self.mask_embedding = nn.Parameter(torch.zeros(d))
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        std = self.config.initializer_range
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=std)
            elif isinstance(module, RMSNorm):
                nn.init.ones_(module.weight)

    def attach(self, big_model: nn.Module) -> "DraftModel":
        """Share the big model's token embedding and LM head (kept out of this module's parameters and
        state_dict, so training never updates them and a saved draft never holds them)."""
        self.__dict__["embed_tokens"] = big_model.model.embed_tokens
        self.__dict__["lm_head"] = big_model.lm_head
        return self

    def features(self, summaries: list[torch.Tensor]) -> torch.Tensor:
        """The chosen block summaries, each (..., d) -> g₀ (..., d)."""
        normed = [
            norm(s.to(self.feature_proj.weight.dtype)) for norm, s in zip(self.feature_norms, summaries, strict=True)
        ]
        return self.feature_proj(torch.cat(normed, dim=-1))

    def _layer(self, tokens_emb: torch.Tensor, g: torch.Tensor, cache: MLALayerCache | None) -> torch.Tensor:
        """(N, T, d) token embeddings (or mask embeddings) and (N, T, d) features -> hidden (N, T, d)."""
        x = self.input_proj(torch.cat([self.token_norm(tokens_emb), self.hidden_norm(g)], dim=-1))
        x = x + self.self_attn(self.input_layernorm(x), cache)
        return x + self.mlp(self.post_attention_layernorm(x))

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(h))

    def propose(self, tokens: torch.Tensor, g0: torch.Tensor, k: int, choose) -> torch.Tensor:
        """Proposals (N, k) for N requests: tokens (N,) the big model's newest token, g0 (N, d) its features.

        choose(logits (N, V), j) -> (N,) the proposal at slot j (argmax, or a draw from the request's
        filtered distribution); whatever choose needs of the logits (a sampled row's q) it keeps itself.
        """
        if self.mode == "block":
            emb = torch.cat([self.embed_tokens(tokens)[:, None], self.mask_embedding.expand(len(tokens), k - 1, -1)], 1)
            logits = self.logits(self._layer(emb, g0[:, None].expand(-1, k, -1), None))  # (N, k, V)
            return torch.stack([choose(logits[:, j], j) for j in range(k)], dim=1)
        cache, g, token, out = MLALayerCache(), g0[:, None], tokens, []
        for j in range(k):
            h = self._layer(self.embed_tokens(token)[:, None], g, cache)  # (N, 1, d)
            token = choose(self.logits(h[:, 0]), j)
            out.append(token)
            g = h
        return torch.stack(out, dim=1)

    def unroll(self, tokens: torch.Tensor, g0: torch.Tensor) -> torch.Tensor:
        """Training as at inference: tokens (N, k) the big model's own continuation (token₀ and the tokens
        a fully accepted chain would have proposed), g0 (N, d) -> draft logits (N, k, V). The chain feeds
        its own hidden state forward exactly as `propose`; the block mode sees only tokens[:, 0]."""
        N, k = tokens.shape
        if self.mode == "block":
            emb = torch.cat([self.embed_tokens(tokens[:, :1]), self.mask_embedding.expand(N, k - 1, -1)], dim=1)
            return self.logits(self._layer(emb, g0[:, None].expand(-1, k, -1), None))
        cache, g, out = MLALayerCache(), g0[:, None], []
        for j in range(k):
            h = self._layer(self.embed_tokens(tokens[:, j : j + 1]), g, cache)
            out.append(self.logits(h[:, 0]))
            g = h
        return torch.stack(out, dim=1)
