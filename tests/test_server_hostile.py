"""`k3 serve` under hostile clients (issue 26): values at the edge of every range, bodies the JSON parser
accepts but nothing else should (NaN, deep nesting, lone surrogates), a client that stops reading, slow
headers and bodies, too many connections, an internal error, requests that can never be admitted, and what
the metrics count of them. Over the real engine and the tiny model on loopback; every loop is bounded.

Each case failed before the fix: the step's other requests errored with it, a 500 that also reset the next
request on the same kept-alive connection, pages held to the end for a client that never read, connections
held indefinitely by a client sending a byte a second, a 429 that no retry could pass."""

import asyncio
import contextlib
import json
import logging
import select
import socket
import time

import httpx
import pytest
import torch

from k3.formats.tokenizer import byte_tokenizer
from k3.serve.async_engine import AsyncEngine
from k3.serve.engine import EngineConfig, LLMEngine
from k3.serve.scheduler import SchedulerConfig
from k3.server import ServerLimits, connections
from k3.server.app import create_app
from k3.server.main import uvicorn_options
from server_helpers import ServerThread
from tiny_models import tiny_model

MODEL = "tiny"
TOK = byte_tokenizer()
WAIT_S = 60


def make_engine(num_pages: int = 2000, **scheduler) -> AsyncEngine:
    model = tiny_model(vocab_size=TOK.vocab_size).float()
    config = EngineConfig(num_pages=num_pages, scheduler=SchedulerConfig(**scheduler))
    engine = AsyncEngine(LLMEngine(model, TOK, config))
    engine.start()
    return engine


def settle(engine: AsyncEngine, timeout_s: float = WAIT_S) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        stats = engine.stats()
        if (stats["running"] == 0 and stats["waiting"] == 0) or time.monotonic() > deadline:
            return stats
        time.sleep(0.05)


def assert_pool_free(engine: AsyncEngine) -> None:
    stats = settle(engine)
    assert stats["running"] == 0 and stats["waiting"] == 0 and stats["pages_used"] == 0


@pytest.fixture(scope="module")
def served():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    engine = make_engine(max_num_seqs=16, max_waiting_requests=32)
    limits = ServerLimits(max_model_len=1024, max_tokens=400, max_n=8, max_stream_backlog=16)
    app = create_app(engine, MODEL, limits)
    try:
        with ServerThread(app, **uvicorn_options(limits)) as url:
            yield url, engine, app
    finally:
        engine.shutdown(drain_timeout=0)
        torch.set_num_threads(threads)


def post(url: str, path: str, body, client=None) -> httpx.Response:
    """json.dumps writes NaN as the bare literal and lone surrogates as escapes, as a careless client would."""
    content = json.dumps(body)
    return (client or httpx).post(
        url + path, content=content, headers={"content-type": "application/json"}, timeout=WAIT_S
    )


def sse_events(response: httpx.Response) -> list:
    return [line[len("data: ") :] for line in response.iter_lines() if line.startswith("data: ")]


def test_values_the_schema_accepts_never_fail_the_step(served):
    """top_k 2**64, temperature 1e-40, top_p 5e-324 beside four plain streams: every request completes."""
    url, engine, _ = served
    plain = {"model": MODEL, "prompt": "def f(x):", "max_tokens": 40, "ignore_eos": True, "stream": True}
    edges = [
        {"top_k": 2**64},
        {"temperature": 1e-40},
        {"top_p": 5e-324},
        {"top_p": 1e-300, "seed": 3},
        {"temperature": 1e-300, "top_k": 2**70, "seed": 1},
    ]

    async def stream(client, body):
        async with client.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200, await r.aread()
            return [json.loads(e) for e in [x async for x in _aevents(r)] if e != "[DONE]"]

    async def main():
        async with httpx.AsyncClient(base_url=url, timeout=WAIT_S) as client:
            bodies = [plain] * 4 + [{**plain, **e} for e in edges]
            return await asyncio.gather(*(stream(client, b) for b in bodies))

    results = asyncio.run(main())
    for chunks in results:
        assert not any("error" in c for c in chunks), chunks
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        assert sum(len(c["choices"][0]["text"]) > 0 for c in chunks) > 0
    assert_pool_free(engine)


