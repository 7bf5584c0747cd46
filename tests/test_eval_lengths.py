"""k3.eval_lengths and `k3 eval --task`: chunked scoring through the cache equals one uncached forward (float64),
accuracy counts exactly the solved examples, lm loss equals the perplexity path's, readable errors."""

import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from k3.cli import main
from k3.data.synthetic import DEFAULT_QUERIES, eval_set
from k3.eval import score_tokens
from k3.eval_lengths import chunked_logits, lm_loss, parse_lengths, task_accuracy
from k3.formats.tokenizer import byte_tokenizer
from k3.model.model import K3Output
from tiny_models import tiny_model


@pytest.fixture(scope="module")
def model():
    return tiny_model(seed=1, router_bias_std=0.1)


def test_chunked_logits_equal_one_uncached_forward(model):
    ids = torch.randint(0, model.config.vocab_size, (2, 150), generator=torch.Generator().manual_seed(0))
    full = model(ids).logits
    positions = [0, 5, 63, 64, 100, 149]
    for chunk in (7, 64, 150):
        got = chunked_logits(model, ids, positions, chunk)
        torch.testing.assert_close(got, full[:, positions], rtol=1e-9, atol=1e-9)


class Oracle(torch.nn.Module):
    """Predicts the true next token of every row except `wrong` rows, which it gets wrong at one position;
    it reads its place in the sequence from the cache, as the model does."""

    def __init__(self, config, sequences: torch.Tensor, wrong_at: dict[int, int]):
        super().__init__()
        self.config, self.sequences, self.wrong_at = config, sequences, wrong_at
        self.dummy = torch.nn.Parameter(torch.zeros(1))

    def forward(self, ids, cache=None, logits_at=None):
        start = cache.seq_len
        cache.seq_len += ids.shape[1]
        positions = start + logits_at
        nxt = self.sequences[:, (positions + 1).clamp(max=self.sequences.shape[1] - 1)]
        for row, pos in self.wrong_at.items():
            nxt[row, positions == pos] = (nxt[row, positions == pos] + 1) % self.config.vocab_size
        return K3Output(F.one_hot(nxt, self.config.vocab_size).double())


def test_accuracy_counts_exactly_the_solved_examples(model):
    tok = byte_tokenizer()
    exs = eval_set("retrieval", 300, 5, tok)
    seqs = torch.tensor([ex.tokens for ex in exs])
    # row 1 misses its last answer token, row 3 a token before the answer (which does not count)
    oracle = Oracle(model.config, seqs, {1: 298, 3: exs[3].answer_start - 10})
    result = task_accuracy(oracle, tok, "retrieval", 300, 5, batch_size=5, chunk_tokens=64)
    assert result.accuracy == 4 / 5 and result.examples == 5
    result = task_accuracy(Oracle(model.config, seqs, {}), tok, "retrieval", 300, 5, batch_size=5, chunk_tokens=300)
    assert result.accuracy == 1.0


class Favours(torch.nn.Module):
    """A stub whose logits at position p favour the token `favoured[:, p + 1]`: a model that predicts exactly
    the sequences it is given (the true ones, or ones with answers changed); its rows are the whole batch, so
    it is called with one batch of every example."""

    def __init__(self, config, favoured: torch.Tensor):
        super().__init__()
        self.config, self.favoured = config, favoured
        self.dummy = torch.nn.Parameter(torch.zeros(1))

    def forward(self, ids, cache=None, logits_at=None):
        positions = cache.seq_len + logits_at
        cache.seq_len += ids.shape[1]
        return K3Output(F.one_hot(self.favoured[:, positions + 1], self.config.vocab_size).double())


def test_mqar_accuracy_is_the_fraction_of_queries_answered(model):
    tok = byte_tokenizer()
    exs = eval_set("mqar", 300, 3, tok, pairs=6)
    truth = torch.tensor([ex.tokens for ex in exs])
    result = task_accuracy(Favours(model.config, truth), tok, "mqar", 300, 3, batch_size=3, chunk_tokens=64, pairs=6)
    assert result.accuracy == 1.0 and result.examples == 3
    # right on each example's first query only: one wrong digit in every later answer
    first_only = truth.clone()
    for row, ex in enumerate(exs):
        for _, end in ex.spans[1:]:
            first_only[row, end - 1] = tok.encode("x")[0]
    stub = Favours(model.config, first_only)
    result = task_accuracy(stub, tok, "mqar", 300, 3, batch_size=3, chunk_tokens=300, pairs=6)
    assert len(exs[0].spans) == DEFAULT_QUERIES
    assert result.accuracy == pytest.approx(1 / DEFAULT_QUERIES)
    # a wrong token between answers (a query line) is not an answer and does not count
    between = truth.clone()
    between[:, exs[0].spans[1][0] - 3] = tok.encode("x")[0]
    assert task_accuracy(Favours(model.config, between), tok, "mqar", 300, 3, pairs=6).accuracy == 1.0


