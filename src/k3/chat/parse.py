"""K3's assistant output -> OpenAI deltas (`reasoning_content`, `content`, `tool_calls`), streaming.

The output continues the generation prompt, so it starts inside the `think` channel (thinking on) or the
`response` channel (off) and should look like (docs/chat.md)

    REASONING <|close|>think<|sep|> <|open|>response<|sep|> CONTENT <|close|>response<|sep|>
    [<|open|>tools<|sep|>
        (<|open|>call tool="NAME" index="i"<|sep|> ARGUMENTS <|close|>call<|sep|>)*
    <|close|>tools<|sep|>]
    <|close|>message<|sep|><|end_of_msg|>

Nothing the model writes is dropped and nothing raises: a tag this grammar does not allow where it
appears (unknown name, bad header, a close that matches nothing) is returned in `content` spelled out,
text outside any channel is `content`, channels left open are closed at the end, and unknown attributes
are ignored. Tool-call `arguments` are a JSON object built as the typed `argument` segments arrive:
string values stream JSON-escaped, other values are kept verbatim when they are JSON (else as a string).
"""

import json
import re
import secrets
from dataclasses import dataclass, field
from typing import Any

from k3.chat.lexer import SPELLING, Event, IdLexer, TextLexer
from k3.chat.render import unescape_attr

_ATTR = re.compile(r'\s+([A-Za-z_][\w.:-]*)="([^"]*)"')
_TAG = re.compile(r"[A-Za-z_][\w-]*")


@dataclass
class ChatDelta:
    """One step's output; tool_calls holds OpenAI delta entries ({"index", "id", "type", "function"})."""

    reasoning_content: str = ""
    content: str = ""
    tool_calls: list[dict] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.reasoning_content or self.content or self.tool_calls)

    def to_openai(self) -> dict:
        """The `delta` object of a chat.completion.chunk (empty fields left out)."""
        out: dict[str, Any] = {}
        if self.reasoning_content:
            out["reasoning_content"] = self.reasoning_content
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


def _json_or_none(raw: str) -> str | None:
    """raw when it is one JSON value (no NaN/Infinity, which other parsers refuse), else None."""

    def refuse(token: str):
        raise ValueError(token)

    try:
        json.loads(raw, parse_constant=refuse)
    except (ValueError, RecursionError):
        return None
    return raw


