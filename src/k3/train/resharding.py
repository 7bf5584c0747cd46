"""Checkpoints of a run on several ranks are the single-process checkpoint: gathered on save, split on load.

Saving (`full_state`): every rank takes part, rank 0 ends up with what one process would hold:
    FSDP2 parameters and their optimiser state (DTensors split by rows)   all-gathered (`full_tensor()`),
                                                                          one tensor at a time in name order
    routed experts of the other ranks of EP group 0, and their state      sent point to point to rank 0,
                                                                          rank by rank, in name order
and rank 0 writes the usual step folder (k3.formats.checkpoint), so a checkpoint written by N ranks is
loaded by any number of ranks, by `k3 export`, `k3 generate` and the serving engine without a conversion.
Loading: every rank reads the files, keeps its own experts (the model's names say which) and takes its
rows of each FSDP2 parameter's state (`local_part`); the model's weights are loaded before it is sharded.

The price is rank 0's memory: the whole model and its optimiser state pass through it, one tensor in
flight per collective. That is fine up to what one host can hold; the released 2.8T model needs a
sharded on-disk format (torch.distributed.checkpoint), which this does not write.
"""

import re
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, distribute_tensor

from k3.formats.checkpoint import write_checkpoint
from k3.model import K3Model
from k3.train.distributed import collective
from k3.train.optim import param_groups
from k3.train.parallelize import ParallelModel

EXPERT = re.compile(r"(.*\.experts\.)(\d+)(\..*)")
STATE_KEYS = {"muon": ("momentum_buffer",), "adamw": ("step", "exp_avg", "exp_avg_sq")}


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().cpu()


def _renumber(name: str, shift: int) -> str:
    m = EXPERT.fullmatch(name)
    return f"{m[1]}{int(m[2]) + shift}{m[3]}"


def _expert_sources(pm: ParallelModel) -> list[int]:
    """The ranks whose experts rank 0 lacks: the rest of EP group 0."""
    return list(range(1, pm.parallel.ep)) if pm.parallel.ep > 1 else []


def full_state(pm: ParallelModel, optimizer, config, expert_optimizer: str, expert_ns_steps: int):
    """(model tensors, optimizer tensors, optimizer meta) as one process would save them, on rank 0; on the
    other ranks (None, None, None). Every rank must call it (collectives)."""
    rank0 = pm.parallel.is_main
    model_tensors = {k: _full(v) for k, v in pm.model.state_dict().items()}  # all-gathers DTensors in order
    names = {id(p): n for n, p in pm.model.named_parameters()}
    algo = {names[id(p)]: g["algo"] for g in optimizer.param_groups for p in g["params"]}
    opt_tensors: dict[str, torch.Tensor] = {}
    for p, state in sorted(optimizer.state.items(), key=lambda item: names[id(item[0])]):
        for key in sorted(state):
            value = state[key]
            if isinstance(value, torch.Tensor):
                opt_tensors[f"{names[id(p)]}::{key}"] = _full(value)
    expert_names = [n for n, _ in pm.experts]
    per_rank = len({int(EXPERT.fullmatch(n)[2]) for n in expert_names})  # held experts (the same in every layer)
    group0 = pm.parallel.rank < pm.parallel.ep and pm.parallel.ep > 1
    if group0 and not rank0:
        _send_experts(expert_names, algo, model_tensors, opt_tensors, pm.parallel.device)
    if rank0:
        for source in _expert_sources(pm):
            _recv_experts(source, source * per_rank, expert_names, algo, model_tensors, opt_tensors, pm.parallel.device)
    if not rank0:
        return None, None, None
    with torch.device("meta"):
        full_model = K3Model(config)
    if expert_ns_steps == 5:  # build_optimizer's rule: the default NS steps need no experts group of their own
        expert_ns_steps = None
    groups = param_groups(full_model, 0.0, 0.0, expert_optimizer, expert_ns_steps)
    local_groups = optimizer.state_dict()["param_groups"]
    saved = []
    for group, local in zip(groups, local_groups, strict=True):
        if group["name"] != local["name"]:
            raise RuntimeError(f"optimiser group {local['name']!r} where the full model has {group['name']!r}")
        saved.append({**{k: v for k, v in local.items() if k != "params"}, "params": [n for n, _ in group["params"]]})
    full_names = list(full_model.state_dict())
    if set(full_names) != set(model_tensors):
        missing = sorted(set(full_names) - set(model_tensors))[:3]
        raise RuntimeError(f"the gathered state lacks {missing} or holds names the model does not have")
    model_tensors = {n: model_tensors[n] for n in full_names}  # the single-process order
    return model_tensors, opt_tensors, {"groups": saved, "scalars": {}}


