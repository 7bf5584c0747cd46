"""LatentMoE (SPEC §2.3): routed experts work in a compressed latent, shared experts at full width.

    u = Σ_i w_i · Expert_i(W_down x)        y = Σ_j shared_j(x) + W_up · RMSNorm(u)

Shape suffixes: T tokens, D model width, L latent width, E experts, K chosen per token, A assignments (T·K).
"""

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from k3.config import K3Config
from k3.model.norm import RMSNorm
from k3.model.router import Router, RouterOutput
from k3.model.situ import Expert, GatedMLP, glu
from k3.ops import moe_cpu
from k3.quant.qat import quantized_input, quantized_weight

# Above this many hidden activations (assignments × expert width) the experts run one whole chain each.
MERGE_ELEMENTS = 1 << 18


class LatentMoE(nn.Module):
    """x (B, T, D) -> y (B, T, D) and the routing decision (for load balancing: K3Output.routing)."""

    def __init__(self, config: K3Config):
        super().__init__()
        D, L = config.hidden_size, config.routed_expert_hidden_size
        self.act = (config.hidden_act, config.activation_situ_beta, config.activation_situ_linear_beta)
        self.gate = Router(
            D, config.num_experts, config.num_experts_per_token, config.moe_renormalize, config.routed_scaling_factor
        )
        self.routed_expert_down_proj = nn.Linear(D, L, bias=False)
        self.experts = nn.ModuleList(Expert(L, config.moe_intermediate_size) for _ in range(config.num_experts))
        self.routed_expert_norm = RMSNorm(L, config.rms_norm_eps) if config.latent_moe_use_norm else nn.Identity()
        self.routed_expert_up_proj = nn.Linear(L, D, bias=False)
        self.quantization = config.expert_quantization  # None, or "mxfp4": MXFP4 weights, MXFP8 inputs
        if config.num_shared_experts:
            self.shared_experts = GatedMLP(D, config.moe_intermediate_size * config.num_shared_experts, *self.act)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, RouterOutput]:
        shape = x.shape
        x_TD = x.reshape(-1, shape[-1])
        routing = self.gate(x_TD)
        z_TL = self.routed_expert_down_proj(x_TD)
        if torch.compiler.is_compiling() and not torch.is_grad_enabled() and self.plain_experts():
            # inside a compiled serving step: the experts behind one operator (their row counts decide the shapes
            # of their matmuls, which a graph cannot): the C++ kernel itself where it loads, with no Python
            # between the graph and it, else the PyTorch one
            weights = [[ex.w1.weight for ex in self.experts], [ex.w3.weight for ex in self.experts]]
            weights.append([ex.w2.weight for ex in self.experts])
            if moe_cpu.usable(z_TL, weights[0][0]):
                scores = routing.weights_TK.to(z_TL.dtype)
                u_TL = torch.ops.k3_cpu.moe_experts(z_TL, routing.experts_TK, scores, *weights, *self.act)
            else:
                u_TL = torch.ops.k3.moe_experts(z_TL, routing.experts_TK, routing.weights_TK, *weights, *self.act)
        else:
            u_TL = self.dispatch(z_TL, routing)
        y_TD = self.routed_expert_up_proj(self.routed_expert_norm(u_TL))
        if hasattr(self, "shared_experts"):
            y_TD = y_TD + self.shared_experts(x_TD)
        return y_TD.view(shape), routing

    def plain_experts(self) -> bool:
        """Whether the experts are unquantised nn.Linear layers (what k3::moe_experts takes)."""
        return not self.quantization and all(type(ex.w1) is nn.Linear for ex in self.experts[:1])

    def dispatch(self, z_TL: torch.Tensor, routing: RouterOutput) -> torch.Tensor:
        """Σ_k w_tk · Expert_{e_tk}(z_t): assignments sorted by expert so each expert's tokens are one
        contiguous run, the experts applied run by run (`experts_forward`), the results weighted and summed
        back per token. Expert parallelism replaces only the middle step (the runs travel to the ranks that
        own their experts), so it computes exactly what this does."""
        return combine(z_TL, routing.experts_TK, routing.weights_TK, routing.loads_E.tolist(), self.experts_forward)

    def experts_forward(self, z_AL: torch.Tensor, counts: list[int], first: int = 0) -> torch.Tensor:
        """z_AL (A, L) sorted by expert, counts[i] rows for expert first + i -> h_AL (A, L), Expert(z) per row.

        Few rows (decoding, short prefill chunks): three matmuls per active expert and the activation once
        over all of them; per expert those were most of the ops of a decode step. Many (training): the whole
        chain per expert, so every temporary stays small and in cache; merged, the activation's multi-MB
        temporaries made a training step's MoE ~15% slower on CPU.

        With expert_quantization "mxfp4" (SPEC §2.8, k3.quant.qat) every expert matmul reads its weight as
        MXFP4 (fake-quantised master weight, or the packed bytes) and its input as MXFP8, quantised per row
        in blocks of 32, so the result of a row does not depend on which rows share the call.
        """
        active = [(self.experts[first + i], n) for i, n in enumerate(counts) if n]
        weight, x = (quantized_weight, quantized_input) if self.quantization else (_plain_weight, _identity)
        weights = [(weight(ex.w1), weight(ex.w3), weight(ex.w2)) for ex, _ in active]
        return run_experts(z_AL, [n for _, n in active], weights, self.act, x)


