"""Byte-level BPE (SPEC §4), trained with the `tokenizers` library and saved as tokenizer.json beside
the checkpoint. Byte-level means every string round-trips, whatever the corpus.

The special tokens are part of the format, the four structural tokens of K3's chat format among them
(k3.chat reads them from here: they are what a tokenizer.json must register for chat to work)."""

from collections.abc import Iterable
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from k3.formats.files import atomic_write

EOS = "<|endoftext|>"  # document boundary
BASE_SPECIAL_TOKENS = [EOS, "<|pad|>", "<|im_start|>", "<|im_end|>", "<|image|>"]
# K3's chat format's structural tokens (SPEC §3, docs/chat.md): `<|open|>` and `<|close|>` start a tag's
# header, `<|sep|>` ends it, `<|end_of_msg|>` ends a message and is the released model's stop token. They come
# after the base tokens: tokenizers trained before they existed still load, and the chat endpoint then says
# the tokenizer has no chat format.
OPEN = "<|open|>"
CLOSE = "<|close|>"
SEP = "<|sep|>"
END_OF_MSG = "<|end_of_msg|>"
CHAT_SPECIAL_TOKENS = [OPEN, CLOSE, SEP, END_OF_MSG]
SPECIAL_TOKENS = [*BASE_SPECIAL_TOKENS, *CHAT_SPECIAL_TOKENS]


class K3Tokenizer:
    """A thin wrapper: encode/decode plus the ids the trainer and generator need."""

    def __init__(self, tokenizer: Tokenizer):
        self.tok = tokenizer
        missing = [t for t in BASE_SPECIAL_TOKENS if tokenizer.token_to_id(t) is None]
        if missing:
            raise ValueError(f"tokenizer lacks the special tokens {missing}")
        self.eos_id = tokenizer.token_to_id(EOS)

    @property
    def has_chat_tokens(self) -> bool:
        """Whether K3's chat format can be rendered with this tokenizer (k3.chat)."""
        return all(self.tok.token_to_id(t) is not None for t in CHAT_SPECIAL_TOKENS)

    @property
    def vocab_size(self) -> int:
        return self.tok.get_vocab_size()

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self.tok.encode_batch(texts)]

    def decode(self, ids: Iterable[int], skip_special: bool = False) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=skip_special)

    def save(self, path: str | Path) -> None:
        """tokenizer.json, written atomically: a kill mid-write leaves no empty or partial file."""
        atomic_write(path, self.tok.to_str(pretty=True))

    @classmethod
    def load(cls, path: str | Path) -> "K3Tokenizer":
        try:
            return cls(Tokenizer.from_file(str(path)))
        except Exception as e:  # tokenizers raises plain Exception subclasses for bad files
            raise ValueError(f"cannot load a tokenizer from {path}: {e}") from e


def _empty_bpe() -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return tok


def train_tokenizer(texts: Iterable[str], vocab_size: int = 8192) -> K3Tokenizer:
    """BPE merges learned from texts on top of the 256 byte symbols and the special tokens."""
    tok = _empty_bpe()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        min_frequency=2,
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    return K3Tokenizer(tok)


def byte_tokenizer() -> K3Tokenizer:
    """No merges: one token per byte plus the special tokens (for `k3 init` and tests)."""
    return train_tokenizer([], vocab_size=256 + len(SPECIAL_TOKENS))
