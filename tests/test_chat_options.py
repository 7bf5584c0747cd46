"""A chat request's options and free-form fields as k3.chat renders them (docs/chat.md): OpenAI's
reasoning_effort mapped to K3's thinking effort, tool_choice (named, required, none) and the tool names the
reply may call, response_format's forms, and the input refused with ChatFormatError (so the server answers
400, never 500): NaN, nesting past the bound, lone surrogates."""

import json

import pytest

from k3 import chat
from k3.chat import CHAT_SPECIAL_TOKENS, ChatEncoder, ChatFormatError, render_text, with_chat_tokens
from k3.formats.tokenizer import byte_tokenizer

O, C, S, E = CHAT_SPECIAL_TOKENS
USER = [{"role": "user", "content": "q"}]


def tool(name: str, parameters: dict | None = None) -> dict:
    return {"type": "function", "function": {"name": name, "parameters": parameters or {"type": "object"}}}


TOOLS = [tool("f"), tool("g")]
REQUIRED = f'{O}message role="system" type="tool-choice"{S}The system is invoked with `tool_choice=required`.'
NONE = f'{O}message role="system" type="tool-choice"{S}The system is invoked with `tool_choice=none`.'


@pytest.fixture(scope="module")
def encoder() -> ChatEncoder:
    return ChatEncoder(with_chat_tokens(byte_tokenizer()))


@pytest.mark.parametrize(
    "reasoning_effort, expected",
    [
        (None, (True, None)),
        ("none", (False, None)),
        ("minimal", (True, "low")),
        ("low", (True, "low")),
        ("medium", (True, "high")),
        ("high", (True, "high")),
        ("xhigh", (True, "max")),
        ("max", (True, "max")),
    ],
)
def test_reasoning_effort_maps_as_vllm_ascend(reasoning_effort, expected):
    assert chat.resolve_thinking(reasoning_effort=reasoning_effort) == expected


def test_chat_template_kwargs_win_over_reasoning_effort_and_stay_strict():
    assert chat.resolve_thinking(thinking=True, reasoning_effort="none") == (True, None)
    assert chat.resolve_thinking(thinking=False, reasoning_effort="high") == (False, "high")
    assert chat.resolve_thinking(thinking_effort="low", reasoning_effort="xhigh") == (True, "low")
    with pytest.raises(ChatFormatError, match="reasoning_effort='extreme' is not one of none, minimal, low, medium"):
        chat.resolve_thinking(reasoning_effort="extreme")
    with pytest.raises(ChatFormatError, match="thinking_effort='medium' is not one of low, high, max"):
        chat.resolve_thinking(thinking_effort="medium")
    thinking, effort = chat.resolve_thinking(reasoning_effort="medium")
    assert "`thinking_effort=high`" in render_text(USER, thinking=thinking, thinking_effort=effort)


def test_a_named_tool_choice_renders_no_text_and_does_not_raise():
    """Today `tool_choice in dict` raised TypeError (unhashable) for OpenAI's named choice."""
    named = {"type": "function", "function": {"name": "g"}}
    assert render_text(USER, TOOLS, tool_choice=named) == render_text(USER, TOOLS)
    assert render_text(USER, TOOLS, tool_choice="auto") == render_text(USER, TOOLS)


def test_required_and_none_are_rendered_only_when_tools_are_declared():
    assert REQUIRED in render_text(USER, TOOLS, tool_choice="required")
    assert NONE in render_text(USER, TOOLS, tool_choice="none")
    assert "tool-choice" not in render_text(USER, tool_choice="none")  # vLLM's default for requests without tools
    dynamic = [{"role": "system", "tools": [tool("late")]}, *USER]
    assert REQUIRED in render_text(dynamic, tool_choice="required")
    assert render_text(USER, TOOLS, tool_choice="none").index(NONE) > render_text(USER, TOOLS).index("q")


