"""k3.chat.constraints: the grammars that force a chat reply (issue 26 items 2 and 7). Each is checked on
symbol streams: what the release renderer writes for the same reply is accepted and parses into the call or
JSON asked for, and a reply that breaks the request (no call where one is required, another tool, two calls
where one is allowed, JSON of the wrong shape, a wrong argument type) is refused."""

import json

import pytest

from k3.chat import ChatFormatError, parse_text, render_text
from k3.chat.constraints import reply_grammar
from k3.chat.lexer import KIND

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}, "metric": {"type": "boolean"}},
            "required": ["city"],
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
TOOLS = [WEATHER, TIME]
NAMES = frozenset({"get_weather", "get_time"})


def symbols(text: str) -> list:
    """A reply with the chat tokens spelled out -> symbols: bytes, and each chat token by its spelling."""
    out, i = [], 0
    while i < len(text):
        marker = next((m for m in KIND if text.startswith(m, i)), None)
        if marker is not None:
            out.append(marker)
            i += len(marker)
        else:
            out.extend(text[i].encode("utf-8"))
            i += 1
    return out


def accepts(grammar, text: str) -> bool:
    state = grammar.start()
    for symbol in symbols(text):
        state = state.feed(symbol)
        if state is None:
            return False
    return state.can_end()


def assistant_reply(calls=(), content="", reasoning="ok", thinking=True) -> str:
    """What the release renderer writes for an assistant message, cut where the generation prompt ends."""
    message = {"role": "assistant", "content": content, "reasoning_content": reasoning, "tool_calls": list(calls)}
    text = render_text([message], thinking=thinking, add_generation_prompt=False)
    opener = "<|open|>think<|sep|>" if thinking else "<|open|>response<|sep|>"
    return text[text.index(opener) + len(opener) :]


def call(name: str, **arguments) -> dict:
    return {"id": "c", "type": "function", "function": {"name": name, "arguments": arguments}}


def test_nothing_forced_is_no_grammar():
    for choice in ("auto", "none", None):
        assert reply_grammar(thinking=True, tools=TOOLS, tool_names=NAMES, tool_choice=choice) is None
    assert (
        reply_grammar(thinking=True, tools=None, tool_names=frozenset(), tool_choice=None, response_format="text")
        is None
    )


@pytest.mark.parametrize("thinking", [True, False])
def test_required_accepts_the_renderers_calls_and_refuses_a_reply_without_one(thinking):
    g = reply_grammar(thinking=thinking, tools=TOOLS, tool_names=NAMES, tool_choice="required")
    one = assistant_reply([call("get_weather", city="Oslo", days=3)], thinking=thinking)
    two = assistant_reply([call("get_weather", city="Oslo", metric=True), call("get_time")], thinking=thinking)
    assert accepts(g, one) and accepts(g, two)
    parsed = parse_text(one, thinking=thinking, tool_names=NAMES)
    assert parsed["tool_calls"][0]["function"]["name"] == "get_weather"
    assert json.loads(parsed["tool_calls"][0]["function"]["arguments"]) == {"city": "Oslo", "days": 3}
    assert not accepts(g, assistant_reply([], content="no call", thinking=thinking))
    assert not accepts(g, assistant_reply([call("delete_all")], thinking=thinking))  # not declared
    # a required argument missing, an integer written as a string, a string argument typed as a number
    assert not accepts(g, assistant_reply([call("get_weather", days=3)], thinking=thinking))
    bad_type = one.replace('key="days" type="number"<|sep|>3', 'key="days" type="string"<|sep|>3')
    assert bad_type != one and not accepts(g, bad_type)
    assert not accepts(g, one.replace("<|sep|>3<|close|>", "<|sep|>three<|close|>"))


def test_a_named_choice_allows_that_tool_once_and_parallel_false_one_call():
    named = {"type": "function", "function": {"name": "get_time"}}
    g = reply_grammar(thinking=True, tools=TOOLS, tool_names=frozenset({"get_time"}), tool_choice=named)
    assert accepts(g, assistant_reply([call("get_time")]))
    assert not accepts(g, assistant_reply([call("get_weather", city="x")]))
    assert not accepts(g, assistant_reply([call("get_time"), call("get_time")]))
    assert not accepts(g, assistant_reply([]))
    single = reply_grammar(thinking=True, tools=TOOLS, tool_names=NAMES, tool_choice="auto", parallel_tool_calls=False)
    assert accepts(single, assistant_reply([call("get_time")])) and accepts(single, assistant_reply([], content="hi"))
    assert not accepts(single, assistant_reply([call("get_time"), call("get_time")]))


