"""K3's assistant output -> OpenAI deltas (`reasoning_content`, `content`, `tool_calls`), streaming.

The output continues the generation prompt, so it starts inside the `think` channel (thinking on) or the
`response` channel (off) and should look like (docs/chat.md)

    REASONING <|close|>think<|sep|> <|open|>response<|sep|> CONTENT <|close|>response<|sep|>
    [<|open|>tools<|sep|>
        (<|open|>call tool="NAME" index="i"<|sep|> ARGUMENTS <|close|>call<|sep|>)*
    <|close|>tools<|sep|>]
    <|close|>message<|sep|><|end_of_msg|>

The rules are vLLM's K3 parsers' where they decide (sources in docs/chat.md):
- reasoning is everything up to the first `<|close|>think<|sep|>`, markup included: inside `think` any
  other tag or stray `<|sep|>` is reasoning text, spelled out. A think never closed is all reasoning.
- after it, a tag not allowed where it appears (unknown name, bad header, a close matching nothing) is
  spelled out into `content`, text outside any channel is `content`, unknown attributes are ignored;
- a tool call is returned once its `<|close|>call<|sep|>` arrives, whole, as one delta entry; a call left
  open (cut by max_tokens, or ended by the tools channel's or the message's end) is not returned, and its
  text is kept in `ChatStreamParser.dropped` (for logs) instead;
- only calls to the names the request allows (`tool_names`) are returned: a call to another name is
  spelled out into `content`, and with no names the tools channel itself is;
- `arguments` is json.dumps of the object the `argument` elements make (a later duplicate key wins):
  string values as written, other values decoded as JSON when they are JSON within k3's bounds (finite,
  at most 64 levels deep; k3.chat.values), else kept as a string. A `json` block is returned as its text.
Nothing raises; apart from `dropped`, no text the model wrote is lost.
"""

import json
import re
import secrets
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

from k3.chat.lexer import SPELLING, Event, IdLexer, TextLexer
from k3.chat.render import unescape_attr
from k3.chat.values import parse_json_value

_ATTR = re.compile(r'\s+([A-Za-z_][\w.:-]*)="([^"]*)"')
_TAG = re.compile(r"[A-Za-z_][\w-]*")
# a close tag -> the states it closes (think only closes think: inside it every other close is reasoning)
_CLOSES = {
    "think": ("think",),
    "response": ("response",),
    "argument": ("argument",),
    "json": ("json",),
    "call": ("call", "argument", "json"),
    "tools": ("tools", "call", "argument", "json"),
    "message": ("response", "between", "tools", "call", "argument", "json"),
}


@dataclass
class ChatDelta:
    """One step's output; tool_calls holds OpenAI delta entries ({"index", "id", "type", "function"}), each
    a whole call (vLLM's shape), so no two entries of a reply share an index."""

    reasoning_content: str = ""
    content: str = ""
    tool_calls: list[dict] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.reasoning_content or self.content or self.tool_calls)

    def __add__(self, other: "ChatDelta") -> "ChatDelta":
        """The delta of this step followed by other's."""
        return ChatDelta(
            self.reasoning_content + other.reasoning_content,
            self.content + other.content,
            self.tool_calls + other.tool_calls,
        )

    def to_openai(self) -> dict:
        """The `delta` object of a chat.completion.chunk (empty fields left out). The reasoning goes under
        both names clients read: `reasoning_content` (SGLang, llama.cpp, DeepSeek) and `reasoning` (vLLM)."""
        out: dict[str, Any] = {}
        if self.reasoning_content:
            out["reasoning_content"] = out["reasoning"] = self.reasoning_content
        if self.content:
            out["content"] = self.content
        if self.tool_calls:
            out["tool_calls"] = self.tool_calls
        return out


def _header(text: str) -> tuple[str, dict[str, str]] | None:
    """`tag key="v" ...` -> (tag, attrs); None when it is not of that shape."""
    m = _TAG.match(text)
    if m is None:
        return None
    attrs, at = {}, m.end()
    for a in _ATTR.finditer(text, at):
        if a.start() != at:
            return None
        attrs.setdefault(a.group(1), unescape_attr(a.group(2)))
        at = a.end()
    return (m.group(), attrs) if text[at:].strip() == "" else None


