"""The server's responses as pydantic models: for the OpenAPI schema only (what /openapi.json tells clients and
fuzzers the server sends). The routes build plain dicts; tests/test_server_engine.py checks every response of
a schema fuzz against these models, so the two cannot drift apart. 400s are documented as 400: FastAPI's
default 422 is never sent here (validation errors are OpenAI-shaped 400s)."""

from typing import Any, Literal

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel


class _Out(BaseModel):
    pass


class ErrorDetail(_Out):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(_Out):
    error: ErrorDetail


class PromptTokensDetails(_Out):
    cached_tokens: int


class Usage(_Out):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class CompletionLogprobs(_Out):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class CompletionChoice(_Out):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: str | None


class Completion(_Out):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class TopLogprob(_Out):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(_Out):
    content: list[TokenLogprob]
    refusal: None


class CalledFunction(_Out):
    name: str
    arguments: str


class ReturnedToolCall(_Out):
    id: str
    type: Literal["function"]
    function: CalledFunction


class AssistantMessage(_Out):
    role: Literal["assistant"]
    content: str | None
    reasoning_content: str | None  # SGLang's and llama.cpp's name
    reasoning: str | None  # vLLM's
    tool_calls: list[ReturnedToolCall] | None


class ChatChoice(_Out):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: str | None


class ChatCompletion(_Out):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ModelCard(_Out):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    max_model_len: int


class ModelList(_Out):
    object: Literal["list"]
    data: list[ModelCard]


class Health(_Out):
    status: Literal["ok", "draining"]


def _errors(*statuses: int) -> dict[int, dict[str, Any]]:
    return {s: {"model": ErrorResponse, "description": _WHY[s]} for s in statuses}


_WHY = {
    400: "an invalid request: the parameter it names, with what to change",
    401: "missing or wrong API key",
    408: "the body did not arrive in time",
    413: "the body is too large",
    429: "the engine's queue is full: retry after the Retry-After header's seconds",
    500: "an unexpected failure; the message gives the id of its traceback in the server log",
    503: "the server is shutting down or has too many connections",
}
# each server-sent event (as schema-based clients and fuzzers read one): `data` a chunk's JSON, the last "[DONE]"
_EVENT = {
    "type": "object",
    "properties": {"data": {"type": "string", "description": "a chunk's JSON; the last event's is [DONE]"}},
    "required": ["data"],
}
_STREAM = {"text/event-stream": {"schema": _EVENT, "description": "OpenAI's chunks as SSE, then [DONE]"}}
POST_ERRORS = _errors(400, 401, 408, 413, 429, 500, 503)

COMPLETIONS = {200: {"model": Completion, "content": _STREAM, "description": "a completion, or a stream"}}
CHAT = {200: {"model": ChatCompletion, "content": _STREAM, "description": "a chat completion, or a stream"}}
MODELS = {200: {"model": ModelList, "description": "the served model"}, **_errors(401, 503)}
HEALTH = {200: {"model": Health, "description": "serving"}, 503: {"model": Health, "description": "draining"}}
METRICS = {200: {"content": {"text/plain": {"schema": {"type": "string"}}}, "description": "Prometheus text"}}


def install_openapi(app: FastAPI, model_name: str) -> None:
    """/openapi.json as this server answers: without FastAPI's automatic 422 (and its HTTPValidationError
    schemas), which it never sends, and with `model` the one name it serves (any other is a 400), so that a
    client or fuzzer generating valid requests from the schema reaches the engine."""

    def openapi() -> dict:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, summary=app.summary, routes=app.routes)
            for path in schema["paths"].values():
                for operation in path.values():
                    operation.get("responses", {}).pop("422", None)
            components = schema.get("components", {}).get("schemas", {})
            for name in ("HTTPValidationError", "ValidationError"):
                components.pop(name, None)
            for name in ("CompletionRequest", "ChatCompletionRequest"):
                components[name]["properties"]["model"] = {"type": "string", "enum": [model_name], "title": "Model"}
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi
