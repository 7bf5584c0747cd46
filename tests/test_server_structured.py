"""Chat requests that force their reply (issue 26 items 2 and 7), end to end over the real engine and a
random tiny model: whatever it would have written, the reply is the JSON the response_format asks for, or a
call to a tool the tool_choice allows with arguments of the declared types. Before, response_format and
tool_choice "required" only became prompt text, and a named choice was a 500."""

import json

import httpx
import jsonschema
import pytest
import torch

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
UNIT_PARAMETERS = {
    "type": "object",
    "properties": {"unit": {"enum": ["C", "F"]}, "loud": {"type": "boolean"}},
    "required": ["unit", "loud"],
}
UNIT = {"type": "function", "function": {"name": "set_unit", "parameters": UNIT_PARAMETERS}}
OTHER = {"type": "function", "function": {"name": "other", "parameters": {"type": "object", "properties": {}}}}


@pytest.fixture(scope="module")
def url():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    model = tiny_model(vocab_size=TOK.vocab_size).float()
    engine = AsyncEngine(LLMEngine(model, TOK, EngineConfig(num_pages=2000, scheduler=SchedulerConfig())))
    engine.start()
    try:
        with ServerThread(create_app(engine, MODEL, ServerLimits(max_model_len=4096, max_tokens=1500))) as base:
            yield base
    finally:
        engine.shutdown(drain_timeout=0)
        torch.set_num_threads(threads)


def chat(url: str, **extra) -> dict:
    # thinking off: the constraint starts at the first token (a random model would reason until max_tokens)
    body = {"model": MODEL, "messages": [{"role": "user", "content": "go"}], "reasoning_effort": "none"}
    body |= {"max_tokens": 1500, "temperature": 1.0, "seed": 3, **extra}
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


@pytest.mark.parametrize("n", [0, 1])
def test_json_schema_response(url, n):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer"}}, "required": ["ok"]}
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}
    choice = chat(url, response_format=fmt, seed=n)
    jsonschema.validate(json.loads(choice["message"]["content"]), schema)
    assert choice["finish_reason"] == "stop"


def test_json_object_response(url):
    choice = chat(url, response_format={"type": "json_object"}, max_tokens=1500, temperature=0.0)
    assert isinstance(json.loads(choice["message"]["content"]), dict)


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "set_unit"}}])
def test_a_forced_call_is_made_with_arguments_of_the_declared_types(url, tool_choice):
    choice = chat(url, tools=[UNIT, OTHER], tool_choice=tool_choice, parallel_tool_calls=False)
    calls = choice["message"]["tool_calls"]
    assert choice["finish_reason"] == "tool_calls" and len(calls) == 1
    if isinstance(tool_choice, dict):
        assert calls[0]["function"]["name"] == "set_unit"
    if calls[0]["function"]["name"] == "set_unit":
        arguments = json.loads(calls[0]["function"]["arguments"])
        jsonschema.validate(arguments, UNIT_PARAMETERS)


def test_a_schema_it_cannot_enforce_is_a_400_naming_the_keyword(url):
    fmt = {"type": "json_schema", "json_schema": {"schema": {"type": "string", "pattern": "^a$"}}}
    body = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "response_format": fmt}
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "response_format"
    assert "'pattern'" in r.json()["error"]["message"]
