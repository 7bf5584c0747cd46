"""One request as the engine tracks it: its tokens, how far its cache has got, its pages and its status."""

import enum
import time

import torch

from k3.serve.detokenizer import IncrementalDetokenizer
from k3.serve.sampling import SamplingParams, StopChecker
from k3.structured.matcher import GrammarMatcher


class SequenceStatus(enum.Enum):
    WAITING = enum.auto()  # queued, holds no pages
    RUNNING = enum.auto()  # scheduled, holds pages
    PREEMPTED = enum.auto()  # pages taken back; will be recomputed from its tokens
    FINISHED = enum.auto()


class FinishReason(str, enum.Enum):
    """The OpenAI `finish_reason` values, and vLLM's two of its own."""

    STOP = "stop"  # eos, a stop token, a stop string, or the end of the request's grammar
    LENGTH = "length"  # max_tokens reached
    ABORT = "abort"  # cancelled by the client or the server
    ERROR = "error"  # computing this request raised (Sequence.error says what); the others in its step go on


def ending_token_ids(params: SamplingParams, eos_token_id: int | None) -> tuple[int, ...]:
    """The tokens that end a request with stop: eos unless ignore_eos, then params.stop_token_ids (what a
    grammar's matcher takes as the tokens that may end it)."""
    eos = () if eos_token_id is None or params.ignore_eos else (eos_token_id,)
    return (*eos, *params.stop_token_ids)


def end_reason(
    params: SamplingParams,
    token_id: int,
    num_output_tokens: int,
    eos_token_id: int | None,
    grammar_complete: bool = False,
) -> FinishReason | None:
    """The one end-of-request rule, token by token: why a request ends with `token_id` as its
    num_output_tokens-th output token, or None if it goes on. Stop: eos (unless ignore_eos), a stop token id,
    or a grammar that is complete; length: max_tokens reached. The token is kept in the output either way.
    Sequence.append_token and speculative verification (k3.serve.speculative.verify) both decide with it, and
    the proposer's room is what it leaves (Sequence.tokens_left). Stop strings are text, not tokens: the
    text stream decides them (Sequence.append_output), and a stop string cuts the output with reason stop."""
    if token_id in ending_token_ids(params, eos_token_id) or grammar_complete:
        return FinishReason.STOP
    if num_output_tokens >= params.max_tokens:
        return FinishReason.LENGTH
    return None


def _check_token_ids(token_ids: list[int], what: str) -> None:
    for i, t in enumerate(token_ids):
        if not isinstance(t, int) or isinstance(t, bool) or t < 0:
            raise ValueError(f"{what} must be non-negative ints, got {t!r} at position {i}")


