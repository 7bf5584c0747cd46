"""K3's chat output parser: render an assistant turn, parse the model-side part back, get the message;
malformed output keeps all its text and never raises; streaming in any chunking equals the whole parse."""

import contextlib
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from k3.chat import CHAT_SPECIAL_TOKENS, ChatEncoder, merge_deltas, parse_text, text_stream_parser, with_chat_tokens
from k3.train.tokenizer import byte_tokenizer

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
    ("system+multi-turn", [SYSTEM, USER, {"role": "assistant", "content": "Hm?"}, {"role": "user", "content": "Again"}],
     {"role": "assistant", "content": "Rain, héhé ✓", "reasoning_content": "second\nthought"}),
    ("tool call", [SYSTEM, USER],
     {"role": "assistant", "content": "Looking.", "reasoning_content": "need a tool",
      "tool_calls": [call(0, "get_weather", '{"city": "Paris", "days": 2, "units": null, "hourly": false}')]}),
    ("two calls no content", [USER],
     {"role": "assistant", "content": None, "reasoning_content": "two",
      "tool_calls": [call(0, "a", '{"q": "x <|close|> \\"y\\""}'), call(1, "b", '{"o": {"k": [1, 2]}, "l": [true]}')]}),
    ("after tool results", [USER, {"role": "assistant", "tool_calls": [call(0, "f", "{}"), call(1, "g", "{}")]},
                            {"role": "tool", "tool_call_id": "c1", "content": "g says"},
                            {"role": "tool", "tool_call_id": "c0", "content": "f says"}],
     {"role": "assistant", "content": "Both done.", "reasoning_content": "read results"}),
    ("empty arguments", [USER], {"role": "assistant", "content": "ok", "reasoning_content": "r",
                                 "tool_calls": [call(0, "ping", "{}")]}),
    ("unparsable arguments", [USER], {"role": "assistant", "content": "x", "reasoning_content": "r",
                                      "tool_calls": [call(0, "f", '{"a": 1')]}),
]  # fmt: skip
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]


def same_message(parsed: dict, original: dict, thinking: bool) -> None:
    assert parsed["content"] == (original.get("content") or None)
    assert parsed["reasoning_content"] == (original.get("reasoning_content") if thinking else None)
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
    prompt = encoder.render(history, TOOLS, thinking=thinking).ids
    full = encoder.render([*history, reply], TOOLS, thinking=thinking, add_generation_prompt=False).ids
    assert full[: len(prompt)] == prompt  # the prompt is exactly where the model takes over
    completion = full[len(prompt) :]
    assert completion[-1] == encoder.token_ids.end_of_msg
    parsed = encoder.parse(completion, thinking=thinking, id_prefix="call_")
    same_message(parsed, reply, thinking)
    assert [c["id"] for c in parsed["tool_calls"] or []] == [
        f"call_{i}" for i in range(len(reply.get("tool_calls") or []))
    ]
    for size in (1, 3):  # token by token and in small chunks: the same message
        parser = encoder.stream_parser(thinking=thinking, id_prefix="call_")
        deltas = [parser.feed(completion[i : i + size]) for i in range(0, len(completion), size)]
        assert merge_deltas([*deltas, parser.finish()]) == parsed
    if not any(m in json.dumps(reply) for m in CHAT_SPECIAL_TOKENS):  # decoded text cannot tell them apart
        assert parse_text(encoder.decode(completion), thinking=thinking, id_prefix="call_") == parsed


def test_streaming_deltas_are_openai_shaped(encoder):
    out = (
        f"plan{C}think{S}{O}response{S}Hi{C}response{S}{O}tools{S}"
        f'{O}call tool="f" index="1"{S}{O}argument key="s" type="string"{S}a"b{C}argument{S}{C}call{S}{C}tools{S}'
        f"{C}message{S}{E}"
    )
    parser = text_stream_parser(id_prefix="id")
    deltas = [parser.feed(ch) for ch in out] + [parser.finish()]
    chunks = [d.to_openai() for d in deltas if d]
    assert chunks[0] == {"reasoning_content": "p"}
    first_call = next(c["tool_calls"][0] for c in chunks if "tool_calls" in c)
    assert first_call == {"index": 0, "id": "id0", "type": "function", "function": {"name": "f", "arguments": ""}}
    assert merge_deltas(deltas)["tool_calls"][0]["function"]["arguments"] == '{"s": "a\\"b"}'
    assert merge_deltas(deltas)["content"] == "Hi" and merge_deltas(deltas)["reasoning_content"] == "plan"


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
        (f"a{C}response{S}{O}tools{S}{O}call tool=\"f\" extra=\"1\"{S}{O}argument key=\"n\" type=\"number\"{S}12",
         False, "a", None, [("f", '{"n": 12}')]),  # truncated tools section; unknown attribute ignored
        (f"{O}tools{S}{O}call{S}x{C}call{S}{C}tools{S}", False, f"{O}call{S}x{C}call{S}", None, []),  # no tool=
        (f"{O}tools{S}{O}call tool=\"f\"{S}{O}argument key=\"n\" type=\"number\"{S}1.5.{C}argument{S}",
         False, None, None, [("f", '{"n": "1.5."}')]),  # bad number kept as a string
        (f"{O}tools{S}{O}call tool=\"f\"{S}{O}argument type=\"string\"{S}v{C}argument{S}{C}call{S}",
         False, f'{O}argument type="string"{S}v{C}argument{S}', None, [("f", "{}")]),  # argument without key
        (f"{O}tools{S}{O}call tool=\"f\"{S}{O}json type=\"object\"{S}{{\"a\": 1{C}json{S}{C}call{S}",
         False, None, None, [("f", '{"a": 1')]),  # raw arguments block returned as given
    ],
)  # fmt: skip
def test_malformed_output_is_kept_and_never_raises(encoder, output, thinking, content, reasoning, calls):
    for parsed in (
        parse_text(output, thinking=thinking),
        encoder.parse(text_to_ids(encoder, output), thinking=thinking),
    ):
        assert parsed["content"] == content
        assert parsed["reasoning_content"] == reasoning
        got = [(c["function"]["name"], c["function"]["arguments"]) for c in parsed["tool_calls"] or []]
        assert got == calls


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


def haystacks(parsed: dict) -> list[str]:
    out = [parsed["content"] or "", parsed["reasoning_content"] or ""]
    for c in parsed["tool_calls"] or []:
        out.append(c["function"]["arguments"])
        with contextlib.suppress(ValueError):  # the raw arguments of a json block need not be JSON
            pairs = json.loads(c["function"]["arguments"], object_pairs_hook=list)
            out += [v for _, v in pairs if isinstance(v, str)] if isinstance(pairs, list) else []
    return out


@settings(max_examples=150, deadline=None)
@given(data=st.data(), thinking=st.booleans(), chunk=st.integers(1, 5))
def test_fuzz_truncated_and_corrupted_outputs_keep_their_text(encoder, data, thinking, chunk):
    _, history, reply = data.draw(st.sampled_from(CASES))
    prompt = encoder.render(history, thinking=thinking).ids
    ids = encoder.render([*history, reply], thinking=thinking, add_generation_prompt=False).ids[len(prompt) :]
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
    parser = encoder.stream_parser(thinking=thinking)
    parsed = merge_deltas([parser.feed(ids[i : i + chunk]) for i in range(0, len(ids), chunk)] + [parser.finish()])
    found = haystacks(parsed)
    for run in body_runs(encoder, ids):
        assert any(run in h for h in found), (run, parsed)
