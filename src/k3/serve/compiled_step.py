"""The serving step compiled: one torch.compile graph for the model's forward over a packed step, with the
paged caches behind custom-op seams (as vLLM V1 compiles its step around its attention ops).

Everything a step computes that does not touch the page pool (embedding, projections, norms, Block AttnRes,
the router, shared experts, the LM head) is traced by Dynamo and compiled by Inductor (C++/OpenMP on a
CPU) into a few fused kernels and the matmuls. Two kinds of work stay outside the graph, each behind a
`torch.library` operator with a fake kernel, so the graph has no break:

- `k3_step::mix`: a layer's sequence mixing (KDA's convolution and delta rule, MLA's attention over the
  latents). The operator takes the layer's inputs for the whole packed row and the layer's index; the
  step's caches (k3.serve.paged_cache.PackedBatch, with its page tables, KDA state rows, checkpoints and
  proposal rows) are reached through the `StepContext` the runner sets around the call, as vLLM's
  attention op reaches its KV cache through its forward context. Inside, the mixing runs as in the eager
  engine, over the pool in place, so the graph holds no pool tensor and no mutation.
- `k3::moe_experts` (k3.model.moe): the routed experts, whose per-expert row counts decide the shapes
  of their matmuls; MXFP4-packed experts go to `k3_cpu::moe_experts_mxfp4_layer`, which names the layer by
  its handle (LatentMoE.handle, read here before tracing) instead of taking its 6·E byte tensors.

Behind the seams, the decoding work runs in C++ where k3's CPU library loads (k3.ops.cpu_library): a KDA layer's
convolutions and recurrence, MLA's attention over the pool's pages, the experts.

The packed row's length and the number of sampled positions are unbacked dimensions, so one graph serves every
step of any mix of prefill pieces, decode rows and proposal rows (a second graph also returns the AttnRes block
summaries a speculative draft reads). Inductor caches its compiled code on disk (k3.ops.compile_cache), so a
second start of the same model and code skips Inductor's code generation and C++ build; Dynamo still traces.
"""

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from k3.model.cache import GroupedLayerCache
from k3.model.model import K3Model
from k3.ops.compile_cache import compiler_missing, use_inductor_cache
from k3.serve.paged_cache import PackedBatch

log = logging.getLogger("k3.serve")

ENV_VAR = "K3_COMPILE"  # auto (default) | on | off: what EngineConfig(compile=None) does
CHOICES = ("auto", "on", "off")


@dataclass
class StepContext:
    """What the seams of one compiled step reach: the step's caches and the model's sequence-mixing
    functions, one per layer (KDA's `mix`, MLA's `attend`)."""

    batch: PackedBatch
    mixers: list[Callable[..., torch.Tensor]]


_local = threading.local()  # .context: the StepContext of the step running on this thread (engines run on theirs)


@contextlib.contextmanager
def step_context(context: StepContext) -> Iterator[None]:
    previous = getattr(_local, "context", None)
    _local.context = context
    try:
        yield
    finally:
        _local.context = previous


@torch.library.custom_op("k3_step::mix", mutates_args=())
def mix(xs: list[torch.Tensor], layer: int, heads: int, head_dim: int) -> torch.Tensor:
    """Layer `layer`'s sequence mixing over the packed row: xs (1, N, ...) each -> (1, N, heads, head_dim),
    through the current StepContext's caches (which read and write the page pool)."""
    context = getattr(_local, "context", None)
    if context is None:
        raise RuntimeError("k3_step::mix runs inside a compiled serving step (step_context), not on its own")
    # contiguous, as the fake kernel promises: the graph reads the output by those strides (MLA's naive path
    # returns a transposed view)
    return context.batch.layers[layer].mix(context.mixers[layer], *xs).contiguous()


@mix.register_fake
def _(xs: list[torch.Tensor], layer: int, heads: int, head_dim: int) -> torch.Tensor:
    return xs[0].new_empty(xs[0].shape[0], xs[0].shape[1], heads, head_dim)


class SeamLayerCache(GroupedLayerCache):
    """The cache a layer sees inside the compiled graph: its mixing becomes one k3_step::mix call."""

    def __init__(self, layer: int, heads: int, head_dim: int):
        self.layer, self.heads, self.head_dim = layer, heads, head_dim

    def mix(self, mix_fn: Callable[..., torch.Tensor], *xs: torch.Tensor) -> torch.Tensor:
        return torch.ops.k3_step.mix(list(xs), self.layer, self.heads, self.head_dim)


class SeamCache:
    """K3Model's `cache` argument inside the compiled graph: one SeamLayerCache per layer."""

    def __init__(self, model: K3Model):
        config = model.config
        self.layers = [
            SeamLayerCache(i, config.kda_num_heads, config.kda_head_dim)
            if kind == "kda"
            else SeamLayerCache(i, config.num_attention_heads, config.v_head_dim)
            for i, kind in enumerate(config.layer_types)
        ]
        self.seq_len = 0


