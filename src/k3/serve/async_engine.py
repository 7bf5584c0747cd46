"""One owner of an LLMEngine's step loop, many consumers: requests from any thread or coroutine, each
with its own queue of outputs, as vLLM's AsyncLLM.

Every engine call happens on one background thread, the loop. Other threads never touch the engine:
they queue calls to the loop (submit, cancel, stats) and wake it. The loop runs, in order: the queued
calls, then one engine step if any request is unfinished, then routes each output to its request's
handle; with nothing to do it waits on a condition (no spinning). A submission is an `add_request`
run on the loop between two steps, and the caller waits for it (at most one step), so the engine's
admission errors (ValueError, TypeError, Overloaded) are raised in the caller. A cancellation is
queued without waiting: the loop aborts the request before its next step, which frees its pages and
state, and the handle's last output then has finish_reason "abort" (or "stop", for a caller that found the
end itself: the server's stop strings on chat content), the reason the engine records.

A step that raises fails the requests it computed (the step's plan; every running request if the
failure came before a plan existed): each is aborted (pages freed) and gets a last output with
finish_reason "error" and the exception's text in `error`; the loop goes on with the others.
"""

import asyncio
import contextlib
import logging
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import Future

from k3.serve.engine import LLMEngine, RequestOutput
from k3.serve.sampling import SamplingParams
from k3.serve.sequence import FinishReason

log = logging.getLogger("k3.serve")

ERROR = "error"  # finish_reason of a request whose step raised
CANCEL_REASONS = ("abort", "stop")  # what RequestHandle.cancel may end a request with


class EngineClosed(RuntimeError):
    """The engine is shut down (or its loop died): it takes no new requests."""


