"""The HTTP server against a scripted engine (fixed token sequences): what the official `openai` client and
raw HTTP see — completions, chat with reasoning and tool calls, streaming, usage, errors, limits, the API
key, 429. The real engine under load is in test_server_engine.py."""

import json

import httpx
import jsonschema
import openai
import pytest

from k3.chat import ChatEncoder
from k3.formats.tokenizer import byte_tokenizer
from k3.server import ServerLimits
from k3.server.app import create_app
from k3.server.guard import ServerState
from server_helpers import ScriptedEngine, ServerThread

MODEL = "tiny-k3"
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                "required": ["city"],
            },
        },
    }
]
HISTORY = [{"role": "user", "content": "Weather in Paris?"}]
CALL = {
    "id": "call_0",
    "type": "function",
    "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 2}'},
}
REPLY = {
    "role": "assistant",
    "reasoning_content": "The user wants weather.",
    "content": "Let me check.",
    "tool_calls": [CALL],
}


@pytest.fixture(scope="module")
def tokenizer():
    return byte_tokenizer()


@pytest.fixture(scope="module")
def encoder(tokenizer):
    return ChatEncoder(tokenizer)


@pytest.fixture(scope="module")
def reply_ids(encoder):
    """The ids a chat-tuned model would write for REPLY after HISTORY's generation prompt."""
    prompt = encoder.render(HISTORY, TOOLS).ids
    full = encoder.render([*HISTORY, REPLY], TOOLS, add_generation_prompt=False).ids
    assert full[: len(prompt)] == prompt
    return full[len(prompt) :]


ODD_TEXT = "line\u2028sep\x85nel\x1erec é"  # characters str.splitlines takes for line ends, and a 2-byte one


def script_for(tokenizer, encoder, reply_ids):
    chat_prompt = encoder.render(HISTORY, TOOLS).ids

    def script(ids, params):
        if ids == chat_prompt:
            return reply_ids
        if ids == tokenizer.encode("odd"):
            return tokenizer.encode(ODD_TEXT)
        return tokenizer.encode(" world, again and again")  # a completion: the same text for every prompt

    return script


@pytest.fixture
def scripted(tokenizer, encoder, reply_ids):
    return ScriptedEngine(tokenizer, tokenizer.vocab_size, script_for(tokenizer, encoder, reply_ids))


@pytest.fixture
def served(scripted):
    app = create_app(scripted, MODEL, ServerLimits(max_model_len=1024, max_tokens=512, max_n=4, max_body_bytes=4096))
    with ServerThread(app) as url:
        yield url


def client(url: str, **kw) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=kw.pop("api_key", "none"), max_retries=0, **kw)


def sse_payloads(response: httpx.Response) -> list:
    """The data of each event; '[DONE]' as a string."""
    events = [line[len("data: ") :] for line in response.text.split("\n\n") if line]
    return [e if e == "[DONE]" else json.loads(e) for e in events]


def test_completion_with_the_openai_client(served, scripted):
    c = client(served)
    out = c.completions.create(model=MODEL, prompt="hello", max_tokens=6, temperature=0, seed=3)
    assert out.choices[0].text == " world"
    assert out.choices[0].finish_reason == "length"
    assert out.usage.prompt_tokens == 5 and out.usage.completion_tokens == 6 and out.usage.total_tokens == 11
    assert out.usage.prompt_tokens_details.cached_tokens == 0
    params = scripted.submitted[-1][1]
    assert (params.temperature, params.max_tokens, params.seed) == (0, 6, 3)
    many = c.completions.create(model=MODEL, prompt=["a", "bb"], max_tokens=3, n=2, seed=10, top_p=0.5)
    assert [ch.index for ch in many.choices] == [0, 1, 2, 3] and all(ch.text == " wo" for ch in many.choices)
    assert many.usage.prompt_tokens == 3 and many.usage.completion_tokens == 12  # each prompt counted once
    assert [p.seed for _, p in scripted.submitted[-4:]] == [10, 11, 10, 11]  # choice j: seed + j
    assert c.models.list().data[0].id == MODEL


