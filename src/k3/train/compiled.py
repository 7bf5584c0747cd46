"""The training step compiled: `k3 train --compile` runs K3Model's forward with its loss through torch.compile,
and AOTAutograd derives the backward as a second compiled graph.

The layer stack traces as one graph with no breaks:
- each hand-written `autograd.Function` (RMSNorm, SiTU, AttnRes, the short conv, the gates, the loss, KDA's chunk
  op over its `k3_kda::chunk_fwd/bwd` operators) is traced, its backward included;
- the routed experts are one operator each way, `k3::moe_experts` and `k3::moe_experts_backward`
  (k3.model.moe), since their row counts, read from the routing, decide the shapes of their matmuls, which a graph
  cannot;
- Inductor fuses the element-wise work around them (casts under bf16 autocast included).

The eager model stays the reference and the fallback (CompiledTraining): the compiled forward computes the
same function (losses equal within fp32 rounding, tests/test_compiled_train.py), evaluation runs eagerly, and a
checkpoint holds the same weights either way. The step runs in torch's deterministic mode (`compile_training`),
so a compiled run repeats bitwise and a resumed one equals the unbroken one. Inductor keeps its code in
`$K3_CACHE_DIR/inductor` (k3.ops.compile_cache), so a later run of the same model and code skips code
generation; Dynamo still traces (~40 s for the small preset on 2 cores, ~150 s with a cold cache). That cost is
why compiling is not the default: docs/training.md has the measurement.
"""

from collections.abc import Callable

import torch
from torch import nn

from k3.ops.compile_cache import compiler_missing, use_inductor_cache

QAT_BLOCKER = (
    "routed experts under quantisation-aware training (--qat) fake-quantise their weights per call, which the "
    "compiled step does not trace; train them without --compile"
)


def setup_blocker(device: torch.device, world_size: int = 1, qat: str | None = None) -> str | None:
    """Why a training step on `device` over `world_size` processes (with --qat `qat`) cannot be compiled, or None:
    what the trainer checks before it writes anything."""
    if device.type != "cpu":
        return f"the compiled training step is built and tested on the CPU; on {device.type} train without --compile"
    if world_size > 1:
        return "the compiled training step runs in one process; with several, train without --compile"
    if qat is not None:
        return QAT_BLOCKER
    return compiler_missing()


def compile_blocker(model: nn.Module, world_size: int = 1) -> str | None:
    """Why the training step of this model cannot be compiled here, or None if it can."""
    reason = setup_blocker(next(model.parameters()).device, world_size)
    if reason is not None:
        return reason
    if model.config.vision_config is not None:
        return "a vision model's training step is not compiled"
    if any(not m.plain_experts() for m in model.modules() if hasattr(m, "plain_experts")):
        return QAT_BLOCKER
    return None


class CompiledTraining:
    """The compiled forward, with the eager model as its fallback: a forward that fails to trace or compile (the
    error is a torch internal, not the model's: eager runs the same call and raises the model's own errors) is
    logged once and every later micro-batch runs eagerly, as the serving step does. A failure there happens
    before any backward, so the step it happens in is an ordinary eager step."""

    def __init__(self, model: nn.Module, log: Callable[[str], None] = print):
        self.model, self.log = model, log
        self.compiled = torch.compile(model)
        self.failed: str | None = None  # why the step runs eagerly

    def __call__(self, *args, **kwargs):
        if self.failed is None:
            try:
                return self.compiled(*args, **kwargs)
            except Exception as error:  # any compile failure: the eager call below re-raises the model's own errors
                self.failed = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
                self.log(f"--compile: the step did not compile, it runs eagerly from here: {self.failed}")
        return self.model(*args, **kwargs)


def compile_training(model: nn.Module, world_size: int = 1, log: Callable[[str], None] = print) -> CompiledTraining:
    """model's forward compiled for training (called as the model is: `f(tokens, labels=tokens)` -> K3Output,
    falling back to eager if it fails to compile); a ValueError naming why where compile_blocker finds a
    reason."""
    reason = compile_blocker(model, world_size)
    if reason is not None:
        raise ValueError(f"--compile: {reason}")
    use_inductor_cache()
    # Inductor lowers scatter-adds (the embedding's and the loss's backward) to atomic adds across OpenMP threads,
    # whose order varies from run to run: two identical runs then differ in the last bit and a resumed run is not
    # the unbroken one. In deterministic mode it calls ATen's sequential kernels for them instead. Dynamo guards
    # on the mode, so it stays on for the process; torch.empty is not filled with NaN (that costs a pass per
    # allocation and changes no result).
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.utils.deterministic.fill_uninitialized_memory = False
    return CompiledTraining(model, log)


class IdleExperts:
    """Keeps the compiled step's optimiser updates those of the eager step for routed experts no token chose.

    Eagerly such an expert is not in the autograd graph, so its gradients stay None and the optimiser leaves it
    alone (no momentum step, no weight decay). k3::moe_experts_backward returns a gradient for every expert (an
    operator's list output has no None), zeros for an idle one, which Muon and AdamW would treat as a step with
    a zero gradient. `observe` each micro-batch's routing, then `release` before the optimiser step sets the
    gradients of the experts idle in every micro-batch back to None."""

    def __init__(self, model: nn.Module):
        self.moes = [m for m in model.modules() if hasattr(m, "plain_experts")]  # LatentMoE, in layer order
        self.used: list[torch.Tensor] | None = None

    def observe(self, routing: list) -> None:
        used = [r.loads_E > 0 for r in routing]
        self.used = used if self.used is None else [a | b for a, b in zip(self.used, used, strict=True)]

    def release(self) -> None:
        for moe, used in zip(self.moes, self.used or [], strict=True):
            for e in (~used).nonzero().flatten().tolist():
                for p in moe.experts[e].parameters():
                    p.grad = None
        self.used = None
