"""The parallelisms applied to a K3Model, and its gradients kept in step across ranks (k3.train.distributed).

    data parallel     every rank takes 1/world of each micro-batch's rows; the non-expert parameters are
                      either replicated with DDP (gradients all-reduced, averaged) or sharded with FSDP2
                      (`fully_shard` per sublayer, then the whole model: parameters are DTensors split by rows,
                      gathered for each layer's forward and backward, gradients reduce-scattered, averaged)
    expert parallel   the routed experts split over groups of `ep` consecutive ranks (k3.train.expert_parallel);
                      neither DDP nor FSDP touches them: `sync_expert_grads` sums their gradients over the
                      replicas of each expert (ranks with the same place in their EP group) and divides by the
                      number of ranks, so every gradient is that of the mean loss over the global batch

With the loss of each rank the mean over its rows, the mean over ranks is the single-process loss of the
whole batch, and these gradients are its gradients.
"""

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from k3.train.distributed import Parallel, collective
from k3.train.expert_parallel import routed_expert_params, shard_experts


@dataclass
class ParallelModel:
    model: nn.Module  # the K3Model: its parameter names are the checkpoint's (FSDP2 shards it in place)
    forward: nn.Module  # what the trainer calls: the DDP wrapper, or the model
    parallel: Parallel
    experts: list[tuple[str, nn.Parameter]]  # the routed experts this rank holds
    ep_group: object = None  # this rank's EP group (None: no expert parallelism)
    replica_group: object = None  # the ranks holding the same experts (None: this rank alone)
    replicas: int = 1


def _groups(parallel: Parallel) -> tuple[object, object]:
    """(this rank's EP group, its replica group). Every rank creates every group, as new_group requires."""
    world, ep = parallel.world_size, parallel.ep
    ep_group = replica_group = None
    for start in range(0, world, ep):
        ranks = list(range(start, start + ep))
        group = dist.new_group(ranks) if ep > 1 else None
        if parallel.rank in ranks:
            ep_group = group
    for j in range(ep):
        ranks = list(range(j, world, ep))
        group = dist.new_group(ranks) if len(ranks) > 1 else None
        if parallel.rank in ranks:
            replica_group = group
    return ep_group, replica_group


def parallelize(model: nn.Module, parallel: Parallel) -> ParallelModel:
    """Shard the experts (ep > 1), then wrap the rest with DDP or FSDP2; the model's weights are already final
    (initialised or loaded from a checkpoint) and identical on every rank."""
    if not parallel.distributed:
        return ParallelModel(model, model, parallel, routed_expert_params(model))
    ep_group, replica_group = _groups(parallel)
    if parallel.ep > 1:
        shard_experts(model, parallel.ep_rank, parallel.ep, ep_group)
    experts = routed_expert_params(model)
    forward = model
    if parallel.dp == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, [n for n, _ in experts])
        forward = DistributedDataParallel(model, forward_sync_buffers=False, find_unused_parameters=True)
    else:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        policy = MixedPrecisionPolicy()
        if torch.cuda.is_available():  # bf16 compute, fp32 gradient reduction, fp32 sharded weights
            policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        ignored = {p for _, p in experts}
        # A K3 layer writes its output into the residual stream object instead of returning it, so FSDP2 would
        # find no output tensor to hook its backward on: the units are the sublayers (attention, FFN or MoE),
        # which take and return tensors; the layers' norms and AttnRes queries go with the root's unit.
        for layer in model.model.layers:
            fully_shard(layer.self_attn, mp_policy=policy, ignored_params=ignored)
            ffn = layer.mlp if hasattr(layer, "mlp") else layer.block_sparse_moe
            fully_shard(ffn, mp_policy=policy, ignored_params=ignored)
        fully_shard(model, mp_policy=policy, ignored_params=ignored)
    replicas = parallel.world_size // parallel.ep
    return ParallelModel(model, forward, parallel, experts, ep_group, replica_group, replicas)


@torch.no_grad()
def sync_expert_grads(pm: ParallelModel) -> None:
    """Each held expert's gradient: summed over its replicas, divided by world_size (module docstring). An
    expert no rank sent tokens to keeps no gradient, as in one process (Muon then leaves it untouched)."""
    if not pm.parallel.distributed or not pm.experts:
        return
    params = [p for _, p in pm.experts]
    if pm.replicas > 1:
        has = torch.tensor([p.grad is not None for p in params], dtype=torch.int32, device=params[0].device)
        collective(dist.all_reduce, has, op=dist.ReduceOp.MAX, group=pm.replica_group)
        live = [p for p, h in zip(params, has.tolist(), strict=True) if h]
        if live:
            flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).flatten() for p in live])
            collective(dist.all_reduce, flat, group=pm.replica_group)
            for p, g in zip(live, flat.split([p.numel() for p in live]), strict=True):
                p.grad = g.view_as(p)
    scale = 1.0 / pm.parallel.world_size
    for p in params:
        if p.grad is not None:
            p.grad.mul_(scale)


@torch.no_grad()
def clip_grad_norm(pm: ParallelModel, max_norm: float) -> float:
    """torch.nn.utils.clip_grad_norm_ over the whole model, wherever its gradients live: returns the total norm
    before clipping. One process: torch's own function (bitwise what k3 always did). Several: squared norms of
    sharded gradients summed over all ranks, of experts over each EP group, in float64."""
    model = pm.model
    if not pm.parallel.distributed:
        return torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm).item()
    expert_ids = {id(p) for _, p in pm.experts}
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    device = pm.parallel.device
    replicated = torch.zeros((), dtype=torch.float64, device=device)
    across = torch.zeros(2, dtype=torch.float64, device=device)  # [sharded, experts / replicas], over all ranks
    for p in model.parameters():
        if p.grad is None:
            continue
        if isinstance(p.grad, DTensor):
            across[0] += p.grad.to_local().double().square().sum()
        elif id(p) in expert_ids:
            across[1] += p.grad.double().square().sum() / pm.replicas
        else:
            replicated += p.grad.double().square().sum()
    collective(dist.all_reduce, across)
    total = (replicated + across.sum()).sqrt().item()
    coef = min(1.0, max_norm / (total + 1e-6))
    if coef < 1.0:
        for g in grads:
            g.mul_(coef)
    return total
