"""A chat request's options that are not messages: thinking and its effort, tool_choice, response_format.
Each is checked here (ChatFormatError, which the server answers with a 400) and turned into what the
prompt says and what the parser may return. The choices and their sources are in docs/chat.md."""

from dataclasses import dataclass
from typing import Any

from k3.chat.errors import ChatFormatError
from k3.chat.values import check_json

THINKING_EFFORTS = ("low", "high", "max")  # what the released renderer accepts (its prose also names `medium`)
DEFAULT_THINKING_EFFORT = "max"  # what the HF wrapper, vLLM, SGLang and llama.cpp render when none is given
# OpenAI's reasoning_effort -> K3's thinking_effort (vllm-ascend's map); "none" turns thinking off
REASONING_EFFORTS = {
    "none": None,
    "minimal": "low",
    "low": "low",
    "medium": "high",
    "high": "high",
    "xhigh": "max",
    "max": "max",
}
TOOL_CHOICES = ("auto", "none", "required")
RESPONSE_FORMATS = ("text", "json_object", "json_schema")


def check_thinking_effort(thinking_effort: str | None) -> None:
    if thinking_effort is not None and thinking_effort not in THINKING_EFFORTS:
        raise ChatFormatError(f"thinking_effort={thinking_effort!r} is not one of {', '.join(THINKING_EFFORTS)}")


def resolve_thinking(
    *, thinking: bool | None = None, thinking_effort: str | None = None, reasoning_effort: str | None = None
) -> tuple[bool, str | None]:
    """(thinking, thinking_effort) for render_segments from a request: `thinking` and `thinking_effort` as
    given in chat_template_kwargs (None when absent), OpenAI's `reasoning_effort` mapped by
    REASONING_EFFORTS. What chat_template_kwargs says wins, as vLLM's setdefault does. The effort returned
    is None when none was asked for; render_segments then renders DEFAULT_THINKING_EFFORT."""
    known = isinstance(reasoning_effort, str) and reasoning_effort in REASONING_EFFORTS
    if reasoning_effort is not None and not known:
        raise ChatFormatError(
            f"reasoning_effort={reasoning_effort!r} is not one of {', '.join(REASONING_EFFORTS)} "
            "(or give chat_template_kwargs.thinking_effort: low, high or max)"
        )
    check_thinking_effort(thinking_effort)
    mapped = REASONING_EFFORTS[reasoning_effort] if reasoning_effort is not None else None
    if thinking is None:
        thinking = reasoning_effort != "none"
    return thinking, thinking_effort if thinking_effort is not None else mapped


def _tool_name(tool: Any, where: str) -> str:
    function = tool.get("function", tool) if isinstance(tool, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str) or not name:
        raise ChatFormatError(f"{where}: a tool needs function.name (a non-empty string)")
    return name


def check_tools(tools: Any, where: str) -> list[str]:
    """The declared names of a tools list (the request's, or a system message's), after checking it is a
    list of tool objects holding JSON within k3's bounds."""
    if not isinstance(tools, list):
        raise ChatFormatError(f"{where} must be a list of tool objects")
    return [_tool_name(check_json(t, f"{where}[{i}]"), f"{where}[{i}]") for i, t in enumerate(tools)]


def _named_choice(tool_choice: dict) -> str:
    """The name in OpenAI's named choice {"type": "function", "function": {"name": NAME}}, nothing else."""
    function = tool_choice.get("function")
    if (
        set(tool_choice) != {"type", "function"}
        or tool_choice["type"] != "function"
        or not isinstance(function, dict)
        or set(function) != {"name"}
        or not isinstance(function["name"], str)
        or not function["name"]
    ):
        raise ChatFormatError(
            f"tool_choice {tool_choice!r} is not {{'type': 'function', 'function': {{'name': NAME}}}}"
        )
    return function["name"]


@dataclass(frozen=True)
class ToolChoice:
    """What a request's tool_choice means for this conversation. `message`: the tool-choice system message
    to render (required/none, and only when tools were declared, as vLLM and SGLang gate it). `callable`:
    the names the parser may return as calls (none: no names; a named choice: that one; else all declared)."""

    message: str | None
    callable: frozenset[str]


def tool_choice_for(tool_choice: Any, declared: list[str]) -> ToolChoice:
    """Checks tool_choice (None, auto, none, required, or a named function) against the declared names."""
    if isinstance(tool_choice, dict):
        name = _named_choice(tool_choice)
        if name not in declared:
            known = ", ".join(sorted(set(declared))) or "none are declared"
            raise ChatFormatError(f"tool_choice names the tool {name!r}, which is not declared ({known})")
        return ToolChoice(None, frozenset({name}))
    if tool_choice is not None and tool_choice not in TOOL_CHOICES:
        raise ChatFormatError(
            f"tool_choice={tool_choice!r} is not one of {', '.join(TOOL_CHOICES)} or a named function"
        )
    if tool_choice == "required" and not declared:
        raise ChatFormatError("tool_choice 'required' needs tools: the request declares none")
    if tool_choice == "none":
        return ToolChoice("none" if declared else None, frozenset())
    return ToolChoice(tool_choice if tool_choice == "required" else None, frozenset(declared))


def response_format_for(response_format: Any) -> tuple[str | None, Any]:
    """(type, schema) of a response_format: OpenAI's {"type": ...} object or the bare type string (as the
    released renderer reads it). The schema of json_schema is looked up as the released renderer does:
    json_schema.schema, else json_schema.json_schema (how vLLM hands it on), else json_schema itself; a
    missing one is None (rendered `null`). type is None for no format or `text`: nothing to render."""
    if response_format is None:
        return None, None
    kind = response_format.get("type") if isinstance(response_format, dict) else response_format
    if kind not in RESPONSE_FORMATS:
        raise ChatFormatError(f"response_format type {kind!r} is not one of {', '.join(RESPONSE_FORMATS)}")
    if kind != "json_schema":
        return (None if kind == "text" else kind), None
    spec = response_format.get("json_schema") if isinstance(response_format, dict) else None
    if spec is not None and not isinstance(spec, dict):
        raise ChatFormatError("response_format.json_schema must be an object")
    schema = spec.get("schema", spec.get("json_schema", spec)) if spec is not None else None
    return kind, check_json(schema, "response_format's schema")
