"""K3's chat output parser: render an assistant turn, parse the model-side part back, get the message;
malformed output keeps its text and never raises; streaming in any chunking equals the whole parse. The
rules that follow vLLM's K3 parsers (reasoning kept whole, calls returned only when closed and allowed,
arguments re-encoded) are in docs/chat.md."""

import contextlib
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from k3.chat import CHAT_SPECIAL_TOKENS, ChatEncoder, merge_deltas, parse_text, text_stream_parser, with_chat_tokens
from k3.formats.tokenizer import byte_tokenizer

O, C, S, E = CHAT_SPECIAL_TOKENS


@pytest.fixture(scope="module")
def encoder() -> ChatEncoder:
    return ChatEncoder(with_chat_tokens(byte_tokenizer()))


def call(i: int, name: str, arguments) -> dict:
    return {"id": f"c{i}", "type": "function", "function": {"name": name, "arguments": arguments}}


SYSTEM = {"role": "system", "content": "You are terse."}
USER = {"role": "user", "content": "What's the weather in Paris, <|open|>really<|sep|>?"}
CASES = [
    ("plain", [USER], {"role": "assistant", "content": "Sunny.", "reasoning_content": "check"}),
    (
        "system+multi-turn",
        [SYSTEM, USER, {"role": "assistant", "content": "Hm?"}, {"role": "user", "content": "Again"}],
        {"role": "assistant", "content": "Rain, héhé ✓", "reasoning_content": "second\nthought"},
    ),
    (
        "tool call",
        [SYSTEM, USER],
        {
            "role": "assistant",
            "content": "Looking.",
            "reasoning_content": "need a tool",
            "tool_calls": [call(0, "get_weather", '{"city": "Paris", "days": 2, "units": null, "hourly": false}')],
        },
    ),
    (
        "two calls no content",
        [USER],
        {
            "role": "assistant",
            "content": None,
            "reasoning_content": "two",
            "tool_calls": [
                call(0, "a", '{"q": "x <|close|> \\"y\\""}'),
                call(1, "b", '{"o": {"k": [1, 2]}, "l": [true]}'),
            ],
        },
    ),
    (
        "after tool results",
        [
            USER,
            {"role": "assistant", "tool_calls": [call(0, "f", "{}"), call(1, "g", "{}")]},
            {"role": "tool", "tool_call_id": "c1", "content": "g says"},
            {"role": "tool", "tool_call_id": "c0", "content": "f says"},
        ],
        {"role": "assistant", "content": "Both done.", "reasoning_content": "read results"},
    ),
    (
        "empty arguments",
        [USER],
        {"role": "assistant", "content": "ok", "reasoning_content": "r", "tool_calls": [call(0, "ping", "{}")]},
    ),
    (
        "unparsable arguments",
        [USER],
        {"role": "assistant", "content": "x", "reasoning_content": "r", "tool_calls": [call(0, "f", '{"a": 1')]},
    ),
]
TOOLS = [
    {"type": "function", "function": {"name": name, "parameters": {"type": "object"}}}
    for name in ("get_weather", "a", "b", "f", "g", "ping")
]
NAMES = frozenset(t["function"]["name"] for t in TOOLS)


def same_message(parsed: dict, original: dict, thinking: bool) -> None:
    assert parsed["content"] == (original.get("content") or None)
    assert (
        parsed["reasoning_content"] == parsed["reasoning"] == (original.get("reasoning_content") if thinking else None)
    )
    calls = original.get("tool_calls") or []
    assert len(parsed["tool_calls"] or []) == len(calls)
    for got, want in zip(parsed["tool_calls"] or [], calls, strict=True):
        assert got["function"]["name"] == want["function"]["name"]
        try:
            assert json.loads(got["function"]["arguments"]) == json.loads(want["function"]["arguments"])
        except ValueError:  # not JSON: returned exactly as given
            assert got["function"]["arguments"] == want["function"]["arguments"]


