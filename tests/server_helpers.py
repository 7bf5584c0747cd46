"""Helpers of the server tests: a uvicorn server on a free loopback port in a thread, and a scripted engine
(the AsyncEngine interface, outputs fixed token sequences) for exact checks of what the server sends."""

import asyncio
import socket
import threading
import time
from types import SimpleNamespace

import uvicorn

from k3.serve.detokenizer import IncrementalDetokenizer
from k3.serve.engine import RequestOutput
from k3.serve.scheduler import Overloaded


class ServerThread:
    """`with ServerThread(app) as base_url:` serves app on 127.0.0.1 at a port the OS chose; `config` is more
    of uvicorn.Config's arguments (k3 serve's: `k3.server.main.uvicorn_options`)."""

    def __init__(self, app, **config):
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        options = {"log_level": "warning", "timeout_graceful_shutdown": 5, "backlog": 1024, **config}
        config = uvicorn.Config(app, **options)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self) -> str:
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the test server did not start")
            time.sleep(0.01)
        return f"http://127.0.0.1:{self.port}"

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=20)
        self.sock.close()


class ScriptedHandle:
    def __init__(
        self, request_id: str, prompt_ids: list[int], tokens: list[int], texts: list[str], reason: str, delay_s: float
    ):
        self.request_id, self.prompt_ids, self.tokens, self.texts = request_id, prompt_ids, tokens, texts
        self.reason, self.delay_s = reason, delay_s
        self.finished = False
        self.finish_reason: str | None = None
        self.cancelled = False

    def cancel(self, reason: str = "abort") -> None:
        if not self.finished:
            self.finish_reason = reason
        self.cancelled = self.finished = True

    async def __aiter__(self):
        for i, (token, text) in enumerate(zip(self.tokens, self.texts, strict=True)):
            await asyncio.sleep(self.delay_s)
            if self.cancelled:
                return
            last = i == len(self.tokens) - 1
            self.finished = last
            self.finish_reason = self.reason if last else None
            yield RequestOutput(
                self.request_id, text, [token], last, self.reason if last else None, len(self.prompt_ids), i + 1, 0
            )


class ScriptedEngine:
    """submit() answers every request with `script(prompt_ids, params) -> token ids`, one per output, each after
    delay_s; it ends with finish reason "stop" when the last token is a stop token id, else "length".
    `overload_after`: submissions beyond that many unfinished ones raise Overloaded."""

    def __init__(self, tokenizer, vocab_size: int, script, delay_s: float = 0.0, overload_after: int | None = None):
        self.engine = SimpleNamespace(
            tokenizer=tokenizer, model=SimpleNamespace(config=SimpleNamespace(vocab_size=vocab_size))
        )
        self.script, self.delay_s, self.overload_after = script, delay_s, overload_after
        self.handles: list[ScriptedHandle] = []
        self.submitted: list[tuple[list[int], object]] = []

    def submit(self, prompt, params=None, request_id=None, max_backlog=None) -> ScriptedHandle:
        ids = self.engine.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if self.overload_after is not None and sum(not h.finished for h in self.handles) >= self.overload_after:
            raise Overloaded("scripted queue full", retry_after=2.5)
        tokens = list(self.script(ids, params))[: params.max_tokens]
        detokenizer = IncrementalDetokenizer(self.engine.tokenizer)  # as the engine streams text
        texts = [detokenizer.step(tokens[: i + 1], final=i == len(tokens) - 1) for i in range(len(tokens))]
        reason = "stop" if tokens and tokens[-1] in params.stop_token_ids else "length"
        handle = ScriptedHandle(request_id, ids, tokens, texts, reason, self.delay_s)
        self.handles.append(handle)
        self.submitted.append((ids, params))
        return handle

    async def submit_async(self, prompt, params=None, request_id=None, max_backlog=None) -> ScriptedHandle:
        return self.submit(prompt, params, request_id)

    def stats(self) -> dict:
        return {
            "running": sum(not h.finished for h in self.handles),
            "waiting": 0,
            "pages_used": 0,
            "pages_free": 10,
            "pages_evictable": 0,
            "preemptions": 0,
        }
