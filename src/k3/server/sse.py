"""Server-sent events as OpenAI streams them: one `data: <json>` event per chunk, then `data: [DONE]`."""

import json

DONE = b"data: [DONE]\n\n"


def sse_event(payload: dict) -> bytes:
    """One event: compact JSON on a single line (JSON escapes newlines, so a payload cannot end the event)."""
    return b"data: " + json.dumps(payload, separators=(",", ":"), ensure_ascii=False).encode() + b"\n\n"
