"""What each token id stands for, as grammar symbols: its bytes, or one special token.

A byte-level BPE tokenizer (k3's: the `tokenizers` library's BPE with the ByteLevel pre-tokenizer and
decoder, as GPT-2's) spells every byte as one printable character of its alphabet; undoing that mapping
gives each token's bytes exactly, whatever they are (a token may end inside a UTF-8 character). Added
tokens (the special ones, "<|open|>", "<|endoftext|>", …) are special symbols named by their spelling:
the tokenizer never produces them from text, so no byte string can stand for them either.
"""

import gc
import json
from collections import OrderedDict

from tokenizers import Tokenizer

from k3.structured.grammar import Symbol
from k3.structured.trie import TokenTrie

_CACHED_VOCABULARIES = 4  # tokenizers whose vocabulary is kept (an engine has one)


class UnsupportedTokenizer(ValueError):
    """The tokenizer is not a byte-level BPE, or its ids do not fit the model's vocabulary."""


def byte_level_alphabet() -> dict[str, int]:
    """The ByteLevel character of each byte, inverted (character -> byte): GPT-2's bytes_to_unicode, in which
    the printable Latin-1 characters stand for their own byte and the 68 others are U+0100, U+0101, … in
    byte order."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    out = {chr(b): b for b in printable}
    others = [b for b in range(256) if chr(b) not in out]
    out.update({chr(0x100 + n): b for n, b in enumerate(others)})
    return out


def _raw(tokenizer: object) -> Tokenizer:
    """A tokenizers.Tokenizer, or the one inside a wrapper that keeps it as `.tok` (k3's K3Tokenizer)."""
    raw = tokenizer if isinstance(tokenizer, Tokenizer) else getattr(tokenizer, "tok", None)
    if not isinstance(raw, Tokenizer):
        raise UnsupportedTokenizer(
            f"structured outputs need a tokenizers.Tokenizer (or a wrapper with one as .tok), got "
            f"{type(tokenizer).__name__}"
        )
    return raw


def _has_byte_level(component: dict | None) -> bool:
    if not component:
        return False
    if component.get("type") == "ByteLevel":
        return True
    parts = component.get("decoders") or component.get("pretokenizers") or []
    return any(_has_byte_level(p) for p in parts)


class Vocabulary:
    """Token ids -> symbols for one tokenizer and a logits width `size` (a model may have more rows than
    the tokenizer has ids; those ids stand for nothing and are never allowed).

    token_bytes[i]: the bytes of token i, None for special and unused ids (a tuple). specials: {id: spelling} of the
    added tokens; special_ids: {spelling: ids}. trie: the byte strings as a TokenTrie, built on first use.
    """

    def __init__(self, token_bytes: list[bytes | None], specials: dict[int, str], size: int) -> None:
        if len(token_bytes) > size or any(i >= size for i in specials):
            raise UnsupportedTokenizer(f"the tokenizer has ids beyond the model's vocabulary of {size}")
        self.size = size
        self.token_bytes = tuple(token_bytes) + (None,) * (size - len(token_bytes))
        self.specials = dict(specials)
        self.special_ids: dict[str, list[int]] = {}
        for i, spelling in sorted(specials.items()):
            self.special_ids.setdefault(spelling, []).append(i)
        self._trie: TokenTrie | None = None

    @classmethod
    def from_tokenizer(cls, tokenizer: object, size: int | None = None) -> "Vocabulary":
        """Read a byte-level BPE tokenizer; size: the logits width (default: the tokenizer's ids)."""
        raw = _raw(tokenizer)
        spec = json.loads(raw.to_str())
        model = spec.get("model") or {}
        if model.get("type") != "BPE" or not _has_byte_level(spec.get("decoder")):
            raise UnsupportedTokenizer(
                f"structured outputs read byte-level BPE tokenizers (a BPE model and a ByteLevel decoder); this one "
                f"has a {model.get('type')} model and decoder {(spec.get('decoder') or {}).get('type')}"
            )
        alphabet = byte_level_alphabet()
        specials = {i: t.content for i, t in raw.get_added_tokens_decoder().items()}
        vocab = raw.get_vocab(with_added_tokens=False)
        n = max([*vocab.values(), *specials, -1]) + 1
        token_bytes: list[bytes | None] = [None] * n
        for text, i in vocab.items():
            if i in specials:
                continue
            try:
                token_bytes[i] = bytes(alphabet[c] for c in text)
            except KeyError as e:
                raise UnsupportedTokenizer(f"token {i} {text!r} has a character outside the ByteLevel alphabet") from e
        return cls(token_bytes, specials, n if size is None else size)

    @classmethod
    def of(cls, tokenizer: object, size: int | None = None) -> "Vocabulary":
        """from_tokenizer, once per tokenizer object and size: reading a 160K vocabulary and building its
        trie take seconds. The tokenizer is kept alongside, so its id() cannot be reused while cached."""
        raw = _raw(tokenizer)
        key = (id(raw), size)
        hit = _CACHE.get(key)
        if hit is not None and hit[0] is raw:
            _CACHE.move_to_end(key)
            return hit[1]
        vocab = cls.from_tokenizer(raw, size)
        _CACHE[key] = (raw, vocab)
        while len(_CACHE) > _CACHED_VOCABULARIES:
            _CACHE.popitem(last=False)
        return vocab

    @property
    def trie(self) -> TokenTrie:
        if self._trie is None:
            self._trie = TokenTrie(self.token_bytes)
            # its million objects are young: collected now, the garbage collector's one long pass over them
            # (70 ms at 164K tokens, untracking the tuples of ints) falls here, not inside a later engine step
            gc.collect()
        return self._trie

    def symbols(self, token_id: int) -> tuple[Symbol, ...]:
        """The symbols token_id stands for: its bytes, or its spelling; () for an id that stands for nothing."""
        if token_id in self.specials:
            return (self.specials[token_id],)
        data = self.token_bytes[token_id] if 0 <= token_id < self.size else None
        return tuple(data) if data else ()


_CACHE: OrderedDict[tuple[int, int | None], tuple[Tokenizer, Vocabulary]] = OrderedDict()
