"""OpenAI-style messages + tools -> the segments of K3's chat format (the grammar is in docs/chat.md).

A segment is either one structural token (inserted by id) or ordinary text (tokenized with special-token
parsing disabled), so nothing a user writes can become structure. Text is split into segments at the
same places as the released renderer (tag name, ` key`, `="`, value, `"` are separate pieces), because
BPE never merges across a segment boundary and the chat-tuned checkpoint saw exactly those ids."""

import json
from dataclasses import dataclass
from typing import Any

from k3.chat.errors import ChatFormatError
from k3.chat.options import (
    DEFAULT_THINKING_EFFORT,
    check_thinking_effort,
    check_tools,
    response_format_for,
    tool_choice_for,
)
from k3.chat.tokens import CLOSE, END_OF_MSG, OPEN, SEP
from k3.chat.values import check_json, deep_sort, dumps, loads_json

_DECLARE = [("role", "system"), ("type", "tool-declare")]
ROLES = ("system", "developer", "user", "assistant", "tool")

_TOOLS_HEADER = "# Tools\nHere are the available tools, described in JSONSchema.\n\n```json\n"
_NEW_TOOLS_HEADER = (
    "## New Tools Available\nThe system dynamically extends the toolset via lazy-loading.\n"
    "You have access to all existing and extended tools.\nHere are the specs for the extended tools.\n\n```json\n"
)
_EFFORT_TEXT = (
    "`thinking_effort` guides on how much to think in your thinking channel (not including the response channel), "
    "supported values include `low`, `medium`, `high`, and `max`.\nNow the system is invoked with "
    "`thinking_effort={}`."
)
_TOOL_CHOICE_TEXT = {
    "required": "The system is invoked with `tool_choice=required`.\nYou MUST call tools in the next message.",
    "none": "The system is invoked with `tool_choice=none`.\nYou MUST NOT call any tools in the next message.",
}
_JSON_RESPONSE_TEXT = (
    "The system is invoked with `response_format={}`.\nYour response must be raw JSON data without markdown "
    "code blocks (```json) or any additional formatting."
)


@dataclass(frozen=True)
class Segment:
    """`structural`: text is one of the four chat tokens and becomes its id; otherwise ordinary text."""

    text: str
    structural: bool = False


def escape_attr(value: str) -> str:
    """Attribute values escape `&` then `"` (the only two characters that could end or confuse one)."""
    return value.replace("&", "&amp;").replace('"', "&quot;")


def unescape_attr(value: str) -> str:
    """Inverse of escape_attr: `&quot;` first, or a literal `&quot;` in a value would come back as `"`."""
    return value.replace("&quot;", '"').replace("&amp;", "&")


