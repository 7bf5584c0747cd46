"""The engine: step() = schedule → run → postprocess, as nano-vllm's.

One page pool (MLA latents and KDA states), the prefix cache with KDA checkpoints, the scheduler and
the model runner. `add_request` takes a prompt (text or token ids) and SamplingParams; every step
returns the new text and tokens of the requests that advanced.

With a draft model (speculative decoding, docs/speculative.md: the draft is k3.spec's, the runtime
k3.serve.speculative's) a decoding request's step is a proposal row: its last token and the draft's
proposals, scored in the same forward as everything else; verification decides the tokens, the runner rolls
the KDA states back to the last accepted one, the scheduler releases the rejected tokens' pages, and the
draft proposes again from the forward's features.

A request with a grammar (SamplingParams.grammar, k3.structured) gets its matcher when it is added (the
grammar compiled against the tokenizer once, shared by the requests that use it): its row is sampled under
the matcher's mask, and the matcher moves as its Sequence appends tokens.
"""

import itertools
import logging
import time
from dataclasses import dataclass, field

import torch

from k3.model.model import K3Model
from k3.serve.compiled_step import resolve as resolve_compile
from k3.serve.images import ImageStore
from k3.serve.layout import PageLayout
from k3.serve.model_runner import ModelRunner, StepOutput
from k3.serve.plan import ProposalRow, StepPlan
from k3.serve.pool import PagePool
from k3.serve.prefix_cache import PrefixCache
from k3.serve.sampling import SamplingParams, TokenLogprob, sample, token_logprobs
from k3.serve.scheduler import Scheduler, SchedulerConfig
from k3.serve.sequence import FinishReason, Sequence, ending_token_ids
from k3.serve.speculative.proposer import Proposer
from k3.serve.speculative.stats import SpecStats
from k3.serve.speculative.verify import verify
from k3.spec.draft import DraftModel
from k3.structured.matcher import GrammarCompiler, GrammarMatcher
from k3.structured.vocabulary import Vocabulary

log = logging.getLogger("k3.serve")


@dataclass
class EngineConfig:
    memory_budget: int | None = None  # bytes for the page pool; or num_pages
    num_pages: int | None = None
    enable_prefix_caching: bool = True
    hash_block_pages: int = 1  # prefix-cache unit, in latent pages (page_tokens tokens each)
    checkpoint_interval_units: int = 4  # store a KDA checkpoint every this many units (and at prompt ends)
    max_model_len: int | None = None  # the context, prompt + max_tokens; None: the model's max_position_embeddings
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    num_speculative_tokens: int | None = None  # proposals per step with a draft; None: the draft's own (7)
    spec_rollback: str = "snapshot"  # how proposal rows' KDA states go back to the last accepted token (kda_state.py)
    # speculate only while at most this many requests run (None: always): on a CPU a full batch already uses
    # the compute that verifying proposals needs, and speculation then slows it down (docs/benchmarks.md)
    spec_max_batch: int | None = None
    # run each step's forward as one compiled graph (k3.serve.compiled_step): None follows $K3_COMPILE (default
    # auto: wherever the model and machine allow it), False the eager reference, True or an error saying why not
    compile: bool | None = None

    def __post_init__(self) -> None:
        if (self.memory_budget is None) == (self.num_pages is None):
            raise ValueError("give exactly one of memory_budget (bytes) and num_pages")
        if self.spec_max_batch is not None and (not isinstance(self.spec_max_batch, int) or self.spec_max_batch < 0):
            raise ValueError(f"spec_max_batch must be None or an int >= 0, got {self.spec_max_batch!r}")
        if self.compile not in (None, True, False):
            raise ValueError(f"compile must be None (auto), True or False, got {self.compile!r}")


@dataclass
class RequestOutput:
    request_id: str
    new_text: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int
    error: str | None = None  # why a request failed (finish_reason "error", set by k3.serve.async_engine)
    # one per new token when the request's SamplingParams.logprobs is set (raw model distribution), else None
    logprobs: list[TokenLogprob] | None = None


