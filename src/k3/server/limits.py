"""What one HTTP request, and one connection, may ask of the server. Each limit is a named default here and a
`k3 serve` flag; docs/serving.md lists them. They bound the work, memory and time a single client can claim,
so one client cannot crowd out the others."""

from dataclasses import dataclass, fields

MAX_BODY_BYTES = 1 << 20  # a JSON request body; larger bodies get 413 before they are parsed
MAX_TOKENS_LIMIT = 4096  # max_tokens / max_completion_tokens one choice may ask for
MAX_N = 16  # choices (n) per prompt
MAX_PROMPTS = 64  # prompts in one /v1/completions request (a list of prompts)
MAX_STOP_STRINGS = 8  # OpenAI allows 4; vLLM more: 8 keeps the per-step stop search cheap
DEFAULT_MAX_TOKENS = 16  # /v1/completions without max_tokens (OpenAI's default)
DRAIN_TIMEOUT_S = 30.0  # on SIGTERM, running requests get this long to finish
# JSON nesting of a request body: tool schemas and response formats nest a few levels (OpenAI's strict mode
# allows 5); 64 leaves room for any real schema and keeps every recursive walk of them far from Python's limit
MAX_JSON_DEPTH = 64
# outputs of one choice queued for a reader that is not reading (a streaming client that stopped reading, with
# the socket buffers full): past this the request is aborted and its pages freed instead of computing on
MAX_STREAM_BACKLOG = 256
HEADER_TIMEOUT_S = 10.0  # a connection must send a request's headers within this (slowloris)
BODY_TIMEOUT_S = 30.0  # and its body within this once the headers are in (408 otherwise)
WRITE_TIMEOUT_S = 60.0  # a response write that waits longer than this on the client aborts the request
MAX_CONNECTIONS = 1024  # open connections at once; past it new ones get 503 (uvicorn's limit_concurrency)
KEEP_ALIVE_TIMEOUT_S = 5.0  # an idle kept-alive connection is closed after this (uvicorn's default)


@dataclass(frozen=True)
class ServerLimits:
    """max_model_len: prompt + output tokens of one request (the model's context, or less)."""

    max_model_len: int
    max_body_bytes: int = MAX_BODY_BYTES
    max_tokens: int = MAX_TOKENS_LIMIT
    max_n: int = MAX_N
    max_prompts: int = MAX_PROMPTS
    max_stop_strings: int = MAX_STOP_STRINGS
    drain_timeout_s: float = DRAIN_TIMEOUT_S
    max_json_depth: int = MAX_JSON_DEPTH
    max_stream_backlog: int = MAX_STREAM_BACKLOG
    header_timeout_s: float = HEADER_TIMEOUT_S
    body_timeout_s: float = BODY_TIMEOUT_S
    write_timeout_s: float = WRITE_TIMEOUT_S
    max_connections: int = MAX_CONNECTIONS
    keep_alive_timeout_s: float = KEEP_ALIVE_TIMEOUT_S

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.type is int and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ValueError(f"{f.name} must be an int >= 1, got {value!r}")
            low = 0 if f.name == "drain_timeout_s" else None  # a drain of 0 s: abort at once on SIGTERM
            number = f.type is float and isinstance(value, int | float) and not isinstance(value, bool)
            if f.type is float and not (number and (value >= low if low is not None else value > 0)):
                raise ValueError(f"{f.name} must be a number {'>= 0' if low is not None else '> 0'}, got {value!r}")
