"""Serving sampler: parameter validation, greedy, per-request seeds independent of the batch and of the
order of the draws (each position its own stream), top-k and top-p support, the temperature-scaled
distribution, values at the edges of every range, and stop strings in a stream.

Shape suffixes: B rows, V vocabulary, N draws.
"""

import math
import random

import pytest
import torch

from k3.serve.sampling import SAMPLING_EPS, SamplingParams, StopChecker, position_noise, sample, stream_seed


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"temperature": -0.1}, "temperature must be a finite number >= 0"),
        ({"temperature": math.nan}, "temperature must be a finite number >= 0"),
        ({"temperature": "1"}, "temperature must be a finite number >= 0"),
        ({"top_p": 1.5}, r"top_p must be in \(0, 1\], got 1.5"),
        ({"top_p": 0}, r"top_p must be in \(0, 1\], got 0"),
        ({"top_k": -2}, "top_k must be an int >= 1, or 0 or -1 for off, got -2"),
        ({"top_k": 2.0}, "top_k must be an int"),
        ({"max_tokens": 0}, "max_tokens must be an int >= 1, got 0"),
        ({"stop": [""]}, "stop must be a string or a list of non-empty strings"),
        ({"stop": [1]}, "stop must be a string or a list of non-empty strings"),
        ({"stop_token_ids": [-1]}, "stop_token_ids must be a list of ints >= 0"),
        ({"stop_token_ids": 5}, "stop_token_ids must be a list of ints >= 0"),
        ({"ignore_eos": 1}, "ignore_eos must be a bool"),
        ({"seed": -1}, r"seed must be None or an int in \[0, 2\*\*63\)"),
        ({"seed": 1.0}, "seed must be None or an int"),
    ],
)
def test_params_validation(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_params_normalise():
    p = SamplingParams(stop=["a", "b"], stop_token_ids=[3, 4], top_k=-1, temperature=0)
    assert p.stop == ("a", "b") and p.stop_token_ids == (3, 4) and p.greedy
    assert SamplingParams(stop="END").stop == ("END",)
    assert hash(p) == hash(SamplingParams(stop=("a", "b"), stop_token_ids=(3, 4), top_k=-1, temperature=0))
    assert SamplingParams(temperature=SAMPLING_EPS / 2).greedy and not SamplingParams(temperature=SAMPLING_EPS).greedy
    assert SamplingParams(seed=1).coupled and not SamplingParams().coupled
    assert not SamplingParams(seed=1, temperature=0).coupled


def test_position_noise_is_a_function_of_seed_and_position():
    a = position_noise(7, [0, 1, 2, 40], 50)
    assert a.shape == (4, 50) and a.dtype == torch.float32 and bool((a > 0).all())
    assert torch.equal(a[3:], position_noise(7, [40], 50))  # row 40 alone: the same values, whatever came before
    assert not torch.equal(a[0], a[1]) and not torch.equal(a[0], position_noise(8, [0], 50)[0])
    # nearby seeds and positions give unrelated streams (a bijective mix, not seed + position)
    assert len({stream_seed(s, n) for s in range(50) for n in range(50)}) == 2500
    assert stream_seed(1, 0) != stream_seed(0, 1)


def test_greedy_is_argmax():
    logits_BV = torch.randn(5, 50, generator=torch.Generator().manual_seed(0)).bfloat16()
    params = [SamplingParams(temperature=0)] * 5
    assert torch.equal(sample(logits_BV, params, [0] * 5), logits_BV.argmax(-1))


def test_row_count_mismatch():
    with pytest.raises(ValueError, match=r"one SamplingParams, one position \(and one mask, if any\) per row"):
        sample(torch.zeros(2, 4), [SamplingParams()], [0, 0])


def test_seeded_row_independent_of_batch():
    """A seeded request draws the same tokens alone and at position 2 of a batch of 4 with other params."""
    V, steps = 64, 8
    gen = torch.Generator().manual_seed(1)
    logits = [torch.randn(4, V, generator=gen) for _ in range(steps)]
    mine = SamplingParams(temperature=0.9, top_p=0.95, top_k=40, seed=1234)
    others = [SamplingParams(temperature=0), SamplingParams(temperature=1.3, seed=5), SamplingParams(top_p=0.5)]

    alone = [sample(step[2:3], [mine], [n]).item() for n, step in enumerate(logits)]

    params = [others[0], others[1], mine, others[2]]
    batched = [sample(step, params, [n, 3, n, 0])[2].item() for n, step in enumerate(logits)]
    assert alone == batched
    # each position has its own stream: drawn in another order (as after a preemption), the same tokens
    backwards = [sample(logits[n][2:3], [mine], [n]).item() for n in reversed(range(steps))]
    assert backwards[::-1] == alone
    # and it is really random: another seed gives another stream
    other = SamplingParams(temperature=0.9, top_p=0.95, top_k=40, seed=4321)
    assert alone != [sample(step[2:3], [other], [n]).item() for n, step in enumerate(logits)]


def test_seeded_race_is_an_exact_draw():
    """argmax p / E over independent positions' noise: frequencies match p (chi-square, df = 4)."""
    logits_V = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0])
    N, params = 6000, SamplingParams(temperature=0.7, seed=11)
    tokens = torch.tensor([sample(logits_V[None], [params], [n]).item() for n in range(N)])
    counts = torch.bincount(tokens, minlength=5).double()
    expected = N * torch.softmax(logits_V.double() / 0.7, dim=-1)
    assert ((counts - expected) ** 2 / expected).sum().item() < 18.47


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1e-40),  # below SAMPLING_EPS: greedy
        SamplingParams(temperature=1e-300, seed=1),
        SamplingParams(temperature=SAMPLING_EPS),  # logits / 1e-5 overflow nothing once the maximum is subtracted
        SamplingParams(temperature=SAMPLING_EPS, seed=3),
        SamplingParams(top_p=5e-324),  # rounds to 0 in fp32: the most likely token stays
        SamplingParams(top_p=1e-300, seed=2),
        SamplingParams(top_k=2**63),  # no int64 holds it: clamped to the vocabulary before any tensor is made
        SamplingParams(top_k=2**200, seed=4, top_p=1e-30),
        SamplingParams(temperature=2.0, top_k=1),
    ],
)
def test_extreme_values_sample_the_most_likely_token_or_a_valid_one(params):
    """Every value the request schema accepts gives a token (the issue's 'Overflow when unpacking long long'
    and NaN probabilities from temperature 1e-40 / top_p 5e-324 failed the whole step)."""
    logits_BV = torch.randn(3, 100, generator=torch.Generator().manual_seed(4)) * 30
    tokens = sample(logits_BV, [params] * 3, [0, 1, 2])
    assert tokens.dtype == torch.int64 and bool(((tokens >= 0) & (tokens < 100)).all())
    if params.greedy or params.top_k == 1 or params.top_p < 1e-20 or params.temperature <= SAMPLING_EPS:
        assert torch.equal(tokens, logits_BV.argmax(-1))


