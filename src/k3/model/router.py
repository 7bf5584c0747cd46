"""The sigmoid top-k router of LatentMoE (SPEC §2.3) and what Quantile Balancing needs from it.

Shape suffixes: T tokens, D model width, E routed experts, K experts chosen per token.
"""

from dataclasses import dataclass

import torch
from torch import nn

from k3.ops.numerics import at_least_fp32


@dataclass
class RouterOutput:
    weights_TK: torch.Tensor  # fp32 combine weights of the chosen experts
    experts_TK: torch.Tensor  # int64 chosen expert ids
    scores_TE: torch.Tensor  # fp32 sigmoid scores, before the bias
    cutoff_T: torch.Tensor  # fp32 (K+1)-th largest biased score per token (−inf when K = E)
    loads_E: torch.Tensor  # int64 tokens routed to each expert

    def required_bias_TE(self) -> torch.Tensor:
        """The bias expert e would need for token t to pick it: cutoff_t − s_te (SPEC §2.6)."""
        return self.cutoff_T[:, None] - self.scores_TE


class Router(nn.Module):
    """s = sigmoid(W_r x) in fp32; top-k on s + b (b only selects); weights = chosen s renormalised,
    times routed_scaling_factor. `e_score_correction_bias` is the bias, a buffer the trainer sets."""

    def __init__(self, dim: int, num_experts: int, top_k: int, renormalize: bool = True, scale: float = 1.0):
        super().__init__()
        self.top_k, self.renormalize, self.scale = top_k, renormalize, scale
        self.weight = nn.Parameter(torch.empty(num_experts, dim))
        self.register_buffer("e_score_correction_bias", torch.zeros(num_experts))

    def forward(self, x_TD: torch.Tensor) -> RouterOutput:
        E, K = self.weight.shape[0], self.top_k
        x_TD = at_least_fp32(x_TD)
        scores_TE = torch.sigmoid(x_TD @ self.weight.to(x_TD.dtype).t())
        biased_TE = scores_TE + self.e_score_correction_bias.to(x_TD.dtype)
        top_vals, top_idx = biased_TE.topk(min(K + 1, E), dim=-1)
        experts_TK = top_idx[:, :K]
        cutoff_T = top_vals[:, K] if K < E else torch.full_like(top_vals[:, 0], float("-inf"))
        weights_TK = scores_TE.gather(1, experts_TK)
        if self.renormalize:
            weights_TK = weights_TK / weights_TK.sum(-1, keepdim=True)
        # counted by index_add (bincount's length depends on the values, which a compiled graph cannot trace)
        chosen = experts_TK.flatten()
        loads_E = chosen.new_zeros(E).index_add_(0, chosen, torch.ones_like(chosen))
        return RouterOutput(weights_TK * self.scale, experts_TK, scores_TE, cutoff_T, loads_E)
