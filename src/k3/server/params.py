"""A validated request body -> what the engine is asked: prompt token ids and one SamplingParams per choice.
Every check whose answer depends on the server's limits or the model is here, each failing with a 400 that
names the parameter; parameters the engine cannot honour are refused by name rather than ignored."""

from dataclasses import dataclass

from k3.serve.sampling import SamplingParams
from k3.server.errors import APIError
from k3.server.limits import DEFAULT_MAX_TOKENS, ServerLimits
from k3.server.protocol import ChatCompletionRequest, CompletionRequest


@dataclass(frozen=True)
class Submission:
    """One choice to generate: `index` is its OpenAI choice index (prompt i, choice j -> i * n + j)."""

    index: int
    prompt_index: int
    prompt_ids: list[int]
    params: SamplingParams


def _unsupported(param: str, why: str) -> APIError:
    return APIError(400, f"{param} is not supported by this server: {why}", param=param, code="unsupported_parameter")


def check_common(body: CompletionRequest | ChatCompletionRequest, model_name: str, limits: ServerLimits) -> None:
    if body.model != model_name:
        raise APIError(
            400,
            f"model {body.model!r} is not served here; this server serves {model_name!r} (GET /v1/models)",
            param="model",
            code="model_not_found",
        )
    if body.n > limits.max_n:
        raise APIError(400, f"n={body.n} exceeds the server's limit of {limits.max_n} choices (--max-n)", param="n")
    for param in ("presence_penalty", "frequency_penalty"):
        if getattr(body, param):  # 0 and null mean off, which is what the engine does
            raise _unsupported(param, "the engine samples without penalties; send 0 or leave it out")
    if body.logit_bias:
        raise _unsupported("logit_bias", "the engine does not bias logits; leave it out")
    stops = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    if len(stops) > limits.max_stop_strings:
        raise APIError(400, f"{len(stops)} stop strings; at most {limits.max_stop_strings}", param="stop")
    if any(not s for s in stops):
        raise APIError(400, "stop strings must be non-empty", param="stop")


def stop_strings(body: CompletionRequest | ChatCompletionRequest) -> tuple[str, ...]:
    return (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())


@dataclass(frozen=True)
class Capacity:
    """What the engine behind the server can hold: request_tokens, the most prompt + max_tokens of one request
    (its context, or what the page pool holds for one request alone if less); sequences, the most choices one
    HTTP request may have (running + waiting at once); waiting_tokens, the prompt tokens the queue takes."""

    request_tokens: int
    sequences: int
    waiting_tokens: int


def max_tokens_for(
    requested: int | None,
    param: str,
    prompt_tokens: int,
    limits: ServerLimits,
    default: int | None,
    prompt_param: str = "prompt",
    capacity: Capacity | None = None,
) -> int:
    """The output budget of one prompt: the request's, or the default capped by what the context and the page
    pool leave (a request that sets nothing is never refused for a budget it did not ask for)."""
    context, why = limits.max_model_len, "the context is {:,} tokens (--max-model-len)"
    if capacity is not None and capacity.request_tokens < context:
        context, why = capacity.request_tokens, "the page pool holds {:,} tokens for one request (--num-pages)"
    why = why.format(context)
    room = context - prompt_tokens
    if room < 1:
        raise APIError(
            400,
            f"the prompt has {prompt_tokens:,} tokens and {why}, which leaves no room to generate: shorten the prompt",
            param=prompt_param,
            code="context_length_exceeded",
        )
    if requested is None:
        return min(limits.max_tokens, room, default if default is not None else room)
    if requested > limits.max_tokens:
        raise APIError(
            400,
            f"{param}={requested:,} exceeds the server's limit of {limits.max_tokens:,} (--max-tokens-limit)",
            param=param,
        )
    if requested > room:
        raise APIError(
            400,
            f"the prompt's {prompt_tokens:,} tokens + {param}={requested:,} exceed what this server "
            f"can hold: {why}; shorten the prompt or lower {param}",
            param=param,
            code="context_length_exceeded",
        )
    return requested


def check_admittable(subs: list["Submission"], capacity: Capacity | None, param: str) -> None:
    """A request the engine could never take whole (more choices than it runs and queues at once, or a prompt
    longer than its queue holds) is a 400, not a 429 that no retry can pass."""
    if capacity is None:
        return
    if len(subs) > capacity.sequences:
        raise APIError(
            400,
            f"this request asks for {len(subs):,} sequences (prompts × n); the engine runs and "
            f"queues at most {capacity.sequences:,} at once: lower n or send fewer prompts",
            param=param,
        )
    longest = max((len(s.prompt_ids) for s in subs), default=0)
    if longest > capacity.waiting_tokens:
        raise APIError(
            400,
            f"a prompt of {longest:,} tokens; the engine's queue holds at most {capacity.waiting_tokens:,}",
            param="messages" if param == "messages" else "prompt",
        )


