"""What a chat request may force its reply to be, as a grammar over K3's chat format (k3.structured): a JSON
response (response_format json_object / json_schema), a tool call (tool_choice "required" or a named tool),
at most one call (parallel_tool_calls false). The engine masks every token the grammar refuses, so the reply
parses into what was asked, as vLLM's and SGLang's structural tags make their K3 replies.

A reply continues the generation prompt, inside `think` (thinking on) or `response` (off):

    [REASONING <|close|>think<|sep|> <|open|>response<|sep|>] CONTENT <|close|>response<|sep|>
    [<|open|>tools<|sep|> CALL+ <|close|>tools<|sep|>] <|close|>message<|sep|> <|end_of_msg|>
    CALL := <|open|>call tool="NAME" index="i"<|sep|> ARGUMENT* <|close|>call<|sep|>
    ARGUMENT := <|open|>argument key="K" type="T"<|sep|> VALUE <|close|>argument<|sep|>

Reasoning is free text (the constraint applies once it ends, as vLLM applies it after the reasoning parser);
CONTENT is the JSON value asked for, or free text. An argument's VALUE is written as the release renderer
writes it: a string raw (its enum/const values exactly; minLength/maxLength are not enforced on raw text),
anything else as JSON matching the property's schema, with `type` naming its JSON type (integer as number,
as the renderer does). A call's arguments are the properties of the tool's parameters schema, in its order,
the required ones always; a tool whose parameters list no properties takes no arguments (llama.cpp's rule).
"""

from typing import Any

from k3.chat.errors import ChatFormatError
from k3.chat.render import escape_attr
from k3.chat.tokens import CLOSE, END_OF_MSG, OPEN, SEP
from k3.structured import (
    ByteSet,
    Choice,
    Grammar,
    InvalidSchema,
    Json,
    Literal,
    Repeat,
    Sequence,
    Special,
    Text,
    UnsupportedSchema,
)

_ATTR_TYPE = {t: t for t in ("string", "number", "boolean", "null", "object", "array")} | {"integer": "number"}
_JSON_TYPES = ("null", "boolean", "object", "array", "number", "string")  # integer is a number
_INDEX = Sequence(ByteSet.range(ord("1"), ord("9")), Repeat(ByteSet.range(ord("0"), ord("9")), 0, 3))


def _open(tag: str, *attrs: tuple[str, Grammar]) -> Grammar:
    parts: list[Grammar] = [Special(OPEN), Literal(tag)]
    for key, value in attrs:
        parts += [Literal(f' {key}="'), value, Literal('"')]
    return Sequence(*parts, Special(SEP))


def _close(tag: str) -> Grammar:
    return Sequence(Special(CLOSE), Literal(tag), Special(SEP))


def _raw_string(schema: dict) -> Grammar:
    """A string argument's raw text: its enum/const values exactly, else any text without chat tokens."""
    values = [schema["const"]] if "const" in schema else schema.get("enum")
    if values is not None:
        strings = [v for v in values if isinstance(v, str)]
        return Choice(*(Literal(s) if s else Sequence() for s in strings))
    return Text()


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int | float):
        return "number"
    return {str: "string", list: "array", dict: "object"}.get(type(value), "string")


def _value_types(schema: dict) -> list[str]:
    """The JSON types a property may take: its `type`, else those of its enum/const values, else any."""
    declared = schema.get("type")
    if isinstance(declared, str):
        return [declared]
    if isinstance(declared, list):
        return [t for t in declared if isinstance(t, str)]
    values = [schema["const"]] if "const" in schema else schema.get("enum")
    if isinstance(values, list):
        return list(dict.fromkeys(_json_type(v) for v in values))
    return list(_JSON_TYPES)