@dataclass
class _Call:
    """A call being read. `written`: its markup and text as the model wrote them (what `dropped` keeps)."""

    name: str
    written: str
    arguments: dict[str, Any] = field(default_factory=dict)
    raw: str | None = None  # a json block's text


class ChatStreamParser:
    """Feed model output (token ids, or decoded text for parse_text/text_stream_parser), get ChatDeltas.

    States: think, response (the channels), between (inside the message, no channel open), tools, call,
    argument, json (raw arguments block), after (the message has ended)."""

    def __init__(
        self,
        lexer: IdLexer | TextLexer,
        *,
        thinking: bool = True,
        id_prefix: str | None = None,
        tool_names: Collection[str] = frozenset(),
    ):
        self.lexer = lexer
        self.tool_names = frozenset(tool_names)
        self.state = "think" if thinking else "response"
        self.fresh = True  # nothing written in the current channel yet: its opener echoed is ignored
        self.id_prefix = id_prefix if id_prefix is not None else f"call_{secrets.token_hex(6)}_"
        self.tag: tuple[str, str] | None = None  # ("open" | "close", header text so far) between marker and sep
        self.calls = 0  # calls returned so far
        self.call: _Call | None = None
        self.arg_key, self.arg_type = "", "string"
        self.buffer = ""  # the open argument's or json block's text
        self.dropped = ""  # the text of calls left open, which are not returned
        self.out = ChatDelta()

    def feed(self, chunk: list[int] | str) -> ChatDelta:
        for event in self.lexer.feed(chunk):
            self._event(event)
        return self._take()

    def finish(self) -> ChatDelta:
        """End of output: flush held text, spell out a half-read tag, drop a call left open."""
        for event in self.lexer.finish():
            self._event(event)
        self._spell_pending_tag()
        self._end_message()
        return self._take()

    def _take(self) -> ChatDelta:
        out, self.out = self.out, ChatDelta()
        return out

    def _loose(self, text: str) -> None:
        """Text that belongs to no element: reasoning while think is open, else content."""
        if self.call is not None:
            self.call.written += text
        if self.state == "think":
            self.out.reasoning_content += text
        else:
            self.out.content += text
        self.fresh = self.fresh and not text

    def _event(self, event: Event) -> None:
        kind, text = event
        if self.tag is not None:
            if kind == "text":
                self.tag = (self.tag[0], self.tag[1] + text)
                return
            if kind == "sep":
                which, header = self.tag
                self.tag = None
                (self._open if which == "open" else self._close)(header)
                return
            self._spell_pending_tag()
        if kind == "text":
            self._text(text)
        elif kind in ("open", "close"):
            self.tag = (kind, "")
        elif kind == "sep":
            self._loose(text)
        else:
            self._end_message()

    def _spell_pending_tag(self) -> None:
        if self.tag is not None:
            which, header = self.tag
            self.tag = None
            self._loose(SPELLING[which] + header)

    def _text(self, text: str) -> None:
        if self.state in ("argument", "json"):
            self.call.written += text
            self.buffer += text
        else:
            self._loose(text)

    def _spell(self, which: str, header: str) -> None:
        self._loose(SPELLING[which] + header + SPELLING["sep"])

    def _enter(self, state: str) -> None:
        self.state, self.fresh = state, True

    def _open(self, header: str) -> None:
        parsed = _header(header)
        tag, attrs = parsed if parsed is not None else ("", {})
        state, call, spelled = self.state, self.call, SPELLING["open"] + header + SPELLING["sep"]
        if tag == state and state in ("think", "response") and not attrs and self.fresh:
            pass  # the prompt's opener echoed
        elif tag in ("think", "response") and state in ("response", "between") and tag != state and not attrs:
            self._enter(tag)
        elif tag == "tools" and state in ("response", "between") and not attrs and self.tool_names:
            self._enter("tools")
        elif tag == "call" and state == "tools" and attrs.get("tool") in self.tool_names:
            self.call = _Call(attrs["tool"], spelled)
            self.state = "call"
        elif tag == "argument" and state == "call" and call.raw is None and "key" in attrs:
            call.written += spelled
            self.arg_key, self.arg_type, self.buffer = attrs["key"], attrs.get("type", "string"), ""
            self.state = "argument"
        elif tag == "json" and state == "call" and call.raw is None and not call.arguments:
            call.written += spelled
            self.buffer = ""
            self.state = "json"
        else:
            self._spell("open", header)

    def _close(self, header: str) -> None:
        tag = header.strip()
        if self.state not in _CLOSES.get(tag, ()):
            self._spell("close", header)
        elif tag in ("argument", "json"):
            self.call.written += SPELLING["close"] + header + SPELLING["sep"]
            self._end_value()
        elif tag == "call":
            self._end_value()
            self._return_call()
        elif tag == "message":
            self._end_message()
        else:  # think, response or tools: back between channels (a call still open in tools is dropped)
            self._drop_call()
            self._enter("between")

    def _end_value(self) -> None:
        """Closes the open argument or json block, if any, into the call, which stays open."""
        if self.state == "argument":
            ok, value = (True, self.buffer) if self.arg_type == "string" else parse_json_value(self.buffer)
            self.call.arguments[self.arg_key] = value if ok else self.buffer
        elif self.state == "json":
            self.call.raw = self.buffer
        else:
            return
        self.buffer = ""
        self.state = "call"

    def _return_call(self) -> None:
        call, self.call = self.call, None
        arguments = call.raw if call.raw is not None else json.dumps(call.arguments, ensure_ascii=False)
        self.out.tool_calls.append(
            {
                "index": self.calls,
                "id": f"{self.id_prefix}{self.calls}",
                "type": "function",
                "function": {"name": call.name, "arguments": arguments},
            }
        )
        self.calls += 1
        self.state = "tools"

    def _drop_call(self) -> None:
        if self.call is not None:
            self.dropped += self.call.written
            self.call, self.buffer = None, ""

    def _end_message(self) -> None:
        """`<|close|>message<|sep|>`, `<|end_of_msg|>` or the end of output: whatever is open ends."""
        self._drop_call()
        self._enter("after")


