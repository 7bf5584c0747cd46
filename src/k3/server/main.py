"""`k3 serve`: bind the port, load a model, start the engine loop, serve HTTP with uvicorn until SIGTERM or
Ctrl-C, then drain.

The address is bound before the model loads, so a port in use is an error at once, not after the load.

Shutdown: the first SIGTERM/SIGINT sets the server draining. It keeps listening: /health answers 503
"draining", new /v1 requests get 503, and the requests already running go on for up to drain_timeout_s.
When none is left in flight the server stops (closes the listener and idle connections) and exits 0. At the
deadline the engine aborts what is still running: each open stream then ends with an error event saying
the server shut down, and `[DONE]`; a non-streamed request gets a 503. A second signal during the drain
stops at once: everything is aborted and the process exits 128 + the signal's number (130 for Ctrl-C, 143
for SIGTERM), as a shell reports a command killed by it. uvicorn itself re-raises the signal after a
graceful stop (exit 143 for SIGTERM): this server does not, since a drained shutdown is a success."""

import asyncio
import logging
import signal
import socket
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import uvicorn

from k3.server.app import create_app
from k3.server.connections import timed_protocol
from k3.server.guard import ServerState
from k3.server.limits import ServerLimits

log = logging.getLogger("k3.server")
SHUTDOWN_SIGNALS = (signal.SIGINT, signal.SIGTERM)
# after the drain deadline's aborts, the streams' last events are written within this, or their tasks are cancelled
ABORT_GRACE_S = 5.0


def _http_protocol() -> type:
    """uvicorn's fastest HTTP protocol here (httptools when installed, as uvicorn's "auto" picks)."""
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

        return HttpToolsProtocol
    except ImportError:
        from uvicorn.protocols.http.h11_impl import H11Protocol

        return H11Protocol


class DrainingServer(uvicorn.Server):
    """uvicorn's server with k3's shutdown (the module's docstring): the listener stays open while draining."""

    def __init__(self, config: uvicorn.Config, state: ServerState, engine, drain_timeout_s: float):
        super().__init__(config)
        self.state, self.engine, self.drain_timeout_s = state, engine, drain_timeout_s
        self.drain_deadline: float | None = None
        self.aborted_at: float | None = None
        self.forced_by: int | None = None  # the second signal, when one stopped the drain

    def handle_exit(self, sig: int, frame) -> None:
        if self.state.draining:
            self.forced_by = sig
            self.should_exit = self.force_exit = True
            return
        self.state.draining = True
        self.drain_deadline = time.monotonic() + self.drain_timeout_s
        log.info("k3 serve: draining (%d requests in flight, up to %g s)", self.state.in_flight, self.drain_timeout_s)

    async def on_tick(self, counter: int) -> bool:
        if await super().on_tick(counter):
            return True
        if not self.state.draining:
            return False
        now = time.monotonic()
        if self.state.in_flight == 0:
            return True
        if self.aborted_at is None and now >= self.drain_deadline:
            log.info("k3 serve: drain timeout: aborting %d requests in flight", self.state.in_flight)
            self.aborted_at = now
            await asyncio.to_thread(self.engine.shutdown, 0)  # their streams end with an error event
        return self.aborted_at is not None and now >= self.aborted_at + ABORT_GRACE_S

    @contextmanager
    def capture_signals(self):
        if threading.current_thread() is not threading.main_thread():  # signals reach the main thread only
            yield
            return
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in SHUTDOWN_SIGNALS}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


def uvicorn_options(limits: ServerLimits) -> dict:
    """uvicorn.Config's arguments for the connection limits: the head deadline, the connection cap, keep-alive."""
    return {
        "http": timed_protocol(_http_protocol(), limits.header_timeout_s),
        "limit_concurrency": limits.max_connections,
        "timeout_keep_alive": limits.keep_alive_timeout_s,
        # the drain is k3's (on_tick); what uvicorn waits for after it is the last writes of aborted streams
        "timeout_graceful_shutdown": ABORT_GRACE_S,
    }


def bind(host: str, port: int) -> socket.socket:
    """The listening socket, bound before anything is loaded: an address in use is a ValueError naming it."""
    try:
        return socket.create_server((host, port))
    except OSError as e:
        raise ValueError(f"cannot listen on {host}:{port}: {e.strerror or e} (is another server using it?)") from None