def test_completion_stream_chunks_usage_and_done(served):
    c = client(served)
    chunks = list(
        c.completions.create(
            model=MODEL, prompt="hi", max_tokens=5, stream=True, stream_options={"include_usage": True}
        )
    )
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == " worl"
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 5
    assert all(ch.usage is None for ch in chunks[:-1])
    raw = httpx.post(served + "/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2, "stream": True})
    assert raw.headers["content-type"].startswith("text/event-stream")
    payloads = sse_payloads(raw)
    assert payloads[-1] == "[DONE]" and [p["choices"][0]["text"] for p in payloads[:-1]] == [" ", "w"]
    assert all("usage" not in p for p in payloads[:-1])  # without include_usage there is no usage field


def test_stream_text_with_line_separators_survives(served):
    chunks = client(served).completions.create(model=MODEL, prompt="odd", max_tokens=64, stream=True)
    assert "".join(ch.choices[0].text for ch in chunks) == ODD_TEXT
    with httpx.stream(
        "POST", served + "/v1/completions", json={"model": MODEL, "prompt": "odd", "max_tokens": 64, "stream": True}
    ) as r:
        lines = [line for line in r.iter_lines() if line]  # splits like str.splitlines
    assert "".join(json.loads(x[6:])["choices"][0]["text"] for x in lines[:-1]) == ODD_TEXT


def test_chat_reasoning_and_tool_calls(served):
    c = client(served)
    out = c.chat.completions.create(model=MODEL, messages=HISTORY, tools=TOOLS, max_completion_tokens=300)
    message = out.choices[0].message
    assert out.choices[0].finish_reason == "tool_calls"
    assert message.content == "Let me check."
    assert message.model_extra["reasoning_content"] == "The user wants weather."
    (call,) = message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris", "days": 2}
    stream = c.chat.completions.create(
        model=MODEL, messages=HISTORY, tools=TOOLS, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    deltas = [ch.choices[0].delta for ch in chunks if ch.choices]
    assert deltas[0].role == "assistant"
    assert "".join(d.content or "" for d in deltas) == "Let me check."
    assert "".join(d.model_extra.get("reasoning_content") or "" for d in deltas) == "The user wants weather."
    calls = [tc for d in deltas for tc in d.tool_calls or []]
    assert calls[0].function.name == "get_weather" and calls[0].id
    assert json.loads("".join(tc.function.arguments or "" for tc in calls)) == {"city": "Paris", "days": 2}
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "tool_calls"
    assert chunks[-1].usage.completion_tokens == out.usage.completion_tokens > 0


def test_chat_stop_string_cuts_the_content(served):
    out = client(served).chat.completions.create(model=MODEL, messages=HISTORY, tools=TOOLS, stop=[" check"])
    assert out.choices[0].message.content == "Let me" and out.choices[0].finish_reason == "stop"


def post(url: str, path: str, body, **kw) -> httpx.Response:
    """json.dumps writes NaN as the bare literal, as a careless client would (httpx refuses to)."""
    return httpx.post(url + path, content=json.dumps(body), headers={"content-type": "application/json"}, **kw)


@pytest.mark.parametrize(
    ("body", "param", "needle"),
    [
        ({"prompt": "x", "max_tokens": -1}, "max_tokens", "greater than or equal to 1"),
        ({"prompt": "x", "temperature": float("nan")}, "temperature", ""),
        ({"prompt": "x", "temperature": 2.5}, "temperature", "less than or equal to 2"),
        ({"prompt": "x", "top_p": 0}, "top_p", "greater than 0"),
        ({"prompt": "x", "top_k": -2}, "top_k", ""),
        ({"prompt": "x", "n": 5}, "n", "limit of 4"),
        ({"prompt": "x", "max_tokens": 513}, "max_tokens", "limit of 512"),
        ({"prompt": "x" * 1000, "max_tokens": 30}, "max_tokens", "the context is 1,024 tokens"),
        ({"prompt": "x" * 1024}, "prompt", "no room"),
        ({"prompt": ""}, "prompt", "empty"),
        ({"prompt": [300]}, "prompt", "outside the vocabulary"),
        ({"prompt": "x", "model": "gpt-4"}, "model", "is not served here"),
        ({"prompt": "x", "logprobs": -1}, "logprobs", "greater than or equal to 0"),
        ({"prompt": "x", "logprobs": 21}, "logprobs", "less than or equal to 20"),
        ({"prompt": "x", "echo": True}, "echo", "not supported"),
        ({"prompt": "x", "presence_penalty": 1.0}, "presence_penalty", "not supported"),
        ({"prompt": "x", "stop": [""]}, "stop", "non-empty"),
        ({"prompt": "x", "seed": -1}, "seed", ""),
        ({}, "prompt", "Field required"),
    ],
)
def test_invalid_completion_parameters_are_400(served, body, param, needle):
    r = post(served, "/v1/completions", {"model": MODEL, **body})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
    assert error["param"] == param and needle in error["message"]


def test_invalid_chat_and_body_errors(served):
    bad = [
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "wizard", "content": "x"}]}, "messages.0.role"),
        ({"messages": HISTORY, "top_logprobs": 2}, "top_logprobs"),
        ({"messages": HISTORY, "logprobs": False, "top_logprobs": 0}, "top_logprobs"),
        ({"messages": HISTORY, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"messages": HISTORY, "logprobs": True, "top_logprobs": -1}, "top_logprobs"),
        ({"messages": HISTORY, "max_completion_tokens": 0}, "max_completion_tokens"),
    ]
    for body, param in bad:
        r = post(served, "/v1/chat/completions", {"model": MODEL, **body})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    r = httpx.post(served + "/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
    r = post(served, "/v1/completions", {"model": MODEL, "prompt": "x" * 5000})
    assert r.status_code == 413 and "4,096 bytes" in r.json()["error"]["message"]
    chunked = httpx.post(served + "/v1/completions", content=iter([b"{" + b" " * 3000, b" " * 3000 + b"}"]))
    assert chunked.status_code == 413  # no Content-Length: counted as it arrives
    assert httpx.get(served + "/v1/nothing").json()["error"]["type"] == "not_found_error"
    assert httpx.get(served + "/health").json() == {"status": "ok"}


def test_api_key(scripted):
    app = create_app(scripted, MODEL, ServerLimits(max_model_len=1024), api_key="s3cret")
    with ServerThread(app) as url:
        with pytest.raises(openai.AuthenticationError):
            client(url, api_key="wrong").completions.create(model=MODEL, prompt="x", max_tokens=1)
        r = post(url, "/v1/completions", {"model": MODEL, "prompt": "x"})
        assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
        assert r.json()["error"]["code"] == "invalid_api_key"
        out = client(url, api_key="s3cret").completions.create(model=MODEL, prompt="x", max_tokens=2)
        assert out.choices[0].text == " w"
        assert httpx.get(url + "/health").status_code == 200 and httpx.get(url + "/metrics").status_code == 200


def test_draining_refuses_new_work(scripted):
    state = ServerState()
    app = create_app(scripted, MODEL, ServerLimits(max_model_len=1024), state=state)
    with ServerThread(app) as url:
        assert post(url, "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 1}).status_code == 200
        state.draining = True  # what SIGTERM sets (k3.server.main)
        r = post(url, "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 1})
        assert r.status_code == 503 and r.json()["error"]["code"] == "shutting_down"
        assert httpx.get(url + "/health").status_code == 503
        assert httpx.get(url + "/metrics").status_code == 200


def test_chat_prompt_longer_than_the_context_names_messages(scripted):
    app = create_app(scripted, MODEL, ServerLimits(max_model_len=64))
    with ServerThread(app) as url:
        r = post(url, "/v1/chat/completions", {"model": MODEL, "messages": HISTORY, "tools": TOOLS})
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
        assert r.json()["error"]["code"] == "context_length_exceeded"


def test_overload_is_429_with_retry_after(tokenizer, encoder, reply_ids):
    engine = ScriptedEngine(
        tokenizer, tokenizer.vocab_size, script_for(tokenizer, encoder, reply_ids), delay_s=0.05, overload_after=1
    )
    app = create_app(engine, MODEL, ServerLimits(max_model_len=1024))
    stream = {"model": MODEL, "prompt": "x", "stream": True}
    with ServerThread(app) as url, httpx.stream("POST", url + "/v1/completions", json=stream) as first:
        r = post(url, "/v1/completions", {"model": MODEL, "prompt": "y", "n": 1})
        assert r.status_code == 429 and r.headers["retry-after"] == "3"  # 2.5 s, rounded up to whole seconds
        assert r.json()["error"]["type"] == "rate_limit_error"
        assert first.status_code == 200 and sse_payloads(httpx.Response(200, content=first.read()))[-1] == "[DONE]"
        metrics = httpx.get(url + "/metrics").text
        assert 'k3_requests_rejected_total{status="429"} 1.0' in metrics


def test_the_openapi_schema_documents_what_the_server_sends(served):
    """Issue 26 item 11: /openapi.json documented FastAPI's 422 (the server sends 400), /metrics as JSON and
    200 bodies as {}. Each documented answer is checked against one the server really gives."""
    schema = httpx.get(served + "/openapi.json").json()
    operations = {(path, method): op for path, ops in schema["paths"].items() for method, op in ops.items()}
    assert not [where for where, op in operations.items() if "422" in op["responses"]]
    assert not {"HTTPValidationError", "ValidationError"} & set(schema["components"]["schemas"])
    metrics = operations["/metrics", "get"]["responses"]["200"]["content"]
    assert list(metrics) == ["text/plain"] and metrics["text/plain"]["schema"] == {"type": "string"}
    assert httpx.get(served + "/metrics").headers["content-type"].startswith("text/plain")

    def documented(ref: dict) -> dict:  # a response schema, its $refs resolved in the document's components
        return {**ref, "components": schema["components"]}

    for path, request, body in [
        ("/v1/completions", "CompletionRequest", {"prompt": "x", "max_tokens": 2}),
        ("/v1/chat/completions", "ChatCompletionRequest", {"messages": HISTORY, "max_tokens": 2}),
    ]:
        responses = operations[path, "post"]["responses"]
        error = responses["400"]["content"]["application/json"]["schema"]
        assert list(responses["400"]["content"]) == ["application/json"]
        assert error == {"$ref": "#/components/schemas/ErrorResponse"}
        assert set(responses["200"]["content"]) == {"application/json", "text/event-stream"}
        assert schema["components"]["schemas"][request]["properties"]["model"]["enum"] == [MODEL]
        refused = post(served, path, {"model": MODEL, **body, "temperature": 9})  # a validation error: 400
        assert refused.status_code == 400
        jsonschema.validate(refused.json(), documented(error))
        answered = post(served, path, {"model": MODEL, **body})
        assert answered.status_code == 200
        jsonschema.validate(answered.json(), documented(responses["200"]["content"]["application/json"]["schema"]))


@pytest.mark.parametrize(
    "declared", [{"tools": TOOLS, "tool_choice": "none"}, {}], ids=["tool_choice_none", "no_tools"]
)
def test_a_call_the_request_does_not_allow_stays_content(tokenizer, reply_ids, declared):
    """Issue 26 item 4, over HTTP: a model reply holding a tool call (REPLY's markup, whatever the prompt) under
    tool_choice "none", or with no tools declared, is text: the markup stays in content, no tool_calls, and
    finish_reason is stop, not tool_calls; streamed the same."""
    scripted = ScriptedEngine(tokenizer, tokenizer.vocab_size, lambda ids, params: reply_ids)
    app = create_app(scripted, MODEL, ServerLimits(max_model_len=4096, max_tokens=2048))
    markup = (
        '<|open|>tools<|sep|><|open|>call tool="get_weather" index="1"<|sep|><|open|>argument key="city" '
        'type="string"<|sep|>Paris<|close|>argument<|sep|><|open|>argument key="days" type="number"<|sep|>2'
        "<|close|>argument<|sep|><|close|>call<|sep|><|close|>tools<|sep|>"
    )
    body = {"model": MODEL, "messages": HISTORY, **declared}
    with ServerThread(app) as url:
        choice = httpx.post(url + "/v1/chat/completions", json=body, timeout=30).json()["choices"][0]
        events = sse_payloads(httpx.post(url + "/v1/chat/completions", json={**body, "stream": True}, timeout=30))
    assert choice["finish_reason"] == "stop" and choice["message"]["tool_calls"] is None
    assert choice["message"]["content"] == "Let me check." + markup
    assert choice["message"]["reasoning_content"] == "The user wants weather."
    deltas = [e["choices"][0] for e in events[:-1]]
    assert "".join(d["delta"].get("content") or "" for d in deltas) == "Let me check." + markup
    assert not [d for d in deltas if d["delta"].get("tool_calls")]
    assert [d["finish_reason"] for d in deltas if d["finish_reason"]] == ["stop"] and events[-1] == "[DONE]"