@pytest.mark.parametrize(
    "tools, tool_choice, needle",
    [
        (None, "required", "tool_choice 'required' needs tools"),
        (None, {"type": "function", "function": {"name": "f"}}, "names the tool 'f', which is not declared"),
        (TOOLS, {"type": "function", "function": {"name": "h"}}, r"'h', which is not declared \(f, g\)"),
        (TOOLS, {"type": "function", "function": {"name": "f"}, "x": 1}, "is not {'type': 'function'"),
        (TOOLS, {"type": "tool", "function": {"name": "f"}}, "is not {'type': 'function'"),
        (TOOLS, {"type": "function", "function": {"name": ""}}, "is not {'type': 'function'"),
        (TOOLS, {"type": "function", "function": "f"}, "is not {'type': 'function'"),
        (TOOLS, {"type": "function"}, "is not {'type': 'function'"),
        (TOOLS, "any", "tool_choice='any' is not one of auto, none, required or a named function"),
        ([{"type": "function", "function": {}}], None, r"tools\[0\]: a tool needs function.name"),
        ({"function": {"name": "f"}}, None, "tools must be a list of tool objects"),
    ],
)
def test_tool_choice_and_tools_that_cannot_be_honoured_are_refused(tools, tool_choice, needle):
    with pytest.raises(ChatFormatError, match=needle):
        render_text(USER, tools, tool_choice=tool_choice)


def test_tool_names_the_reply_may_call(encoder):
    dynamic = [{"role": "developer", "content": "x", "tools": [tool("late")]}, *USER]
    assert encoder.render(USER).tool_names == frozenset()
    assert encoder.render(USER, TOOLS).tool_names == {"f", "g"}
    assert encoder.render(dynamic, TOOLS, tool_choice="required").tool_names == {"f", "g", "late"}
    assert encoder.render(dynamic, TOOLS, tool_choice="none").tool_names == frozenset()
    named = {"type": "function", "function": {"name": "late"}}
    assert encoder.render(dynamic, TOOLS, tool_choice=named).tool_names == {"late"}


SCHEMA = {"type": "object", "properties": {"b": {"type": "string"}, "a": {"type": "integer"}}}
SCHEMA_TEXT = '{"properties":{"a":{"type":"integer"},"b":{"type":"string"}},"type":"object"}'
JSON_OBJECT = (
    f'{O}message role="system" type="response-format"{S}The system is invoked with `response_format=json_object`.\n'
    f"Your response must be raw JSON data without markdown code blocks (```json) or any additional formatting."
    f"{C}message{S}{E}"
)


def schema_message(schema_text: str) -> str:
    return (
        f'{O}message role="system" type="response-format"{S}The system is invoked with `response_format=json_schema`.'
        "\nYour response must be raw JSON data without markdown code blocks (```json) or any additional formatting."
        f"\nThe JSON data must match the following schema:\n```json\n{schema_text}\n```{C}message{S}{E}"
    )


@pytest.mark.parametrize(
    "response_format, expected",
    [
        ({"type": "json_object"}, JSON_OBJECT),
        ("json_object", JSON_OBJECT),  # the bare string form, as the released renderer reads it
        ({"type": "json_schema", "json_schema": {"name": "n", "schema": SCHEMA}}, schema_message(SCHEMA_TEXT)),
        ({"type": "json_schema", "json_schema": {"name": "n", "json_schema": SCHEMA}}, schema_message(SCHEMA_TEXT)),
        ({"type": "json_schema", "json_schema": SCHEMA}, schema_message('{"properties":' + SCHEMA_TEXT[14:])),
        ({"type": "json_schema"}, schema_message("null")),
        ("json_schema", schema_message("null")),
        ({"type": "text"}, ""),
        ("text", ""),
        (None, ""),
    ],
)
def test_response_format_forms(response_format, expected):
    text = render_text(USER, thinking=False, response_format=response_format)
    prompt = f'{O}message role="assistant"{S}{O}response{S}'
    assert text == f'{O}message role="user"{S}q{C}message{S}{E}' + expected + prompt


@pytest.mark.parametrize("response_format", [{"type": "xml"}, "yaml", {"json_schema": SCHEMA}, 5])
def test_an_unknown_response_format_is_refused_naming_the_accepted_ones(response_format):
    with pytest.raises(ChatFormatError, match="is not one of text, json_object, json_schema"):
        render_text(USER, response_format=response_format)


