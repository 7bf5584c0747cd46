"""LatentMoE (SPEC §2.3): routed experts work in a compressed latent, shared experts at full width.

    u = Σ_i w_i · Expert_i(W_down x)        y = Σ_j shared_j(x) + W_up · RMSNorm(u)

Shape suffixes: T tokens, D model width, L latent width, E experts, K chosen per token, A assignments (T·K).
"""

import torch
from torch import nn

from k3.config import K3Config
from k3.model.norm import RMSNorm
from k3.model.router import Router, RouterOutput
from k3.model.situ import Expert, GatedMLP, glu


class LatentMoE(nn.Module):
    """x (B, T, D) -> (B, T, D); the last routing decision is kept in `self.last_routing`."""

    def __init__(self, config: K3Config):
        super().__init__()
        D, L = config.hidden_size, config.routed_expert_hidden_size
        self.act = (config.hidden_act, config.activation_situ_beta, config.activation_situ_linear_beta)
        self.gate = Router(D, config.num_experts, config.num_experts_per_token, config.moe_renormalize,
                           config.routed_scaling_factor)  # fmt: skip
        self.routed_expert_down_proj = nn.Linear(D, L, bias=False)
        self.experts = nn.ModuleList(Expert(L, config.moe_intermediate_size) for _ in range(config.num_experts))
        self.routed_expert_norm = RMSNorm(L, config.rms_norm_eps) if config.latent_moe_use_norm else nn.Identity()
        self.routed_expert_up_proj = nn.Linear(L, D, bias=False)
        if config.num_shared_experts:
            self.shared_experts = GatedMLP(D, config.moe_intermediate_size * config.num_shared_experts, *self.act)
        self.last_routing: RouterOutput | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x_TD = x.reshape(-1, shape[-1])
        routing = self.gate(x_TD)
        self.last_routing = routing
        z_TL = self.routed_expert_down_proj(x_TD)
        u_TL = self.dispatch(z_TL, routing)
        y_TD = self.routed_expert_up_proj(self.routed_expert_norm(u_TL))
        if hasattr(self, "shared_experts"):
            y_TD = y_TD + self.shared_experts(x_TD)
        return y_TD.view(shape)

    def dispatch(self, z_TL: torch.Tensor, routing: RouterOutput) -> torch.Tensor:
        """Σ_k w_tk · Expert_{e_tk}(z_t): tokens grouped by expert, one batched matmul chain per active expert."""
        K = routing.experts_TK.shape[1]
        experts_A = routing.experts_TK.flatten()
        order_A = experts_A.argsort(stable=True)
        tokens_A = order_A // K  # which token each sorted assignment belongs to
        weights_A = routing.weights_TK.flatten()[order_A].to(z_TL.dtype)
        out_TL = torch.zeros_like(z_TL)
        start = 0
        for e, count in enumerate(routing.loads_E.tolist()):
            if count == 0:
                continue
            idx = tokens_A[start : start + count]
            expert = self.experts[e]
            z = z_TL[idx]
            h = expert.w2(glu(expert.w1(z), expert.w3(z), *self.act))
            out_TL.index_add_(0, idx, h * weights_A[start : start + count, None])
            start += count
        return out_TL