class Sequence:
    """One request: prompt and output tokens, sampling state, cache progress and page tables.

    num_computed_tokens counts tokens whose MLA latents and KDA state are in the cache (chunked
    prefill advances it chunk by chunk); num_cached_tokens is how many prompt tokens came from the
    prefix cache, reported in usage. latent_pages is the MLA latent page table (page i holds tokens
    [i·P, (i+1)·P)); state_pages holds one page per KDA layer. Who writes what: the scheduler the pages
    and num_computed_tokens (advanced only by Scheduler.complete after a forward; set by the prefix
    cache's acquire on admission, zeroed by reset_for_recompute); the engine the output, through
    append_output, which also keeps the request's text stream (output_text) and moves the request's grammar
    matcher, if it has one, past each token: only there, so a preemption (which keeps the tokens and
    recomputes their cache) leaves the matcher where the output is.
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams | None = None,
        arrival_time: float | None = None,
        tokenizer=None,
        matcher: GrammarMatcher | None = None,
    ) -> None:
        if len(prompt_token_ids) == 0:
            raise ValueError("prompt is empty")
        _check_token_ids(prompt_token_ids, "prompt token ids")
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.params = params if params is not None else SamplingParams()
        self.status = SequenceStatus.WAITING
        self.finish_reason: FinishReason | None = None
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.error: str | None = None  # why the request failed (finish_reason ERROR)
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0
        self.latent_pages: list[int] = []
        self.state_pages: list[int] = []
        # the text stream: detokenised incrementally (without a tokenizer, no text), stop strings held back
        self.detokenizer = IncrementalDetokenizer(tokenizer) if tokenizer is not None else None
        self.stop_checker = StopChecker(self.params.stop)
        self.output_text = ""
        # speculative decoding: the draft's proposals for the tokens after the last one (the engine sets
        # them after each step, the scheduler plans their verification), the draft distributions they were
        # drawn from (K, V) for a sampled request (the counts of proposed and accepted tokens: SpecStats)
        self.draft_token_ids: list[int] = []
        self.draft_probs: torch.Tensor | None = None
        self.matcher = matcher  # the output's position in params.grammar (k3.structured), compiled by the engine

    def __repr__(self) -> str:
        return (
            f"Sequence({self.request_id!r}, {self.status.name}, prompt={self.num_prompt_tokens}, "
            f"output={self.num_output_tokens}, computed={self.num_computed_tokens})"
        )

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_ids(self, start: int, end: int) -> list[int]:
        """all_token_ids[start:end] (0 <= start <= end) without building the whole list: a decode step
        reads one token of a sequence that may hold a million."""
        P = len(self.prompt_token_ids)
        if end <= P:
            return self.prompt_token_ids[start:end]
        if start >= P:
            return self.output_token_ids[start - P : end - P]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - P]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    @property
    def remaining_prefill(self) -> int:
        """Tokens not yet in the cache: the rest of the prompt while prefilling, 1 while decoding (the
        last sampled token), everything after a recompute."""
        return self.num_tokens - self.num_computed_tokens

    @property
    def last_token_id(self) -> int:
        return self.output_token_ids[-1] if self.output_token_ids else self.prompt_token_ids[-1]

    @property
    def tokens_left(self) -> int:
        """Output tokens the request may still produce before end_reason ends it by length."""
        return self.params.max_tokens - self.num_output_tokens

    def append_token(self, token_id: int, eos_token_id: int | None = None) -> FinishReason | None:
        """Add a sampled token; finish, and return why, where end_reason says the request ends. The eos or
        stop token is kept in output_token_ids (usage counts it). A token the grammar refuses raises
        GrammarViolation, before anything changes."""
        reason = self._append(token_id, eos_token_id)
        if reason is not None:
            self.finish(reason)
        return self.finish_reason

    def append_output(self, token_id: int, eos_token_id: int | None = None) -> str:
        """append_token, then the text it adds to the stream: detokenised, cut at a stop string, with a possible
        start of a stop string held back until it is decided. A stop string that cuts the text finishes the
        request with stop, also when its token ended it by length: the output ends at the stop string."""
        reason = self._append(token_id, eos_token_id)
        text = self.detokenizer.step(self.output_token_ids, final=reason is not None) if self.detokenizer else ""
        hit, new_text = self.stop_checker.update(text, final=reason is not None)
        self.output_text += new_text
        if hit:
            reason = FinishReason.STOP
        if reason is not None:
            self.finish(reason)
        return new_text

    def _append(self, token_id: int, eos_token_id: int | None) -> FinishReason | None:
        if self.is_finished:
            raise RuntimeError(f"request {self.request_id!r} is finished ({self.finish_reason}); cannot append")
        _check_token_ids([token_id], "token ids")
        if self.matcher is not None:
            self.matcher.advance(token_id)
        self.output_token_ids.append(token_id)
        complete = self.matcher is not None and self.matcher.finished
        return end_reason(self.params, token_id, self.num_output_tokens, eos_token_id, complete)

    def finish(self, reason: FinishReason) -> None:
        """Mark finished. The first reason sticks: an abort that arrives after a stop changes nothing."""
        if not self.is_finished:
            self.status, self.finish_reason = SequenceStatus.FINISHED, reason

    def reset_for_recompute(self) -> list[int]:
        """Preempt by recompute: drop every page and all cache progress, keep the tokens (output tokens
        become part of what is prefilled again). Returns the dropped pages, latent then state, for the
        caller to release. num_cached_tokens keeps the first admission's hit, which is what usage reports."""
        if self.is_finished:
            raise RuntimeError(f"request {self.request_id!r} is finished; nothing to recompute")
        dropped = self.latent_pages + self.state_pages
        self.latent_pages, self.state_pages = [], []
        self.draft_token_ids, self.draft_probs = [], None
        self.num_computed_tokens = 0
        self.status = SequenceStatus.PREEMPTED
        return dropped