@pytest.mark.parametrize("thinking", [True, False])
def test_json_responses(thinking):
    none = {"tools": None, "tool_names": frozenset(), "tool_choice": None}
    g = reply_grammar(thinking=thinking, response_format={"type": "json_object"}, **none)
    assert accepts(g, assistant_reply(content='{"a": [1, 2]}', thinking=thinking))
    assert not accepts(g, assistant_reply(content="[1, 2]", thinking=thinking))  # json_object: an object
    assert not accepts(g, assistant_reply(content="sure! {}", thinking=thinking))
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    g = reply_grammar(thinking=thinking, response_format=fmt, **none)
    assert accepts(g, assistant_reply(content='{"n": 4}', thinking=thinking))
    assert not accepts(g, assistant_reply(content='{"n": 4.5}', thinking=thinking))
    assert not accepts(g, assistant_reply(content="{}", thinking=thinking))


def test_string_enums_are_raw_and_exact():
    parameters = {"type": "object", "properties": {"unit": {"enum": ["C", "F"]}}, "required": ["unit"]}
    tool = {"type": "function", "function": {"name": "f", "parameters": parameters}}
    g = reply_grammar(thinking=False, tools=[tool], tool_names=frozenset({"f"}), tool_choice="required")
    assert accepts(g, assistant_reply([call("f", unit="C")], thinking=False))
    assert not accepts(g, assistant_reply([call("f", unit="K")], thinking=False))


def test_a_schema_that_cannot_be_enforced_is_refused_by_name():
    fmt = {"type": "json_schema", "json_schema": {"schema": {"type": "string", "pattern": "^a+$"}}}
    with pytest.raises(ChatFormatError, match=r"response_format: JSON schema keyword 'pattern'"):
        reply_grammar(thinking=True, tools=None, tool_names=frozenset(), tool_choice=None, response_format=fmt)
    parameters = {"type": "object", "properties": {"n": {"type": "number", "minimum": 0}}}
    tool = {"type": "function", "function": {"name": "f", "parameters": parameters}}
    with pytest.raises(ChatFormatError, match=r"tools: tools\[0\]: JSON schema keyword 'minimum'"):
        reply_grammar(thinking=True, tools=[tool], tool_names=frozenset({"f"}), tool_choice="required")


def test_what_docs_chat_md_says_is_enforced():
    """docs/chat.md's account of tool_choice and parallel_tool_calls, one line each."""
    required_one = reply_grammar(
        thinking=False, tools=TOOLS, tool_names=NAMES, tool_choice="required", parallel_tool_calls=False
    )
    assert accepts(required_one, assistant_reply([call("get_time")], thinking=False))
    assert not accepts(required_one, assistant_reply([], content="hi", thinking=False))
    assert not accepts(required_one, assistant_reply([call("get_time"), call("get_time")], thinking=False))
    # none: a JSON response_format still forces the content, and no tools section may follow it
    g = reply_grammar(
        thinking=False, tools=TOOLS, tool_names=frozenset(), tool_choice="none", response_format="json_object"
    )
    assert accepts(g, assistant_reply(content="{}", thinking=False))
    assert not accepts(g, assistant_reply([call("get_time")], content="{}", thinking=False))
    # auto with parallel_tool_calls true forces nothing; a tool's property schemas are compiled once something is
    strict = {"type": "object", "properties": {"n": {"type": "integer", "pattern": "x"}}}
    tools, f = [{"type": "function", "function": {"name": "f", "parameters": strict}}], frozenset({"f"})
    assert reply_grammar(thinking=True, tools=tools, tool_names=f, tool_choice="auto", parallel_tool_calls=True) is None
    with pytest.raises(ChatFormatError, match=r"tools: tools\[0\]: JSON schema keyword 'pattern'"):
        reply_grammar(thinking=True, tools=tools, tool_names=f, tool_choice="auto", response_format="json_object")
