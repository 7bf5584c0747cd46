"""The server over the real AsyncEngine and the tiny model: the `openai` client unmodified, 256 concurrent
streams, 50 clients that hang up mid-stream, and a schema fuzzer (schemathesis) that must never see a 5xx.
After each, nothing is left allocated in the page pool."""

import asyncio
import json
import time

import httpx
import openai
import pytest
import torch
from hypothesis import HealthCheck, given, settings

from k3.formats.tokenizer import byte_tokenizer
from k3.serve.async_engine import AsyncEngine
from k3.serve.engine import EngineConfig, LLMEngine
from k3.serve.scheduler import SchedulerConfig
from k3.server import ServerLimits
from k3.server.app import create_app
from server_helpers import ServerThread
from tiny_models import tiny_model

MODEL = "tiny"
TOK = byte_tokenizer()


def make_engine(num_pages: int = 2000, **scheduler) -> AsyncEngine:
    model = tiny_model(vocab_size=TOK.vocab_size).float()
    config = EngineConfig(num_pages=num_pages, scheduler=SchedulerConfig(**scheduler))
    engine = AsyncEngine(LLMEngine(model, TOK, config))
    engine.start()
    return engine


@pytest.fixture(scope="module")
def served():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        engine = make_engine(max_num_seqs=64, max_waiting_requests=512)
        app = create_app(engine, MODEL, ServerLimits(max_model_len=512, max_tokens=64, max_n=4))
        with ServerThread(app) as url:
            yield url, engine
        engine.shutdown(drain_timeout=0)
    finally:
        torch.set_num_threads(threads)  # later tests (bitwise resume across processes) depend on it


def settle(engine: AsyncEngine, timeout_s: float = 30.0) -> dict:
    """The engine's counts once it has nothing running or waiting (cancellations take effect between steps)."""
    deadline = time.monotonic() + timeout_s
    while True:
        stats = engine.stats()
        if (stats["running"] == 0 and stats["waiting"] == 0) or time.monotonic() > deadline:
            return stats
        time.sleep(0.05)


def assert_pool_free(engine: AsyncEngine) -> None:
    stats = settle(engine)
    assert stats["running"] == 0 and stats["waiting"] == 0
    assert stats["pages_used"] == 0  # cached pages (evictable) are free to take; none is held by a request
    assert stats["pages_free"] + stats["pages_evictable"] == engine.engine.pool.num_pages


def test_openai_client_against_the_engine(served):
    url, engine = served
    c = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
    greedy = {"model": MODEL, "max_tokens": 8, "temperature": 0, "extra_body": {"ignore_eos": True}}
    prompt = "def fibonacci(n):\n    return " * 3  # 87 tokens: several whole prefix-cache units
    first = c.completions.create(prompt=prompt, **greedy)
    assert first.usage.prompt_tokens == len(TOK.encode(prompt)) and first.usage.completion_tokens == 8
    again = c.completions.create(prompt=prompt, **greedy)
    assert again.choices[0].text == first.choices[0].text  # greedy: the same tokens, now from a cached prefix
    assert again.usage.prompt_tokens_details.cached_tokens > 0
    streamed = c.completions.create(prompt=prompt, stream=True, stream_options={"include_usage": True}, **greedy)
    chunks = list(streamed)
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == first.choices[0].text
    assert chunks[-1].usage.completion_tokens == 8
    chat = c.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=6,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    message = chat.choices[0].message  # an untrained model: whatever it writes comes back, as content or reasoning
    assert chat.usage.completion_tokens == 6 and chat.choices[0].finish_reason == "length"
    assert message.role == "assistant" and (message.content or message.model_extra.get("reasoning_content"))
    metrics = httpx.get(url + "/metrics").text
    assert "k3_pages_free " in metrics and "k3_time_to_first_token_seconds_count" in metrics
    assert "k3_prefix_cache_latent_hit_tokens_total" in metrics and "k3_generation_tokens_total" in metrics
    assert_pool_free(engine)


def _finished_counts(url: str) -> dict[str, float]:
    prefix = "k3_requests_finished_total{finish_reason="
    lines = [line for line in httpx.get(url + "/metrics").text.splitlines() if line.startswith(prefix)]
    return {line[len(prefix) + 1 : line.index('"}')]: float(line.split()[-1]) for line in lines}


def test_a_stop_string_in_chat_content_ends_the_engine_request_with_stop(served):
    """The server cuts chat content at a stop string and cancels the engine request: the engine records
    "stop", the reason the client is told (it used to record "abort", which the server then took for a
    shutdown: a 503, or an error event in a stream)."""
    url, engine = served
    messages = [{"role": "user", "content": "hi"}]
    body = {"model": MODEL, "messages": messages, "max_tokens": 40, "temperature": 0, "ignore_eos": True}
    body["reasoning_effort"] = "none"  # the reply is content, which stop strings apply to
    reply = httpx.post(url + "/v1/chat/completions", json=body, timeout=60).json()
    content = reply["choices"][0]["message"]["content"]
    assert len(content) >= 13  # an untrained model's reply, the same every time (greedy)
    stop = content[10:13]
    before = _finished_counts(url)
    r = httpx.post(url + "/v1/chat/completions", json={**body, "stop": [stop]}, timeout=60)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["message"]["content"] == content[: content.index(stop)] and choice["finish_reason"] == "stop"
    with httpx.stream("POST", url + "/v1/chat/completions", json={**body, "stop": [stop], "stream": True}) as s:
        events = [e[len("data: ") :] for e in s.read().decode().split("\n\n") if e]
    assert events[-1] == "[DONE]" and all("error" not in e for e in events)
    assert json.loads(events[-2])["choices"][0]["finish_reason"] == "stop"
    after = _finished_counts(url)
    assert after.get("stop", 0) - before.get("stop", 0) == 2 and after.get("abort") == before.get("abort")
    assert_pool_free(engine)