def test_task_accuracy_of_a_model_is_its_uncached_greedy_answer(model):
    tok = byte_tokenizer()
    exs = eval_set("count", 200, 3, tok)
    ids = torch.tensor([ex.tokens for ex in exs])
    guess = model(ids).logits.argmax(-1)
    expect = sum(
        bool((guess[i, ex.answer_start - 1 : -1] == ids[i, ex.answer_start :]).all()) for i, ex in enumerate(exs)
    )
    assert task_accuracy(model, tok, "count", 200, 3, batch_size=2, chunk_tokens=50).accuracy == expect / 3


def test_lm_loss_equals_the_perplexity_path(model):
    tokens = np.random.default_rng(0).integers(0, model.config.vocab_size, 2000)
    result = lm_loss(model, tokens, 99, windows=1, chunk_tokens=40)
    nll, count = score_tokens(model, tokens[:100].tolist(), 99, 1)
    assert count == 99
    assert result.nats_per_token == pytest.approx(nll / count, rel=1e-10)
    ids = torch.tensor(tokens[:100])[None]
    per_token = F.cross_entropy(model(ids).logits[0, :-1], ids[0, 1:], reduction="none")
    assert result.late_nats_per_token == pytest.approx(per_token[75:].mean().item(), rel=1e-10)
    with pytest.raises(ValueError, match="has only 2,000 tokens"):
        lm_loss(model, tokens, 4000, windows=1)


def test_cli_task_by_length_json_and_errors(tmp_path, capsys):
    run = tmp_path / "run"
    assert main(["init", "--preset", "tiny", "--out", str(run)]) == 0
    capsys.readouterr()
    assert (
        main(["eval", "--model", str(run), "--task", "multihop", "--lengths", "200,400", "--examples", "3", "--json"])
        == 0
    )
    out = json.loads(capsys.readouterr().out)
    assert [r["length"] for r in out["results"]] == [200, 400]
    assert all(r["examples"] == 3 and 0 <= r["accuracy"] <= 1 for r in out["results"])
    assert main(["eval", "--model", str(run), "--task", "retrieval", "--lengths", "9000"]) == 2
    assert "longer than this model's context of 4,096" in capsys.readouterr().err
    assert main(["eval", "--model", str(run), "--task", "mqar", "--lengths", "300", "--pairs", "6", "--json"]) == 0
    (row,) = json.loads(capsys.readouterr().out)["results"]
    assert row["task"] == "mqar" and row["length"] == 300 and 0 <= row["accuracy"] <= 1
    assert main(["eval", "--model", str(run), "--task", "mqar", "--lengths", "300", "--pairs", "40"]) == 2
    assert "mqar with 40 pairs and 4 queries takes" in capsys.readouterr().err
    assert main(["eval", "--model", str(run), "--task", "mqar", "--pairs", "0"]) == 2
    assert "--pairs must be at least 1" in capsys.readouterr().err
    assert main(["eval", "--model", str(run), "--task", "retrieval", "--pairs", "6"]) == 2
    assert "does nothing for --task retrieval: drop it or use --task mqar" in capsys.readouterr().err
    assert main(["eval", "--model", str(run), "--data", str(run), "--pairs", "6"]) == 2
    assert "does nothing for perplexity" in capsys.readouterr().err
    assert main(["eval", "--model", str(run), "--task", "count", "--lengths", "2k"]) == 2
    assert "comma-separated" in capsys.readouterr().err
    assert main(["eval", "--model", str(run)]) == 2
    assert "--data is needed" in capsys.readouterr().err
    assert main(["eval", "--model", str(run), "--task", "lm", "--lengths", "64"]) == 2
    assert "--task lm needs --data" in capsys.readouterr().err
    (tmp_path / "text.txt").write_text("def f(x):\n    return x\n" * 40)
    assert (
        main(["eval", "--model", str(run), "--task", "lm", "--lengths", "64,128", "--data", str(tmp_path / "text.txt")])
        == 0
    )
    rows = capsys.readouterr().out.strip().splitlines()
    assert len(rows) == 2 and "nats/token" in rows[0] and "128 tokens" in rows[1]


def test_parse_lengths():
    assert parse_lengths("512,2048") == [512, 2048]
    with pytest.raises(ValueError, match="at least 2"):
        parse_lengths("1")