def draw(logits_V: torch.Tensor, params: SamplingParams, N: int) -> torch.Tensor:
    """N draws from one row: counts per token (V,). Uses the shared global-RNG path (one multinomial)."""
    with torch.random.fork_rng():
        torch.manual_seed(0)
        tokens_N = sample(logits_V.expand(N, -1), [params] * N, [0] * N)
    return torch.bincount(tokens_N, minlength=logits_V.numel())


def test_top_k_and_top_p_support():
    logits_V = torch.tensor([0.4, 0.3, 0.2, 0.1]).log()
    counts = draw(logits_V, SamplingParams(top_k=2), 4000)
    assert counts[2:].sum() == 0 and counts[:2].min() > 0
    counts = draw(logits_V, SamplingParams(top_p=0.5), 4000)  # 0.4 < 0.5 so the second is needed
    assert counts[2:].sum() == 0 and counts[:2].min() > 0
    counts = draw(logits_V, SamplingParams(top_p=0.7), 4000)  # 0.4 + 0.3 reaches 0.7: exactly two
    assert counts[2:].sum() == 0 and counts[:2].min() > 0
    counts = draw(logits_V, SamplingParams(top_k=3, top_p=0.95), 4000)  # top-p on the renormalised top 3
    assert counts[3] == 0 and counts[:3].min() > 0
    # the seeded per-row path respects the same support
    tokens = sample(logits_V.expand(300, -1), [SamplingParams(top_k=2, seed=0)] * 300, list(range(300)))
    assert set(tokens.tolist()) == {0, 1}


