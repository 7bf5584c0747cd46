"""Per-request sampling for the serving engine: parameters, the batched sampler and stop strings.

Every row of a batch carries its own SamplingParams. A seeded request's token at output position n is a
function of its distribution there and of (seed, n) only: the exponential race argmax_v p(v) / E(v),
E ~ Exp(1) i.i.d. drawn from a stream keyed by (seed, n) (`position_noise`), which is an exact draw from p
(it is the Gumbel-max trick). Nothing else a step does consumes that stream, so a seeded request draws the
same tokens whatever shares its batch, wherever it sits in it, after a preemption, and with or without
speculative decoding: a draft proposes with the same E, and verification accepts a proposal exactly when
it is the token the big model's race gives (k3.serve.speculative.verify). Unseeded requests share torch's global RNG.

Log-probabilities (SamplingParams.logprobs) are those of the raw model distribution, log_softmax of the
logits before temperature, top-k and top-p, as vLLM's default: they say what the model thinks of each
token whatever the request's sampling settings, its grammar included (a token the grammar forced may have
a low log-probability; the ones it refused may be among the top alternatives).

A request with a grammar (SamplingParams.grammar, k3.structured) samples from its logits with every token
the grammar refuses set to -inf first, before temperature, top-k and top-p: greedy or sampled, seeded or
not, it draws from the model's distribution restricted to the allowed tokens.

Shape suffixes: B rows in the batch, S rows that sample (temperature > 0), L rows that asked for
log-probabilities, N alternatives, V vocabulary.
"""

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from k3.model.sampling import filtered_probs
from k3.structured.grammar import Grammar

MAX_LOGPROBS = 20  # alternatives per token a request may ask for (OpenAI's top_logprobs limit, vLLM's default)
# a temperature below this samples greedily, as vLLM's _SAMPLING_EPS: logits / 1e-40 is no distribution in fp32
SAMPLING_EPS = 1e-5
_MASK64 = (1 << 64) - 1


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


@dataclass(frozen=True)
class SamplingParams:
    """How one request samples and when it stops.

    temperature 0 (or below SAMPLING_EPS) is greedy; top_k 0 or -1 is off, and one above the vocabulary
    keeps it all; top_p 1 is off, and the most likely token always stays however small top_p is. stop
    strings end the output before the string (it is never returned); stop_token_ids and eos end it after
    the token (the engine does not detokenise it). max_tokens counts generated tokens. seed makes the
    request reproducible, position by position (the module's docstring).
    logprobs: None (off) or N in [0, 20]: each output carries the sampled token's log-probability and
    the N most likely tokens', under the raw model distribution (log_softmax of the logits, before
    temperature, top-k and top-p).
    grammar: None, or a k3.structured grammar (Json(schema), or combinators) the output must follow: the
    engine compiles it against its tokenizer when the request is added, and only tokens it allows are
    sampled; where it is complete only eos and stop_token_ids remain (docs/serving.md, "Structured outputs").
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_tokens: int = 16
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    seed: int | None = None
    logprobs: int | None = None
    grammar: Grammar | None = None

    def __post_init__(self) -> None:
        t = self.temperature
        if not isinstance(t, int | float) or isinstance(t, bool) or not math.isfinite(t) or t < 0:
            raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {t!r}")
        p = self.top_p
        if not isinstance(p, int | float) or isinstance(p, bool) or not 0 < p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {p!r}")
        if not _is_int(self.top_k) or self.top_k < -1:
            raise ValueError(f"top_k must be an int >= 1, or 0 or -1 for off, got {self.top_k!r}")
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an int >= 1, got {self.max_tokens!r}")
        # frozen dataclass: normalise list inputs to tuples so params stay hashable and immutable
        stop = (self.stop,) if isinstance(self.stop, str) else self.stop
        if not isinstance(stop, list | tuple) or not all(isinstance(s, str) and s for s in stop):
            raise ValueError(f"stop must be a string or a list of non-empty strings, got {self.stop!r}")
        object.__setattr__(self, "stop", tuple(stop))
        ids = self.stop_token_ids
        if not isinstance(ids, list | tuple) or not all(_is_int(i) and i >= 0 for i in ids):
            raise ValueError(f"stop_token_ids must be a list of ints >= 0, got {ids!r}")
        object.__setattr__(self, "stop_token_ids", tuple(ids))
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be a bool, got {self.ignore_eos!r}")
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed < 2**63):
            raise ValueError(f"seed must be None or an int in [0, 2**63), got {self.seed!r}")
        n = self.logprobs
        if n is not None and (not _is_int(n) or not 0 <= n <= MAX_LOGPROBS):
            raise ValueError(f"logprobs must be None (off) or an int in [0, {MAX_LOGPROBS}], got {n!r}")
        if self.grammar is not None and not isinstance(self.grammar, Grammar):
            raise ValueError(
                f"grammar must be None or a k3.structured grammar (e.g. k3.structured.Json(schema)), "
                f"got {type(self.grammar).__name__}"
            )

    @property
    def greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS

    @property
    def coupled(self) -> bool:
        """Sampled with a seed: every position draws from its own stream (`position_noise`)."""
        return self.seed is not None and not self.greedy


def _mix64(x: int) -> int:
    """splitmix64's finaliser: a bijection of 64-bit ints whose outputs for nearby inputs look unrelated."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def stream_seed(seed: int, position: int) -> int:
    """The seed of request seed's stream for output position `position` (0 = the first generated token)."""
    return _mix64(_mix64(seed) ^ position)