class CompiledStep:
    """model(token_ids, cache=batch, logits_at=…) for the serving engine, compiled; `__call__` runs one step.

    The first calls compile (`compile_seconds` accumulates the time of the calls that did); later calls of
    any row length run the cached graphs."""

    def __init__(self, model: K3Model, cache_dir: Path | None = None):
        self.model = model
        self.mixers = [
            layer.self_attn.mix if layer.kind == "kda" else layer.self_attn.attend for layer in model.model.layers
        ]
        self.seams = SeamCache(model)
        # one eager token builds the tensors the model keeps across inference calls (k3.model.derived: KDA's
        # concatenated projections), so the graph takes them as inputs instead of concatenating every step
        with torch.no_grad():
            model(torch.zeros(1, 1, dtype=torch.long, device=next(model.parameters()).device))
        # packed experts are reached by their layer's handle, given (and their tensors handed over) before tracing
        packed = [moe for moe in model.modules() if hasattr(moe, "packed_experts") and moe.packed_experts()]
        self.handles = [moe.handle for moe in packed]
        use_inductor_cache(cache_dir)
        self._compiled = torch.compile(self._forward, fullgraph=True, options={"size_asserts": False})
        self.compile_seconds = 0.0
        self._seen: set[tuple[int, ...]] = set()  # the block summaries asked for: one graph each

    def _forward(
        self, token_ids: torch.Tensor, logits_at: torch.Tensor, summaries: tuple[int, ...]
    ) -> tuple[torch.Tensor, ...]:
        out = self.model(token_ids, cache=self.seams, logits_at=logits_at, summaries=summaries)
        return out.logits[0], *(s[0] for s in out.summaries or ())

    @torch.no_grad()
    def __call__(
        self, batch: PackedBatch, summaries: tuple[int, ...] = ()
    ) -> tuple[torch.Tensor, list[torch.Tensor]] | None:
        """The step's logits (n, vocab) at batch.logits_at, and there the AttnRes block summaries numbered in
        `summaries` (a speculative draft's features, (n, d) each); None if the graph does not compile (logged:
        the caller runs the step eagerly; compiling runs nothing on the pool, so the step is still to run)."""
        start = time.perf_counter() if summaries not in self._seen else None
        token_ids, logits_at = batch.token_ids, batch.logits_at
        self.seams.seq_len = 0  # the forward adds the step's tokens; the graph is traced (and guarded) at 0
        # unbacked: no specialisation of a size 0 or 1 (one logit, one token), so one graph takes every step
        torch._dynamo.decorators.mark_unbacked(token_ids, 1)
        torch._dynamo.decorators.mark_unbacked(logits_at, 0)
        # once a graph exists, Dynamo's guards (a check of every parameter per call, ~1.7 ms for the small
        # preset) are skipped but for those that tell its graphs apart: the inputs are two integer tensors
        stance = torch.compiler.set_stance("default", skip_guard_eval_unsafe=start is None)
        try:
            with step_context(StepContext(batch, self.mixers)), stance:
                logits, *blocks = self._compiled(token_ids, logits_at, summaries)
        except torch._dynamo.exc.TorchDynamoException as error:
            if start is None:
                raise
            log.warning("k3 engine: the step did not compile, it runs eagerly: %s", str(error).splitlines()[0])
            return None
        if start is not None:
            self._seen.add(summaries)
            seconds = time.perf_counter() - start
            self.compile_seconds += seconds
            what = f"with block summaries {summaries}" if summaries else "of any rows"
            log.info("k3 engine: compiled the step's graph (%s) in %.1f s", what, seconds)
        return logits, blocks


def compile_blocker(model: nn.Module) -> str | None:
    """Why the serving step of this model cannot be compiled here, or None if it can."""
    config = model.config
    device = next(model.parameters()).device
    if device.type != "cpu":
        return f"the compiled step is built and tested on the CPU; on {device.type} the step runs eagerly"
    if config.vision_config is not None:
        return "a vision model's steps place image embeddings, which the compiled step does not take"
    for moe in (m for m in model.modules() if hasattr(m, "packed_experts")):
        if moe.packed_experts():
            continue  # the MXFP4 kernel's seam, with or without MXFP8 inputs
        if config.expert_quantization is not None:
            return (
                f"the dense routed experts compute as expert_quantization {config.expert_quantization!r} "
                "(fake-quantised weights per call, QAT), which the compiled step does not trace; load with "
                'quantization="mxfp4" to serve them packed'
            )
        if not moe.plain_experts():
            return "the routed experts are neither nn.Linear nor MXFP4-packed layers"
    return compiler_missing()


def resolve(model: nn.Module, compile: bool | None) -> bool:
    """EngineConfig.compile -> whether the engine compiles its step: None takes $K3_COMPILE (auto: wherever
    compile_blocker finds nothing); True where it cannot is an error naming why."""
    if compile is None:
        choice = os.environ.get(ENV_VAR, "auto")
        if choice not in CHOICES:
            raise ValueError(f"{ENV_VAR} must be one of {CHOICES}, got {choice!r}")
        if choice == "off":
            return False
        compile = True if choice == "on" else None
    if compile is False:
        return False
    reason = compile_blocker(model)
    if reason is not None and compile:
        raise ValueError(f"compile=True, but {reason}; pass compile=False (--no-compile)")
    if reason is not None:
        log.info("k3 engine: eager step (%s)", reason)
    return reason is None
