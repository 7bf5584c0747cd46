"""The engine's log-probabilities (k3.serve.sampling.TokenLogprob, raw model distribution) in OpenAI's two
formats: the legacy completions' `{tokens, token_logprobs, top_logprobs, text_offset}` and the chat's
`{content: [{token, logprob, bytes, top_logprobs}]}`. Each choice has one accumulator: entries are added
as outputs arrive and taken when a chunk (or the whole response) is sent, so a token whose text is held
back (an unfinished character, a possible stop string) still has its entry sent with the next chunk.

A token's text is its bytes decoded as UTF-8; a byte-level token that is only part of a character is
written `bytes:\\xNN...` (OpenAI's spelling), and its exact bytes are in the chat format's `bytes`."""

from k3.serve.sampling import TokenLogprob

LOGPROB_FLOOR = -9999.0  # JSON has no -inf: a token of probability 0 (or a NaN) is reported as this, as vLLM does


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet, character -> byte: printable bytes stand for themselves, the others
    (controls, space, some Latin-1) are shifted to the characters from U+0100 on, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    shifted = [b for b in range(256) if b not in printable]
    return {chr(b): b for b in printable} | {chr(256 + n): b for n, b in enumerate(shifted)}


_ALPHABET = _byte_level_alphabet()


class TokenText:
    """token id -> its bytes and its text as OpenAI reports it, memoised (a vocabulary is at most ~10^5 ids)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        tok = getattr(tokenizer, "tok", None)  # k3's K3Tokenizer wraps a `tokenizers.Tokenizer`
        self._tok = tok
        self._added = {i: t.content for i, t in tok.get_added_tokens_decoder().items()} if tok is not None else {}
        self._bytes: dict[int, bytes] = {}

    def bytes(self, token_id: int) -> bytes:
        b = self._bytes.get(token_id)
        if b is None:
            b = self._bytes[token_id] = self._token_bytes(token_id)
        return b

    def _token_bytes(self, token_id: int) -> bytes:
        if token_id in self._added:  # special tokens are stored as their text, not in the byte alphabet
            return self._added[token_id].encode()
        piece = self._tok.id_to_token(token_id) if self._tok is not None else None
        if piece is not None and all(c in _ALPHABET for c in piece):
            return bytes(_ALPHABET[c] for c in piece)
        # another kind of tokenizer: what decoding the token alone gives
        return self.tokenizer.decode([token_id]).encode()

    def text(self, token_id: int) -> str:
        b = self.bytes(token_id)
        try:
            return b.decode()
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{x:02x}" for x in b)


def _value(logprob: float) -> float:
    return logprob if logprob > LOGPROB_FLOOR else LOGPROB_FLOOR  # NaN compares false: floored too


class CompletionLogprobs:
    """One /v1/completions choice's `logprobs`. text_offset: where each token's text starts in the choice's
    text, in characters (a token whose text is held back starts where the text resumes)."""

    def __init__(self, text: TokenText):
        self.text = text
        self.offset = 0
        self.pending: list[tuple[TokenLogprob, int]] = []

    def add(self, entries: list[TokenLogprob] | None, new_text: str) -> None:
        self.pending += [(e, self.offset) for e in entries or ()]
        self.offset += len(new_text)

    def take(self) -> dict:
        pending, self.pending = self.pending, []
        t = self.text
        return {
            "tokens": [t.text(e.token_id) for e, _ in pending],
            "token_logprobs": [_value(e.logprob) for e, _ in pending],
            "top_logprobs": [{t.text(i): _value(v) for i, v in e.top} for e, _ in pending],
            "text_offset": [offset for _, offset in pending],
        }


class ChatLogprobs:
    """One /v1/chat/completions choice's `logprobs`: every generated token, the chat format's structural
    tokens and the reasoning included (the model sampled them all)."""

    def __init__(self, text: TokenText):
        self.text = text
        self.pending: list[TokenLogprob] = []

    def add(self, entries: list[TokenLogprob] | None) -> None:
        self.pending += entries or ()

    def _token(self, token_id: int, logprob: float) -> dict:
        return {"token": self.text.text(token_id), "logprob": _value(logprob), "bytes": list(self.text.bytes(token_id))}

    def take(self) -> dict:
        pending, self.pending = self.pending, []
        content = [
            self._token(e.token_id, e.logprob) | {"top_logprobs": [self._token(i, v) for i, v in e.top]}
            for e in pending
        ]
        return {"content": content, "refusal": None}