def argument_type(value: Any) -> str:
    """The `type` attribute of a typed argument (bool before number: True is an int in Python)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int | float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list | tuple):
        return "array"
    if isinstance(value, dict):
        return "object"
    raise ChatFormatError(f"a tool-call argument of type {type(value).__name__} is not JSON")


def tool_arguments(arguments: Any, where: str = "tool call") -> tuple[list[tuple[str, str, str]], str | None]:
    """A call's arguments as (key, type, text) triples, written as the released renderer writes them: a
    JSON string is parsed first, then each value is its text when a string, else json.dumps with its
    default separators (`1e2` -> `100.0`, `[1,2]` -> `[1, 2]`); keys in their order. ([], raw) when
    arguments is a string that is not JSON or not an object: the renderer then writes it whole in a `json`
    block rather than drop it or fail (the released renderer raises on a non-object)."""
    if arguments is None or (isinstance(arguments, str) and not arguments.strip()):
        return [], None
    if isinstance(arguments, str):
        try:
            parsed = loads_json(arguments, f"{where}: arguments")
        except json.JSONDecodeError:
            return [], arguments
        if not isinstance(parsed, dict):
            return [], arguments
        arguments = parsed
    elif isinstance(arguments, dict):
        check_json(arguments, f"{where}: arguments")
    else:
        got = type(arguments).__name__
        raise ChatFormatError(f"{where}: arguments must be a JSON object string or a dict, got {got}")
    items = arguments.items()
    return [(k, argument_type(v), v if isinstance(v, str) else dumps(v, compact=False)) for k, v in items], None


class _Segments:
    def __init__(self):
        self.out: list[Segment] = []

    def token(self, spelling: str) -> None:
        self.out.append(Segment(spelling, True))

    def text(self, text: str) -> None:
        if text:
            self.out.append(Segment(text))

    def open(self, tag: str, attrs: list[tuple[str, str]] = ()) -> None:
        self.token(OPEN)
        self.text(tag)
        for key, value in attrs:
            self.text(f" {key}")
            self.text('="')
            self.text(escape_attr(value))
            self.text('"')
        self.token(SEP)

    def close(self, tag: str) -> None:
        self.token(CLOSE)
        self.text(tag)
        self.token(SEP)

    def message(self, attrs: list[tuple[str, str]], body: str) -> None:
        self.open("message", attrs)
        self.text(body)
        self.close("message")
        self.token(END_OF_MSG)


def _content_pieces(content: Any, where: str) -> list[str]:
    """Text parts stay separate segments, as in the released renderer."""
    if content is None:
        return []
    if isinstance(content, str):
        return [content]
    if isinstance(content, list):
        pieces = []
        for part in content:
            if isinstance(part, dict) and part.get("type", "text") == "text" and isinstance(part.get("text"), str):
                pieces.append(part["text"])
            elif isinstance(part, dict) and part.get("type") in ("image", "image_url"):
                raise ChatFormatError(f"{where}: image content is not supported by k3's chat renderer")
            else:
                raise ChatFormatError(f"{where}: a content part must be {{'type': 'text', 'text': str}}, got {part!r}")
        return pieces
    raise ChatFormatError(f"{where}: content must be a string, a list of text parts or null")


def _call_function(call: Any, where: str) -> dict:
    if not isinstance(call, dict):
        raise ChatFormatError(f"{where}: a tool call must be an object")
    function = call.get("function", call)
    if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"]:
        raise ChatFormatError(f"{where}: a tool call needs function.name (a non-empty string)")
    return function


def _order_tool_results(messages: list[dict]) -> list[dict]:
    """Each run of tool messages is put in the order of the calls of the assistant message before it (matched
    by tool_call_id), and each learns its call's name. A run with any unmatched id is left as it is."""
    out, calls, i = [], {}, 0
    while i < len(messages):
        m = messages[i]
        if m.get("role") == "assistant":
            calls = {}
            for pos, call in enumerate(m.get("tool_calls") or []):
                if isinstance(call, dict) and call.get("id") is not None and str(call["id"]) not in calls:
                    function = call.get("function", call)
                    calls[str(call["id"])] = (pos, function.get("name") if isinstance(function, dict) else None)
        if m.get("role") != "tool":
            out.append(m)
            i += 1
            continue
        run = []
        while i < len(messages) and messages[i].get("role") == "tool":
            call_id = messages[i].get("tool_call_id", messages[i].get("id"))
            run.append((calls.get(str(call_id)) if call_id is not None else None, len(run), messages[i]))
            i += 1
        if any(match is None for match, _, _ in run):
            out.extend(m for _, _, m in run)
            continue
        for (_, name), _, m in sorted(run, key=lambda r: (r[0][0], r[1])):
            if name is not None:
                m = {**m, "tool": name} | ({"name": name} if "name" in m else {})
            out.append(m)
    return out


def _render_assistant(seg: _Segments, m: dict, thinking: bool, where: str) -> None:
    if thinking:
        reasoning = m.get("reasoning_content") or m.get("reasoning")
        seg.open("think")
        if reasoning is not None and str(reasoning).strip():
            seg.text(str(reasoning))
        seg.close("think")
    seg.open("response")
    for piece in _content_pieces(m.get("content"), where):
        seg.text(piece)
    seg.close("response")
    calls = m.get("tool_calls") or []
    if not calls:
        return
    seg.open("tools")
    for index, call in enumerate(calls, 1):
        function = _call_function(call, where)
        seg.open("call", [("tool", function["name"]), ("index", str(index))])
        triples, raw = tool_arguments(function.get("arguments"), f"{where}.tool_calls[{index - 1}]")
        if raw is not None:
            seg.open("json", [("type", "object")])
            seg.text(raw)
            seg.close("json")
        for key, kind, text in triples:
            seg.open("argument", [("key", key), ("type", kind)])
            seg.text(text)
            seg.close("argument")
        seg.close("call")
    seg.close("tools")


def _check_messages(messages: Any) -> list[dict]:
    if not isinstance(messages, list):
        raise ChatFormatError("messages must be a list of message objects")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            got = m.get("role") if isinstance(m, dict) else type(m).__name__
            raise ChatFormatError(f"messages[{i}]: role {got!r} is not one of {', '.join(ROLES)}")
    return messages