def sampling_params(
    body: CompletionRequest | ChatCompletionRequest,
    max_tokens: int,
    choice: int,
    stop: tuple[str, ...],
    stop_token_ids: tuple[int, ...] = (),
    logprobs: int | None = None,
    grammar=None,
) -> SamplingParams:
    """Choice j of a seeded request samples with seed + j: the choices differ, and the request repeats.
    logprobs: the engine's (None: off, else the number of alternatives per token); grammar: what the output
    must follow (k3.chat.constraints), or None."""
    seed = None if body.seed is None else (body.seed + choice) % (1 << 63)
    try:
        return SamplingParams(
            temperature=1.0 if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p,
            top_k=body.top_k or 0,
            max_tokens=max_tokens,
            stop=stop,
            stop_token_ids=stop_token_ids,
            ignore_eos=body.ignore_eos,
            seed=seed,
            logprobs=logprobs,
            grammar=grammar,
        )
    except ValueError as e:  # the protocol's ranges match SamplingParams'; this is the backstop
        raise APIError(400, str(e)) from None


def completion_prompts(body: CompletionRequest, encode, vocab_size: int, limits: ServerLimits) -> list[list[int]]:
    """The request's prompts as token ids: a string, a list of ids, or a list of either."""
    p = body.prompt
    prompts = [p] if isinstance(p, str) or (p and isinstance(p[0], int)) else list(p)
    if not prompts:
        raise APIError(400, "prompt is empty", param="prompt")
    if len(prompts) > limits.max_prompts:
        raise APIError(
            400, f"{len(prompts)} prompts in one request; at most {limits.max_prompts} (--max-prompts)", param="prompt"
        )
    out = []
    for i, prompt in enumerate(prompts):
        where = "prompt" if len(prompts) == 1 else f"prompt[{i}]"
        if isinstance(prompt, str):
            check_text(prompt, where, "prompt")
        ids = encode(prompt) if isinstance(prompt, str) else list(prompt)
        if not ids:
            raise APIError(400, f"{where} is empty", param="prompt")
        if max(ids) >= vocab_size:
            raise APIError(
                400, f"{where}: token id {max(ids)} is outside the vocabulary ({vocab_size})", param="prompt"
            )
        out.append(ids)
    return out


def check_text(text: str, where: str, param: str) -> None:
    """Text the tokenizer will see must be encodable UTF-8: a lone surrogate ("\\ud800", which JSON can spell)
    is a 400 naming where it is, not a tokenizer exception."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise APIError(
            400,
            f"{where}: {text[e.start : e.end]!a} at character {e.start} is a lone surrogate, "
            "which is not text (UTF-8 cannot encode it)",
            param=param,
        ) from None


def completion_submissions(
    body: CompletionRequest, prompts: list[list[int]], limits: ServerLimits, capacity: Capacity | None = None
) -> list[Submission]:
    if body.echo:
        raise _unsupported("echo", "the prompt is not returned with the completion")
    if body.suffix:
        raise _unsupported("suffix", "K3 has no fill-in-the-middle format")
    if body.best_of is not None and body.best_of != body.n:
        raise _unsupported("best_of", "choices are not ranked by log-probability here; use n")
    stop = stop_strings(body)
    subs = []
    for i, ids in enumerate(prompts):
        max_tokens = max_tokens_for(
            body.max_tokens, "max_tokens", len(ids), limits, DEFAULT_MAX_TOKENS, "prompt", capacity
        )
        for j in range(body.n):
            params = sampling_params(body, max_tokens, j, stop, logprobs=body.logprobs)
            subs.append(Submission(i * body.n + j, i, ids, params))
    check_admittable(subs, capacity, "n" if len(prompts) == 1 else "prompt")
    return subs


def chat_logprobs(body: ChatCompletionRequest) -> int | None:
    """The engine's logprobs for a chat request: None without `logprobs: true`, else top_logprobs (0 if absent).
    top_logprobs without logprobs is refused, as OpenAI does, rather than silently returning nothing."""
    if body.top_logprobs is not None and not body.logprobs:
        raise APIError(
            400,
            "top_logprobs needs logprobs: true (top_logprobs is how many alternatives each token's entry lists)",
            param="top_logprobs",
        )
    return (body.top_logprobs or 0) if body.logprobs else None


def chat_max_tokens(
    body: ChatCompletionRequest, prompt_tokens: int, limits: ServerLimits, capacity: Capacity | None = None
) -> int:
    if body.max_completion_tokens is not None:
        return max_tokens_for(
            body.max_completion_tokens, "max_completion_tokens", prompt_tokens, limits, None, "messages", capacity
        )
    return max_tokens_for(body.max_tokens, "max_tokens", prompt_tokens, limits, None, "messages", capacity)
