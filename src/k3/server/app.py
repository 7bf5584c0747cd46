"""The OpenAI-compatible HTTP server over one AsyncEngine: FastAPI routes, thin. Requests are checked
(`params.py`), submitted (`run.py`) and answered as JSON or as an SSE stream; errors in OpenAI's shape
(`errors.py`); limits (`limits.py`), the API key and shutdown (`guard.py`); Prometheus metrics (`metrics.py`)."""

import asyncio
import logging
import re
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from k3.chat import ChatEncoder, ChatFormatError, resolve_thinking
from k3.chat.constraints import reply_grammar
from k3.demo.server import routing_app
from k3.server.chat_stream import ChatChoice
from k3.server.errors import APIError, Shield, error_body, install_error_handlers
from k3.server.guard import ClientGone, Guard, ServerState
from k3.server.images import image_spans, splice_images, take_images
from k3.server.limits import ServerLimits
from k3.server.logprobs import ChatLogprobs, CompletionLogprobs, TokenText
from k3.server.metrics import ServerMetrics
from k3.server.params import (
    Capacity,
    Submission,
    chat_logprobs,
    chat_max_tokens,
    check_admittable,
    check_common,
    completion_prompts,
    completion_submissions,
    sampling_params,
    stop_strings,
)
from k3.server.protocol import ChatCompletionRequest, ChatTemplateKwargs, CompletionRequest
from k3.server.responses import CHAT, COMPLETIONS, HEALTH, METRICS, MODELS, POST_ERRORS, install_openapi
from k3.server.run import EngineFailed, Run, ShutDown
from k3.server.sse import DONE, sse_event

log = logging.getLogger("k3.server")


@dataclass
class Server:
    """What the routes share: the engine, the served name, the limits, the chat format (or why there is none)."""

    engine: object  # k3.serve.async_engine.AsyncEngine, started
    model_name: str
    limits: ServerLimits
    metrics: ServerMetrics
    state: ServerState
    chat: ChatEncoder | None
    chat_error: str | None
    capacity: Capacity | None = None  # None: the engine does not say (a test's scripted engine)
    token_text: TokenText | None = field(default=None)  # made on first use: only log-probabilities need it

    @property
    def tokenizer(self):
        return self.engine.engine.tokenizer

    def texts(self) -> TokenText:
        if self.token_text is None:
            self.token_text = TokenText(self.tokenizer)
        return self.token_text

    @property
    def vocab_size(self) -> int:
        return self.engine.engine.model.config.vocab_size

    def run(self, prefix: str) -> Run:
        return Run(self.engine, self.metrics, prefix, self.limits.max_stream_backlog)


def engine_capacity(engine) -> Capacity | None:
    """What the engine can hold, read once: its pool and scheduler bounds do not change while it runs."""
    inner = engine.engine
    if not hasattr(inner, "max_request_tokens"):
        return None
    config = inner.scheduler.config
    waiting = config.max_num_seqs + config.max_waiting_requests
    return Capacity(inner.max_request_tokens, waiting, config.max_waiting_tokens)


def create_app(
    engine, model_name: str, limits: ServerLimits, api_key: str | None = None, state: ServerState | None = None
) -> FastAPI:
    """The ASGI app over a started AsyncEngine. The caller owns the engine (starts and shuts it down) and
    sets `state.draining` when shutdown begins."""
    try:
        chat, chat_error = ChatEncoder(engine.engine.tokenizer), None
    except (ChatFormatError, TypeError) as e:
        chat, chat_error = None, f"this model's tokenizer has no chat format: {e}"
    metrics = ServerMetrics(engine.stats)
    srv = Server(engine, model_name, limits, metrics, state or ServerState(), chat, chat_error, engine_capacity(engine))
    app = FastAPI(title="k3", version="1", summary="Kimi K3 behind an OpenAI-compatible API")
    app.state.server = srv
    install_error_handlers(app)
    install_openapi(app, model_name)
    _routes(app, srv)
    if api_key is None:
        # the routing figure (docs/routing.md) is open to anyone who can connect and costs CPU beside the
        # engine: a server that asks for a key does not offer it (`k3 demo routing` serves it on its own)
        app.mount("/demo/routing", routing_app())
    app.add_middleware(Shield, passthrough=(ClientGone,))  # innermost: what no route handled
    app.add_middleware(Guard, limits=limits, api_key=api_key, state=srv.state, metrics=metrics)
    return app


@asynccontextmanager
async def _cancel_on_disconnect(request: Request, run: Run):
    """A non-streaming request whose client goes away is cancelled too (streams are cancelled by Starlette);
    one whose requests ended early is answered with the error."""

    async def watch() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass
        run.cancel()

    task = asyncio.create_task(watch())
    try:
        yield
    except (EngineFailed, ShutDown) as e:
        raise _ended_early(e) from None
    finally:
        task.cancel()
        run.cancel()


