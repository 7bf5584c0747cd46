"""`k3 eval`: perplexity of a model on a user's text, checked against forwards computed here by hand."""

import json
import math

import pytest
import torch
import torch.nn.functional as F

from k3.cli import main
from k3.eval import EvalDataError, evaluate, read_texts, score_tokens, token_stream, windows
from k3.hub import load_pretrained, load_tokenizer

TEXT_A = "def add(a, b):\n    return a + b\n"
TEXT_B = "import os\nprint(os.getcwd())\n"


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("ckpt")
    assert main(["init", "--preset", "tiny", "--out", str(path)]) == 0
    return path


@pytest.fixture(scope="module")
def model64(ckpt):
    pretrained = load_pretrained(ckpt, dtype=torch.float64)
    return pretrained.model, load_tokenizer(pretrained)


def nll_by_hand(model, ids: list[int]) -> float:
    """One forward over the tokens, the summed cross-entropy of predicting each from those before it."""
    x = torch.tensor([ids])
    return F.cross_entropy(model(x).logits[0, :-1], x[0, 1:], reduction="sum").item()


def test_windows_predict_every_token_but_the_first_once():
    for n, L in [(2, 1), (10, 3), (10, 9), (10, 100), (13, 4)]:
        spans = windows(n, L)
        predicted = [t for s, e in spans for t in range(s + 1, e)]
        assert predicted == list(range(1, n)), (n, L)
        assert all(e - s <= L + 1 for s, e in spans)
    assert windows(10, 3) == [(0, 4), (3, 7), (6, 10)]


def test_scores_equal_forwards_by_hand(model64):
    model, tokenizer = model64
    ids = token_stream([TEXT_A, TEXT_B], tokenizer)
    assert ids == [*tokenizer.encode(TEXT_A), tokenizer.eos_id, *tokenizer.encode(TEXT_B), tokenizer.eos_id]
    # one window holding the whole stream: exactly one forward's loss
    nll, count = score_tokens(model, ids, seq_len=len(ids), batch_size=4)
    assert count == len(ids) - 1 and nll == pytest.approx(nll_by_hand(model, ids), rel=1e-12)
    # windows of 7 predicted tokens, batched three at a time with a short last window alone
    want = sum(nll_by_hand(model, ids[s:e]) for s, e in windows(len(ids), 7))
    for batch_size in (1, 3, 100):
        nll, count = score_tokens(model, ids, seq_len=7, batch_size=batch_size)
        assert count == len(ids) - 1 and nll == pytest.approx(want, rel=1e-12)
    assert (len(ids) - 1) % 7 != 0  # the short last window was exercised


def test_cli_prints_perplexity_of_a_folder(ckpt, model64, tmp_path, capsys):
    data = tmp_path / "data"
    (data / "sub").mkdir(parents=True)
    (data / "a.py").write_text(TEXT_A)
    (data / "sub" / "b.txt").write_text(TEXT_B)
    (data / "blob.bin").write_bytes(b"\xff\xfe\x00\x01")
    (data / "empty.txt").write_bytes(b"")
    found = read_texts(data)
    assert found.names == ["a.py", "sub/b.txt"] and found.not_utf8 == ["blob.bin"] and found.empty == ["empty.txt"]

    capsys.readouterr()
    assert main(["eval", "--model", str(ckpt), "--data", str(data), "--seq-len", "16", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    model, tokenizer = model64
    ids = token_stream([TEXT_A, TEXT_B], tokenizer)
    want = sum(nll_by_hand(model, ids[s:e]) for s, e in windows(len(ids), 16)) / (len(ids) - 1)
    assert got["tokens"] == len(ids) - 1 and got["files"] == 2 and got["seq_len"] == 16
    assert got["skipped_not_utf8"] == 1 and got["skipped_empty"] == 1
    assert got["nats_per_token"] == pytest.approx(want, rel=1e-5)  # fp32 model against the fp64 one
    assert got["perplexity"] == pytest.approx(math.exp(got["nats_per_token"]), rel=1e-12)
    # an untrained model is close to uniform over the vocabulary
    assert abs(got["nats_per_token"] - math.log(model.config.vocab_size)) < 0.1

    assert main(["eval", "--model", str(ckpt), "--data", str(data), "--seq-len", "16"]) == 0
    line = capsys.readouterr().out
    assert line.startswith(
        f"perplexity {got['perplexity']:.3f} ({got['nats_per_token']:.4f} nats/token) over "
        f"{len(ids) - 1} tokens of 2 files (skipped: 1 not UTF-8 text, 1 empty); windows of 16 "
        f"tokens; model "
    )


def test_single_file_equals_api_and_default_window(ckpt, tmp_path):
    path = tmp_path / "one.txt"
    path.write_text(TEXT_A)
    result = evaluate(ckpt, path)
    assert result.seq_len == 512 and result.files == 1 and result.tokens == len(TEXT_A.encode())  # bytes + eos - 1
    assert result.perplexity == pytest.approx(math.exp(result.nll / result.tokens))


def test_clear_errors_for_data_without_text(ckpt, tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    (tmp_path / "nothing.txt").write_bytes(b"")
    (tmp_path / "binary").mkdir()
    (tmp_path / "binary" / "x.bin").write_bytes(b"\x00\x01\x02")
    (tmp_path / "ok.txt").write_text(TEXT_A)
    cases = [
        (["--data", str(tmp_path / "missing")], "missing: no such file or folder"),
        (["--data", str(tmp_path / "empty")], "empty: the folder holds no files"),
        (["--data", str(tmp_path / "nothing.txt")], "no text to score (1 empty, 0 not UTF-8 text, of 1 file)"),
        (["--data", str(tmp_path / "binary")], "no text to score (0 empty, 1 not UTF-8 text, of 1 file)"),
        (["--data", str(tmp_path / "ok.txt"), "--seq-len", "4096"], "--seq-len 4096: a window reads seq_len + 1"),
        (["--data", str(tmp_path / "ok.txt"), "--batch-size", "0"], "--batch-size 0: must be at least 1"),
        (["--data", str(tmp_path / "ok.txt"), "--seq-len", "0"], "--seq-len 0: must be at least 1"),
    ]
    for flags, message in cases:
        capsys.readouterr()
        assert main(["eval", "--model", str(ckpt), *flags]) == 2, flags
        err = capsys.readouterr().err
        assert err.startswith("k3 eval: ") and message in err and len(err.splitlines()) == 1, err
    with pytest.raises(EvalDataError):
        read_texts(tmp_path / "empty")
    assert main(["eval", "--model", str(tmp_path / "no-model"), "--data", str(tmp_path / "ok.txt")]) == 2
    assert "no such checkpoint" in capsys.readouterr().err