async def _aevents(response):
    async for line in response.aiter_lines():
        if line.startswith("data: "):
            yield line[len("data: ") :]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": "a\ud800b"}, "prompt"),
        ({"prompt": ["fine", "bad \udfff"]}, "prompt"),
        ({"prompt": "x", "logit_bias": {"1": float("nan")}}, "logit_bias.1"),
        ({"prompt": "x", "temperature": float("inf")}, "temperature"),
        ({"prompt": "x", "stop": [[[[[[[[[[[[[[[[[[[["x"]]]]]]]]]]]]]]]]]]]]}, "stop"),
        ({"prompt": "x", "user": {"deep": json.loads("[" * 700 + "]" * 700)}}, "user"),
    ],
)
def test_bodies_json_accepts_but_nothing_else_should_are_400_and_the_connection_lives(served, body, param, caplog):
    url, _, _ = served
    with httpx.Client(timeout=WAIT_S) as client, caplog.at_level(logging.ERROR):
        r = post(url, "/v1/completions", {"model": MODEL, **body}, client)
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == param and error["type"] == "invalid_request_error"
        again = post(url, "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 2}, client)
        assert again.status_code == 200  # the same kept-alive connection serves the next request
    assert "Traceback" not in caplog.text


def test_an_unexpected_error_is_one_generic_500_logged_once_and_the_connection_lives(served, caplog, monkeypatch):
    url, _, app = served
    srv = app.state.server

    def broken(*args, **kwargs):
        raise RuntimeError("Overflow when unpacking long long")

    monkeypatch.setattr(srv, "run", broken)
    with httpx.Client(timeout=WAIT_S) as client, caplog.at_level(logging.ERROR):
        r = post(url, "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 2}, client)
        assert r.status_code == 500
        message = r.json()["error"]["message"]
        assert "Overflow" not in message and "server log" in message  # internals stay in the log
        monkeypatch.undo()
        again = post(url, "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 2}, client)
        assert again.status_code == 200
    assert caplog.text.count("Traceback") == 1 and "Overflow when unpacking long long" in caplog.text


ABORTED = 'k3_requests_finished_total{finish_reason="abort"}'
LENGTH = 'k3_requests_finished_total{finish_reason="length"}'


def test_a_client_that_stops_reading_is_aborted_and_its_pages_freed(served):
    url, engine, _ = served
    body = json.dumps(
        {"model": MODEL, "prompt": "go", "max_tokens": 400, "n": 8, "ignore_eos": True, "stream": True}
    ).encode()
    host, port = url.removeprefix("http://").split(":")
    aborted, ended = counter(url, ABORTED), counter(url, LENGTH)
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # a small window fills fast
    sock.connect((host, int(port)))
    # and so does a small send buffer on the server's side of this connection: the kernel would otherwise
    # absorb ~3 MB on loopback (the n=16 x 4,000 tokens are ~12 MB; this test's 8 x 400 ~0.6 MB)
    deadline = time.monotonic() + WAIT_S
    while sock.getsockname() not in connections._OPEN and time.monotonic() < deadline:
        time.sleep(0.01)
    server_side = connections._OPEN[sock.getsockname()].transport.get_extra_info("socket")
    server_side.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    head = f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {len(body)}"
    sock.sendall(head.encode() + b"\r\n\r\n" + body)
    try:
        deadline = time.monotonic() + WAIT_S
        seen_running = False
        while time.monotonic() < deadline:
            stats = engine.stats()
            seen_running = seen_running or stats["running"] > 0
            if seen_running and stats["running"] == 0 and stats["waiting"] == 0:
                break
            time.sleep(0.05)
        assert seen_running
        stats = engine.stats()
        assert stats["running"] == 0 and stats["pages_used"] == 0  # aborted long before 8 x 400 tokens
    finally:
        sock.close()
    # the metric counts engine requests: the dropped stream's 8 choices, each ended by the abort, none by length
    assert counter(url, ABORTED) == aborted + 8
    assert counter(url, LENGTH) == ended


def stalled_client(url: str, body: dict) -> socket.socket:
    """A raw connection that sends `body` to /v1/completions and never reads, with small socket buffers and
    no transport buffer on the server's side, so the server's writes wait on it after a few KB."""
    content = json.dumps(body).encode()
    host, port = url.removeprefix("http://").split(":")
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect((host, int(port)))
    deadline = time.monotonic() + WAIT_S
    while sock.getsockname() not in connections._OPEN and time.monotonic() < deadline:
        time.sleep(0.01)
    transport = connections._OPEN[sock.getsockname()].transport
    transport.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    transport.set_write_buffer_limits(high=0)  # asyncio's 64 KiB would otherwise absorb the first writes
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {len(content)}"
    )
    sock.sendall(head.encode() + b"\r\n\r\n" + content)
    return sock


def test_a_client_that_never_reads_is_cut_at_the_write_timeout():
    """--write-timeout: a write that waits longer on the client ends the request and closes the connection.
    The backlog bound is set out of reach and the request would stream 4,000 tokens (many seconds), so only
    the write deadline can end it within the test's few seconds."""
    engine = make_engine(num_pages=400)
    limits = ServerLimits(max_model_len=4096, max_tokens=4000, write_timeout_s=0.5, max_stream_backlog=100_000)
    app = create_app(engine, MODEL, limits)
    body = {"model": MODEL, "prompt": "go", "max_tokens": 4000, "ignore_eos": True, "stream": True, "logprobs": 5}
    try:
        with ServerThread(app, **uvicorn_options(limits)) as url:
            aborted, ended = counter(url, ABORTED), counter(url, LENGTH)
            sock = stalled_client(url, body)
            start = time.monotonic()
            try:
                seen_running = False
                while time.monotonic() - start < 5:  # not reading meanwhile
                    stats = engine.stats()
                    seen_running = seen_running or stats["running"] > 0
                    if seen_running and stats["running"] == 0 and stats["waiting"] == 0:
                        break
                    time.sleep(0.02)
                freed_after = time.monotonic() - start
                sock.settimeout(5)
                received = b""
                with contextlib.suppress(ConnectionResetError):
                    while chunk := sock.recv(1 << 16):  # what the buffers held, then the server's close
                        received += chunk
            finally:
                sock.close()
            assert stats["running"] == 0 and stats["pages_used"] == 0, stats
            assert 0.5 <= freed_after < 5, freed_after
            assert received.startswith(b"HTTP/1.1 200") and b"data: [DONE]" not in received
            assert counter(url, ABORTED) == aborted + 1 and counter(url, LENGTH) == ended
    finally:
        engine.shutdown(drain_timeout=0)


def test_an_idle_kept_alive_connection_is_closed_at_the_keep_alive_timeout():
    """--keep-alive-timeout: after a response, a connection that sends nothing more is closed after it (the
    header deadline, set far beyond, is not what closes it)."""
    engine = make_engine(num_pages=200)
    limits = ServerLimits(max_model_len=256, keep_alive_timeout_s=0.3, header_timeout_s=30)
    try:
        with ServerThread(create_app(engine, MODEL, limits), **uvicorn_options(limits)) as url:
            host, port = url.removeprefix("http://").split(":")
            with socket.create_connection((host, int(port))) as sock:
                sock.settimeout(10)
                sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
                reply = b""
                while not reply.endswith(b'{"status":"ok"}'):
                    reply += sock.recv(4096)
                start = time.monotonic()
                assert reply.startswith(b"HTTP/1.1 200") and b"connection: close" not in reply.lower()
                assert sock.recv(4096) == b""  # the server closes it, idle
                closed_after = time.monotonic() - start
            assert 0.2 < closed_after < 2, closed_after
    finally:
        engine.shutdown(drain_timeout=0)


def test_slow_headers_are_cut_at_the_header_timeout():
    engine = make_engine(num_pages=200)
    limits = ServerLimits(max_model_len=256, header_timeout_s=0.5, body_timeout_s=0.5)
    try:
        with ServerThread(create_app(engine, MODEL, limits), **uvicorn_options(limits)) as url:
            host, port = url.removeprefix("http://").split(":")
            assert httpx.get(url + "/health").status_code == 200  # a request at a normal pace is served
            with socket.create_connection((host, int(port))) as sock:
                sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHo")
                start, closed_after = time.monotonic(), None
                while closed_after is None and time.monotonic() - start < 5:
                    readable, _, _ = select.select([sock], [], [], 0.1)  # a byte every 0.1 s, never a whole head
                    try:
                        if readable and sock.recv(4096) == b"":
                            closed_after = time.monotonic() - start
                        else:
                            sock.sendall(b"s")
                    except OSError:
                        closed_after = time.monotonic() - start
                assert closed_after is not None and closed_after < 2, closed_after
    finally:
        engine.shutdown(drain_timeout=0)


def test_slow_body_is_408_and_too_many_connections_503():
    engine = make_engine(num_pages=200)
    limits = ServerLimits(max_model_len=256, body_timeout_s=0.5, max_connections=4)
    try:
        with ServerThread(create_app(engine, MODEL, limits), **uvicorn_options(limits)) as url:
            host, port = url.removeprefix("http://").split(":")
            with socket.create_connection((host, int(port))) as sock:
                sock.settimeout(10)
                sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{")
                reply = b""
                while chunk := sock.recv(4096):  # the server closes the connection after the 408
                    reply += chunk
                assert reply.startswith(b"HTTP/1.1 408") and b"request_timeout" in reply
            held = [socket.create_connection((host, int(port))) for _ in range(8)]
            try:
                statuses = []
                for s in held:
                    s.settimeout(10)
                    s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
                    statuses.append(s.recv(4096).split(b" ", 2)[1])
                assert b"503" in statuses and b"200" in statuses
            finally:
                for s in held:
                    s.close()
    finally:
        engine.shutdown(drain_timeout=0)


def counter(url: str, name: str) -> float:
    """The value of one sample line of /metrics (0 if absent)."""
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return 0.0


def test_validation_refusals_are_counted_by_status(served):
    url, _, _ = served
    before = counter(url, 'k3_requests_rejected_total{status="400"}')
    assert post(url, "/v1/completions", {"model": MODEL, "prompt": "x", "temperature": 9}).status_code == 400
    assert post(url, "/v1/completions", {"model": MODEL, "prompt": "x", "top_p": float("nan")}).status_code == 400
    assert post(url, "/v1/completions", {"model": "other", "prompt": "x"}).status_code == 400
    assert counter(url, 'k3_requests_rejected_total{status="400"}') == before + 3


def test_a_request_that_can_never_be_admitted_is_400_not_429(served):
    """16 running + 32 waiting: 8 prompts x n=8 = 64 sequences can never be in the engine at once."""
    url, engine, _ = served
    r = post(url, "/v1/completions", {"model": MODEL, "prompt": ["a"] * 8, "n": 8, "max_tokens": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
    assert "at most 48 at once" in r.json()["error"]["message"]
    assert_pool_free(engine)


def test_a_default_budget_is_capped_by_the_pool_not_refused():
    """A request that sets no max_tokens on a pool smaller than the context gets what the pool holds; one that
    asks for more than that is a 400 naming max_tokens and the pool."""
    engine = make_engine(num_pages=12)  # the tiny model: far fewer tokens than its context of 512
    capacity = engine.engine.max_request_tokens
    limits = ServerLimits(max_model_len=512, max_tokens=512)
    try:
        with ServerThread(create_app(engine, MODEL, limits)) as url:
            fits = {"model": MODEL, "prompt": "x", "max_tokens": capacity - 1, "ignore_eos": True}
            r = post(url, "/v1/completions", fits)
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == capacity - 1
            r = post(url, "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": capacity + 5})
            error = r.json()["error"]
            assert r.status_code == 400 and error["param"] == "max_tokens" and "page pool" in error["message"]
            assert error["code"] == "context_length_exceeded"
    finally:
        engine.shutdown(drain_timeout=0)


def test_the_routing_demo_is_not_offered_by_a_server_with_an_api_key():
    engine = make_engine(num_pages=50)
    try:
        with ServerThread(create_app(engine, MODEL, ServerLimits(max_model_len=64), api_key="k")) as url:
            assert httpx.get(url + "/demo/routing/api/limits").status_code == 404
        with ServerThread(create_app(engine, MODEL, ServerLimits(max_model_len=64))) as url:
            assert httpx.get(url + "/demo/routing/api/limits").status_code == 200
    finally:
        engine.shutdown(drain_timeout=0)


CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "ignore_eos": True}
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"messages": [{"role": "user", "content": "lone \ud800"}]}, "messages"),
        ({"messages": [{"role": "user", "content": [{"type": "text", "text": "\udc00"}]}]}, "messages"),
        (
            {"tools": [{**TOOL, "function": {"name": "f", "parameters": {"x": float("nan")}}}]},
            "tools.0.function.parameters.x",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": {"max": float("inf")}}}},
            "response_format.json_schema.schema.max",
        ),
        (
            {"tools": [{**TOOL, "function": {"name": "f", "parameters": json.loads('{"a":' * 600 + "1" + "}" * 600)}}]},
            "tools",
        ),
        ({"tool_choice": {"type": "function", "function": {"name": "g"}}, "tools": [TOOL]}, "tool_choice"),
        ({"tool_choice": {"type": "function", "function": {"name": "f"}}}, "tool_choice"),  # no tools declared
        ({"reasoning_effort": "enormous"}, "reasoning_effort"),
    ],
)
def test_chat_bodies_that_were_500s_are_400s(served, extra, param, caplog):
    url, _, _ = served
    with httpx.Client(timeout=WAIT_S) as client, caplog.at_level(logging.ERROR):
        r = post(url, "/v1/chat/completions", {**CHAT, **extra}, client)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == param, r.text
        assert post(url, "/v1/chat/completions", CHAT, client).status_code == 200  # same connection, next request
    assert "Traceback" not in caplog.text


def test_named_tool_choice_and_reasoning_effort_none_are_served(served):
    url, _, _ = served
    named = {"tool_choice": {"type": "function", "function": {"name": "f"}}, "tools": [TOOL]}
    assert post(url, "/v1/chat/completions", {**CHAT, **named}).status_code == 200
    assert post(url, "/v1/chat/completions", {**CHAT, "reasoning_effort": "none"}).status_code == 200


def test_a_chat_without_max_tokens_on_a_small_pool_gets_what_the_pool_holds():
    engine = make_engine(num_pages=40)  # fewer tokens than the context, more than the prompt
    capacity = engine.engine.max_request_tokens
    try:
        with ServerThread(create_app(engine, MODEL, ServerLimits(max_model_len=4096, max_tokens=4096))) as url:
            body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "ignore_eos": True}
            r = post(url, "/v1/chat/completions", body)
            assert r.status_code == 200, r.text
            usage, reason = r.json()["usage"], r.json()["choices"][0]["finish_reason"]
            total = usage["prompt_tokens"] + usage["completion_tokens"]
            assert total == capacity if reason == "length" else total < capacity and reason in ("stop", "tool_calls")
    finally:
        engine.shutdown(drain_timeout=0)