class ChatStreamParser:
    """Feed model output (token ids, or decoded text for parse_text/text_stream_parser), get ChatDeltas.

    States: think, response (the channels), between (inside the message, no channel open), tools, call,
    argument, json (raw arguments block), after (the message has ended)."""

    def __init__(self, lexer: IdLexer | TextLexer, *, thinking: bool = True, id_prefix: str | None = None):
        self.lexer = lexer
        self.state = "think" if thinking else "response"
        self.id_prefix = id_prefix if id_prefix is not None else f"call_{secrets.token_hex(6)}_"
        self.tag: tuple[str, str] | None = None  # ("open" | "close", header text so far) between marker and sep
        self.calls = 0
        self.call_args = 0  # arguments written in the open call; -1 once it holds a json block
        self.arg_type = "string"
        self.buffer = ""  # a non-string argument's or a json block's text, judged when it closes
        self.out = ChatDelta()

    def feed(self, chunk: list[int] | str) -> ChatDelta:
        for event in self.lexer.feed(chunk):
            self._event(event)
        return self._take()

    def finish(self) -> ChatDelta:
        """End of output: flush held text, spell out a half-read tag, close whatever is open."""
        for event in self.lexer.finish():
            self._event(event)
        self._spell_pending_tag()
        self._close_to("after")
        return self._take()

    def _take(self) -> ChatDelta:
        out, self.out = self.out, ChatDelta()
        return out

    def _content(self, text: str) -> None:
        self.out.content += text

    def _arguments(self, piece: str) -> None:
        calls = self.out.tool_calls
        if calls and calls[-1]["index"] == self.calls - 1:
            calls[-1]["function"]["arguments"] += piece
        else:
            calls.append({"index": self.calls - 1, "function": {"arguments": piece}})

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
            self._content(text)
        else:
            self._close_to("after")

    def _spell_pending_tag(self) -> None:
        if self.tag is not None:
            which, header = self.tag
            self.tag = None
            self._content(SPELLING[which] + header)

    def _text(self, text: str) -> None:
        if self.state == "think":
            self.out.reasoning_content += text
        elif self.state == "response":
            self._content(text)
        elif self.state == "argument" and self.arg_type == "string":
            self._arguments(json.dumps(text, ensure_ascii=False)[1:-1])
        elif self.state in ("argument", "json"):
            self.buffer += text
        else:
            self._content(text)

    def _spell(self, which: str, header: str) -> None:
        self._content(SPELLING[which] + header + SPELLING["sep"])

    def _open(self, header: str) -> None:
        parsed = _header(header)
        tag, attrs = parsed if parsed is not None else ("", {})
        state = self.state
        if tag in ("think", "response") and state in ("think", "response", "between") and not attrs:
            # the same channel again is the prompt's opener echoed: nothing to do
            if tag != state:
                self._close_to("between")
                self.state = tag
        elif tag == "tools" and state in ("think", "response", "between") and not attrs:
            self._close_to("between")
            self.state = "tools"
        elif tag == "call" and state == "tools" and attrs.get("tool"):
            self.calls += 1
            self.call_args = 0
            self.out.tool_calls.append(
                {
                    "index": self.calls - 1,
                    "id": f"{self.id_prefix}{self.calls - 1}",
                    "type": "function",
                    "function": {"name": attrs["tool"], "arguments": ""},
                }
            )
            self.state = "call"
        elif tag == "argument" and state == "call" and self.call_args >= 0 and "key" in attrs:
            self.arg_type = attrs.get("type", "string")
            piece = ("{" if self.call_args == 0 else ", ") + json.dumps(attrs["key"], ensure_ascii=False) + ": "
            self._arguments(piece + ('"' if self.arg_type == "string" else ""))
            self.call_args += 1
            self.buffer = ""
            self.state = "argument"
        elif tag == "json" and state == "call" and self.call_args == 0:
            self.call_args = -1
            self.buffer = ""
            self.state = "json"
        else:
            self._spell("open", header)

    def _close(self, header: str) -> None:
        tag = header.strip()
        state = self.state
        closes = {
            "think": ("think",),
            "response": ("response",),
            "argument": ("argument",),
            "json": ("json",),
            "call": ("call", "argument", "json"),
            "tools": ("tools", "call", "argument", "json"),
            "message": ("think", "response", "between", "tools", "call", "argument", "json"),
        }
        if state not in closes.get(tag, ()):
            self._spell("close", header)
        elif tag in ("argument", "json"):
            self._end_value()
        elif tag == "call":
            self._close_to("tools")
        else:
            self._close_to("between" if tag != "message" else "after")

    def _end_value(self) -> None:
        """Closes the open argument or json block; the call stays open."""
        if self.state == "argument":
            if self.arg_type == "string":
                self._arguments('"')
            else:
                self._arguments(_json_or_none(self.buffer) or json.dumps(self.buffer, ensure_ascii=False))
        elif self.state == "json":
            self._arguments(self.buffer)
        self.buffer = ""
        self.state = "call"

    def _close_to(self, target: str) -> None:
        """Close open elements from the innermost out until `target` (tools, between or after) is reached."""
        if self.state in ("argument", "json"):
            self._end_value()
        if self.state == "call":
            self._arguments("{}" if self.call_args == 0 else "}" if self.call_args > 0 else "")
            self.state = "tools"
        if target == "tools":
            return
        if self.state != "after":
            self.state = target


def merge_deltas(deltas: list[ChatDelta]) -> dict:
    """The assistant message a sequence of deltas adds up to (OpenAI shape; empty fields are None)."""
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
        "tool_calls": [calls[i] for i in sorted(calls)] or None,
    }


def text_stream_parser(*, thinking: bool = True, id_prefix: str | None = None) -> ChatStreamParser:
    """A parser fed decoded text in which the chat tokens appear spelled out."""
    return ChatStreamParser(TextLexer(), thinking=thinking, id_prefix=id_prefix)


def parse_text(text: str, *, thinking: bool = True, id_prefix: str | None = None) -> dict:
    """Non-streaming parse of decoded text: the merge of the streaming deltas."""
    parser = text_stream_parser(thinking=thinking, id_prefix=id_prefix)
    return merge_deltas([parser.feed(text), parser.finish()])
