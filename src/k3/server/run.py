"""The engine requests behind one HTTP request: submitted together (all or none), their outputs merged as
they arrive, cancelled together when the client goes away; and the usage and metrics they add up to."""

import asyncio
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


class EngineFailed(RuntimeError):
    """A step computing this request raised; the engine aborted it and goes on with the others."""


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


class Run:
    def __init__(self, engine, metrics: ServerMetrics, prefix: str):
        self.engine, self.metrics = engine, metrics
        self.id = f"{prefix}-{secrets.token_hex(12)}"
        self.created = int(time.time())
        self.choices: dict[int, _Choice] = {}
        self._tasks: list[asyncio.Task] = []

    async def submit(self, subs: list[Submission]) -> None:
        """Submit every choice, or none: a refusal cancels those already submitted and becomes an APIError.
        submit_async waits for the engine loop to admit (up to one step) without blocking the event loop."""
        try:
            for s in subs:
                handle = await self.engine.submit_async(s.prompt_ids, s.params, request_id=f"{self.id}-{s.index}")
                self.choices[s.index] = _Choice(s, handle, time.perf_counter(), prompt_tokens=len(s.prompt_ids))
        except Overloaded as e:
            self.cancel()
            self.metrics.rejections.labels("429").inc()
            raise overloaded(e.retry_after, str(e)) from None
        except EngineClosed:
            self.cancel()
            self.metrics.rejections.labels("503").inc()
            raise APIError(503, "the server is shutting down and takes no new requests", code="shutting_down") from None
        except (ValueError, TypeError) as e:  # e.g. the request needs more pages than the pool has
            self.cancel()
            self.metrics.rejections.labels("400").inc()
            raise APIError(400, str(e)) from None

    async def outputs(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(choice index, output) as the engine produces them, every choice to its end."""
        if len(self.choices) == 1:
            ((index, choice),) = self.choices.items()
            async for out in choice.handle:
                self._record(choice, out)
                yield index, out
            return
        queue: asyncio.Queue = asyncio.Queue()

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
            self.metrics.requests.labels(out.finish_reason or "unknown").inc()
            if out.finish_reason == ERROR:  # the engine's step failed: the server's fault, not the request's
                raise EngineFailed(f"generation failed: {out.error}")

    def cancel(self) -> None:
        """Abort every choice not finished (their pages and state are freed by the engine)."""
        for task in self._tasks:
            task.cancel()
        for choice in self.choices.values():
            if not choice.handle.finished:
                choice.handle.cancel()

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
