"""Segments -> token ids for one tokenizer, and the id-level parser for the same tokenizer.

Structural segments become their token ids directly; text segments are tokenized by a private copy of the
tokenizer with special-token matching switched off, so text spelling `<|open|>` (or `<|endoftext|>`)
stays bytes. The copy keeps the shared tokenizer's own setting untouched (it is used by other threads).

Every text that is tokenized passes through here, so here is where text the tokenizer cannot take is
refused: a lone UTF-16 surrogate (a JSON "\\ud800" without its pair, which Python's json accepts) makes
`tokenizers` raise a TypeError, which would surface as a server error instead of a 400."""

import re
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tokenizers import Tokenizer

from k3.chat.errors import ChatFormatError
from k3.chat.lexer import IdLexer
from k3.chat.parse import ChatStreamParser, merge_deltas
from k3.chat.render import Segment, render_chat
from k3.chat.tokens import _raw, chat_token_ids

if TYPE_CHECKING:
    from k3.formats.tokenizer import K3Tokenizer


_SURROGATE = re.compile("[\ud800-\udfff]")


def check_encodable(texts: list[str]) -> None:
    """ChatFormatError when a text holds a surrogate code point (never valid in Unicode text)."""
    for text in texts:
        m = _SURROGATE.search(text)
        if m is not None:
            raise ChatFormatError(
                f"the request's text holds U+{ord(m.group()):04X}, a lone UTF-16 surrogate, which is not a "
                f"character (after {text[max(0, m.start() - 20) : m.start()]!r}); send the text as UTF-8, or "
                "as JSON \\u escapes that pair a high surrogate with a low one"
            )


@dataclass(frozen=True)
class RenderedChat:
    """tool_names: what the reply may call (give it to the parser: stream_parser(tool_names=...))."""

    segments: list[Segment]
    ids: list[int]
    tool_names: frozenset[str] = field(default_factory=frozenset)

    @property
    def text(self) -> str:
        return "".join(s.text for s in self.segments)


class ChatEncoder:
    """K3's chat format bound to one tokenizer; raises ChatFormatError when the tokenizer lacks the tokens."""

    def __init__(self, tokenizer: "Tokenizer | K3Tokenizer"):
        self.tokenizer = _raw(tokenizer)
        self.token_ids = chat_token_ids(self.tokenizer)
        self._structural = {s: i for i, s in self.token_ids.by_id().items()}
        self._text = Tokenizer.from_str(self.tokenizer.to_str())
        self._text.encode_special_tokens = True

    def encode_text(self, text: str) -> list[int]:
        """Ordinary text -> ids; no special token can come out of it."""
        check_encodable([text])
        return self._text.encode(text, add_special_tokens=False).ids

    def encode_segments(self, segments: list[Segment]) -> list[int]:
        texts = [s.text for s in segments if not s.structural]
        check_encodable(texts)
        encoded = iter(self._text.encode_batch(texts, add_special_tokens=False)) if texts else iter(())
        ids: list[int] = []
        for s in segments:
            if s.structural:
                ids.append(self._structural[s.text])
            else:
                ids.extend(next(encoded).ids)
        return ids

    def render(self, messages: list[dict], tools: list[dict] | None = None, **options) -> RenderedChat:
        """render_chat (same options: thinking, add_generation_prompt, thinking_effort, tool_choice,
        response_format), the prompt's token ids and the tool names the reply may call."""
        segments, tool_names = render_chat(messages, tools, **options)
        return RenderedChat(segments, self.encode_segments(segments), tool_names)

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=False)

    def stream_parser(
        self, *, thinking: bool = True, id_prefix: str | None = None, tool_names: Collection[str] = frozenset()
    ) -> ChatStreamParser:
        """A parser fed the generated token ids; `thinking` must match the prompt's, `tool_names` is the
        rendered prompt's (RenderedChat.tool_names): calls to other names are not returned."""
        lexer = IdLexer(self.token_ids, self.decode)
        return ChatStreamParser(lexer, thinking=thinking, id_prefix=id_prefix, tool_names=tool_names)

    def parse(
        self,
        ids: list[int],
        *,
        thinking: bool = True,
        id_prefix: str | None = None,
        tool_names: Collection[str] = frozenset(),
    ) -> dict:
        """Non-streaming parse of generated ids: the merge of the streaming deltas."""
        parser = self.stream_parser(thinking=thinking, id_prefix=id_prefix, tool_names=tool_names)
        return merge_deltas([parser.feed(list(ids)), parser.finish()])
