"""k3.server.chat_stream.ChatChoice, one chat choice's output as the server streams and returns it: which
calls are returned (the rendered prompt's tool names), finish_reason `tool_calls` only after a complete
call, the reasoning under both field names, and streamed deltas adding up to the returned message."""

import pytest

from k3.chat import CHAT_SPECIAL_TOKENS, ChatEncoder, with_chat_tokens
from k3.formats.tokenizer import byte_tokenizer
from k3.server.chat_stream import ChatChoice

O, C, S, E = CHAT_SPECIAL_TOKENS
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
CALL = (
    f'{O}call tool="get_weather" index="1"{S}{O}argument key="city" type="string"{S}Paris{C}argument{S}'
    f'{O}argument key="days" type="number"{S}2{C}argument{S}{C}call{S}'
)
REPLY = f"why{C}think{S}{O}response{S}Let me check.{C}response{S}{O}tools{S}{CALL}{C}tools{S}{C}message{S}{E}"


@pytest.fixture(scope="module")
def encoder() -> ChatEncoder:
    return ChatEncoder(with_chat_tokens(byte_tokenizer()))


def ids_of(encoder: ChatEncoder, text: str) -> list[int]:
    """The chat tokens' spellings as their ids, the rest as text (what the model writes)."""
    spelled = {s: i for i, s in encoder.token_ids.by_id().items()}
    ids, rest = [], text
    while rest:
        at, marker = min(((rest.find(m), m) for m in spelled if m in rest), default=(len(rest), None))
        ids += encoder.encode_text(rest[:at])
        if marker is None:
            break
        ids.append(spelled[marker])
        rest = rest[at + len(marker) :]
    return ids


def run(encoder, text: str, engine_reason: str, tool_names, stop=(), step: int = 1) -> tuple[ChatChoice, list[dict]]:
    """Feeds the reply's ids `step` at a time, as the server does; the last feed is final."""
    choice = ChatChoice(encoder, True, stop, tool_names)
    ids = ids_of(encoder, text)
    chunks = [ids[i : i + step] for i in range(0, len(ids), step)] or [[]]
    deltas = []
    for n, chunk in enumerate(chunks):
        deltas.append(choice.feed(chunk, final=n == len(chunks) - 1).to_openai())
        if choice.done:
            break
    return choice, deltas


def test_a_complete_call_is_returned_with_finish_reason_tool_calls(encoder):
    names = encoder.render([{"role": "user", "content": "weather?"}], TOOLS).tool_names
    choice, deltas = run(encoder, REPLY, "stop", names)
    assert choice.finish_reason("stop") == "tool_calls"
    message = choice.message()
    assert message["content"] == "Let me check."
    assert message["reasoning_content"] == message["reasoning"] == "why"
    (call,) = message["tool_calls"]
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris", "days": 2}'}
    entries = [c for d in deltas for c in d.get("tool_calls", [])]
    assert entries == [{"index": 0, **call}]  # one entry, sent whole
    assert "".join(d.get("reasoning", "") for d in deltas) == "".join(d.get("reasoning_content", "") for d in deltas)


@pytest.mark.parametrize("cut", [REPLY.index(f"{C}call{S}"), REPLY.index("Paris") + 2, REPLY.index(f"{O}tools")])
def test_a_reply_cut_before_the_call_closes_returns_no_call_and_stays_length(encoder, cut):
    choice, deltas = run(encoder, REPLY[:cut], "length", {"get_weather"}, step=3)
    assert choice.finish_reason("length") == "length"
    assert choice.message()["tool_calls"] is None and not any("tool_calls" in d for d in deltas)
    assert choice.message()["content"] == "Let me check."


def test_a_call_ended_without_its_close_is_not_tool_calls_even_when_the_model_stops(encoder):
    text = REPLY.replace(f"{C}call{S}", "")
    choice, _ = run(encoder, text, "stop", {"get_weather"})
    assert choice.message()["tool_calls"] is None and choice.finish_reason("stop") == "stop"


def test_without_allowed_names_no_call_is_returned(encoder):
    """tool_choice none, or no tools declared: the call's markup stays content, spelled out."""
    for names in (frozenset(), {"other"}):
        choice, _ = run(encoder, REPLY, "stop", names)
        assert choice.message()["tool_calls"] is None and choice.finish_reason("stop") == "stop"
        assert CALL in choice.message()["content"]
    default = ChatChoice(encoder, True, ())
    default.feed(ids_of(encoder, REPLY), final=True)
    assert default.message()["tool_calls"] is None


def test_a_stop_string_in_the_content_ends_the_choice_with_stop(encoder):
    choice, _ = run(encoder, REPLY, "stop", {"get_weather"}, stop=(" check",))
    assert choice.stopped and choice.finish_reason("stop") == "stop"
    assert choice.message()["content"] == "Let me"
