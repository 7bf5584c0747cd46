"""Admission and scheduling (SPEC §3): continuous batching with chunked prefill under a per-step token
budget, budget-based and cache-aware admission, a bounded waiting queue, preemption by recompute.

A request's cost is counted in pages before it is admitted: its KDA state pages plus the latent
pages of its prompt and of `reserve_output_fraction` of its max_tokens. Admitted requests therefore
normally finish without running out of pages; if they do (reservation below 1, or pages taken by
checkpoints in between), the newest running request is preempted: its pages are released and it
is recomputed from its tokens later. The pool is never exceeded: every page comes from
PagePool.allocate, which refuses rather than overcommits.

Progress is guaranteed whatever the reservation: a request is refused unless its prompt and all of its
max_tokens fit the pool alone, and the victim of a preemption is always the newest running request
(the one asking, if it is the newest), so the oldest running request is never preempted by another and,
once the others are gone, has every page it can need. It finishes; then the next oldest does.
"""

import itertools
import math
import time
from collections import deque
from dataclasses import dataclass, field

from k3.serve.plan import StepPlan, decode_row, prefill_piece
from k3.serve.pool import OutOfPages, PagePool
from k3.serve.sequence import Sequence, SequenceStatus


class Overloaded(RuntimeError):
    """The waiting queue is full; retry after `retry_after` seconds (an estimate)."""

    def __init__(self, message: str, retry_after: float):
        super().__init__(message)
        self.retry_after = retry_after


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 64  # running requests at once
    max_batched_tokens: int = 512  # tokens computed per step: decodes + prefill chunks
    max_waiting_requests: int = 256
    max_waiting_tokens: int = 1 << 20  # prompt tokens waiting
    reserve_output_fraction: float = 1.0  # share of max_tokens reserved in pages at admission
    max_wait_s: float = 10.0  # past this a waiting request goes first, whatever its cached prefix


@dataclass
class _Draft:
    """The step being decided: decodes and prefill chunks (seq, start, end, phase, checkpoint), before
    checkpoint pages are reserved and the plan is frozen. Preemption drops a request's entries."""

    decode: list[Sequence] = field(default_factory=list)
    prefill: list[tuple[Sequence, int, int, int, bool]] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    proposals: dict[Sequence, int] = field(default_factory=dict)  # draft tokens each decode verifies