@pytest.mark.parametrize("T", [0.5, 1.0, 2.0])
def test_temperature_distribution(T):
    """Empirical frequencies match softmax(logits / T): Pearson chi-square below the p = 0.001 critical value."""
    logits_V = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0])
    N = 20000
    counts = draw(logits_V, SamplingParams(temperature=T), N).double()
    expected = N * torch.softmax(logits_V.double() / T, dim=-1)
    chi2 = ((counts - expected) ** 2 / expected).sum().item()
    assert chi2 < 18.47, (chi2, counts.tolist(), expected.tolist())  # df = 4


def stream(checker: StopChecker, pieces: list[str], final: bool = True) -> tuple[bool, list[str]]:
    """Feed detokenised pieces one at a time; returns (finished, deltas)."""
    deltas, finished = [], False
    for piece in pieces:
        finished, delta = checker.update(piece)
        deltas.append(delta)
        if finished:
            return True, deltas
    if final:
        finished, delta = checker.update("", final=True)
        deltas.append(delta)
    return finished, deltas


def test_stop_string_across_tokens():
    checker = StopChecker(("</s>",))
    finished, deltas = stream(checker, ["Hello <", "/", "s> and more"])
    assert finished and checker.matched == "</s>"
    assert deltas == ["Hello ", "", ""]
    assert checker.update(" still") == (True, "")


def test_held_back_text_released():
    checker = StopChecker(("STOP",))
    finished, deltas = stream(checker, ["a S", "T", "x", " ST"])
    assert not finished
    assert deltas == ["a ", "", "STx", " ", "ST"]  # the last "ST" only comes out at final


def test_several_stop_strings_earliest_wins():
    checker = StopChecker(["world", "lo w"])
    finished, deltas = stream(checker, ["hel", "lo", " wor", "ld"])
    assert finished and checker.matched == "lo w" and "".join(deltas) == "hel"


def test_no_stop_strings_emits_everything():
    checker = StopChecker(())
    pieces = ["a", "bc", "", "d"]
    finished, deltas = stream(checker, pieces, final=False)
    assert not finished and deltas == pieces


def test_stop_checker_random_streams():
    """Over random texts and token splits: the stream never shows a stop string or part of one (every
    prefix of what was sent is a prefix of the truncated text) and sends all of it in the end. A short
    stop string that completes first wins over a longer one that started earlier but had not completed:
    generation stops there."""
    rng = random.Random(0)
    for _ in range(400):
        stop = tuple("".join(rng.choice("ab") for _ in range(rng.randint(1, 3))) for _ in range(rng.randint(1, 3)))
        text = "".join(rng.choice("abc") for _ in range(rng.randint(0, 12)))
        cuts = sorted(rng.sample(range(1, len(text) + 1), k=rng.randint(0, len(text))))
        pieces = [text[i:j] for i, j in zip([0, *cuts], [*cuts, len(text)], strict=True)]
        # generation ends at the first piece whose text holds a stop string, cut at its earliest start
        truncated, hit = text, False
        for n in range(1, len(pieces) + 1):
            seen = "".join(pieces[:n])
            if hits := [i for s in stop if (i := seen.find(s)) >= 0]:
                truncated, hit = seen[: min(hits)], True
                break

        finished, deltas = stream(StopChecker(stop), pieces)
        assert finished == hit
        sent = ""
        for delta in deltas:
            sent += delta
            assert truncated.startswith(sent), (stop, text, deltas)
        assert sent == truncated, (stop, text, deltas)