# a ChatFormatError's message starts with the field it is about; the rest are about the messages
_CHAT_FIELDS = re.compile(r"(tool_choice|response_format|reasoning_effort|thinking_effort|tools)\b")


def _chat_param(message: str) -> str:
    field = _CHAT_FIELDS.match(message)
    if field is None:
        return "messages"
    return "chat_template_kwargs.thinking_effort" if field.group(1) == "thinking_effort" else field.group(1)


def _ended_early(e: Exception) -> APIError:
    """What a client is told when its requests ended without finishing: the server shut down (503), or
    computing them failed (500; the engine's own error text is in the log, not in the answer)."""
    if isinstance(e, ShutDown):
        return APIError(503, str(e), code="shutting_down")
    return APIError(500, str(e), code="generation_failed")


class _EventStream(StreamingResponse):
    """An SSE response whose run is cancelled however the response ends. When a write raises (ClientGone past
    --write-timeout, k3.server.guard) Starlette leaves the body generator suspended, so the generator's own
    `finally` would run only once it is garbage-collected, and the engine would go on computing the request
    for a closed connection until its backlog bound (--max-stream-backlog) aborted it."""

    def __init__(self, content, run: Run):
        super().__init__(content, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self.run = run

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.run.cancel()


def _sse(events, run: Run) -> StreamingResponse:
    async def body():
        try:
            async for event in events:
                yield event
        except (EngineFailed, ShutDown) as e:  # the stream has begun (status 200 sent): an error event
            err = _ended_early(e)
            yield sse_event(error_body(err.status, err.message, code=err.code))
        except Exception:
            log.exception("k3 server: stream %s failed", run.id)
            yield sse_event(error_body(500, "generation failed on the server; the server log has the details"))
        finally:
            run.cancel()  # a client gone mid-stream lands here (Starlette cancels the body): free its requests
        yield DONE

    return _EventStream(body(), run)


def _routes(app: FastAPI, srv: Server) -> None:
    @app.get("/health", responses=HEALTH)
    async def health() -> JSONResponse:
        if srv.state.draining:
            return JSONResponse({"status": "draining"}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics", response_class=PlainTextResponse, responses=METRICS)
    async def metrics() -> Response:
        # the engine's snapshot is taken between two steps: waited for in a thread, not on the event loop
        return Response(
            await asyncio.to_thread(srv.metrics.render), media_type="text/plain; version=0.0.4; charset=utf-8"
        )

    @app.get("/v1/models", responses=MODELS)
    async def models() -> dict:
        card = {
            "id": srv.model_name,
            "object": "model",
            "created": 0,
            "owned_by": "k3",
            "max_model_len": srv.limits.max_model_len,
        }
        return {"object": "list", "data": [card]}

    @app.post("/v1/completions", responses={**COMPLETIONS, **POST_ERRORS})
    async def completions(body: CompletionRequest, request: Request):
        check_common(body, srv.model_name, srv.limits)
        prompts = completion_prompts(body, srv.tokenizer.encode, srv.vocab_size, srv.limits)
        run = srv.run("cmpl")
        await run.submit(completion_submissions(body, prompts, srv.limits, srv.capacity))
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        logprobs = {i: CompletionLogprobs(srv.texts()) for i in run.choices} if body.logprobs is not None else {}

        def add_logprobs(i: int, out) -> None:
            if i in logprobs:
                logprobs[i].add(out.logprobs, out.new_text)

        def take_logprobs(i: int) -> dict | None:
            return logprobs[i].take() if i in logprobs else None

        def chunk(choices: list[dict], usage: dict | None = None) -> dict:
            out = {
                "id": run.id,
                "object": "text_completion",
                "created": run.created,
                "model": srv.model_name,
                "choices": choices,
            }
            if include_usage:
                out["usage"] = usage
            return out

        if body.stream:

            async def events():
                async for i, out in run.outputs():
                    add_logprobs(i, out)
                    if out.new_text or out.finished:
                        reason = out.finish_reason if out.finished else None
                        yield sse_event(
                            chunk(
                                [
                                    {
                                        "index": i,
                                        "text": out.new_text,
                                        "logprobs": take_logprobs(i),
                                        "finish_reason": reason,
                                    }
                                ]
                            )
                        )
                if include_usage:
                    yield sse_event(chunk([], run.usage()))

            return _sse(events(), run)
        texts: dict[int, list[str]] = {i: [] for i in run.choices}
        async with _cancel_on_disconnect(request, run):
            async for i, out in run.outputs():
                add_logprobs(i, out)
                texts[i].append(out.new_text)
        choices = [
            {
                "index": i,
                "text": "".join(texts[i]),
                "logprobs": take_logprobs(i),
                "finish_reason": run.choices[i].finish_reason,
            }
            for i in sorted(texts)
        ]
        return {
            "id": run.id,
            "object": "text_completion",
            "created": run.created,
            "model": srv.model_name,
            "choices": choices,
            "usage": run.usage(),
        }

    @app.post("/v1/chat/completions", responses={**CHAT, **POST_ERRORS})
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        check_common(body, srv.model_name, srv.limits)
        if srv.chat is None:
            raise APIError(400, srv.chat_error, param="messages", code="no_chat_format")
        options = body.chat_template_kwargs or ChatTemplateKwargs()
        messages, images, sentinel = take_images([m.model_dump(exclude_none=True) for m in body.messages])
        if images and getattr(srv.engine.engine, "images", None) is None:
            raise APIError(400, "image content needs a vision model; this one has no vision tower", param=images[0][0])
        try:
            thinking, effort = resolve_thinking(
                thinking=options.thinking,
                thinking_effort=options.thinking_effort,
                reasoning_effort=body.reasoning_effort,
            )
            rendered = srv.chat.render(
                messages,
                [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None,
                thinking=thinking,
                thinking_effort=effort,
                tool_choice=body.tool_choice,
                response_format=body.response_format,
            )
            declared = [t.model_dump(exclude_none=True) for t in body.tools or ()]
            declared += [t for m in messages if m.get("role") in ("system", "developer") for t in m.get("tools", ())]
            grammar = reply_grammar(
                thinking=thinking,
                tools=declared,
                tool_names=rendered.tool_names,
                tool_choice=body.tool_choice,
                response_format=body.response_format,
                parallel_tool_calls=body.parallel_tool_calls,
            )
        except ChatFormatError as e:
            raise APIError(400, str(e), param=_chat_param(str(e))) from None
        ids = rendered.ids
        if max(ids, default=0) >= srv.vocab_size:
            raise APIError(
                400,
                f"the chat tokens' ids reach {max(ids)}; the model has {srv.vocab_size} tokens",
                param="messages",
                code="no_chat_format",
            )
        if images:  # the tower runs off the event loop; k3.server.images
            spans = await asyncio.to_thread(image_spans, srv.engine.engine.images, srv.tokenizer, images)
            ids = splice_images(srv.chat, rendered.segments, spans, sentinel)
        max_tokens = chat_max_tokens(body, len(ids), srv.limits, srv.capacity)
        want_logprobs = chat_logprobs(body)
        end = (srv.chat.token_ids.end_of_msg,)
        # stop strings apply to the parsed content, not to the raw token stream (which carries the structure)
        subs = [
            Submission(j, 0, ids, sampling_params(body, max_tokens, j, (), end, want_logprobs, grammar))
            for j in range(body.n)
        ]
        check_admittable(subs, srv.capacity, "n")
        run = srv.run("chatcmpl")
        await run.submit(subs)
        stop = stop_strings(body)
        parsed = {j: ChatChoice(srv.chat, thinking, stop, rendered.tool_names) for j in run.choices}
        logprobs = {j: ChatLogprobs(srv.texts()) for j in run.choices} if want_logprobs is not None else {}

        def take_logprobs(j: int) -> dict | None:
            return logprobs[j].take() if j in logprobs else None

        include_usage = bool(body.stream_options and body.stream_options.include_usage)

        def advance(j: int, out) -> tuple[dict, str | None] | None:
            choice = parsed[j]
            if choice.done:
                return None  # output after a stop string ended this choice
            if j in logprobs:
                logprobs[j].add(out.logprobs)
            delta = choice.feed(out.new_token_ids, out.finished)
            if choice.stopped and not out.finished:
                run.choices[j].handle.cancel("stop")  # the engine ends it with the reason the client is told
            return delta.to_openai(), choice.finish_reason(out.finish_reason) if choice.done else None

        def chunk(choices: list[dict], usage: dict | None = None) -> dict:
            out = {
                "id": run.id,
                "object": "chat.completion.chunk",
                "created": run.created,
                "model": srv.model_name,
                "choices": choices,
            }
            if include_usage:
                out["usage"] = usage
            return out

        if body.stream:

            async def events():
                first = {"role": "assistant", "content": ""}
                yield sse_event(
                    chunk(
                        [
                            {"index": j, "delta": first, "logprobs": None, "finish_reason": None}
                            for j in sorted(run.choices)
                        ]
                    )
                )
                async for j, out in run.outputs():
                    step = advance(j, out)
                    if step is not None and (step[0] or step[1]):
                        yield sse_event(
                            chunk(
                                [{"index": j, "delta": step[0], "logprobs": take_logprobs(j), "finish_reason": step[1]}]
                            )
                        )
                if include_usage:
                    yield sse_event(chunk([], run.usage()))

            return _sse(events(), run)
        async with _cancel_on_disconnect(request, run):
            async for j, out in run.outputs():
                advance(j, out)
        choices = [
            {
                "index": j,
                "message": parsed[j].message(),
                "logprobs": take_logprobs(j),
                "finish_reason": parsed[j].finish_reason(run.choices[j].finish_reason),
            }
            for j in sorted(run.choices)
        ]
        return {
            "id": run.id,
            "object": "chat.completion",
            "created": run.created,
            "model": srv.model_name,
            "choices": choices,
            "usage": run.usage(),
        }