@pytest.mark.parametrize("thinking", [True, False])
@pytest.mark.parametrize("name, history, reply", CASES, ids=[c[0] for c in CASES])
def test_round_trip_render_then_parse_the_model_side(encoder, name, history, reply, thinking):
    rendered = encoder.render(history, TOOLS, thinking=thinking)
    prompt, names = rendered.ids, rendered.tool_names
    assert names == NAMES
    full = encoder.render([*history, reply], TOOLS, thinking=thinking, add_generation_prompt=False).ids
    assert full[: len(prompt)] == prompt  # the prompt is exactly where the model takes over
    completion = full[len(prompt) :]
    assert completion[-1] == encoder.token_ids.end_of_msg
    parsed = encoder.parse(completion, thinking=thinking, id_prefix="call_", tool_names=names)
    same_message(parsed, reply, thinking)
    assert [c["id"] for c in parsed["tool_calls"] or []] == [
        f"call_{i}" for i in range(len(reply.get("tool_calls") or []))
    ]
    for size in (1, 3):  # token by token and in small chunks: the same message
        parser = encoder.stream_parser(thinking=thinking, id_prefix="call_", tool_names=names)
        deltas = [parser.feed(completion[i : i + size]) for i in range(0, len(completion), size)]
        assert merge_deltas([*deltas, parser.finish()]) == parsed
    if not any(m in json.dumps(reply) for m in CHAT_SPECIAL_TOKENS):  # decoded text cannot tell them apart
        text = encoder.decode(completion)
        assert parse_text(text, thinking=thinking, id_prefix="call_", tool_names=names) == parsed


def test_streaming_deltas_are_openai_shaped():
    """Each call is one delta entry, sent when it closes, carrying everything (vLLM's shape)."""
    out = (
        f"plan{C}think{S}{O}response{S}Hi{C}response{S}{O}tools{S}"
        f'{O}call tool="f" index="1"{S}{O}argument key="s" type="string"{S}a"b{C}argument{S}{C}call{S}'
        f'{O}call tool="g" index="2"{S}{C}call{S}{C}tools{S}{C}message{S}{E}'
    )
    parser = text_stream_parser(id_prefix="id", tool_names={"f", "g"})
    deltas = [parser.feed(ch) for ch in out] + [parser.finish()]
    chunks = [d.to_openai() for d in deltas if d]
    assert chunks[0] == {"reasoning_content": "p", "reasoning": "p"}
    calls = [c["tool_calls"] for c in chunks if "tool_calls" in c]
    assert calls == [
        [{"index": 0, "id": "id0", "type": "function", "function": {"name": "f", "arguments": '{"s": "a\\"b"}'}}],
        [{"index": 1, "id": "id1", "type": "function", "function": {"name": "g", "arguments": "{}"}}],
    ]
    closes_first = out.index(f"{C}call{S}") + len(f"{C}call{S}")
    assert sum(1 for d in deltas[:closes_first] if d.tool_calls) == 1  # sent on the call's last character
    merged = merge_deltas(deltas)
    assert merged["content"] == "Hi" and merged["reasoning_content"] == merged["reasoning"] == "plan"


F = f'{O}tools{S}{O}call tool="f"{S}'  # the start of a call of f, thinking off


@pytest.mark.parametrize(
    "output, thinking, content, reasoning, calls",
    [
        ("just text, no markers", False, "just text, no markers", None, []),
        ("still thinking", True, None, "still thinking", []),
        (f"r{C}think{S}{O}response{S}cut off mid-answ", True, "cut off mid-answ", "r", []),
        (f"a{O}bogus x{S}b{C}response{S}", False, f"a{O}bogus x{S}b", None, []),  # unknown tag spelled out
        (f"a{C}think{S}b", False, f"a{C}think{S}b", None, []),  # a close that matches nothing
        (f"a{S}b{E}after", False, f"a{S}bafter", None, []),  # stray sep; text after the end kept
        (f"a{O}respo", False, f"a{O}respo", None, []),  # header cut off
        (f'{O}tools{S}{O}call tool="f" extra="1"{S}{C}call{S}', False, None, None, [("f", "{}")]),  # unknown attr
        (f"{O}tools{S}{O}call{S}x{C}call{S}{C}tools{S}", False, f"{O}call{S}x{C}call{S}", None, []),  # no tool=
        (
            F + f'{O}argument key="n" type="number"{S}1.5.{C}argument{S}{C}call{S}',
            False,
            None,
            None,
            [("f", '{"n": "1.5."}')],
        ),  # bad number kept as a string
        (
            F + f'{O}argument type="string"{S}v{C}argument{S}{C}call{S}',
            False,
            f'{O}argument type="string"{S}v{C}argument{S}',
            None,
            [("f", "{}")],
        ),  # argument without key
        (
            F + f'{O}json type="object"{S}{{"a": 1{C}json{S}{C}call{S}',
            False,
            None,
            None,
            [("f", '{"a": 1')],
        ),  # raw arguments block returned as given
    ],
)
def test_malformed_output_is_kept_and_never_raises(encoder, output, thinking, content, reasoning, calls):
    check_parse(encoder, output, thinking, content, reasoning, calls, {"f"})


