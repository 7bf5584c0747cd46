"""`k3 serve`: load a model, start the engine loop, serve HTTP with uvicorn until SIGTERM or Ctrl-C, then drain.

Shutdown: the first SIGTERM/SIGINT sets the server draining (new /v1 requests get 503, /health says
"draining"), uvicorn stops accepting connections and waits up to drain_timeout_s for the open ones (running
streams go on to their end), then the engine aborts whatever is left and its loop stops; exit status 0.
uvicorn itself re-raises the signal after a graceful stop (exit 143 for SIGTERM): this server does not,
since a drained shutdown is a success."""

import logging
import signal
import threading
from contextlib import contextmanager
from pathlib import Path

import uvicorn

from k3.server.app import create_app
from k3.server.guard import ServerState
from k3.server.limits import ServerLimits

log = logging.getLogger("k3.server")
SHUTDOWN_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, state: ServerState):
        super().__init__(config)
        self.state = state

    def handle_exit(self, sig: int, frame) -> None:
        self.state.draining = True
        super().handle_exit(sig, frame)

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


def build_engine(model: str | Path, memory_budget: int | None, num_pages: int | None, device: str = "cpu",
                 quantization: str | None = None, max_num_seqs: int | None = None,
                 speculative_model: str | Path | None = None):  # fmt: skip
    """(AsyncEngine started, the model's context) for a model, run or step folder; speculative_model: a
    draft folder from `k3 train-draft` (docs/speculative.md)."""
    from k3.hub import load_for_inference
    from k3.serve.async_engine import AsyncEngine
    from k3.serve.engine import EngineConfig, LLMEngine
    from k3.serve.scheduler import SchedulerConfig
    from k3.spec.folder import load_draft, read_meta

    if speculative_model is not None:
        read_meta(speculative_model)  # a wrong folder is an error before the model's load
    weights, tokenizer = load_for_inference(model, device=device, quantization=quantization)
    draft = load_draft(speculative_model, weights) if speculative_model is not None else None
    if memory_budget is None and num_pages is None:
        memory_budget = 256 << 20
    scheduler = SchedulerConfig() if max_num_seqs is None else SchedulerConfig(max_num_seqs=max_num_seqs)
    config = EngineConfig(memory_budget=memory_budget, num_pages=num_pages, scheduler=scheduler)
    engine = AsyncEngine(LLMEngine(weights, tokenizer, config, draft=draft))
    engine.start()
    return engine, weights.config.max_position_embeddings


def serve(model: str | Path, host: str, port: int, *, max_model_len: int | None = None, limits: dict | None = None,
          api_key: str | None = None,
          model_name: str | None = None, memory_budget: int | None = None, num_pages: int | None = None,
          device: str = "cpu", quantization: str | None = None, max_num_seqs: int | None = None,
          log_level: str = "info", ready=None, speculative_model: str | Path | None = None) -> int:  # fmt: skip
    """Serve until a shutdown signal; 0 after a drained shutdown. max_model_len may only lower the model's
    context; `limits` holds ServerLimits' other fields. `ready(engine)`, if given, is called once serving starts."""
    engine, context = build_engine(model, memory_budget, num_pages, device, quantization, max_num_seqs,
                                   speculative_model)  # fmt: skip
    try:
        if max_model_len is not None and not 1 <= max_model_len <= context:
            raise ValueError(f"--max-model-len {max_model_len}: must be in 1..{context:,} (the model's context)")
        limits = ServerLimits(max_model_len=max_model_len or context, **(limits or {}))
    except ValueError:
        engine.shutdown(drain_timeout=0)
        raise
    state = ServerState()
    name = model_name or Path(model).resolve().name
    try:
        app = create_app(engine, name, limits, api_key=api_key, state=state)
        config = uvicorn.Config(app, host=host, port=port, log_level=log_level,
                                timeout_graceful_shutdown=max(1, round(limits.drain_timeout_s)))  # fmt: skip
        print(f"k3 serve: {name} on http://{host}:{port}/v1 ({engine.engine.describe().splitlines()[0]})",
              flush=True)  # fmt: skip
        if ready is not None:
            ready(engine)
        DrainingServer(config, state).run()
    finally:
        engine.shutdown(drain_timeout=limits.drain_timeout_s)
    print("k3 serve: stopped", flush=True)
    return 0