async def _stream(client: httpx.AsyncClient, i: int) -> tuple[str, list]:
    body = {
        "model": MODEL,
        "prompt": f"request {i}: ",
        "max_tokens": 4,
        "stream": True,
        "ignore_eos": True,
        "temperature": 0.8,
        "seed": i,
        "stream_options": {"include_usage": True},
    }
    async with client.stream("POST", "/v1/completions", json=body) as r:
        text = (await r.aread()).decode()
    events = [e[len("data: ") :] for e in text.split("\n\n") if e]
    return events[-1], [json.loads(e) for e in events[:-1]]


def test_256_concurrent_streams_all_complete(served):
    url, engine = served

    async def main():
        limits = httpx.Limits(max_connections=300, max_keepalive_connections=300)
        async with httpx.AsyncClient(base_url=url, limits=limits, timeout=120) as client:
            return await asyncio.gather(*(_stream(client, i) for i in range(256)))

    results = asyncio.run(main())
    assert all(done == "[DONE]" for done, _ in results)
    for _, chunks in results:
        assert all("error" not in c for c in chunks)
        assert chunks[-2]["choices"][0]["finish_reason"] == "length"
        assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 4
    assert_pool_free(engine)


def test_50_clients_hanging_up_mid_stream_leave_nothing_allocated(served):
    url, engine = served

    async def hang_up(client: httpx.AsyncClient, i: int) -> int:
        body = {"model": MODEL, "prompt": f"long {i}", "max_tokens": 64, "stream": True, "ignore_eos": True}
        async with client.stream("POST", "/v1/completions", json=body) as r:
            async for _ in r.aiter_bytes():
                break  # one chunk, then close the connection
        return r.status_code

    async def main():
        async with httpx.AsyncClient(base_url=url, timeout=60) as client:
            return await asyncio.gather(*(hang_up(client, i) for i in range(50)))

    assert asyncio.run(main()) == [200] * 50
    assert_pool_free(engine)
    out = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": "still fine", "max_tokens": 3}).json()
    assert out["usage"]["completion_tokens"] >= 1  # the engine goes on serving


def rss_bytes() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def test_overload_is_429_and_memory_stays_bounded():
    engine = make_engine(max_num_seqs=1, max_waiting_requests=2)
    app = create_app(engine, MODEL, ServerLimits(max_model_len=512, max_tokens=64))
    body = {"model": MODEL, "prompt": "busy", "max_tokens": 40, "ignore_eos": True}

    async def main(url, n):
        async with httpx.AsyncClient(base_url=url, timeout=120) as client:
            return await asyncio.gather(*(client.post("/v1/completions", json=body) for _ in range(n)))

    try:
        with ServerThread(app) as url:
            asyncio.run(main(url, 40))  # warm: first-call allocations are not growth
            before = rss_bytes()
            responses = asyncio.run(main(url, 200))
            assert rss_bytes() - before < 64 << 20  # refused requests leave nothing behind
            codes = sorted(r.status_code for r in responses)
            assert codes.count(200) >= 3 and codes.count(429) >= 100 and set(codes) == {200, 429}
            refused = next(r for r in responses if r.status_code == 429)
            assert int(refused.headers["retry-after"]) >= 1 and refused.json()["error"]["code"] == "overloaded"
            assert engine.stats()["waiting"] <= 2  # the queue never grew past its bound
            assert_pool_free(engine)
    finally:
        engine.shutdown(drain_timeout=0)


def _fuzz(url: str, examples: int) -> int:
    """Every operation of the app's OpenAPI schema with schemathesis-generated requests, valid and invalid;
    returns how many were sent. A 5xx fails, and so does a response the schema does not describe: a status
    it does not list, another content type, or a body that does not match its model (k3.server.responses)."""
    import schemathesis
    from schemathesis import GenerationMode
    from schemathesis.checks import (
        content_type_conformance,
        not_a_server_error,
        response_schema_conformance,
        status_code_conformance,
    )

    checks = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]

    schema = schemathesis.openapi.from_url(url + "/openapi.json")
    sent = 0
    for result in schema.get_all_operations():
        operation = result.ok()
        # a GET here takes no parameters: there is nothing to make invalid
        modes = [GenerationMode.POSITIVE] + ([GenerationMode.NEGATIVE] if operation.method.upper() == "POST" else [])
        for mode in modes:

            @given(case=operation.as_strategy(generation_mode=mode))
            @settings(max_examples=examples, deadline=None, database=None, suppress_health_check=list(HealthCheck))
            def check(case):
                nonlocal sent
                response = case.call(base_url=url, timeout=60)
                sent += 1
                assert response.status_code < 500, (case.method, case.path, case.body, response.text)
                case.validate_response(response, checks=checks)

            check()
    return sent


@pytest.fixture(scope="module")
def fuzzed_server():
    engine = make_engine(num_pages=400)
    # 1024: a chat prompt carries the thinking-effort message (~300 byte tokens) whatever the fuzzer sends
    app = create_app(engine, MODEL, ServerLimits(max_model_len=1024, max_tokens=4, max_n=2, max_prompts=2))
    with ServerThread(app) as url:
        yield url, engine
    engine.shutdown(drain_timeout=0)


def test_schema_fuzz_never_5xx(fuzzed_server):
    url, engine = fuzzed_server
    assert _fuzz(url, examples=75) >= 300
    assert_pool_free(engine)


@pytest.mark.slow
def test_schema_fuzz_never_5xx_long(fuzzed_server):
    url, engine = fuzzed_server
    assert _fuzz(url, examples=250) >= 1000
    assert_pool_free(engine)
