"""Expert parallelism for LatentMoE: each rank of an EP group holds E/N routed experts, and the tokens go to them.

LatentMoE.dispatch sorts a rank's assignments by expert and hands the runs to `experts_forward(z_AL, counts)`.
`shard_experts` keeps only this rank's experts [first, first + E/N) in each LatentMoE (the others' modules
become empty, so they hold no memory and no parameters) and puts an exchange around experts_forward:

    1. counts: all_to_all of the per-expert counts, so each rank learns how many rows every rank sends to
       each of its experts: recv_counts_SX (sources S = N ranks, X = E/N local experts)
    2. rows: all_to_all_single of z_AL with variable splits (rank d gets the runs of d's experts), arriving
       ordered (source, expert); reordered to (expert, source) so each local expert's rows are one run
    3. the model's own experts_forward over the local runs (first = this rank's first expert), so whatever
       it computes (dense experts, quantisation-aware training) is what expert parallelism computes
    4. the results reordered back and returned with the inverse all_to_all, in the caller's order

Both all_to_alls are autograd functions whose backward is the reverse exchange, so an expert's gradient
sums the contributions of every rank's tokens, and the gradient of each rank's z_AL comes back to it.
The router, the latent projections and the shared experts stay replicated (data parallel).

Shape suffixes: A assignments (rows), L latent width, E experts, S source ranks, X local experts.
"""

import torch
import torch.distributed as dist
from torch import nn

from k3.model.moe import LatentMoE
from k3.train.distributed import collective
from k3.train.optim import routed_expert_weights


class _AllToAll(torch.autograd.Function):
    """Rows of x (A, ...) split by send_splits go to the group's ranks; the result holds recv_splits rows from
    each. The backward sends the gradient the other way."""

    @staticmethod
    def forward(ctx, x, send_splits: list[int], recv_splits: list[int], group):
        ctx.splits, ctx.group = (send_splits, recv_splits), group
        out = x.new_empty(sum(recv_splits), *x.shape[1:])
        collective(dist.all_to_all_single, out, x.contiguous(), recv_splits, send_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        send_splits, recv_splits = ctx.splits
        out = grad.new_empty(sum(send_splits), *grad.shape[1:])
        collective(dist.all_to_all_single, out, grad.contiguous(), send_splits, recv_splits, group=ctx.group)
        return out, None, None, None


def all_to_all(x: torch.Tensor, send_splits: list[int], recv_splits: list[int], group=None) -> torch.Tensor:
    return _AllToAll.apply(x, send_splits, recv_splits, group)


class ExpertExchange:
    """The experts_forward of one LatentMoE under expert parallelism (module docstring, steps 1-4)."""

    def __init__(self, moe: LatentMoE, inner, ep_rank: int, ep_size: int, group=None):
        self.inner, self.ep_rank, self.ep_size, self.group = inner, ep_rank, ep_size, group
        self.num_experts = len(moe.experts)
        self.local = self.num_experts // ep_size
        self.first = ep_rank * self.local

    def __call__(self, z_AL: torch.Tensor, counts: list[int], first: int = 0) -> torch.Tensor:
        if first != 0 or len(counts) != self.num_experts:
            raise ValueError(
                f"expert parallelism exchanges the runs of all {self.num_experts} experts; got "
                f"{len(counts)} counts from expert {first}"
            )
        N, X = self.ep_size, self.local
        counts_E = torch.tensor(counts, dtype=torch.int64, device=z_AL.device)  # (NCCL takes GPU tensors only)
        recv_counts = torch.empty_like(counts_E)
        collective(dist.all_to_all_single, recv_counts, counts_E, group=self.group)
        counts_E, recv_counts_SX = counts_E.cpu(), recv_counts.cpu().view(N, X)
        send_splits = counts_E.view(N, X).sum(1).tolist()
        recv_splits = recv_counts_SX.sum(1).tolist()
        z_recv = all_to_all(z_AL, send_splits, recv_splits, self.group)  # (source, expert) order
        # each received row's key expert·N + source; a stable sort makes each local expert's rows one run
        key = torch.arange(X).repeat(N) * N + torch.arange(N).repeat_interleave(X)
        order = key.repeat_interleave(recv_counts_SX.flatten()).argsort(stable=True).to(z_AL.device)
        h_sorted = self.inner(z_recv.index_select(0, order), recv_counts_SX.sum(0).tolist(), self.first)
        h_recv = h_sorted.index_select(0, order.argsort())
        return all_to_all(h_recv, recv_splits, send_splits, self.group)


def moe_layers(model: nn.Module) -> list[LatentMoE]:
    return [m for m in model.modules() if isinstance(m, LatentMoE)]


def local_experts(num_experts: int, ep_rank: int, ep_size: int) -> range:
    if num_experts % ep_size:
        raise ValueError(f"--ep {ep_size} must divide the number of routed experts ({num_experts})")
    per = num_experts // ep_size
    return range(ep_rank * per, (ep_rank + 1) * per)


def shard_experts(model: nn.Module, ep_rank: int, ep_size: int, group=None) -> range:
    """Keep this rank's routed experts in every LatentMoE of `model` and route through ExpertExchange.
    Returns the local expert indices. The other experts' entries become empty modules: their parameters
    are gone from named_parameters() and state_dict() (checkpoints gather them, k3.train.resharding)."""
    layers = moe_layers(model)
    if not layers:
        raise ValueError("--ep needs a model with LatentMoE layers")
    mine = local_experts(len(layers[0].experts), ep_rank, ep_size)
    for moe in layers:
        for e in range(len(moe.experts)):
            if e not in mine:
                moe.experts[e] = nn.Module()
        # an instance attribute in front of the class's method: dispatch's call goes through the exchange
        moe.experts_forward = ExpertExchange(moe, moe.experts_forward, ep_rank, ep_size, group)
    return mine


def routed_expert_params(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """(name, parameter) of the routed experts this rank holds, in model order."""
    routed = routed_expert_weights(model)  # the optimiser's rule, so sharding and parameter groups agree
    return [(n, p) for n, p in model.named_parameters() if n in routed]