def check_parse(encoder, output, thinking, content, reasoning, calls, tool_names) -> None:
    """Both lexers (decoded text, and ids with the chat tokens as their ids) give this message."""
    for parsed in (
        parse_text(output, thinking=thinking, tool_names=tool_names),
        encoder.parse(text_to_ids(encoder, output), thinking=thinking, tool_names=tool_names),
    ):
        assert parsed["content"] == content
        assert parsed["reasoning_content"] == parsed["reasoning"] == reasoning
        got = [(c["function"]["name"], c["function"]["arguments"]) for c in parsed["tool_calls"] or []]
        assert got == calls


@pytest.mark.parametrize(
    "output, content, reasoning, calls",
    [
        (
            f'r{O}tools{S}{O}call tool="f"{S}{C}call{S}{C}tools{S}',
            None,
            f'r{O}tools{S}{O}call tool="f"{S}{C}call{S}{C}tools{S}',
            [],
        ),
        (f"a{O}response{S}b{C}response{S}c", None, f"a{O}response{S}b{C}response{S}c", []),  # think never closed
        (
            f"a{S}b{C}bogus{S}c{O}x y{S}d{C}message{S}e{O}cut",
            None,
            f"a{S}b{C}bogus{S}c{O}x y{S}d{C}message{S}e{O}cut",
            [],
        ),
        (f"{O}think{S}echo{O}think{S}x{C}think{S}y", "y", f"echo{O}think{S}x", []),  # the prompt's opener echoed
        (f'a{O}tools{S}b{C}think{S}{O}tools{S}{O}call tool="f"{S}{C}call{S}', None, f"a{O}tools{S}b", [("f", "{}")]),
        (f"a{E}b", "b", "a", []),  # the stop token ends the message wherever it is
    ],
)
def test_reasoning_is_everything_up_to_the_first_think_close_markup_included(
    encoder, output, content, reasoning, calls
):
    """As vLLM: a tools channel (or any markup) inside think is reasoning text, never a call or content."""
    check_parse(encoder, output, True, content, reasoning, calls, {"f"})


@pytest.mark.parametrize(
    "output, content, calls",
    [
        (F + f'{O}argument key="n" type="number"{S}12', None, []),  # cut by max_tokens mid-argument
        (F + f'{O}argument key="n" type="number"{S}12{C}argument{S}', None, []),  # cut before the call closes
        (F + f"{C}call{S}" + f'{O}call tool="f"{S}{O}json type="object"{S}{{', None, [("f", "{}")]),  # 2nd cut
        (F + f"{C}tools{S}after", "after", []),  # ended by the tools close: not a complete call either
        (F + f"{C}message{S}{E}", None, []),
        (F + f"{E}", None, []),
    ],
)
def test_a_call_without_its_close_is_not_returned(encoder, output, content, calls):
    """As vLLM and SGLang: only `<|close|>call<|sep|>` completes a call; its text goes to `dropped`."""
    check_parse(encoder, output, False, content, None, calls, {"f"})
    parser = text_stream_parser(thinking=False, tool_names={"f"})
    parser.feed(output)
    parser.finish()
    assert parser.dropped.startswith(f'{O}call tool="f"{S}') and parser.dropped.count(f"{O}call ") == 1


def test_calls_to_names_the_request_does_not_allow_stay_content(encoder):
    g = f'{O}call tool="g" index="1"{S}{O}argument key="k" type="string"{S}v{C}argument{S}{C}call{S}'
    f = f'{O}call tool="f" index="2"{S}{C}call{S}'
    output = f"{O}response{S}Hi{C}response{S}{O}tools{S}{g}{f}{C}tools{S}{C}message{S}{E}"
    check_parse(encoder, output, False, f"Hi{g}", None, [("f", "{}")], {"f"})  # the allowed call keeps index 0
    tools_section = f"{O}tools{S}{g}{f}{C}tools{S}"
    check_parse(encoder, output, False, f"Hi{tools_section}", None, [], frozenset())  # no tools: no channel either
    check_parse(encoder, output, False, f"Hi{tools_section}", None, [], ())  # the default: none allowed


