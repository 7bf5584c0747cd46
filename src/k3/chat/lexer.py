"""Model output -> a stream of events: ("text", str) or a structural token ("open", "close", "sep", "end").

From token ids the split is exact: a structural token is its own id. Text ids are decoded in runs and
emitted only at whole characters (a byte-level token can end mid UTF-8 sequence). From decoded text the
markers are found by their spellings, holding back a tail that could be the start of one."""

from collections.abc import Callable

from k3.chat.tokens import CLOSE, END_OF_MSG, OPEN, SEP, ChatTokenIds

Event = tuple[str, str]
KIND = {OPEN: "open", CLOSE: "close", SEP: "sep", END_OF_MSG: "end"}
SPELLING = {kind: spelling for spelling, kind in KIND.items()}


class IdLexer:
    """Token ids in, events out. decode(ids) -> str must keep special tokens other than the chat ones."""

    def __init__(self, ids: ChatTokenIds, decode: Callable[[list[int]], str]):
        self.kinds = {i: KIND[s] for i, s in ids.by_id().items()}
        self.decode = decode
        self.pending: list[int] = []

    def _flush(self, whole_chars_only: bool) -> list[Event]:
        if not self.pending:
            return []
        text = self.decode(self.pending)
        if whole_chars_only and text.endswith("\ufffd"):
            return []  # the next token may complete the character
        self.pending = []
        return [("text", text)] if text else []

    def feed(self, token_ids: list[int]) -> list[Event]:
        events: list[Event] = []
        for i in token_ids:
            kind = self.kinds.get(int(i))
            if kind is None:
                self.pending.append(int(i))
                events += self._flush(whole_chars_only=True)
            else:
                events += self._flush(whole_chars_only=False)
                events.append((kind, SPELLING[kind]))
        return events

    def finish(self) -> list[Event]:
        return self._flush(whole_chars_only=False)


class TextLexer:
    """Decoded text in (special tokens rendered as their spellings), events out."""

    def __init__(self):
        self.buf = ""

    def _held(self) -> int:
        """Length of the longest tail of buf that is a proper prefix of a marker."""
        for n in range(min(len(self.buf), max(map(len, KIND)) - 1), 0, -1):
            tail = self.buf[-n:]
            if any(m.startswith(tail) for m in KIND):
                return n
        return 0

    def feed(self, text: str) -> list[Event]:
        self.buf += text
        events: list[Event] = []
        while True:
            hits = [(self.buf.find(m), m) for m in KIND if m in self.buf]
            if not hits:
                break
            at, marker = min(hits)
            if at:
                events.append(("text", self.buf[:at]))
            events.append((KIND[marker], marker))
            self.buf = self.buf[at + len(marker) :]
        keep = self._held()
        if len(self.buf) > keep:
            events.append(("text", self.buf[: len(self.buf) - keep]))
            self.buf = self.buf[len(self.buf) - keep :]
        return events

    def finish(self) -> list[Event]:
        text, self.buf = self.buf, ""
        return [("text", text)] if text else []