def nested(depth: int) -> dict:
    """An object exactly `depth` containers deep: {"a": [{"a": [...]}]}, innermost {}."""
    value: dict | list = {}
    for i in range(depth - 1):
        value = {"a": value} if (depth - 2 - i) % 2 == 0 else [value]
    return value


def call_with(arguments) -> list[dict]:
    return [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": arguments}}]}]


@pytest.mark.parametrize(
    "messages, tools, options, needle",
    [
        (call_with({"x": float("nan")}), None, {}, r"messages\[0\].tool_calls\[0\]: arguments holds nan"),
        (call_with('{"x": NaN}'), None, {}, "arguments holds NaN, which is not a JSON number"),
        (call_with('{"x": -Infinity}'), None, {}, "arguments holds -Infinity"),
        (call_with('{"x": 1e999}'), None, {}, "arguments holds inf"),
        (USER, [tool("f", {"default": float("inf")})], {}, r"tools\[0\] holds inf"),
        (
            USER,
            None,
            {"response_format": {"type": "json_schema", "json_schema": {"schema": {"x": float("nan")}}}},
            "response_format's schema holds nan",
        ),
        (
            [{"role": "system", "tools": [tool("f", {"d": float("nan")})]}],
            None,
            {},
            r"messages\[0\].tools\[0\] holds nan",
        ),
        (call_with({"x": object()}), None, {}, "holds a Python object, which is not JSON"),
        (call_with({"x": {1: 2}}), None, {}, "has a key 1 that is not a string"),
        (call_with('{"x": ' + "1" * 5000 + "}"), None, {}, "Exceeds the limit"),
    ],
)
def test_non_finite_numbers_and_non_json_values_are_refused(messages, tools, options, needle):
    with pytest.raises(ChatFormatError, match=needle):
        render_text(messages, tools, **options)


def test_free_form_fields_nested_past_64_levels_are_refused_not_a_recursion_error():
    assert json.dumps(nested(3)) == '{"a": [{}]}'
    deep, limit = nested(65), nested(64)
    schema = {"type": "json_schema", "json_schema": {"schema": deep}}
    cases = [
        (USER, [tool("f", deep)], {}),
        (call_with(deep), None, {}),
        (call_with(json.dumps(deep)), None, {}),
        (call_with("[" * 100_000 + "]" * 100_000), None, {}),  # json.loads itself would recurse too deep
        (call_with({"x": [[[[]]]] * 2 + [nested(10_000)]}), None, {}),
        (USER, None, {"response_format": schema}),
    ]
    for messages, tools, options in cases:
        with pytest.raises(ChatFormatError, match="nested deeper than 64 levels"):
            render_text(messages, tools, **options)
    render_text(call_with(limit), None)  # 64 levels is within the bound
    render_text(USER, None, response_format={"type": "json_schema", "json_schema": {"schema": limit}})


@pytest.mark.parametrize(
    "messages, tools",
    [
        ([{"role": "user", "content": "a\ud800b"}], None),
        ([{"role": "user", "content": [{"type": "text", "text": "x"}, {"type": "text", "text": "\udfff"}]}], None),
        ([{"role": "user", "content": "q", "name": "\ud83d"}], None),
        (USER, [tool("f\udc00")]),
        (call_with({"k": "v\ud800"}), None),
        (call_with('{"k\\ud800": 1}'), None),
        ([{"role": "tool", "name": "f", "content": "\ud800"}], None),
    ],
)
def test_a_lone_surrogate_anywhere_in_the_prompt_is_a_chat_format_error(encoder, messages, tools):
    """tokenizers raises TypeError on it, which the server would answer with a 500."""
    with pytest.raises(ChatFormatError, match="lone UTF-16 surrogate"):
        encoder.render(messages, tools)
    with pytest.raises(ChatFormatError, match="U\\+D800"):
        encoder.encode_text("x\ud800")
