"""Runs the model over the page pool: one forward per engine step for every piece of its plan, prefill
pieces of any lengths, decode rows and proposal rows alike (packed by k3.serve.paged_cache.PackedBatch).

The runner executes a StepPlan and nothing else: it reads the pieces' tokens and page tables, writes
the KDA states, conv tails and latents they compute into the pool (and the KDA checkpoints the plan
asks for), and returns logits at the sampled positions, with the big model's AttnRes block summaries
there when a draft needs them. After verification, `rollback` returns each proposal row's KDA states to
its last accepted token. It changes no Sequence and no page's ownership; progress and commits are the
scheduler's, after the forward.
"""

from dataclasses import dataclass

import torch

from k3.model.model import K3Model
from k3.serve.compiled_step import CompiledStep
from k3.serve.paged_cache import PackedBatch
from k3.serve.plan import StepPlan
from k3.serve.pool import PagePool


@dataclass
class StepOutput:
    """logits (n, vocab): row i for the i-th sampled position (plan.sampled's pieces, num_logits rows each);
    summaries: the draft's block summaries at the same positions, (n, d) each, or None without a draft;
    batch: what `ModelRunner.rollback` needs of the forward."""

    logits: torch.Tensor
    summaries: list[torch.Tensor] | None
    batch: PackedBatch | None


class ModelRunner:
    """compile: run each step's forward as one compiled graph (k3.serve.compiled_step); a vision model's steps
    run eagerly."""

    def __init__(self, model: K3Model, pool: PagePool, rollback: str = "snapshot", compile: bool = False):
        self.model, self.pool, self.rollback_mode = model.eval(), pool, rollback
        self.config = model.config
        self.device = pool.storage.device
        self.images = None  # the engine's k3.serve.images.ImageStore, for a vision model
        self.compiled = CompiledStep(model) if compile else None

    def reset_state(self, state_pages: list[int]) -> None:
        """Zero KDA state pages: a piece starting at token 0 starts from S = 0 and empty conv tails."""
        if not state_pages:
            return
        rows = torch.tensor(state_pages, device=self.device)
        self.pool.kda_states()[rows] = 0
        self.pool.kda_conv()[rows] = 0

    @torch.no_grad()
    def run(self, plan: StepPlan) -> torch.Tensor:
        """One forward for the whole step -> logits (Σ num_logits of plan.sampled, vocab), in its order."""
        return self.execute(plan).logits

    @torch.no_grad()
    def execute(self, plan: StepPlan, feature_blocks: tuple[int, ...] | None = None) -> StepOutput:
        """The step's one forward; with feature_blocks (1-based), also those block summaries at the
        sampled positions."""
        pieces = plan.pieces
        if not pieces:
            return StepOutput(torch.empty(0, self.config.vocab_size, device=self.device), None, None)
        self.reset_state([page for p in pieces if p.start == 0 for page in p.state_pages])
        batch = PackedBatch(self.pool, self.config, pieces, self.rollback_mode)
        # each MLA layer takes the model's configured path; the default, "auto", picks per group
        # (latent-space attention for decodes, per-head keys and values for long prefill chunks)
        token_ids, image_embeds = batch.token_ids, None
        if self.images is not None:  # image token ids -> the placeholder and its stored embedding
            token_ids, image_embeds = self.images.resolve(token_ids)
        blocks = tuple(feature_blocks or ())
        if self.compiled is not None and self.images is None:
            out = self.compiled(batch, blocks)
            if out is not None:
                logits, summaries = out
                return StepOutput(logits, summaries if blocks else None, batch)
            self.compiled = None  # it did not compile (the reason is logged): this step and the later ones eager
        out = self.model(token_ids, cache=batch, logits_at=batch.logits_at, image_embeds=image_embeds, summaries=blocks)
        summaries = [s[0] for s in out.summaries] if blocks else None
        return StepOutput(out.logits[0], summaries, batch)

    @torch.no_grad()
    def rollback(self, output: StepOutput, accepted: dict) -> None:
        """After verification: each proposal row keeps accepted[seq] of its tokens in its KDA states."""
        if output.batch is not None:
            output.batch.rollback(accepted)