def test_arguments_are_the_json_object_vllm_returns():
    """json.dumps of the decoded object: a later duplicate key wins, values re-encoded (`1e2` -> 100.0); text
    that is not JSON within k3's bounds (NaN, 1e999, past 64 levels) stays a string."""

    def arguments(*pairs: tuple[str, str, str]) -> str:
        body = "".join(f'{O}argument key="{k}" type="{t}"{S}{v}{C}argument{S}' for k, t, v in pairs)
        parsed = parse_text(F + body + f"{C}call{S}", thinking=False, tool_names={"f"})
        return parsed["tool_calls"][0]["function"]["arguments"]

    assert arguments(("n", "number", "1e2"), ("l", "array", "[1,2]"), ("n", "number", "3")) == '{"n": 3, "l": [1, 2]}'
    assert arguments(("o", "object", '{"b":1, "a":{"x":true}}')) == '{"o": {"b": 1, "a": {"x": true}}}'
    assert arguments(("s", "string", 'é "q" \\'), ("z", "null", "null")) == '{"s": "é \\"q\\" \\\\", "z": null}'
    deep = "[" * 65 + "]" * 65
    assert json.loads(arguments(("a", "number", "NaN"), ("b", "number", "1e999"), ("c", "array", deep))) == {
        "a": "NaN",
        "b": "1e999",
        "c": deep,
    }
    assert json.loads(arguments(("c", "array", "[" * 64 + "]" * 64)))["c"] == json.loads("[" * 64 + "]" * 64)


def text_to_ids(encoder: ChatEncoder, text: str) -> list[int]:
    """Spellings of the chat tokens become their ids, the rest is ordinary text (what a model would emit)."""
    ids, rest = [], text
    spelled = {s: i for i, s in encoder.token_ids.by_id().items()}
    while rest:
        hits = [(rest.find(m), m) for m in spelled if m in rest]
        at, marker = min(hits) if hits else (len(rest), None)
        ids += encoder.encode_text(rest[:at])
        if marker is None:
            break
        ids.append(spelled[marker])
        rest = rest[at + len(marker) :]
    return ids


def body_runs(encoder: ChatEncoder, ids: list[int]) -> list[str]:
    """The text that is not part of a tag: each run of text tokens not directly after <|open|> / <|close|>."""
    special, runs, run, after_marker = encoder.token_ids.by_id(), [], [], False
    for i in [*ids, encoder.token_ids.sep]:
        if i in special:
            if run and not after_marker:
                runs.append(encoder.decode(run))
            run, after_marker = [], i in (encoder.token_ids.open, encoder.token_ids.close)
        else:
            run.append(i)
    return [r for r in runs if r]


def haystacks(parsed: dict, dropped: str) -> list[str]:
    out = [parsed["content"] or "", parsed["reasoning_content"] or "", dropped]
    for c in parsed["tool_calls"] or []:
        out.append(c["function"]["arguments"])
        with contextlib.suppress(ValueError):  # the raw arguments of a json block need not be JSON
            pairs = json.loads(c["function"]["arguments"], object_pairs_hook=list)
            out += [v for _, v in pairs if isinstance(v, str)] if isinstance(pairs, list) else []
    return out


def argument_values(parsed: dict) -> list:
    """Every call's argument values, as parsed from its JSON arguments."""
    out = []
    for c in parsed["tool_calls"] or []:
        with contextlib.suppress(ValueError):
            pairs = json.loads(c["function"]["arguments"], object_pairs_hook=list)
            out += [v for _, v in pairs] if isinstance(pairs, list) else []
    return out


def parses_to_one_of(run: str, values: list) -> bool:
    """A typed argument's body (an object, an array) is kept as its JSON value, re-serialised: a corrupted output
    whose `{"k":[1, 2]}` lost a space comes back as `{"k": [1, 2]}`, the same value."""
    try:
        value = json.loads(run, object_pairs_hook=list)
    except ValueError:
        return False
    return any(json.dumps(value) == json.dumps(v) for v in values)


