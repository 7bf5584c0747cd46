"""K3's chat format: render OpenAI-style conversations to token ids, parse the model's output back.
The grammar and its sources are in docs/chat.md."""

from k3.chat.encode import ChatEncoder, RenderedChat
from k3.chat.errors import ChatFormatError
from k3.chat.options import REASONING_EFFORTS, THINKING_EFFORTS, resolve_thinking
from k3.chat.parse import ChatDelta, ChatStreamParser, merge_deltas, parse_text, text_stream_parser
from k3.chat.render import Segment, escape_attr, render_chat, render_segments, render_text, unescape_attr
from k3.chat.tokens import (
    CHAT_SPECIAL_TOKENS,
    CLOSE,
    END_OF_MSG,
    OPEN,
    SEP,
    ChatTokenIds,
    chat_token_ids,
    with_chat_tokens,
)

__all__ = [
    "CHAT_SPECIAL_TOKENS",
    "CLOSE",
    "END_OF_MSG",
    "OPEN",
    "REASONING_EFFORTS",
    "SEP",
    "THINKING_EFFORTS",
    "ChatDelta",
    "ChatEncoder",
    "ChatFormatError",
    "ChatStreamParser",
    "ChatTokenIds",
    "RenderedChat",
    "Segment",
    "chat_token_ids",
    "escape_attr",
    "merge_deltas",
    "parse_text",
    "render_chat",
    "render_segments",
    "render_text",
    "resolve_thinking",
    "text_stream_parser",
    "unescape_attr",
    "with_chat_tokens",
]
