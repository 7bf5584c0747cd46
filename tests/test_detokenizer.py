"""Streaming detokenisation: the pieces add up to the whole decode, an unfinished UTF-8 character is
never sent as U+FFFD, and each step decodes a window of a few tokens, not the whole output."""

import random

from k3.formats.tokenizer import byte_tokenizer, train_tokenizer
from k3.serve.detokenizer import IncrementalDetokenizer

TEXT = "naïve café — 世界, déjà vu 🙂 and plain ascii\n" * 3


class CountingTokenizer:
    """Wraps a tokenizer and records how many ids each decode call gets."""

    def __init__(self, tok):
        self.tok, self.sizes = tok, []

    def decode(self, ids, skip_special=False):
        self.sizes.append(len(ids))
        return self.tok.decode(ids, skip_special=skip_special)


def stream(tok, ids: list[int]) -> list[str]:
    detok, pieces = IncrementalDetokenizer(tok), []
    for n in range(1, len(ids) + 1):
        pieces.append(detok.step(ids[:n], final=n == len(ids)))
    return pieces


def test_bytes_split_across_tokens():
    tok = byte_tokenizer()  # one token per byte: every non-ASCII character spans 2–4 tokens
    ids = tok.encode(TEXT)
    pieces = stream(tok, ids)
    assert "".join(pieces) == TEXT
    assert not any("\ufffd" in p for p in pieces)
    assert pieces[ids.index(tok.encode("ï")[0])] == ""  # the first byte of ï alone: held back


def test_bpe_and_windows_stay_small():
    tok = train_tokenizer([TEXT * 20], vocab_size=400)
    rng = random.Random(0)
    text = "".join(rng.choice(TEXT) for _ in range(3000))
    ids = tok.encode(text)
    counting = CountingTokenizer(tok)
    assert "".join(stream(counting, ids)) == tok.decode(ids)
    assert max(counting.sizes) <= 8  # a window of the newest tokens, however long the output


def test_final_flushes_an_unfinished_character():
    tok = byte_tokenizer()
    ids = tok.encode("ok 世")[:-1]  # the last character cut after two of its three bytes
    pieces = stream(tok, ids)
    assert "".join(pieces) == tok.decode(ids) and pieces[-1].endswith("\ufffd")
