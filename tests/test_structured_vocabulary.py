"""k3.structured's vocabulary: token ids to bytes through the ByteLevel alphabet, special tokens as symbols,
the preorder trie, for k3's byte tokenizer and a trained BPE; tokenizers it cannot read are refused."""

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, models, pre_tokenizers

from k3.formats.tokenizer import SPECIAL_TOKENS, byte_tokenizer, train_tokenizer
from k3.structured import UnsupportedTokenizer, Vocabulary
from k3.structured.vocabulary import byte_level_alphabet

TEXTS = [
    json.dumps({"name": f"item {i}", "price": i * 1.5, "tags": ["a", "é", "🙂"][: i % 4], "ok": i % 2 == 0})
    for i in range(200)
] + ["def f(x):\n    return x * 2  # ünïcode\n"] * 20
TOKENIZERS = {"bytes": byte_tokenizer(), "bpe600": train_tokenizer(TEXTS, vocab_size=600)}


def test_the_alphabet_is_tokenizers_byte_level_one():
    alphabet = byte_level_alphabet()
    assert set(alphabet) == set(pre_tokenizers.ByteLevel.alphabet()) and sorted(alphabet.values()) == list(range(256))
    assert alphabet["a"] == ord("a") and alphabet["Ġ"] == ord(" ") and alphabet["Ċ"] == ord("\n")


@pytest.mark.parametrize("name", TOKENIZERS)
def test_every_token_stands_for_its_bytes_or_its_special_spelling(name):
    tok = TOKENIZERS[name]
    vocab = Vocabulary.from_tokenizer(tok)
    assert vocab.size == tok.vocab_size
    assert sorted(vocab.special_ids) == sorted(SPECIAL_TOKENS)
    for spelling, ids in vocab.special_ids.items():
        assert ids == [tok.tok.token_to_id(spelling)] and vocab.symbols(ids[0]) == (spelling,)
    singles = {
        vocab.token_bytes[i] for i in range(vocab.size) if vocab.token_bytes[i] and len(vocab.token_bytes[i]) == 1
    }
    assert len(singles) == 256  # every byte has its own token: no state can be left without one
    for i in range(vocab.size):
        data = vocab.token_bytes[i]
        if data is None:
            assert i in vocab.specials
            continue
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:  # a token may end inside a character; its decoded text would be U+FFFD
            continue
        assert tok.decode([i]) == text and vocab.symbols(i) == tuple(data)


@settings(max_examples=150, deadline=None)
@given(st.text(st.characters(codec="utf-8"), max_size=40), st.sampled_from(sorted(TOKENIZERS)))
def test_encoded_text_is_the_concatenation_of_its_tokens_bytes(text, name):
    tok = TOKENIZERS[name]
    vocab = Vocabulary.of(tok)
    pieces = [vocab.symbols(i) for i in tok.encode(text)]
    assert all(len(p) != 1 or isinstance(p[0], int) or p[0] in SPECIAL_TOKENS for p in pieces)
    out = b"".join(bytes(p) if all(isinstance(s, int) for s in p) else p[0].encode() for p in pieces)
    assert out == text.encode("utf-8")


def test_special_tokens_in_text_are_symbols_not_bytes():
    tok = TOKENIZERS["bpe600"]
    vocab = Vocabulary.of(tok)
    ids = tok.encode('<|open|>call tool="x"<|sep|>')
    assert vocab.symbols(ids[0]) == ("<|open|>",) and vocab.symbols(ids[-1]) == ("<|sep|>",)
    assert b"".join(bytes(vocab.symbols(i)) for i in ids[1:-1]) == b'call tool="x"'


def test_the_trie_lists_every_token_under_its_bytes():
    vocab = Vocabulary.of(TOKENIZERS["bpe600"])
    trie = vocab.trie
    regular = sorted(i for i in range(vocab.size) if vocab.token_bytes[i])
    assert sorted(trie.order.tolist()) == regular
    path: list[int] = []
    for node in range(1, trie.num_nodes):  # each node's tokens, and those below it, start with its path
        del path[trie.depth[node] - 1 :]
        path.append(trie.byte[node])
        below = trie.order[trie.first[node] : trie.first[trie.end[node]]].tolist()
        assert below and all(vocab.token_bytes[t].startswith(bytes(path)) for t in below)
        here = trie.order[trie.first[node] : trie.first[node + 1]].tolist()
        assert all(vocab.token_bytes[t] == bytes(path) for t in here)
        assert all(trie.below[node] >> b & 1 for t in below for b in vocab.token_bytes[t][len(path) - 1 :])


def test_sizes_caching_and_refusals():
    tok = TOKENIZERS["bytes"]
    wide = Vocabulary.from_tokenizer(tok, size=tok.vocab_size + 7)  # a model with padding rows
    assert wide.size == tok.vocab_size + 7 and wide.symbols(tok.vocab_size + 3) == () and wide.symbols(-1) == ()
    with pytest.raises(UnsupportedTokenizer, match="beyond the model's vocabulary"):
        Vocabulary.from_tokenizer(tok, size=tok.vocab_size - 1)
    assert Vocabulary.of(tok) is Vocabulary.of(tok.tok) and Vocabulary.of(tok) is not Vocabulary.of(tok, size=300)
    word_level = Tokenizer(models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]"))
    with pytest.raises(UnsupportedTokenizer, match="byte-level BPE"):
        Vocabulary.from_tokenizer(word_level)
    with pytest.raises(UnsupportedTokenizer, match=r"tokenizers\.Tokenizer"):
        Vocabulary.from_tokenizer(object())
