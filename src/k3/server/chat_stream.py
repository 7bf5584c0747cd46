"""One chat choice's output, token ids -> OpenAI deltas: K3's chat parser (reasoning, content, tool calls),
then the request's stop strings applied to the content (the model's structure never holds a stop string)."""

from collections.abc import Collection

from k3.chat import ChatDelta, ChatEncoder, merge_deltas
from k3.serve.sampling import StopChecker


class ChatChoice:
    """tool_names: the rendered prompt's RenderedChat.tool_names, the only names returned as tool calls."""

    def __init__(
        self, encoder: ChatEncoder, thinking: bool, stop: tuple[str, ...], tool_names: Collection[str] = frozenset()
    ):
        self.parser = encoder.stream_parser(thinking=thinking, tool_names=tool_names)
        self.stop = StopChecker(stop)
        self.deltas: list[ChatDelta] = []
        self.done = False
        self.stopped = False  # a stop string ended the content: the engine request is ended with "stop"
        self.has_tool_calls = False  # a complete call was returned (the parser returns no other)

    def feed(self, token_ids: list[int], final: bool) -> ChatDelta:
        """The delta these tokens add; final: the engine finished this choice (flush the parser)."""
        delta = self.parser.feed(list(token_ids))
        if final:
            delta += self.parser.finish()
        hit, delta.content = self.stop.update(delta.content, final=final)
        if hit:
            self.stopped = True
        self.done = final or hit
        self.has_tool_calls = self.has_tool_calls or bool(delta.tool_calls)
        self.deltas.append(delta)
        return delta

    def finish_reason(self, engine_reason: str | None) -> str | None:
        """tool_calls when the model ended its turn (stop) after a complete call; a cut-off call is dropped
        by the parser, so a reply cut by max_tokens mid-call stays `length`."""
        if self.stopped:
            return "stop"
        if engine_reason == "stop" and self.has_tool_calls:
            return "tool_calls"
        return engine_reason

    def message(self) -> dict:
        return merge_deltas(self.deltas)