class Scheduler:
    def __init__(self, config: SchedulerConfig, pool: PagePool, prefix_cache=None):
        self.config, self.pool, self.cache = config, pool, prefix_cache
        self.layout = pool.layout
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.step_seconds = 0.05  # running average of a step, for retry-after estimates
        self.num_preemptions = 0

    def pages_needed(self, seq: Sequence) -> int:
        """Pages the request reserves: KDA states + latents of its prompt and reserved output, or of every
        token it has (a preempted request recomputes its output too), whichever is more."""
        reserved = math.ceil(seq.params.max_tokens * self.config.reserve_output_fraction)
        return self.layout.n_kda + self.layout.latent_pages(max(seq.num_tokens, seq.num_prompt_tokens + reserved))

    def _outstanding(self) -> int:
        """Pages running requests may still claim under their reservation."""
        return sum(max(0, self.pages_needed(s) - len(s.latent_pages) - len(s.state_pages)) for s in self.running)

    def check_fits(self, seq: Sequence) -> None:
        """Refuse a request that could not finish even alone in the pool: its prompt and all of its max_tokens,
        whatever the reservation (a request admitted on a smaller reservation must still be able to finish)."""
        need = self.layout.n_kda + self.layout.latent_pages(seq.num_prompt_tokens + seq.params.max_tokens)
        if need > self.pool.num_pages:
            raise ValueError(
                f"request {seq.request_id} needs {need} pages ({seq.num_prompt_tokens} prompt + "
                f"{seq.params.max_tokens} max tokens) but the pool has {self.pool.num_pages}: shorten it"
            )

    def add(self, seq: Sequence) -> None:
        self.check_fits(seq)
        waiting_tokens = sum(s.num_prompt_tokens for s in self.waiting)
        if (
            len(self.waiting) >= self.config.max_waiting_requests
            or waiting_tokens + seq.num_prompt_tokens > self.config.max_waiting_tokens
        ):
            # the queue drains about max_batched_tokens per step
            retry = max(0.1, (waiting_tokens / max(1, self.config.max_batched_tokens)) * self.step_seconds)
            raise Overloaded(
                f"{len(self.waiting)} requests ({waiting_tokens} prompt tokens) are waiting; "
                f"limits are {self.config.max_waiting_requests} and {self.config.max_waiting_tokens}",
                retry_after=round(retry, 2),
            )
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def abort(self, request_id: str) -> Sequence | None:
        for seq in [*self.waiting, *self.running]:
            if seq.request_id == request_id:
                self.remove(seq)
                return seq
        return None

    def finish(self, seq: Sequence) -> None:
        """A request finished: register its full latent units (its output is a cacheable prefix too) and remove it."""
        if self.cache is not None:
            self.cache.commit_latents(seq)
        self.remove(seq)

    def remove(self, seq: Sequence) -> None:
        """Take a finished or aborted request out and give its pages back (latents of full units stay
        cached if the prefix cache registered them)."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self._release(seq)

    def _release(self, seq: Sequence) -> None:
        pages = seq.latent_pages + seq.state_pages
        seq.latent_pages, seq.state_pages = [], []
        if pages:
            self.pool.release(pages)

    def schedule(self) -> StepPlan:
        """Decide the step: which requests decode, which prompt tokens are computed (split at checkpoint
        positions), which are admitted or preempted; then reserve the checkpoint pages. Changes no
        request's progress: that is `complete`'s, after the forward."""
        draft = _Draft()
        budget = self.config.max_batched_tokens
        # 1. Decodes first: a running request with its prompt computed produces one token per step.
        for seq in list(self.running):
            if seq not in self.running or seq.remaining_prefill != 1:
                continue
            if budget < 1:
                break
            if self._grow(seq, seq.num_tokens, draft):
                draft.decode.append(seq)
                budget -= 1
                if seq.draft_token_ids:
                    budget -= self._speculate(seq, budget, draft)
        # 2. Prefill chunks of running requests, then admissions, under what is left of the budget.
        for seq in self.running:
            if budget <= 0:
                break
            if seq.remaining_prefill > 1:  # (a decode row has one token left: never here)
                budget -= self._prefill(seq, budget, draft)
        for seq in self._admission_order():
            if budget <= 0 or len(self.running) >= self.config.max_num_seqs:
                break
            if not self._admit(seq):
                break  # keep the order: a large request is not overtaken forever by small ones
            budget -= self._prefill(seq, budget, draft)
        return self._plan(draft)

    def _plan(self, draft: _Draft) -> StepPlan:
        """Freeze the draft. Checkpoint pages are reserved last, after every page the step's tokens need:
        a checkpoint is an optimisation and must not preempt a request."""
        prefill = []
        for seq, start, end, phase, checkpoint in draft.prefill:
            pages = self.cache.reserve_checkpoint(seq, end) if checkpoint else None
            prefill.append(prefill_piece(seq, start, end, phase, pages))
        return StepPlan(prefill, [decode_row(s, draft.proposals.get(s, 0)) for s in draft.decode], draft.preempted)

    def _speculate(self, seq: Sequence, budget: int, draft: _Draft) -> int:
        """Verify up to len(seq.draft_token_ids) proposals after seq's last token, within the token budget and
        the pages free now: speculation takes pages only when nothing is evicted or preempted for them
        (it is an optimisation, and the proposals' pages are handed back after the step). Returns tokens used."""
        k = min(len(seq.draft_token_ids), budget)
        need = self.layout.latent_pages(seq.num_tokens + k) - len(seq.latent_pages)
        while k and need > self.pool.num_free:
            k -= 1
            need = self.layout.latent_pages(seq.num_tokens + k) - len(seq.latent_pages)
        if k:
            seq.latent_pages += self.pool.allocate(max(0, need))
            draft.proposals[seq] = k
        return k

    def complete(self, plan: StepPlan, accepted: dict[Sequence, int] | None = None) -> None:
        """After the plan's forward: advance each request's progress (the only place that does), commit the
        checkpoints the forward filled, and register the latent units that are now full.

        accepted: for each proposal row's request, the new tokens verification gave it (accepted proposals
        + 1): its last token and the accepted proposals are computed, the rejected ones are not, and the
        latent pages past the next token's slot (the rejected proposals') go back to the pool."""
        for piece in plan.pieces:
            piece.seq.num_computed_tokens = piece.end
        for row in plan.proposal_rows:
            seq, n = row.seq, (accepted or {}).get(row.seq)
            if n is None or not 1 <= n <= row.num_tokens:
                raise ValueError(f"proposal row of {seq!r} needs 1 … {row.num_tokens} accepted tokens, got {n}")
            seq.num_computed_tokens = row.start + n
            keep = self.layout.latent_pages(seq.num_computed_tokens + 1)
            if len(seq.latent_pages) > keep:
                self.pool.release(seq.latent_pages[keep:])
                del seq.latent_pages[keep:]
        if self.cache is None:
            return
        for piece in plan.prefill:
            if piece.checkpoint_pages is not None:
                self.cache.commit_checkpoint(piece.seq, piece.end, list(piece.checkpoint_pages))
        for seq in {id(p.seq): p.seq for p in plan.prefill}.values():
            self.cache.commit_latents(seq)

    def abandon(self, plan: StepPlan) -> None:
        """The plan's forward failed: give back its checkpoint pages; progress did not move, so the next
        step plans the same tokens again."""
        if plan.checkpoint_pages:
            self.pool.release(plan.checkpoint_pages)

    def _admission_order(self) -> list[Sequence]:
        """Cache-aware: requests whose prefix is cached cost less prefill and go first; a request that
        has waited longer than max_wait_s goes before all of them."""
        now = time.monotonic()

        def cost(seq: Sequence) -> tuple:
            overdue = now - seq.arrival_time > self.config.max_wait_s
            cached = self.cache.match(seq).resume_tokens if self.cache is not None else 0
            return (not overdue, seq.status != SequenceStatus.PREEMPTED, seq.num_tokens - cached, seq.arrival_time)

        return sorted(self.waiting, key=cost)

    def _admit(self, seq: Sequence) -> bool:
        need = self.pages_needed(seq)
        if need + self._outstanding() > self.pool.available():
            return False
        try:
            if self.cache is not None:
                self.cache.acquire(seq, self.cache.match(seq))
            if not seq.state_pages:
                seq.state_pages = self.pool.allocate(self.layout.n_kda)
        except OutOfPages:  # acquire changed nothing; only state pages allocated here are given back
            self._release(seq)
            return False
        self.waiting.remove(seq)
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)
        return True

    def _prefill(self, seq: Sequence, budget: int, draft: _Draft) -> int:
        """Schedule the next prompt tokens of seq, up to budget, as consecutive chunks split at the
        checkpoint positions they cross: the runner computes them in one forward, one after another,
        and fills the KDA checkpoint at each split without an extra pass. Returns tokens used."""
        start = seq.num_computed_tokens
        end = min(seq.num_tokens, start + budget)
        if end <= start or not self._grow(seq, end, draft):
            return 0
        cuts = []
        if self.cache is not None:
            cuts = [pos for pos in self.cache.checkpoint_positions(seq.num_prompt_tokens) if start < pos <= end]
        bounds = [start, *cuts, *([end] if not cuts or cuts[-1] < end else [])]
        for phase, (a, b) in enumerate(itertools.pairwise(bounds)):
            draft.prefill.append((seq, a, b, phase, b in cuts))
        return end - start

    def _grow(self, seq: Sequence, tokens: int, draft: _Draft) -> bool:
        """Make seq hold latent pages for `tokens` tokens, preempting the newest running request while the
        pool is short. That is seq itself when seq is the newest: a newer request never takes pages from an
        older one (which would let two requests preempt each other forever). False if seq was preempted."""
        need = self.layout.latent_pages(tokens) - len(seq.latent_pages)
        while need > 0:
            try:
                seq.latent_pages += self.pool.allocate(need)
                return True
            except OutOfPages:
                victim = self.running[-1]
                self._preempt(victim, draft)
                if victim is seq:
                    return False
        return True

    def _preempt(self, seq: Sequence, draft: _Draft) -> None:
        self.running.remove(seq)
        draft.decode = [s for s in draft.decode if s is not seq]
        draft.proposals.pop(seq, None)
        draft.prefill = [c for c in draft.prefill if c[0] is not seq]
        self.pool.release(seq.reset_for_recompute())
        self.waiting.appendleft(seq)
        draft.preempted.append(seq)
        self.num_preemptions += 1