def merge_deltas(deltas: list[ChatDelta]) -> dict:
    """The assistant message a sequence of deltas adds up to (OpenAI shape; empty fields are None). The
    reasoning is under both `reasoning_content` and `reasoning`, as in ChatDelta.to_openai."""
    reasoning = "".join(d.reasoning_content for d in deltas)
    content = "".join(d.content for d in deltas)
    calls: dict[int, dict] = {}
    for d in deltas:
        for c in d.tool_calls:
            empty = {"id": None, "type": "function", "function": {"name": None, "arguments": ""}}
            call = calls.setdefault(c["index"], empty)
            call["id"] = c.get("id", call["id"])
            call["function"]["name"] = c["function"].get("name", call["function"]["name"])
            call["function"]["arguments"] += c["function"].get("arguments", "")
    return {
        "role": "assistant",
        "content": content or None,
        "reasoning_content": reasoning or None,
        "reasoning": reasoning or None,
        "tool_calls": [calls[i] for i in sorted(calls)] or None,
    }


def text_stream_parser(
    *, thinking: bool = True, id_prefix: str | None = None, tool_names: Collection[str] = frozenset()
) -> ChatStreamParser:
    """A parser fed decoded text in which the chat tokens appear spelled out."""
    return ChatStreamParser(TextLexer(), thinking=thinking, id_prefix=id_prefix, tool_names=tool_names)


def parse_text(
    text: str, *, thinking: bool = True, id_prefix: str | None = None, tool_names: Collection[str] = frozenset()
) -> dict:
    """Non-streaming parse of decoded text: the merge of the streaming deltas."""
    parser = text_stream_parser(thinking=thinking, id_prefix=id_prefix, tool_names=tool_names)
    return merge_deltas([parser.feed(text), parser.finish()])