class RequestHandle:
    """One request's output channel. Outputs arrive in order, the last with finished=True; read them
    with `for out in handle` (blocking), `async for out in handle` (never blocks the event loop) or
    `outputs(timeout)`. Each output is delivered once: give a handle one consumer."""

    def __init__(self, request_id: str, owner: "AsyncEngine", max_backlog: int | None = None):
        self.request_id = request_id
        self._owner = owner
        self.max_backlog = max_backlog  # outputs left unread past which the loop aborts the request
        self._cond = threading.Condition()
        self._queue: deque[RequestOutput] = deque()
        self._finished = False  # the last output was queued: the engine holds nothing of the request
        self._finish_reason: str | None = None  # the last output's, once it is queued
        self._drained = False  # the last output was read: iterators end
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future]] = []

    def __repr__(self) -> str:
        return f"RequestHandle({self.request_id!r}, finished={self._finished})"

    @property
    def finished(self) -> bool:
        """True once the request is over (finished, aborted or failed) and its pages are released."""
        return self._finished

    @property
    def finish_reason(self) -> str | None:
        """The last output's finish_reason once the request is over (read or not), else None."""
        return self._finish_reason

    @property
    def backlog(self) -> int:
        """Outputs queued and not yet read."""
        return len(self._queue)

    def cancel(self, reason: str = "abort") -> None:
        """End the request: its pages and state are freed before the engine's next step and the iterators
        end with an output whose finish_reason is `reason`, which the engine records: "abort", or "stop" when
        the caller found the request's end itself (a stop string in parsed chat content). Idempotent; nothing
        happens once finished (the first reason sticks). Does not wait: `wait()` does."""
        if reason not in CANCEL_REASONS:
            raise ValueError(f"a request is cancelled with reason {' or '.join(CANCEL_REASONS)}, got {reason!r}")
        if not self._finished:
            self._owner._cancel(self.request_id, reason)

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the request is over (its pages released); False if timeout seconds passed first."""
        with self._cond:
            return self._cond.wait_for(lambda: self._finished, timeout)

    def outputs(self, timeout: float | None = None) -> Iterator[RequestOutput]:
        """The outputs as they come, ending after the finished one; TimeoutError if one takes longer than
        timeout seconds (the request goes on: cancel it if it is no longer wanted)."""
        while True:
            with self._cond:
                if not self._cond.wait_for(lambda: self._queue or self._drained, timeout):
                    raise TimeoutError(f"request {self.request_id!r}: no output within {timeout} s")
                if not self._queue:
                    return
                out = self._queue.popleft()
                self._drained = out.finished
            yield out
            if out.finished:
                return

    def __iter__(self) -> Iterator[RequestOutput]:
        return self.outputs()

    async def _aiter(self) -> AsyncIterator[RequestOutput]:
        loop = asyncio.get_running_loop()
        while True:
            with self._cond:
                if self._queue:
                    out = self._queue.popleft()
                    self._drained = out.finished
                elif self._drained:
                    return
                else:
                    out, ready = None, loop.create_future()
                    self._waiters.append((loop, ready))
            if out is None:
                await ready  # resolved by _put from the loop thread, through call_soon_threadsafe
                continue
            yield out
            if out.finished:
                return

    def __aiter__(self) -> AsyncIterator[RequestOutput]:
        return self._aiter()

    def _put(self, out: RequestOutput) -> None:
        """Called by the engine loop only."""
        with self._cond:
            if self._finished:
                return  # one last output per request, whichever came first
            self._queue.append(out)
            self._finish_reason = out.finish_reason if out.finished else None
            self._finished = out.finished
            waiters, self._waiters = self._waiters, []
            self._cond.notify_all()
        for loop, ready in waiters:
            with contextlib.suppress(RuntimeError):  # that event loop is closed: its consumer is gone
                loop.call_soon_threadsafe(_resolve, ready)


def _cancel_added(done: Future) -> None:
    if done.exception() is None:
        done.result().cancel()


def _resolve(ready: asyncio.Future) -> None:
    if not ready.done():
        ready.set_result(None)


class AsyncEngine:
    """One owner of an LLMEngine's step loop (a background thread); requests from any thread or coroutine.

    engine = AsyncEngine(LLMEngine(...)); engine.start()
    handle = engine.submit("def f(x):", SamplingParams(max_tokens=32))
    for out in handle: print(out.new_text, end="")          # or: async for out in handle
    engine.shutdown(drain_timeout=10)
    """

    def __init__(self, engine: LLMEngine):
        self._engine = engine
        self._cond = threading.Condition()  # guards the fields below; the loop waits on it
        # run on the loop, in order, before the next step; a caller waiting on the future gets EngineClosed if the
        # loop stops before running its call
        self._calls: deque[tuple[Callable[[], None], Future | None]] = deque()
        self._handles: dict[str, RequestHandle] = {}  # unfinished requests; touched by the loop only
        self._closing = False
        self._drain_deadline: float | None = None
        self._stopped = False
        self._thread: threading.Thread | None = None

    @property
    def engine(self) -> LLMEngine:
        """The engine. Read it (or call it) from another thread only after shutdown: the loop owns it."""
        return self._engine

    def start(self) -> None:
        """Start the loop thread; idempotent. submit() starts it too."""
        with self._cond:
            if self._thread is not None or self._closing:
                return
            # a daemon: an engine nobody shut down does not keep the interpreter alive
            self._thread = threading.Thread(target=self._loop, name="k3-engine-loop", daemon=True)
            self._thread.start()

    def submit(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        max_backlog: int | None = None,
    ) -> RequestHandle:
        """Queue a request; returns its handle. Thread-safe; waits for the loop to add it (at most one step),
        so the engine's admission errors (ValueError, TypeError, Overloaded) are raised here. EngineClosed
        after shutdown. From a coroutine, `await submit_async(...)` does not block the event loop.
        max_backlog: once this many outputs wait unread, the request is aborted (finish_reason "abort"): a
        consumer that stopped reading does not keep the engine computing for it, nor its outputs piling up."""
        done = self._submit(prompt, params, request_id, max_backlog)
        try:
            return done.result()
        except BaseException:
            # interrupted while waiting (Ctrl-C): a request added after all is cancelled, not left running
            done.add_done_callback(_cancel_added)
            raise

    async def submit_async(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        max_backlog: int | None = None,
    ) -> RequestHandle:
        """submit() for asyncio: the wait for the loop is awaited, not blocked on."""
        done = self._submit(prompt, params, request_id, max_backlog)
        try:
            return await asyncio.shield(asyncio.wrap_future(done))
        except BaseException:  # the coroutine was cancelled (its client went away) while the loop added it
            done.add_done_callback(_cancel_added)
            raise

    def _submit(self, prompt, params, request_id, max_backlog) -> Future:
        self.start()
        done: Future = Future()

        def add() -> None:
            if not done.set_running_or_notify_cancel():
                return  # the caller gave up on a future nobody shielded: add nothing
            try:
                rid = self._engine.add_request(prompt, params, request_id)
            except BaseException as exc:
                done.set_exception(exc)
                return
            handle = self._handles[rid] = RequestHandle(rid, self, max_backlog)
            done.set_result(handle)

        self._queue_call(add, done)
        return done

    def stats(self) -> dict:
        """engine.metrics(), taken on the loop between two steps (at most one step's wait), so the counts
        are consistent with each other; read directly once the loop has stopped."""
        with self._cond:
            thread = self._thread if not self._stopped else None
        if thread is None:
            return self._engine.metrics()
        done: Future = Future()
        try:
            self._queue_call(lambda: done.set_result(self._engine.metrics()), done, admitting=False)
            return done.result()
        except EngineClosed:  # the loop stopped in between: once it has ended nothing else uses the engine
            thread.join()
            return self._engine.metrics()

    def shutdown(self, drain_timeout: float | None = None) -> None:
        """Stop admitting (submit raises EngineClosed); let the submitted requests finish for up to
        drain_timeout seconds (None: until they all do; 0: not at all), abort the rest (their outputs end
        with "abort") and stop the loop thread. Idempotent; returns once the thread has ended."""
        deadline = None if drain_timeout is None else time.monotonic() + drain_timeout
        with self._cond:
            if not self._closing:
                self._closing, self._drain_deadline = True, deadline
            elif deadline is not None and (self._drain_deadline is None or deadline < self._drain_deadline):
                self._drain_deadline = deadline  # a second, more impatient shutdown (another SIGTERM) shortens it
            thread = self._thread
            if thread is None:
                self._stopped = True
            self._cond.notify_all()
        if thread is not None and thread is not threading.current_thread():
            thread.join()

    def _queue_call(self, call: Callable[[], None], done: Future | None, admitting: bool = True) -> None:
        with self._cond:
            if self._stopped or (admitting and self._closing):
                raise EngineClosed("the engine is shut down: it takes no new requests")
            self._calls.append((call, done))
            self._cond.notify_all()

    def _cancel(self, request_id: str, reason: str = "abort") -> None:
        with self._cond:
            if self._stopped:
                return  # the loop aborted everything when it stopped
            self._calls.append((lambda: self._abort(request_id, reason), None))
            self._cond.notify_all()

    def _loop(self) -> None:
        try:
            while True:
                with self._cond:
                    while not (self._calls or self._closing or self._engine.has_unfinished()):
                        self._cond.wait()
                    calls, self._calls = self._calls, deque()
                    closing, deadline = self._closing, self._drain_deadline
                for call, _ in calls:
                    call()
                overdue = deadline is not None and time.monotonic() >= deadline
                if closing and (overdue or not self._engine.has_unfinished()):
                    break
                if self._engine.has_unfinished():
                    self._step()
        except BaseException as exc:  # a bug in the loop itself: end every request rather than hang them
            log.exception("k3 engine loop died")
            with self._cond:
                self._closing = True
            self._fail(list(self._handles), exc)
            raise
        finally:
            with self._cond:
                self._stopped = True
                calls, self._calls = self._calls, deque()
            for _, done in calls:
                if done is not None and not done.done():
                    done.set_exception(EngineClosed("the engine loop stopped before taking the request"))
            for request_id in list(self._handles):  # past the drain deadline
                self._abort(request_id, "abort")

    def _step(self) -> None:
        try:
            outputs = self._engine.step()
        except Exception as exc:
            plan = self._engine.last_plan
            if plan is None:
                affected = [s.request_id for s in self._engine.scheduler.running]
            else:
                affected = list(dict.fromkeys(p.seq.request_id for p in plan.pieces))
            # a request the step finished before it raised is gone from the engine with its output lost
            affected += [rid for rid in self._handles if rid not in self._engine.seqs and rid not in affected]
            log.exception("k3 engine step failed; failing requests %s", affected)
            self._fail(affected, exc)
            return
        for out in outputs:
            handle = self._handles.get(out.request_id)
            if handle is not None:
                handle._put(out)
                if out.finished:
                    del self._handles[out.request_id]
                elif handle.max_backlog is not None and handle.backlog >= handle.max_backlog:
                    log.info("k3 engine: aborting %s: %d outputs unread", out.request_id, handle.backlog)
                    self._abort(out.request_id, "abort", f"its reader left {handle.backlog} outputs unread")

    def _fail(self, request_ids: list[str], exc: BaseException) -> None:
        for request_id in request_ids:
            self._abort(request_id, ERROR, f"{type(exc).__name__}: {exc}")

    def _abort(self, request_id: str, reason: str, error: str | None = None) -> None:
        """End one request on the loop with `reason` (its pages and state freed; the engine records the reason)
        and give its handle its last output, with the same reason."""
        handle = self._handles.pop(request_id, None)
        seq = self._engine.seqs.get(request_id)
        try:
            if seq is not None:
                self._engine.abort(request_id, FinishReason(reason))
        finally:  # the handle ends even if the abort raised: its reader must not wait forever
            if handle is not None:
                handle._put(
                    RequestOutput(
                        request_id,
                        "",
                        [],
                        True,
                        reason,
                        seq.num_prompt_tokens if seq else 0,
                        seq.num_output_tokens if seq else 0,
                        seq.num_cached_tokens if seq else 0,
                        error,
                    )
                )