def _declared_tool_names(messages: list[dict], tools: Any) -> list[str]:
    """The names of the request's tools and of those a system/developer message declares."""
    names = check_tools(tools, "tools") if tools is not None else []
    for i, m in enumerate(messages):
        if m["role"] in ("system", "developer") and m.get("tools"):
            names += check_tools(m["tools"], f"messages[{i}].tools")
    return names


def _tool_declaration(header: str, tools: list) -> str:
    return header + dumps(deep_sort(tools), compact=True) + "\n```"


def render_chat(
    messages: list[dict],
    tools: list[dict] | None = None,
    *,
    thinking: bool = True,
    add_generation_prompt: bool = True,
    thinking_effort: str | None = None,
    tool_choice: Any = None,
    response_format: dict | str | None = None,
) -> tuple[list[Segment], frozenset[str]]:
    """The conversation as segments, and the tool names the model's reply may call (what the parser is
    given: tool_choice none -> none, a named choice -> that one, else every declared tool).

    In order (docs/chat.md): the tool declaration; the thinking-effort message (thinking on only;
    DEFAULT_THINKING_EFFORT when none is given); the messages (`developer` renders as `system`; a
    system/developer message with `tools` declares them instead of its content, as the released
    renderer); the tool-choice message (required/none, only when tools are declared); the
    response-format message; the generation prompt, ending inside an open assistant message in the
    `think` channel (thinking on) or `response` (off), where the model's output continues."""
    messages = _order_tool_results(_check_messages(messages))
    choice = tool_choice_for(tool_choice, _declared_tool_names(messages, tools))
    format_kind, schema = response_format_for(response_format)
    check_thinking_effort(thinking_effort)
    seg = _Segments()
    if tools:
        seg.message(_DECLARE, _tool_declaration(_TOOLS_HEADER, tools))
    if thinking:
        effort = thinking_effort if thinking_effort is not None else DEFAULT_THINKING_EFFORT
        seg.message([("role", "system"), ("type", "thinking-effort")], _EFFORT_TEXT.format(effort))
    previous_calls, tool_index = [], 0
    for i, m in enumerate(messages):
        where, role = f"messages[{i}]", m["role"]
        name = [("name", str(m["name"]))] if m.get("name") else []
        if role in ("system", "developer") and m.get("tools"):
            seg.message(_DECLARE, _tool_declaration(_NEW_TOOLS_HEADER, m["tools"]))
        elif role in ("system", "developer", "user"):
            seg.open("message", [("role", "user" if role == "user" else "system"), *name])
            for piece in _content_pieces(m.get("content"), where):
                seg.text(piece)
            seg.close("message")
            seg.token(END_OF_MSG)
        elif role == "assistant":
            previous_calls, tool_index = m.get("tool_calls") or [], 0
            seg.open("message", [("role", "assistant"), *name])
            _render_assistant(seg, m, thinking, where)
            seg.close("message")
            seg.token(END_OF_MSG)
        else:
            tool_index += 1
            tool = m["tool"] if "tool" in m else m.get("name")
            if tool is None and tool_index <= len(previous_calls):
                tool = _call_function(previous_calls[tool_index - 1], where)["name"]
            if tool is None:
                raise ChatFormatError(
                    f"{where}: a tool result needs its tool's name: give tool_call_id of a call in the assistant "
                    "message before it, or `name`"
                )
            seg.open("message", [("role", "tool"), ("tool", str(tool)), ("index", str(tool_index))])
            for piece in _content_pieces(m.get("content"), where):
                seg.text(piece)
            seg.close("message")
            seg.token(END_OF_MSG)
    if choice.message is not None:
        seg.message([("role", "system"), ("type", "tool-choice")], _TOOL_CHOICE_TEXT[choice.message])
    if format_kind is not None:
        body = _JSON_RESPONSE_TEXT.format(format_kind)
        if format_kind == "json_schema":
            body += "\nThe JSON data must match the following schema:\n```json\n"
            body += dumps(deep_sort(schema), compact=True) + "\n```"
        seg.message([("role", "system"), ("type", "response-format")], body)
    if add_generation_prompt:
        seg.open("message", [("role", "assistant")])
        seg.open("think" if thinking else "response")
    return seg.out, choice.callable


def render_segments(messages: list[dict], tools: list[dict] | None = None, **options) -> list[Segment]:
    """render_chat's segments alone (same options)."""
    return render_chat(messages, tools, **options)[0]


def render_text(messages: list[dict], tools: list[dict] | None = None, **options) -> str:
    """The segments joined: for reading and golden tests only. Never tokenize this string as a whole (user
    text spelling `<|open|>` would become the token); use ChatEncoder.render."""
    return "".join(s.text for s in render_segments(messages, tools, **options))
