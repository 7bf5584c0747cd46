"""The special tokens of K3's chat format and where a tokenizer keeps them.

Only four tokens carry structure (SPEC §3, docs/chat.md): `<|open|>` and `<|close|>` start a tag's
header, `<|sep|>` ends it, `<|end_of_msg|>` ends a message and is the released model's stop token.
Everything else in a rendered conversation (tag names, attributes, text) is ordinary text."""

from dataclasses import dataclass

from tokenizers import Tokenizer

from k3.chat.errors import ChatFormatError
from k3.formats.tokenizer import CHAT_SPECIAL_TOKENS, CLOSE, END_OF_MSG, OPEN, SEP, K3Tokenizer


@dataclass(frozen=True)
class ChatTokenIds:
    """Ids of the four structural tokens in one tokenizer."""

    open: int
    close: int
    sep: int
    end_of_msg: int

    def by_id(self) -> dict[int, str]:
        """id -> the token's spelling, for telling structure from text in a token stream."""
        return {self.open: OPEN, self.close: CLOSE, self.sep: SEP, self.end_of_msg: END_OF_MSG}


def _raw(tokenizer: "Tokenizer | K3Tokenizer") -> Tokenizer:
    if isinstance(tokenizer, Tokenizer):
        return tokenizer
    raw = getattr(tokenizer, "tok", None)
    if not isinstance(raw, Tokenizer):
        raise TypeError(f"expected a K3Tokenizer or a tokenizers.Tokenizer, got {type(tokenizer).__name__}")
    return raw


def chat_token_ids(tokenizer: "Tokenizer | K3Tokenizer") -> ChatTokenIds:
    """The ids of the chat tokens, each of which must be registered as a *special* added token: k3 turns
    special-token matching off for text (encode_special_tokens), which stops matching special added
    tokens only; a non-special added `<|open|>` would still be produced from user text and forge structure.
    (The released checkpoint's tokenizer marks `<|open|>`, `<|close|>` and `<|sep|>` non-special, see
    docs/chat.md; a conversion of it needs with_chat_tokens, which keeps their ids.)"""
    tok = _raw(tokenizer)
    added = tok.get_added_tokens_decoder()
    ids, missing, ordinary = {}, [], []
    for name in CHAT_SPECIAL_TOKENS:
        i = tok.token_to_id(name)
        if i is None or i not in added or not added[i].special:
            missing.append(name)
            if i is not None and i in added:
                ordinary.append(name)
        else:
            ids[name] = i
    if missing:
        why = ""
        if ordinary:
            why = (
                f" ({', '.join(ordinary)} {'is an' if len(ordinary) == 1 else 'are'} added but not special, as the "
                "released checkpoint's tokenizer_config.json marks <|open|>, <|close|> and <|sep|>: user text "
                "could produce them; k3.chat.with_chat_tokens re-registers them as special with the same ids)"
            )
        raise ChatFormatError(
            f"this tokenizer has no chat tokens: {', '.join(missing)} "
            f"{'is' if len(missing) == 1 else 'are'} not registered as special tokens{why}. "
            "Chat needs a tokenizer that has them (k3.chat.with_chat_tokens adds them to a copy); "
            "/v1/completions works without them."
        )
    return ChatTokenIds(ids[OPEN], ids[CLOSE], ids[SEP], ids[END_OF_MSG])


def with_chat_tokens(tokenizer: "Tokenizer | K3Tokenizer") -> "Tokenizer | K3Tokenizer":
    """A copy of the tokenizer with the chat tokens added as special tokens (new ids at the end of the
    vocabulary for those it lacks; one already added as an ordinary token becomes special with its id);
    the original is untouched. Returns the same kind it was given."""
    copy = Tokenizer.from_str(_raw(tokenizer).to_str())
    copy.add_special_tokens(CHAT_SPECIAL_TOKENS)
    if isinstance(tokenizer, Tokenizer):
        return copy
    return type(tokenizer)(copy)