def _send(t: torch.Tensor, device: torch.device) -> None:
    collective(dist.send, t.contiguous().to(device), dst=0)


def _recv(like: torch.Tensor, source: int, device: torch.device) -> torch.Tensor:
    buf = torch.empty(like.shape, dtype=like.dtype, device=device)
    collective(dist.recv, buf, src=source)
    return buf.cpu()


def _send_experts(expert_names, algo, model_tensors, opt_tensors, device) -> None:
    """To rank 0: each held expert's weight, a presence flag for its optimiser state, and the state."""
    for name in expert_names:
        _send(model_tensors[name], device)
    for name in expert_names:
        _send(torch.tensor([f"{name}::{STATE_KEYS[algo[name]][-1]}" in opt_tensors], dtype=torch.int32), device)
        if f"{name}::{STATE_KEYS[algo[name]][-1]}" in opt_tensors:
            for key in STATE_KEYS[algo[name]]:
                _send(opt_tensors[f"{name}::{key}"], device)


def _recv_experts(source, shift, expert_names, algo, model_tensors, opt_tensors, device) -> None:
    """From rank `source`: the experts numbered `shift` above rank 0's (same shapes, same order)."""
    for name in expert_names:
        model_tensors[_renumber(name, shift)] = _recv(model_tensors[name], source, device)
    step_like = torch.empty((), dtype=torch.float32)
    for name in expert_names:
        if _recv(torch.empty(1, dtype=torch.int32), source, device).item():
            for key in STATE_KEYS[algo[name]]:
                like = step_like if key == "step" else model_tensors[name]
                opt_tensors[f"{_renumber(name, shift)}::{key}"] = _recv(like, source, device)


def local_part(param: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """A saved optimiser-state tensor as this rank keeps it: its rows of a sharded parameter's, else as is."""
    if isinstance(param, DTensor) and value.ndim > 0:
        return distribute_tensor(value.to(param.device), param.device_mesh, param.placements, src_data_rank=None)
    return value


def save_gathered(
    pm: ParallelModel,
    optimizer,
    run: Path,
    step: int,
    config,
    state: dict[str, Any],
    expert_optimizer: str,
    expert_ns_steps: int,
    keep_last: int,
) -> Path:
    """full_state, written by rank 0 as step `step` of `run` (k3.formats.checkpoint.write_checkpoint, with the
    layout in the training state); every rank returns after the write (a barrier)."""
    model_tensors, opt_tensors, opt_meta = full_state(pm, optimizer, config, expert_optimizer, expert_ns_steps)
    path = run / f"step_{step:08d}"
    if pm.parallel.is_main:
        state = {**state, "parallel": layout(pm)}
        path = write_checkpoint(run, step, model_tensors, opt_tensors, opt_meta, config, state, keep_last=keep_last)
    pm.parallel.barrier()
    return path


def layout(pm: ParallelModel) -> dict[str, Any]:
    """How the run that wrote a checkpoint was spread (recorded in its training state; loading ignores it)."""
    return {"world_size": pm.parallel.world_size, "ep": pm.parallel.ep, "dp": pm.parallel.dp}