def build_engine(
    model: str | Path,
    memory_budget: int | None,
    num_pages: int | None,
    device: str = "cpu",
    quantization: str | None = None,
    max_num_seqs: int | None = None,
    speculative_model: str | Path | None = None,
    compile: bool | None = None,
    dtype: str = "float32",
):
    """(AsyncEngine started, the model's context) for a model, run or step folder; speculative_model: a
    draft folder from `k3 train-draft` (docs/speculative.md); compile: EngineConfig.compile (None: auto);
    dtype: a name or "auto" (k3.ops.compute_dtype)."""
    from k3.hub import load_for_inference
    from k3.ops.compute_dtype import resolve_dtype
    from k3.serve.async_engine import AsyncEngine
    from k3.serve.engine import EngineConfig, LLMEngine
    from k3.serve.scheduler import SchedulerConfig
    from k3.spec.folder import load_draft, read_meta

    if speculative_model is not None:
        read_meta(speculative_model)  # a wrong folder is an error before the model's load
    choice = resolve_dtype(dtype, device)
    if dtype == "auto":
        print(f"k3 serve: dtype {choice}", flush=True)
    weights, tokenizer = load_for_inference(model, device=device, dtype=choice.dtype, quantization=quantization)
    draft = load_draft(speculative_model, weights) if speculative_model is not None else None
    if memory_budget is None and num_pages is None:
        memory_budget = 256 << 20
    scheduler = SchedulerConfig() if max_num_seqs is None else SchedulerConfig(max_num_seqs=max_num_seqs)
    config = EngineConfig(memory_budget=memory_budget, num_pages=num_pages, scheduler=scheduler, compile=compile)
    engine = AsyncEngine(LLMEngine(weights, tokenizer, config, draft=draft))
    engine.start()
    return engine, weights.config.max_position_embeddings


def serve(
    model: str | Path,
    host: str,
    port: int,
    *,
    max_model_len: int | None = None,
    limits: dict | None = None,
    api_key: str | None = None,
    model_name: str | None = None,
    memory_budget: int | None = None,
    num_pages: int | None = None,
    device: str = "cpu",
    quantization: str | None = None,
    max_num_seqs: int | None = None,
    log_level: str = "info",
    ready=None,
    speculative_model: str | Path | None = None,
    compile: bool | None = None,
    dtype: str = "float32",
) -> int:
    """Serve until a shutdown signal; 0 after a drained shutdown, 128 + the signal after a forced one.
    max_model_len may only lower the model's context; `limits` holds ServerLimits' other fields.
    `ready(engine)`, if given, is called once serving starts."""
    ServerLimits(max_model_len=max_model_len or 1, **(limits or {}))  # bad flags are errors before the load
    sock = bind(host, port)
    with sock:
        engine, context = build_engine(
            model, memory_budget, num_pages, device, quantization, max_num_seqs, speculative_model, compile, dtype
        )
        try:
            if max_model_len is not None and not 1 <= max_model_len <= context:
                raise ValueError(f"--max-model-len {max_model_len}: must be in 1..{context:,} (the model's context)")
            limits = ServerLimits(max_model_len=max_model_len or context, **(limits or {}))
            state = ServerState()
            name = model_name or Path(model).resolve().name
            app = create_app(engine, name, limits, api_key=api_key, state=state)
            config = uvicorn.Config(app, log_level=log_level, **uvicorn_options(limits))
            bound = sock.getsockname()
            print(
                f"k3 serve: {name} on http://{bound[0]}:{bound[1]}/v1 ({engine.engine.describe().splitlines()[0]})",
                flush=True,
            )
            if ready is not None:
                ready(engine)
            server = DrainingServer(config, state, engine, limits.drain_timeout_s)
            server.run(sockets=[sock])
        finally:
            engine.shutdown(drain_timeout=0)  # the drain, if any, is over: abort whatever is left
    if server.forced_by is not None:
        print(f"k3 serve: stopped without draining ({signal.Signals(server.forced_by).name} twice)", flush=True)
        return 128 + server.forced_by
    print("k3 serve: stopped", flush=True)
    return 0
