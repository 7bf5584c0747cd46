"""Corpus, tokenizer and packed sequences."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from k3.formats.tokenizer import EOS, SPECIAL_TOKENS, K3Tokenizer, byte_tokenizer, train_tokenizer
from k3.train.corpus import CorpusError, Document, load_corpus
from k3.train.data import PackedSequences, cached_pack, pack

BYTES = byte_tokenizer()


def test_stdlib_corpus_is_deterministic_and_excludes_site_packages():
    train, val = load_corpus()
    assert len(train) > 500 and len(val) > 5
    names = [d.name for d in train + val]
    assert not any("site-packages" in n for n in names)
    assert all(n.endswith(".py") for n in names)
    assert {d.name for d in val}.isdisjoint(d.name for d in train)
    train2, val2 = load_corpus()
    assert [d.name for d in val2] == [d.name for d in val] and len(train2) == len(train)


def test_directory_corpus_skips_files_that_are_not_utf8_and_says_how_many(tmp_path):
    for i in range(200):
        (tmp_path / f"f{i:03d}.txt").write_text(f"document {i}\n" * 3)
    (tmp_path / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    (tmp_path / "blob.bin").write_bytes(b"\x00\x01\x02")
    (tmp_path / "empty.txt").write_bytes(b"")
    messages = []
    train, val = load_corpus(tmp_path, log=messages.append)
    names = {d.name for d in train + val}
    assert len(names) == 200 and "latin1.txt" not in names and "blob.bin" not in names
    assert messages == [
        f"--data {tmp_path}: skipped 2 not UTF-8 text (e.g. blob.bin, latin1.txt) and 1 empty "
        f"(e.g. empty.txt); using 200 files"
    ]
    only_empty = tmp_path / "e.txt"
    only_empty.write_bytes(b"")
    with pytest.raises(CorpusError, match="the file is empty"):  # empty is not "not UTF-8"
        load_corpus(only_empty)
    with pytest.raises(CorpusError, match="not a UTF-8 text file"):
        load_corpus(tmp_path / "latin1.txt")


def test_a_folder_of_few_files_still_gets_a_validation_split(tmp_path):
    """Three files: the 2% hash split would leave validation empty (or take everything); ranked by the same
    hash, one file is held out, the same one every time; --val-fraction and --val-data choose otherwise."""
    for name in ("a.py", "b.py", "c.py"):
        (tmp_path / name).write_text(f"# {name}\nx = 1\n")
    train, val = load_corpus(tmp_path)
    assert len(train) == 2 and len(val) == 1 and {d.name for d in train + val} == {"a.py", "b.py", "c.py"}
    assert [d.name for d in load_corpus(tmp_path)[1]] == [val[0].name]
    train, val = load_corpus(tmp_path, val_fraction=0.99)  # all three by hash: at most n - 1 are held out
    assert len(train) == 1 and len(val) == 2
    held = tmp_path.parent / "held"
    held.mkdir()
    (held / "v.txt").write_text("validation text\n")
    train, val = load_corpus(tmp_path, val_data=held)
    assert len(train) == 3 and [d.name for d in val] == ["v.txt"]
    one = tmp_path.parent / "one"
    one.mkdir()
    (one / "only.py").write_text("".join(f"line {i}\n" for i in range(10)))
    train, val = load_corpus(one, val_fraction=0.2)  # one file: split at a line boundary
    assert train[0].text.count("\n") == 8 and val[0].text == "line 8\nline 9\n"
    with pytest.raises(CorpusError, match="--val-fraction must be between 0 and 1"):
        load_corpus(tmp_path, val_fraction=1.0)


def test_single_file_and_bad_paths(tmp_path):
    f = tmp_path / "one.txt"
    f.write_text("".join(f"line {i}\n" for i in range(100)))
    train, val = load_corpus(f)
    assert train[0].text + val[0].text == f.read_text() and len(val[0].text) < len(train[0].text)
    with pytest.raises(CorpusError, match="no such file"):
        load_corpus(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(CorpusError, match="no UTF-8 text files in it"):
        load_corpus(tmp_path / "empty")


@settings(max_examples=100, deadline=None)
@given(st.text(max_size=200))
def test_byte_level_round_trip(text):
    assert BYTES.decode(BYTES.encode(text)) == text


def test_special_tokens_are_single_ids(tmp_path):
    for t in SPECIAL_TOKENS:
        assert len(BYTES.encode(t)) == 1
    BYTES.save(tmp_path / "tok.json")
    again = K3Tokenizer.load(tmp_path / "tok.json")
    assert again.encode("héllo" + EOS) == BYTES.encode("héllo" + EOS) and again.eos_id == BYTES.eos_id
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(ValueError, match="cannot load a tokenizer"):
        K3Tokenizer.load(tmp_path / "bad.json")


def test_trained_bpe_compresses_python():
    train, _ = load_corpus()
    tok = train_tokenizer([d.text for d in train[::20]], vocab_size=2048)
    text = "".join(d.text for d in train[1:200:40])
    assert tok.vocab_size == 2048
    assert tok.decode(tok.encode(text)) == text
    assert len(tok.encode(text)) < 0.5 * len(text.encode())  # bytes alone would be 1.0


def test_pack_separates_documents_with_eos(tmp_path):
    docs = [Document("a", "ab"), Document("b", "c")]
    tokens = pack(docs, BYTES)
    assert tokens.tolist() == [*BYTES.encode("ab"), BYTES.eos_id, *BYTES.encode("c"), BYTES.eos_id]
    path = tmp_path / "t.npy"
    assert np.array_equal(cached_pack(path, docs, BYTES), tokens)
    assert np.array_equal(cached_pack(path, [], BYTES), tokens)  # read back from the file, not re-packed


def test_packed_order_is_seeded_resumable_and_covers_each_epoch():
    data = PackedSequences(np.arange(10 * 4, dtype=np.int32), seq_len=4, seed=7)
    whole = data.batch(0, 25)  # two and a half epochs
    pieces = torch.cat([data.batch(0, 3), data.batch(3, 9), data.batch(12, 13)])
    assert torch.equal(whole, pieces)
    for epoch in range(2):
        starts = sorted(whole[epoch * 10 : (epoch + 1) * 10, 0].tolist())
        assert starts == list(range(0, 40, 4))
    assert not torch.equal(whole[:10], whole[10:20])  # a new permutation each epoch
    assert torch.equal(PackedSequences(np.arange(40, dtype=np.int32), 4, seed=7).batch(5, 4), data.batch(5, 4))
    with pytest.raises(ValueError, match="do not fill one sequence"):
        PackedSequences(np.arange(3, dtype=np.int32), seq_len=4)
