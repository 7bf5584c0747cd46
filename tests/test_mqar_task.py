"""experiments/mqar.py's token-space MQAR batches: every queried value is labelled where its key is asked, the
bindings in front hold that value, and nothing else is labelled (a wrong label would train the wrong task)."""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "experiments"))
import mqar


@pytest.mark.parametrize("length", [64, 67])
def test_mqar_batch_labels_each_queried_value(length):
    counts = [4, 9, 16]
    tokens, labels = mqar.mqar_batch(3, length, counts, torch.Generator().manual_seed(0))
    assert tokens.shape == labels.shape == (3, length)
    for row, n in enumerate(counts):
        start = length - 4 * n
        assert (tokens[row, :start] == mqar.PAD).all()
        keys, values = tokens[row, start : length - 2 * n : 2], tokens[row, start + 1 : length - 2 * n : 2]
        assert len(set(keys.tolist())) == n and (keys >= 1).all() and (keys <= mqar.KEYS).all()
        assert (values > mqar.KEYS).all() and (values <= mqar.KEYS + mqar.VALUES).all()
        bound = dict(zip(keys.tolist(), values.tolist(), strict=True))
        at = (labels[row] != -100).nonzero().flatten().tolist()
        assert len(at) == n and all(t >= length - 2 * n for t in at)
        asked = [tokens[row, t - 1].item() for t in at]
        assert sorted(asked) == sorted(bound)  # every key asked once
        for t, key in zip(at, asked, strict=True):
            assert labels[row, t] == tokens[row, t] == bound[key]


def test_mqar_batch_refuses_too_many_pairs():
    with pytest.raises(ValueError, match="17 pairs take 68 tokens"):
        mqar.mqar_batch(1, 64, [17], torch.Generator())