class LLMEngine:
    def __init__(self, model: K3Model, tokenizer, config: EngineConfig, draft: DraftModel | None = None):
        self.model, self.tokenizer, self.config = model.eval(), tokenizer, config
        device = next(model.parameters()).device
        dtype = next(model.parameters()).dtype
        # latents and conv tails in the model's dtype; KDA states fp32 (fp64 for an fp64 model) in any pool
        self.layout = PageLayout.from_config(model.config, dtype)
        if config.num_pages is not None:
            self.pool = PagePool(self.layout, config.num_pages, device=device)
        else:
            self.pool = PagePool.from_budget(self.layout, config.memory_budget, device=device)
        self.cache = None
        if config.enable_prefix_caching:
            block = config.hash_block_pages * self.layout.page_tokens
            self.cache = PrefixCache(self.pool, block, block * config.checkpoint_interval_units)
        self.scheduler = Scheduler(config.scheduler, self.pool, self.cache)
        compile = resolve_compile(model, config.compile)
        self.runner = ModelRunner(model, self.pool, config.spec_rollback, compile=compile)
        # images: their tokens carry content-keyed ids above the vocabulary (k3.serve.images)
        self.images = ImageStore(model) if model.config.vision_config is not None else None
        self.runner.images = self.images
        self.seqs: dict[str, Sequence] = {}  # every request not yet finished or aborted, and its state
        self._ids = itertools.count()
        self.eos_id = getattr(tokenizer, "eos_id", None)
        limit = model.config.max_position_embeddings
        if config.max_model_len is not None and not 1 <= config.max_model_len <= limit:
            raise ValueError(f"max_model_len {config.max_model_len} must be in [1, {limit}] (max_position_embeddings)")
        self.max_model_len = config.max_model_len or limit
        self.draft, self.proposer, self.spec_stats = draft, None, SpecStats()
        if draft is not None:
            self.proposer = Proposer(draft.attach(model), config.num_speculative_tokens)
        self.last_plan: StepPlan | None = None  # the plan of the step running or last run; None if schedule failed
        self.grammars: GrammarCompiler | None = None  # made with the first request that has a grammar
        log.info("k3 engine: %s", self.pool.describe())

    def describe(self) -> str:
        return self.pool.describe()

    @property
    def max_request_tokens(self) -> int:
        """The most prompt + max_tokens one request may have: the context, or what the pool holds for one
        request alone (its KDA states and latent pages) if that is less."""
        room = self.pool.num_pages - self.layout.n_kda
        pool_tokens = room * self.layout.page_tokens if self.layout.n_mla else (self.max_model_len if room else 0)
        return max(0, min(self.max_model_len, pool_tokens))

    def add_request(
        self, prompt: str | list[int], params: SamplingParams | None = None, request_id: str | None = None
    ) -> str:
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise TypeError(
                f"params must be a k3.serve.sampling.SamplingParams, got {type(params).__name__}: "
                "write SamplingParams(**your_dict)"
            )
        if not isinstance(prompt, (str, list, tuple)):
            raise TypeError(f"a prompt is a string or a list of token ids, got {type(prompt).__name__}")
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        if request_id in self.seqs:
            raise ValueError(f"request id {request_id!r} is already in use")
        if max(ids, default=0) >= self.model.config.vocab_size and (self.images is None or self.draft is not None):
            why = "" if self.images is None else " (image token ids: speculative decoding takes text prompts only)"
            raise ValueError(f"token id {max(ids)} is outside the vocabulary ({self.model.config.vocab_size}){why}")
        if self.images is not None:
            self.images.check(ids)
        total = len(ids) + params.max_tokens
        if total > self.max_model_len:
            raise ValueError(
                f"the prompt's {len(ids):,} tokens + max_tokens {params.max_tokens:,} = {total:,} exceed the "
                f"context of {self.max_model_len:,} tokens; shorten the prompt or lower max_tokens"
            )
        matcher = self._matcher(params) if params.grammar is not None else None
        seq = Sequence(request_id, ids, params, tokenizer=self.tokenizer, matcher=matcher)
        self.scheduler.add(seq)  # may raise Overloaded or ValueError; nothing is stored then
        self.seqs[request_id] = seq
        return request_id

    def _matcher(self, params: SamplingParams) -> GrammarMatcher:
        """A matcher of params.grammar, compiled against the tokenizer (once per grammar); a grammar this
        engine cannot follow raises a ValueError (GrammarError, UnsupportedTokenizer) from add_request."""
        if self.grammars is None:
            self.grammars = GrammarCompiler(Vocabulary.of(self.tokenizer, self.model.config.vocab_size))
        return self.grammars.matcher(params.grammar, list(ending_token_ids(params, self.eos_id)))

    def abort(self, request_id: str, reason: FinishReason = FinishReason.ABORT) -> bool:
        """Take a request out before it finished, its pages freed, finished with `reason`: abort (cancelled),
        stop (the caller found an end the engine cannot see: the server's stop string in parsed chat content)
        or error (computing it failed outside the engine's step: k3.serve.async_engine)."""
        if reason not in (FinishReason.ABORT, FinishReason.STOP, FinishReason.ERROR):
            raise ValueError(f"a request is taken out with reason abort, stop or error, got {reason!r}")
        seq = self.scheduler.abort(request_id)
        if seq is None:
            return False
        seq.finish(reason)
        del self.seqs[request_id]
        return True

    def has_unfinished(self) -> bool:
        return bool(self.scheduler.waiting or self.scheduler.running)

    @torch.no_grad()
    def step(self) -> list[RequestOutput]:
        """schedule → run → postprocess. The plan says what the forward computes; the forward fills the
        KDA checkpoints the plan reserved; `complete` advances progress and commits them."""
        t0 = time.perf_counter()
        self.last_plan = None
        plan = self.last_plan = self.scheduler.schedule()
        try:
            if self.draft is None:
                out = StepOutput(self.runner.run(plan), None, None)
            else:  # the block summaries for the draft come from the same forward
                out = self.runner.execute(plan, self.draft.feature_blocks)
        except BaseException:
            self.scheduler.abandon(plan)
            raise
        new_tokens, rows, failed = self._choose(plan, out.logits)
        # a failed proposal row keeps its last token only; the request ends with its error in _postprocess
        accepted = {
            p.seq: max(1, len(t)) for p, t in zip(plan.sampled, new_tokens, strict=True) if isinstance(p, ProposalRow)
        }
        self.runner.rollback(out, accepted)
        self.scheduler.complete(plan, accepted)
        outputs = self._postprocess(plan, out.logits, new_tokens, rows, failed)
        if self.proposer is not None:
            # the big model's features where each request's newest token came from
            ready = [
                (p.seq, r[len(t) - 1])
                for p, t, r in zip(plan.sampled, new_tokens, rows, strict=True)
                if not p.seq.is_finished and p.seq.remaining_prefill == 1
            ]
            limit = self.config.spec_max_batch
            if limit is not None and len(self.scheduler.running) > limit:
                for seq, _ in ready:
                    seq.draft_token_ids, seq.draft_probs = [], None
            elif ready:
                at = torch.tensor([r for _, r in ready], device=out.logits.device)
                self._propose([s for s, _ in ready], [f[at] for f in out.summaries])
        self.scheduler.step_seconds = 0.9 * self.scheduler.step_seconds + 0.1 * (time.perf_counter() - t0)
        return outputs

    def _propose(self, seqs: list[Sequence], summaries: list[torch.Tensor]) -> None:
        """The draft's proposals for seqs (summaries: (len(seqs), d) each); a request whose proposing raises
        goes on with none. Not an error, unlike a failed sampling or verify: a proposal only saves steps, since
        verification gives greedy and seeded requests the same tokens with or without one (the distribution
        for the others), and the engine already decodes requests without (grammar rows, spec_max_batch). If the
        request's own params broke the draft, sampling them next step fails that request alone (_choose)."""
        try:
            self.proposer.propose(seqs, summaries)
            return
        except Exception:  # one row broke the batch: propose for each alone to find which
            log.exception("k3 engine: the draft's proposals failed; proposing for each of %d requests", len(seqs))
        for j, seq in enumerate(seqs):
            try:
                self.proposer.propose([seq], [f[j : j + 1] for f in summaries])
            except Exception as exc:
                log.warning("k3 engine: request %s decodes without proposals this step (%r)", seq.request_id, exc)
                seq.draft_token_ids, seq.draft_probs = [], None

    def _choose(self, plan: StepPlan, logits: torch.Tensor) -> tuple[list[list[int]], list[list[int]], dict]:
        """The new tokens of every sampled piece (one sampled token; a proposal row's verified tokens) and the
        logits rows they came from, in plan.sampled's order; and {piece index: exception} for the pieces
        whose sampling raised (they get no token; the other rows of the step are unaffected)."""
        pieces, rows, start = plan.sampled, [], 0
        for p in pieces:
            rows.append(list(range(start, start + p.num_logits)))
            start += p.num_logits
        plain = [i for i, p in enumerate(pieces) if not isinstance(p, ProposalRow)]
        new: list[list[int]] = [[] for _ in pieces]
        failed: dict[int, Exception] = {}
        if plain:
            at = torch.tensor([rows[i][0] for i in plain], device=logits.device)
            seqs = [pieces[i].seq for i in plain]
            allowed = [self._allowed(s, plain[j], failed) for j, s in enumerate(seqs)]
            try:
                positions = [s.num_output_tokens for s in seqs]
                tokens = sample(logits[at], [s.params for s in seqs], positions, allowed).tolist()
            except Exception:  # one row's logits or params broke the batch: sample each alone to find which
                one = self._sample_one
                tokens = [one(logits[at[j : j + 1]], s, allowed[j], plain[j], failed) for j, s in enumerate(seqs)]
            for i, t in zip(plain, tokens, strict=True):
                new[i] = [] if t is None or i in failed else [t]
        greedy = [i for i, p in enumerate(pieces) if isinstance(p, ProposalRow) and p.seq.params.greedy]
        best = logits.argmax(-1).tolist() if greedy else None  # every greedy proposal row's argmax, one device read
        for i, p in enumerate(pieces):
            if isinstance(p, ProposalRow):
                seq = p.seq
                row_best = None if best is None else [best[r] for r in rows[i]]
                try:
                    args = (seq.params, seq.num_output_tokens, seq.draft_probs, self.eos_id, row_best)
                    new[i] = verify(logits[rows[i]], list(p.proposals), *args)
                except Exception as exc:
                    failed[i] = exc
                    continue
                self.spec_stats.record(len(p.proposals), len(new[i]) - 1)
        return new, rows, failed

    @staticmethod
    def _allowed(seq: Sequence, index: int, failed: dict) -> torch.Tensor | None:
        """The (V,) mask of the tokens seq's grammar allows next; None without a grammar, or when it raised
        (the piece then fails alone)."""
        try:
            return None if seq.matcher is None else seq.matcher.mask()
        except Exception as exc:
            failed[index] = exc
            return None

    @staticmethod
    def _sample_one(
        logits_1V: torch.Tensor, seq: Sequence, allowed_V: torch.Tensor | None, index: int, failed: dict
    ) -> int | None:
        try:
            return sample(logits_1V, [seq.params], [seq.num_output_tokens], [allowed_V]).item()
        except Exception as exc:
            failed[index] = exc
            return None

    def _postprocess(
        self, plan: StepPlan, logits: torch.Tensor, new_tokens: list[list[int]], rows: list[list[int]], failed: dict
    ) -> list[RequestOutput]:
        """Append each sampled piece's new tokens (a proposal row's until one ends the request), stream their
        text, finish and drop what is done. A request whose sampling, log-probabilities or detokenisation
        raised ends with finish_reason "error" (its pages freed); the others are unaffected."""
        outputs = []
        for i, (piece, tokens, at) in enumerate(zip(plan.sampled, new_tokens, rows, strict=True)):
            seq = piece.seq
            logprobs, text, appended = None, [], []
            try:
                if i in failed:
                    raise failed[i]
                if seq.params.logprobs is not None:
                    n = len(tokens)
                    logprobs = token_logprobs(
                        logits[at[:n]], torch.tensor(tokens, device=logits.device), [seq.params] * n
                    )
                for token in tokens:
                    text.append(seq.append_output(token, self.eos_id))
                    appended.append(token)
                    if seq.is_finished:
                        break
            except Exception as exc:
                log.exception("k3 engine: request %s failed after the forward; the step's others go on", seq.request_id)
                seq.error = f"{type(exc).__name__}: {exc}"
                seq.finish(FinishReason.ERROR)
            if seq.finish_reason == FinishReason.ERROR:
                self.scheduler.remove(seq)  # its pages back, nothing of it registered in the prefix cache
            elif seq.is_finished:
                self.scheduler.finish(seq)
            if seq.is_finished:
                del self.seqs[seq.request_id]
            outputs.append(
                RequestOutput(
                    seq.request_id,
                    "".join(text),
                    appended,
                    seq.is_finished,
                    seq.finish_reason.value if seq.finish_reason else None,
                    seq.num_prompt_tokens,
                    seq.num_output_tokens,
                    seq.num_cached_tokens,
                    error=seq.error,
                    logprobs=None if logprobs is None else logprobs[: len(appended)],
                )
            )
        return outputs

    def metrics(self) -> dict:
        stats = self.cache.stats.as_dict() if self.cache is not None else {}
        return {
            "running": len(self.scheduler.running),
            "waiting": len(self.scheduler.waiting),
            "pages_free": self.pool.num_free,
            "pages_evictable": self.pool.num_evictable,
            "pages_used": self.pool.num_used,
            "preemptions": self.scheduler.num_preemptions,
            **stats,
            **(self.spec_stats.as_dict() if self.draft is not None else {}),
        }
