"""Streaming detokenisation in O(new tokens) per step, however long the output grows.

Decoding a request's whole output every step costs O(n) per step and O(n²) per request. Instead each
step decodes only a window: the tokens from `prefix` (where the text last ended on a whole
character) to the end, and the same window without the newest tokens; the new text is the
difference. A byte-level BPE token can end inside a multi-byte UTF-8 character, which decodes as
U+FFFD until its last byte arrives: such text is held back, and the window then starts no later than
the last point that decoded cleanly.
"""

from collections.abc import Sequence


class IncrementalDetokenizer:
    """step(token_ids) with the whole output so far -> the text it added since the last call."""

    def __init__(self, tokenizer, skip_special: bool = True):
        self.tokenizer, self.skip_special = tokenizer, skip_special
        self.prefix = 0  # the window starts here: every token before it has been turned into text
        self.read = 0  # tokens up to here are in the text already returned

    def step(self, token_ids: Sequence[int], final: bool = False) -> str:
        """New text since the last call; an unfinished character is held back unless final."""
        known = self._decode(token_ids[self.prefix : self.read])
        text = self._decode(token_ids[self.prefix :])
        if len(text) <= len(known) or (text.endswith("\ufffd") and not final):
            return ""
        self.prefix, self.read = self.read, len(token_ids)
        return text[len(known) :]

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special=self.skip_special) if ids else ""