@settings(max_examples=150, deadline=None)
@given(data=st.data(), thinking=st.booleans(), chunk=st.integers(1, 5))
def test_fuzz_truncated_and_corrupted_outputs_keep_their_text(encoder, data, thinking, chunk):
    _, history, reply = data.draw(st.sampled_from(CASES))
    prompt = encoder.render(history, TOOLS, thinking=thinking).ids
    ids = encoder.render([*history, reply], TOOLS, thinking=thinking, add_generation_prompt=False).ids[len(prompt) :]
    specials = list(encoder.token_ids.by_id())
    edits = st.tuples(st.sampled_from(["drop", "insert", "swap"]), st.integers(0, 10_000))
    any_token = st.one_of(st.sampled_from(specials), st.integers(0, encoder.tokenizer.get_vocab_size() - 1))
    for op, at in data.draw(st.lists(edits, max_size=6)):
        at %= len(ids) + 1
        if op == "drop" and at < len(ids):
            del ids[at]
        elif op == "insert":
            ids.insert(at, data.draw(any_token))
        elif op == "swap" and at + 1 < len(ids):
            ids[at], ids[at + 1] = ids[at + 1], ids[at]
    ids = ids[: data.draw(st.integers(0, len(ids)))]  # truncated anywhere
    parser = encoder.stream_parser(thinking=thinking, tool_names=NAMES)
    parsed = merge_deltas([parser.feed(ids[i : i + chunk]) for i in range(0, len(ids), chunk)] + [parser.finish()])
    found, values = haystacks(parsed, parser.dropped), argument_values(parsed)
    for run in body_runs(encoder, ids):
        assert any(run in h for h in found) or parses_to_one_of(run, values), (run, parsed)


PIECES = [
    O,
    C,
    S,
    E,
    "think",
    "response",
    "tools",
    "message",
    'call tool="f" index="1"',
    'call tool="h"',
    'argument key="k" type="string"',
    'argument key="n" type="number"',
    'json type="object"',
    "call",
    "argument",
    "json",
    "12",
    '"x"',
    "hi ",
    "\n",
    "<|",
    "|>",
    "é",
]
REPLY = [
    "r",
    C,
    "think",
    S,
    O,
    "response",
    S,
    "x",
    C,
    "response",
    S,
    O,
    "tools",
    S,
    O,
    'call tool="f" index="1"',
    S,
    O,
    'argument key="n" type="number"',
    S,
    "12",
    C,
    "argument",
    S,
    C,
    "call",
    S,
    O,
    'call tool="h"',
    S,
    C,
    "call",
    S,
    O,
    'call tool="f" index="3"',
    S,
    O,
    'json type="object"',
    S,
    "{",
    C,
    "json",
    S,
    C,
    "call",
    S,
    C,
    "tools",
    S,
    C,
    "message",
    S,
    E,
]  # a well-formed reply (thinking on) as pieces, for edits that keep most of its structure


@st.composite
def outputs(draw) -> str:
    """Random pieces, or the reply above with pieces dropped or inserted at random."""
    if draw(st.booleans()):
        return "".join(draw(st.lists(st.sampled_from(PIECES), max_size=40)))
    pieces = list(REPLY)
    for at, insert in draw(
        st.lists(st.tuples(st.integers(0, len(REPLY)), st.sampled_from([None, *PIECES])), max_size=4)
    ):
        if insert is None:
            del pieces[min(at, len(pieces) - 1)]
        else:
            pieces.insert(at, insert)
    return "".join(pieces[: draw(st.integers(0, len(pieces)))])


def stream(parser, parts) -> list:
    return [parser.feed(p) for p in parts] + [parser.finish()]


@settings(max_examples=120, deadline=None)
@given(output=outputs(), thinking=st.booleans(), names=st.sampled_from([frozenset(), frozenset({"f"})]))
def test_property_streamed_in_two_parts_at_every_split_point_equals_the_one_shot_parse(
    encoder, output, thinking, names
):
    """Calls are sent whole once closed, so a stream agrees with the one-shot parse wherever it is split,
    and no stream ever sends two entries for one call index."""
    kw = {"thinking": thinking, "id_prefix": "c", "tool_names": names}
    ids = text_to_ids(encoder, output)
    whole_text, whole_ids = parse_text(output, **kw), encoder.parse(ids, **kw)
    assert whole_ids == whole_text  # the spelled markers are the chat tokens here: the lexers agree
    for at in range(len(output) + 1):
        deltas = stream(text_stream_parser(**kw), [output[:at], output[at:]])
        assert merge_deltas(deltas) == whole_text
    for at in range(len(ids) + 1):
        deltas = stream(encoder.stream_parser(**kw), [ids[:at], ids[at:]])
        assert merge_deltas(deltas) == whole_ids
        entries = [c for d in deltas for c in d.tool_calls]
        assert [c["index"] for c in entries] == list(range(len(entries)))
        assert all(
            set(c) == {"index", "id", "type", "function"} and set(c["function"]) == {"name", "arguments"}
            for c in entries
        )
