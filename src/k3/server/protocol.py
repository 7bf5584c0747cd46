"""The request bodies of the OpenAI-compatible endpoints, as pydantic models (they also make the OpenAPI
schema that clients and the fuzzer read). Only the shape and the ranges that hold for every server are
checked here; limits that depend on the server's flags (max_tokens, n, the context) are checked by the
endpoint, in `app.py`. NaN and infinities are refused everywhere (`allow_inf_nan=False`)."""

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from k3.data.image_input import MAX_IMAGE_BYTES
from k3.serve.sampling import MAX_LOGPROBS

SEED_LIMIT = 2**63  # SamplingParams' seed range: [0, 2**63)
MAX_IMAGE_URL_CHARS = 4 * (MAX_IMAGE_BYTES // 3) + 64  # a data URL of an image of at most MAX_IMAGE_BYTES

Temperature = Annotated[float, Field(ge=0, le=2)]
TopP = Annotated[float, Field(gt=0, le=1)]
Penalty = Annotated[float, Field(ge=-2, le=2)]
TokenId = Annotated[int, Field(ge=0)]


class _Body(BaseModel):
    # unknown fields are ignored (clients send vendor extensions); NaN/inf are never a valid number here
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


class StreamOptions(_Body):
    include_usage: bool = False


class _Sampling(_Body):
    """Fields both endpoints share. `top_k` and `ignore_eos` are extensions (vLLM's spelling)."""

    model: str
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: Annotated[int, Field(ge=-1)] | None = None
    n: Annotated[int, Field(ge=1)] = 1
    stop: str | list[str] | None = None
    seed: Annotated[int, Field(ge=0, lt=SEED_LIMIT)] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    logit_bias: dict[str, float] | None = None
    ignore_eos: bool = False
    user: str | None = None


class CompletionRequest(_Sampling):
    """POST /v1/completions. prompt: a string, token ids, or a list of either (one completion set each)."""

    prompt: str | list[TokenId] | list[str] | list[list[TokenId]]
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None  # alternatives per token (vLLM's 20)
    echo: bool = False
    best_of: Annotated[int, Field(ge=1)] | None = None
    suffix: str | None = None


class ContentPart(_Body):
    type: Literal["text"]
    text: str


class ImageURL(_Body):
    # a base64 data URL (k3.server.images); the body limit (--max-body-bytes) bounds it first
    url: Annotated[str, Field(max_length=MAX_IMAGE_URL_CHARS)]
    detail: Literal["auto", "low", "high"] | None = None


class ImagePart(_Body):
    type: Literal["image_url"]
    image_url: ImageURL


class FunctionCall(_Body):
    name: str
    arguments: str | dict[str, Any] = "{}"


class ToolCall(_Body):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class FunctionDefinition(_Body):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Body):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class ChatMessage(_Body):
    """One message. A system or developer message may declare `tools` (rendered as a dynamic tool declaration,
    its content then not rendered, as the release's renderer); an assistant message's reasoning is
    `reasoning_content` (SGLang, llama.cpp) or `reasoning` (vLLM's newer name)."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart | ImagePart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None
    tools: list[Tool] | None = None


class ChatTemplateKwargs(_Body):
    """K3's chat options: thinking on (the generation prompt opens `think`) or off (`response`); absent, it is
    on unless reasoning_effort is "none"."""

    thinking: bool | None = None
    thinking_effort: str | None = None


class ChatCompletionRequest(_Sampling):
    """POST /v1/chat/completions."""

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    response_format: dict[str, Any] | str | None = None
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    reasoning_effort: str | None = None
    chat_template_kwargs: ChatTemplateKwargs | None = None
    parallel_tool_calls: bool | None = None
