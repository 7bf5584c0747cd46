"""Runs the model over the page pool: one forward per engine step for every piece of its plan, prefill
pieces of any lengths and decode rows alike (packed by k3.serve.paged_cache.PackedBatch).

The runner executes a StepPlan and nothing else: it reads the pieces' tokens and page tables, writes
the KDA states, conv tails and latents they compute into the pool (and the KDA checkpoints the plan
asks for), and returns logits at the sampled positions. It changes no Sequence and no page's
ownership; progress and commits are the scheduler's, after the forward.
"""

import torch

from k3.model.model import K3Model
from k3.serve.paged_cache import PackedBatch
from k3.serve.plan import StepPlan
from k3.serve.pool import PagePool


class ModelRunner:
    def __init__(self, model: K3Model, pool: PagePool):
        self.model, self.pool = model.eval(), pool
        self.config = model.config
        self.device = pool.storage.device

    def reset_state(self, state_pages: list[int]) -> None:
        """Zero KDA state pages: a piece starting at token 0 starts from S = 0 and empty conv tails."""
        if not state_pages:
            return
        rows = torch.tensor(state_pages, device=self.device)
        self.pool.kda_states()[rows] = 0
        self.pool.kda_conv()[rows] = 0

    @torch.no_grad()
    def run(self, plan: StepPlan) -> torch.Tensor:
        """One forward for the whole step -> logits (len(plan.sampled), vocab), row i for plan.sampled[i]."""
        pieces = plan.pieces
        if not pieces:
            return torch.empty(0, self.config.vocab_size, device=self.device)
        self.reset_state([page for p in pieces if p.start == 0 for page in p.state_pages])
        batch = PackedBatch(self.pool, self.config, pieces)
        # each MLA layer takes the model's configured path; the default, "auto", picks per group
        # (latent-space attention for decodes, per-head keys and values for long prefill chunks)
        return self.model(batch.token_ids, cache=batch, logits_at=batch.logits_at).logits[0]
