"""What one HTTP request may ask of the server. Each limit is a named default here and a `k3 serve` flag;
docs/serving.md lists them. They bound the work and memory a single client can claim, so one request
cannot crowd out the others."""

from dataclasses import dataclass

MAX_BODY_BYTES = 1 << 20  # a JSON request body; larger bodies get 413 before they are parsed
MAX_TOKENS_LIMIT = 4096  # max_tokens / max_completion_tokens one choice may ask for
MAX_N = 16  # choices (n) per prompt
MAX_PROMPTS = 64  # prompts in one /v1/completions request (a list of prompts)
MAX_STOP_STRINGS = 8  # OpenAI allows 4; vLLM more: 8 keeps the per-step stop search cheap
DEFAULT_MAX_TOKENS = 16  # /v1/completions without max_tokens (OpenAI's default)
DRAIN_TIMEOUT_S = 30.0  # on SIGTERM, running requests get this long to finish


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

    def __post_init__(self) -> None:
        for name in ("max_model_len", "max_body_bytes", "max_tokens", "max_n", "max_prompts", "max_stop_strings"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if not self.drain_timeout_s >= 0:
            raise ValueError(f"drain_timeout_s must be >= 0, got {self.drain_timeout_s!r}")
