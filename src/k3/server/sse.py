"""Server-sent events as OpenAI streams them: one `data: <json>` event per chunk, then `data: [DONE]`."""

import json

DONE = b"data: [DONE]\n\n"


def sse_event(payload: dict) -> bytes:
    """One event: compact JSON on a single line. ASCII only: JSON escapes CR and LF anyway, and escaping the
    rest keeps U+2028, U+0085, U+001E... out of the stream too, which clients that split lines like
    str.splitlines (httpx's line reader does) would otherwise take for line ends inside a payload."""
    return b"data: " + json.dumps(payload, separators=(",", ":"), ensure_ascii=True).encode() + b"\n\n"