def combine(
    z_TL: torch.Tensor,
    experts_TK: torch.Tensor,
    weights_TK: torch.Tensor,
    counts: list[int],
    experts_forward: Callable[[torch.Tensor, list[int]], torch.Tensor],
) -> torch.Tensor:
    """Σ_k w_tk · Expert_{e_tk}(z_t), with experts_forward(z_AL, counts) applying the experts to the
    assignments sorted by expert (LatentMoE.dispatch)."""
    K = experts_TK.shape[1]
    order_A = experts_TK.flatten().argsort(stable=True)
    tokens_A = order_A // K  # which token each sorted assignment belongs to
    weights_A = weights_TK.flatten()[order_A].to(z_TL.dtype)
    h_AL = experts_forward(z_TL.index_select(0, tokens_A), counts)
    return torch.zeros_like(z_TL).index_add_(0, tokens_A, h_AL * weights_A[:, None])


def run_experts(
    z_AL: torch.Tensor,
    sizes: list[int],
    weights: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
    act: tuple[str, float, float],
    x: Callable[[torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """z_AL (A, L) in runs of sizes[i] rows for the i-th expert, whose (w1, w3, w2) weights are weights[i],
    inputs quantised by x -> h_AL (A, L) (LatentMoE.experts_forward)."""
    if not sizes:
        return z_AL.new_zeros(0, z_AL.shape[1])
    z_AL = x(z_AL)
    z_parts = z_AL.split(sizes)  # split: its backward is one cat
    if len(z_AL) * weights[0][0].shape[0] > MERGE_ELEMENTS:
        return torch.cat(
            [
                F.linear(x(glu(F.linear(z, w1), F.linear(z, w3), *act)), w2)
                for (w1, w3, w2), z in zip(weights, z_parts, strict=True)
            ]
        )
    gate_AI = torch.cat([F.linear(z, w1) for (w1, _, _), z in zip(weights, z_parts, strict=True)])
    up_AI = torch.cat([F.linear(z, w3) for (_, w3, _), z in zip(weights, z_parts, strict=True)])
    h_parts = x(glu(gate_AI, up_AI, *act)).split(sizes)
    return torch.cat([F.linear(h, w2) for (_, _, w2), h in zip(weights, h_parts, strict=True)])


@torch.library.custom_op("k3::moe_experts", mutates_args=())
def moe_experts(
    z_TL: torch.Tensor,
    experts_TK: torch.Tensor,
    weights_TK: torch.Tensor,
    w1: list[torch.Tensor],
    w3: list[torch.Tensor],
    w2: list[torch.Tensor],
    act: str,
    beta1: float,
    beta2: float,
) -> torch.Tensor:
    """LatentMoE.dispatch as one operator, for unquantised experts given as their weights (w1[e], w3[e], w2[e]
    of expert e): z_TL (T, L), the routing's experts_TK and weights_TK -> u_TL (T, L). The seam a compiled
    graph calls, since the experts' row counts, read from the routing, decide the shapes of their matmuls.
    On the CPU it runs k3's C++ kernel (k3.ops.moe_cpu) where that loads; this path is its reference."""
    if moe_cpu.usable(z_TL, w1[0]):
        return moe_cpu.moe_experts(z_TL, experts_TK, weights_TK, w1, w3, w2, act, beta1, beta2)
    counts = torch.bincount(experts_TK.flatten(), minlength=len(w1)).tolist()
    active = [e for e, n in enumerate(counts) if n]

    def experts_forward(z_AL: torch.Tensor, counts: list[int]) -> torch.Tensor:
        weights = [(w1[e], w3[e], w2[e]) for e in active]
        return run_experts(z_AL, [counts[e] for e in active], weights, (act, beta1, beta2), _identity)

    return combine(z_TL, experts_TK, weights_TK, counts, experts_forward)


@moe_experts.register_fake
def _(z_TL, experts_TK, weights_TK, w1, w3, w2, act, beta1, beta2) -> torch.Tensor:
    return torch.empty_like(z_TL)


def _plain_weight(layer: nn.Module) -> torch.Tensor:
    return layer.weight


def _identity(x: torch.Tensor) -> torch.Tensor:
    return x
