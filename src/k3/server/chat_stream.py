"""One chat choice's output, token ids -> OpenAI deltas: K3's chat parser (reasoning, content, tool calls),
then the request's stop strings applied to the content (the model's structure never holds a stop string)."""

from k3.chat import ChatDelta, ChatEncoder, merge_deltas
from k3.serve.sampling import StopChecker


class ChatChoice:
    def __init__(self, encoder: ChatEncoder, thinking: bool, stop: tuple[str, ...]):
        self.parser = encoder.stream_parser(thinking=thinking)
        self.stop = StopChecker(stop)
        self.deltas: list[ChatDelta] = []
        self.done = False
        self.stopped = False  # a stop string ended the content: the engine request is cancelled
        self.has_tool_calls = False

    def feed(self, token_ids: list[int], final: bool) -> ChatDelta:
        """The delta these tokens add; final: the engine finished this choice (flush the parser)."""
        delta = self.parser.feed(list(token_ids))
        if final:
            tail = self.parser.finish()
            delta = ChatDelta(delta.reasoning_content + tail.reasoning_content, delta.content + tail.content,
                              delta.tool_calls + tail.tool_calls)  # fmt: skip
        hit, delta.content = self.stop.update(delta.content, final=final)
        if hit:
            self.stopped = True
        self.done = final or hit
        self.has_tool_calls = self.has_tool_calls or bool(delta.tool_calls)
        self.deltas.append(delta)
        return delta

    def finish_reason(self, engine_reason: str | None) -> str | None:
        if self.stopped:
            return "stop"
        if engine_reason == "stop" and self.has_tool_calls:
            return "tool_calls"
        return engine_reason

    def message(self) -> dict:
        return merge_deltas(self.deltas)