def _argument(key: str, schema: Any, root: dict, where: str) -> Grammar:
    """One `argument` element for property `key`: a type attribute and a value for each type it may have."""
    if schema is True or schema == {}:
        schema = {}
    if not isinstance(schema, dict):
        raise ChatFormatError(f"{where}: the schema of property {key!r} must be an object")
    options = []
    for t in _value_types(schema):
        if t not in _ATTR_TYPE:
            continue
        try:
            value = _raw_string(schema) if t == "string" else Json({**schema, "type": t}, root=root)
        except InvalidSchema:  # no value of this type matches the rest of the schema: not an option
            continue
        options.append((_ATTR_TYPE[t], value))
    if not options:
        raise InvalidSchema(f"no value matches the schema of property {key!r}")
    header = [Special(OPEN), Literal("argument"), Literal(f' key="{escape_attr(key)}" type="')]
    elements = [
        Sequence(*header, Literal(attr), Literal('"'), Special(SEP), v, _close("argument")) for attr, v in options
    ]
    return Choice(*elements)


def _arguments(parameters: Any, where: str) -> Grammar:
    if parameters is None:
        return Sequence()
    if not isinstance(parameters, dict):
        raise ChatFormatError(f"{where}: parameters must be a JSON schema object")
    properties = parameters.get("properties") or {}
    required = set(parameters.get("required") or ())
    parts = []
    for key, schema in properties.items():
        element = _argument(key, schema, parameters, where)
        parts.append(element if key in required else Choice(element, Sequence()))
    return Sequence(*parts)


def _call(tool: dict, where: str) -> Grammar:
    function = tool.get("function", tool)
    name = function["name"]
    attrs = (("tool", Literal(escape_attr(name))), ("index", _INDEX))
    return Sequence(_open("call", *attrs), _arguments(function.get("parameters"), where), _close("call"))


def _content(response_format: Any) -> Grammar:
    kind = response_format if isinstance(response_format, str) else (response_format or {}).get("type", "text")
    if kind == "json_object":
        return Json({"type": "object"})
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if isinstance(spec, dict):
            schema = spec.get("schema", spec.get("json_schema"))
            if schema is not None:
                return Json(schema)
        return Json({})  # no schema given: any JSON value
    return Text()


def reply_grammar(
    *,
    thinking: bool,
    tools: list[dict] | None,
    tool_names: frozenset[str],
    tool_choice: Any,
    response_format: Any = None,
    parallel_tool_calls: bool | None = None,
) -> Grammar | None:
    """The grammar a reply must match, or None when the request forces nothing. tools: every tool the request
    declares (the request's and its system messages'); tool_names: those the reply may call
    (RenderedChat.tool_names). ChatFormatError when a schema cannot be enforced (its message names the
    keyword and where)."""
    kind = response_format if isinstance(response_format, str) else (response_format or {}).get("type", "text")
    forced = tool_choice == "required" or isinstance(tool_choice, dict)
    single = parallel_tool_calls is False
    if kind in (None, "text") and not forced and not (single and tool_names):
        return None
    try:
        content = _content(response_format)
    except (UnsupportedSchema, InvalidSchema) as e:
        raise ChatFormatError(f"response_format: {e}") from None
    calls = []
    for i, tool in enumerate(tools or ()):
        if tool.get("function", tool).get("name") in tool_names:
            try:
                calls.append(_call(tool, f"tools[{i}]"))
            except (UnsupportedSchema, InvalidSchema) as e:
                raise ChatFormatError(f"tools: tools[{i}]: {e}") from None
    end = Sequence(_close("message"), Special(END_OF_MSG))
    reply: list[Grammar] = [content, _close("response")]
    if calls:
        most = 1 if single or isinstance(tool_choice, dict) else None  # a named choice: that one call
        section = Sequence(_open("tools"), Repeat(Choice(*calls), 1, most), _close("tools"))
        reply.append(section if forced else Choice(section, Sequence()))
    elif forced:
        raise ChatFormatError("tool_choice: no declared tool may be called, so no call can be forced")
    reply.append(end)
    if thinking:
        reply = [Text(), _close("think"), _open("response"), *reply]
    return Sequence(*reply)
