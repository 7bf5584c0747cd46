"""The engine requests behind one HTTP request: submitted together (all or none), their outputs merged as
they arrive, cancelled together when the client goes away; and the usage and metrics they add up to."""

import asyncio
import logging
import secrets
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from k3.serve.async_engine import ERROR, EngineClosed
from k3.serve.engine import RequestOutput
from k3.serve.scheduler import Overloaded
from k3.server.errors import APIError, overloaded
from k3.server.metrics import ServerMetrics
from k3.server.params import Submission

log = logging.getLogger("k3.server")


class EngineFailed(RuntimeError):
    """Computing this request raised; the engine ended it and goes on with the others. The message is for
    the client (the engine's error text is for the log: it names internals)."""


class ShutDown(RuntimeError):
    """The engine aborted this request without the client asking: the server shut down before it finished."""


@dataclass
class _Choice:
    sub: Submission
    handle: object  # k3.serve.async_engine.RequestHandle
    submitted_s: float
    last_s: float | None = None
    prompt_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int = 0
    finish_reason: str | None = None
    cancelled: bool = False  # the server cancelled it (client gone, stop string, request over)
    counted: bool = False  # its end is in k3_requests_finished_total


class Run:
    def __init__(self, engine, metrics: ServerMetrics, prefix: str, max_backlog: int | None = None):
        self.engine, self.metrics, self.max_backlog = engine, metrics, max_backlog
        self.id = f"{prefix}-{secrets.token_hex(12)}"
        self.created = int(time.time())
        self.choices: dict[int, _Choice] = {}
        self._tasks: list[asyncio.Task] = []

    async def submit(self, subs: list[Submission]) -> None:
        """Submit every choice, or none: a refusal cancels those already submitted and becomes an APIError.
        submit_async waits for the engine loop to admit (up to one step) without blocking the event loop."""
        try:
            for s in subs:
                rid = f"{self.id}-{s.index}"
                handle = await self.engine.submit_async(s.prompt_ids, s.params, rid, self.max_backlog)
                self.choices[s.index] = _Choice(s, handle, time.perf_counter(), prompt_tokens=len(s.prompt_ids))
        except Overloaded as e:
            self.cancel(count=False)
            raise overloaded(e.retry_after, str(e)) from None
        except EngineClosed:
            self.cancel(count=False)
            raise APIError(503, "the server is shutting down and takes no new requests", code="shutting_down") from None
        except (ValueError, TypeError) as e:  # e.g. the request needs more pages than the pool has
            self.cancel(count=False)
            raise APIError(400, str(e)) from None

    async def outputs(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(choice index, output) as the engine produces them, every choice to its end."""
        if len(self.choices) == 1:
            ((index, choice),) = self.choices.items()
            async for out in choice.handle:
                self._record(choice, out)
                yield index, out
            return
        # bounded: when the response is not read, the pumps stop and the handles' own backlog bound applies
        queue: asyncio.Queue = asyncio.Queue(maxsize=self.max_backlog or 0)

        async def pump(index: int, choice: _Choice) -> None:
            try:
                async for out in choice.handle:
                    await queue.put((index, out))
            finally:
                await queue.put((index, None))

        self._tasks = [asyncio.create_task(pump(i, c)) for i, c in self.choices.items()]
        open_choices = len(self._tasks)
        while open_choices:
            index, out = await queue.get()
            if out is None:
                open_choices -= 1
                continue
            self._record(self.choices[index], out)
            yield index, out
        for task in self._tasks:
            task.result()  # a pump that failed raises here rather than ending its choice silently

    def _record(self, choice: _Choice, out: RequestOutput) -> None:
        now = time.perf_counter()
        if out.new_token_ids:
            if choice.last_s is None:
                self.metrics.ttft.observe(now - choice.submitted_s)
                self.metrics.prompt_tokens.inc(out.num_prompt_tokens)
            else:
                self.metrics.itl.observe(now - choice.last_s)
            choice.last_s = now
            self.metrics.generation_tokens.inc(len(out.new_token_ids))
        choice.prompt_tokens, choice.output_tokens = out.num_prompt_tokens, out.num_output_tokens
        choice.cached_tokens = out.num_cached_tokens
        if out.finished:
            choice.finish_reason = out.finish_reason
            self._count(choice, out.finish_reason or "unknown")
            if out.finish_reason == ERROR:  # computing it failed: the server's fault, not the request's
                log.error("k3 server: %s failed in the engine: %s", choice.handle.request_id, out.error)
                raise EngineFailed("generation failed on the server; the server log has the details")
            if out.finish_reason == "abort" and not choice.cancelled:
                raise ShutDown("the server shut down before this request finished")

    def _count(self, choice: _Choice, reason: str) -> None:
        if not choice.counted:
            choice.counted = True
            self.metrics.requests.labels(reason).inc()

    def cancel(self, count: bool = True) -> None:
        """Abort every choice not finished (their pages and state are freed by the engine); each is counted as
        finished with reason "abort" unless count is False (a request refused at submission never ran). A
        choice that ended with its last output unread is counted with that output's reason: the engine loop
        aborts the choices of a client that stopped reading (their backlog full), and nobody reads that end."""
        for task in self._tasks:
            task.cancel()
        for choice in self.choices.values():
            if not choice.handle.finished:
                choice.cancelled = True
                choice.handle.cancel()
                if count:
                    self._count(choice, "abort")
            elif count and not choice.counted:
                self._count(choice, choice.handle.finish_reason or "unknown")

    def usage(self) -> dict:
        """OpenAI's usage: each prompt counted once; cached_tokens is the prefix-cache hit of its choices."""
        prompts: dict[int, tuple[int, int]] = {}
        for c in self.choices.values():
            tokens, cached = prompts.get(c.sub.prompt_index, (0, 0))
            prompts[c.sub.prompt_index] = (max(tokens, c.prompt_tokens), max(cached, c.cached_tokens))
        prompt_tokens = sum(t for t, _ in prompts.values())
        completion_tokens = sum(c.output_tokens for c in self.choices.values())
        return {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": sum(c for _, c in prompts.values())},
        }