def position_noise(seed: int, positions: Sequence[int], V: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """(len(positions), V) fp32 Exp(1) noise, row j from the stream of (seed, positions[j]): the same values
    on every call, whatever else has been drawn. Floored at the smallest normal float so that p / E is
    never 0/0 (torch's exponential_ may return 0)."""
    out = torch.empty(len(positions), V, dtype=torch.float32, device=device)
    for j, position in enumerate(positions):
        generator = torch.Generator(device=device).manual_seed(stream_seed(seed, position))
        out[j].exponential_(generator=generator)
    return out.clamp_(min=torch.finfo(torch.float32).tiny)


def race(probs_SV: torch.Tensor, noise_SV: torch.Tensor) -> torch.Tensor:
    """The exponential race: argmax_v p(v) / E(v) per row, a draw from p when E ~ Exp(1) i.i.d. (S,) int64."""
    return (probs_SV.float() / noise_SV).argmax(dim=-1)


def sample(
    logits_BV: torch.Tensor,
    params: Sequence[SamplingParams],
    positions: Sequence[int],
    allowed: Sequence[torch.Tensor | None] | None = None,
) -> torch.Tensor:
    """logits (B, V), any float dtype -> token ids (B,) int64, each row with its own params.

    positions: the output position of the token each row draws (what a seeded row's stream is keyed by).
    allowed: per row None, or a (V,) bool mask of the tokens its grammar allows; the others get -inf
    before anything else. Greedy rows are argmax and use no randomness. Sampled rows: logits / temperature
    in fp32, top-k, top-p (vectorised over rows); then a seeded row races its own noise for that position,
    and the rows without a seed share one multinomial draw from torch's global RNG.
    """
    B = len(logits_BV)
    if len(params) != B or len(positions) != B or (allowed is not None and len(allowed) != B):
        raise ValueError(
            f"need one SamplingParams, one position (and one mask, if any) per row: B={B}, got {len(params)}, "
            f"{len(positions)} and {None if allowed is None else len(allowed)}"
        )
    masked = [i for i in range(B) if allowed is not None and allowed[i] is not None]
    if masked:
        at = torch.tensor(masked, device=logits_BV.device)
        allowed_MV = torch.stack([allowed[i] for i in masked]).to(logits_BV.device)
        logits_BV = logits_BV.index_put((at,), logits_BV[at].masked_fill(~allowed_MV, -math.inf))
    tokens_B = logits_BV.argmax(dim=-1)
    rows = [i for i, p in enumerate(params) if not p.greedy]
    if not rows:
        return tokens_B
    device = logits_BV.device
    rows_S = torch.tensor(rows, device=device)
    probs_SV = request_probs(logits_BV[rows_S], [params[i] for i in rows], torch.float32)

    drawn_S = torch.empty(len(rows), dtype=torch.long, device=device)
    shared = [j for j, i in enumerate(rows) if params[i].seed is None]
    if shared:
        shared_t = torch.tensor(shared, device=device)
        drawn_S[shared_t] = torch.multinomial(probs_SV[shared_t], 1).squeeze(-1)
    seeded = [j for j, i in enumerate(rows) if params[i].seed is not None]
    if seeded:
        V = logits_BV.shape[1]
        noise_SV = torch.cat([position_noise(params[rows[j]].seed, [positions[rows[j]]], V, device) for j in seeded])
        seeded_t = torch.tensor(seeded, device=device)
        drawn_S[seeded_t] = race(probs_SV[seeded_t], noise_SV)
    tokens_B[rows_S] = drawn_S
    return tokens_B


def request_probs(
    logits_SV: torch.Tensor, params_S: list[SamplingParams], dtype: torch.dtype | None = None
) -> torch.Tensor:
    """(S, V) logits, one SamplingParams per row -> (S, V) the distributions those rows sample from:
    temperature, then top-k, then top-p (the one rule of sampling, speculative decoding's draft and
    verification included), in `dtype` (default: the logits' dtype, at least fp32)."""
    V = logits_SV.shape[1]
    device = logits_SV.device
    dtype = dtype or torch.promote_types(logits_SV.dtype, torch.float32)
    # greedy rows (a proposal row's, here) are scaled by 1: their distribution is never drawn from
    temperature_S = torch.tensor([max(p.temperature, SAMPLING_EPS) for p in params_S], dtype=dtype, device=device)
    # clamped in Python: a top_k of 2**63 is a valid "keep everything", but no int64 tensor holds it
    top_k_S = torch.tensor([min(p.top_k, V) if p.top_k > 0 else V for p in params_S], device=device)
    top_p_S = torch.tensor([p.top_p for p in params_S], dtype=torch.float32, device=device)
    # the row's maximum subtracted first: (logits - max) / T is <= 0 and never inf - inf, for any T >= SAMPLING_EPS
    shifted = logits_SV.to(dtype)
    shifted = shifted - shifted.amax(dim=-1, keepdim=True)
    return filtered_probs(shifted / temperature_S[:, None], top_k_S, top_p_S)


@dataclass(frozen=True)
class TokenLogprob:
    """One sampled token under the raw model distribution: its id and log-probability, and the N most
    likely tokens as (token id, log-probability), most likely first."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]


def token_logprobs(
    logits_BV: torch.Tensor, tokens_B: torch.Tensor, params: Sequence[SamplingParams]
) -> list[TokenLogprob | None]:
    """The log-probabilities of each row's sampled token and its top-N, for the rows whose params ask for
    them (None for the others, which cost nothing). log_softmax in fp32 (fp64 for an fp64 model) over the
    raw logits; only the L asking rows' chosen and top-N values reach the host."""
    rows = [i for i, p in enumerate(params) if p.logprobs is not None]
    out: list[TokenLogprob | None] = [None] * len(params)
    if not rows:
        return out
    device = logits_BV.device
    rows_L = torch.tensor(rows, device=device)
    logprobs_LV = torch.log_softmax(logits_BV[rows_L].to(torch.promote_types(logits_BV.dtype, torch.float32)), -1)
    chosen_L = logprobs_LV.gather(1, tokens_B[rows_L][:, None]).squeeze(1)
    n = min(max(params[i].logprobs for i in rows), logits_BV.shape[1])
    top_values_LN, top_ids_LN = logprobs_LV.topk(n, dim=-1, sorted=True)  # n may be 0: empty (L, 0)
    top_values_LN, top_ids_LN = top_values_LN.tolist(), top_ids_LN.tolist()
    tokens = tokens_B[rows_L].tolist()
    for j, (i, chosen) in enumerate(zip(rows, chosen_L.tolist(), strict=True)):
        k = params[i].logprobs
        out[i] = TokenLogprob(tokens[j], chosen, tuple(zip(top_ids_LN[j][:k], top_values_LN[j][:k], strict=True)))
    return out


class StopChecker:
    """Stop strings for detokenised streaming.

    Call update(new_text) after each step with the text that step added; it returns (finished,
    delta): delta is the new text that is now safe to send. Two rules make a stream never show any
    part of a stop string, even one split across tokens:

    - the output ends just before the first stop string to appear (finished=True; generation stops
      there, and the stop string itself is never emitted; if one update shows several, the one that
      starts earliest wins);
    - a tail of the text that could still grow into a stop string (a proper prefix of one) is held
      back until a later update shows it does not.

    When generation ends for another reason (eos, max_tokens), call update(new_text, final=True):
    nothing can follow, so the held-back tail is released. Work per call is O(new text + the longest
    stop string): only the held-back tail is kept. With no stop strings everything is emitted at once.
    """

    def __init__(self, stop: Sequence[str] = ()) -> None:
        stop = (stop,) if isinstance(stop, str) else tuple(stop)
        if not all(isinstance(s, str) and s for s in stop):
            raise ValueError(f"stop strings must be non-empty strings, got {stop!r}")
        self.stop = stop
        self.max_len = max((len(s) for s in stop), default=0)
        self.held = ""  # text received but not yet sent: a proper prefix of some stop string
        self.finished = False
        self.matched: str | None = None  # the stop string that ended the output

    def update(self, new_text: str, final: bool = False) -> tuple[bool, str]:
        if self.finished:
            return True, ""
        # everything sent was proven free of stop strings and of their starts, so any occurrence starts
        # in the held-back tail or later; the earliest one across all stop strings wins
        text = self.held + new_text
        hits = [(i, s) for s in self.stop if (i := text.find(s)) >= 0]
        if hits:
            end, self.matched = min(hits, key=lambda h: h[0])
            self.finished = True
        else:
            end = len(text) if final else self._safe_end(text)
        self.held = "" if self.finished else text[end:]
        return self.finished, text[:end]

    def _safe_end(self, text: str) -> int:
        """The first position from which the rest of the text is a proper prefix of a stop string."""
        for p in range(max(0, len(text) - self.max_len + 1), len(text)):
            tail = text[p:]
            if any(s.startswith(tail) for s in self.stop):
                return p
        return len(text)
