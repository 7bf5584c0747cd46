"""k3.data.synthetic: exact lengths, answers that the context determines, determinism, held-out splits, mixing."""

import re

import pytest
import torch

from k3.data.synthetic import DEFAULT_QUERIES, MIX_TASKS, TASKS, SyntheticError, SyntheticMix, eval_set, make_example
from k3.formats.tokenizer import byte_tokenizer


@pytest.fixture(scope="module")
def tok():
    return byte_tokenizer()


def solve(task: str, text: str) -> str:
    """The answer computed from the prompt's text alone, by the task's definition."""
    *body, query = text.rstrip("\n").split("\n")
    if task == "count":
        return f" {sum(line.strip().startswith('hit(') for line in body)}"
    if task == "mqar":  # the answers to every query, given the bindings above the first
        binding = dict(re.findall(r"^    (\w+) = (\d+)$", "\n".join(body), re.M))
        return "".join(f" {binding[key]}" for key in re.findall(r"assert (\w+) ==", text))
    binding = dict(re.fullmatch(r"    (\w+) = (\w+)", line).groups() for line in body if line.strip())
    name = re.fullmatch(r"    assert (\w+) ==", query).group(1)
    while not name.isdigit():
        name = binding[name]
    return f" {name}"


@pytest.mark.parametrize("task", TASKS)
@pytest.mark.parametrize("length", [200, 1000])
def test_examples_have_the_exact_length_and_the_answer_the_context_determines(tok, task, length):
    for seed in range(3):
        ex = make_example(task, length, tok, seed=seed)
        assert len(ex.tokens) == length
        assert tok.decode(ex.answer_tokens) == ex.answer
        # mqar: the queries' answers from the bindings alone (the answers in the text are not read)
        text = tok.decode(ex.tokens if task == "mqar" else ex.tokens[: ex.answer_start])
        assert solve(task, text) == ex.answer


def test_distractors_fill_the_context_and_the_needle_moves(tok):
    exs = eval_set("retrieval", 2000, 8, tok)
    positions = set()
    for ex in exs:
        text = tok.decode(ex.tokens[: ex.answer_start])
        lines = text.strip("\n").split("\n")
        assert len(lines) > 100  # the context is mostly distractor bindings
        key = re.search(r"assert (\w+) ==", lines[-1]).group(1)
        positions.add(next(i for i, line in enumerate(lines) if line.startswith(f"    {key} =")))
    assert len(positions) == len(exs)  # the needle's depth varies with the seed


def test_count_answers_span_the_range(tok):
    answers = {make_example("count", 300, tok, seed=s, max_count=5).answer for s in range(40)}
    assert answers == {f" {i}" for i in range(1, 6)}


def test_multihop_hops(tok):
    ex = make_example("multihop", 400, tok, seed=3, hops=4)
    text = tok.decode(ex.tokens[: ex.answer_start])
    assert solve("multihop", text) == ex.answer
    key = re.search(r"assert (\w+) ==", text).group(1)
    binding = dict(re.findall(r"    (\w+) = (\w+)", text))
    chain = [key]
    while not chain[-1].isdigit():
        chain.append(binding[chain[-1]])
    assert len(chain) == 6  # the key, four names behind it, the value


def test_deterministic_and_splits_disjoint(tok):
    a, b = make_example("multihop", 500, tok, seed=7), make_example("multihop", 500, tok, seed=7)
    assert a == b
    train = {tuple(make_example("retrieval", 300, tok, seed=s, split="train").tokens) for s in range(30)}
    held_out = {tuple(ex.tokens) for ex in eval_set("retrieval", 300, 30, tok)}
    assert not train & held_out
    assert len(held_out) == 30
    # another length is another held-out set, not a prefix of this one
    assert eval_set("retrieval", 301, 1, tok)[0].tokens[-60:] != eval_set("retrieval", 300, 1, tok)[0].tokens[-60:]


def test_bad_arguments_are_named(tok):
    with pytest.raises(SyntheticError, match="unknown task 'sort'"):
        make_example("sort", 100, tok)
    with pytest.raises(SyntheticError, match="choose a longer length"):
        make_example("count", 40, tok, max_count=9, seed=0)
    with pytest.raises(SyntheticError, match="ratio must be in"):
        SyntheticMix(tok, 1.5)
    with pytest.raises(SyntheticError, match="unknown synthetic tasks"):
        SyntheticMix(tok, 0.5, tasks=("retrieval", "sort"))


def test_mix_replaces_the_ratio_of_positions_deterministically(tok):
    batch = torch.zeros(4, 240, dtype=torch.long)
    assert SyntheticMix(tok, 0.0).apply(batch, 0) is batch
    full = SyntheticMix(tok, 1.0, seed=1).apply(batch, 8)
    assert (full != 0).any(-1).all()  # every row is an example now
    mix = SyntheticMix(tok, 0.25, seed=2)
    chosen = [mix.example_at(p, 240) for p in range(400)]
    share = sum(ex is not None for ex in chosen) / 400
    assert 0.18 < share < 0.32
    assert {ex.task for ex in chosen if ex is not None} == set(MIX_TASKS)
    again = SyntheticMix(tok, 0.25, seed=2)
    for p in (0, 57, 399):
        a, b = chosen[p], again.example_at(p, 240)
        assert (a is None and b is None) or a == b
    mixed = mix.apply(torch.zeros(8, 240, dtype=torch.long), 16)
    rows = [chosen[p] is not None for p in range(16, 24)]
    assert [bool((r != 0).any()) for r in mixed] == rows


def test_mqar_queries_bindings_that_are_each_in_the_context_once(tok):
    for seed in range(4):
        ex = make_example("mqar", 400, tok, seed=seed, pairs=10, queries=3)
        assert len(ex.tokens) == 400
        assert len(ex.spans) == 3 and ex.spans[-1][1] == 400 and ex.answer_start == ex.spans[0][0]
        text = tok.decode(ex.tokens)
        bindings = re.findall(r"^    (\w+) = (\d{4})$", text, re.M)
        keys = [key for key, _ in bindings]
        assert len(bindings) == 10 and len(set(keys)) == 10
        asked = re.findall(r"^    assert (\w+) ==", text, re.M)
        assert len(asked) == len(set(asked)) == 3 and set(asked) <= set(keys)
        values = dict(bindings)
        for key, (start, end) in zip(asked, ex.spans, strict=True):
            answer = tok.decode(ex.tokens[start:end])
            assert answer == f" {values[key]}"
            assert text.count(f"    {key} = ") == 1  # its binding once, in the context
            # the answer follows its own query line
            assert tok.decode(ex.tokens[:start]).endswith(f"    assert {key} ==")
        assert ex.answer == "".join(f" {values[key]}" for key in asked)


def test_mqar_pairs_default_to_filling_the_length_and_sweep_at_one_length(tok):
    full = make_example("mqar", 600, tok, seed=1)
    n_full = len(re.findall(r"^    \w+ = \d+$", tok.decode(full.tokens), re.M))
    assert len(full.spans) == DEFAULT_QUERIES
    # every binding line is 16 byte tokens: padding is less than one more line
    assert full.tokens[: full.answer_start].count(tok.encode("\n")[0]) - n_full < 16
    for pairs in (4, 12, n_full):
        ex = make_example("mqar", 600, tok, seed=1, pairs=pairs)
        assert len(ex.tokens) == 600
        assert len(re.findall(r"^    \w+ = \d+$", tok.decode(ex.tokens), re.M)) == pairs
    too_many = f"mqar with {n_full + 1} pairs and 4 queries takes .* more than the length"
    with pytest.raises(SyntheticError, match=too_many):
        make_example("mqar", 600, tok, seed=1, pairs=n_full + 1)


def test_mqar_deterministic_and_splits_disjoint(tok):
    assert make_example("mqar", 300, tok, seed=5, pairs=6) == make_example("mqar", 300, tok, seed=5, pairs=6)
    train = {tuple(make_example("mqar", 300, tok, seed=s, split="train").tokens) for s in range(30)}
    held_out = {tuple(ex.tokens) for ex in eval_set("mqar", 300, 30, tok)}
    assert len(held_out) == 30 and not train & held_out
    assert SyntheticMix(tok, 1.0, tasks=("mqar",)).example_at(3, 300).task == "mqar"


def test_mqar_bad_arguments_are_named(tok):
    with pytest.raises(SyntheticError, match="more than the length of 100: choose fewer pairs or a longer length"):
        make_example("mqar", 100, tok, pairs=20)
    with pytest.raises(SyntheticError, match="at least as many pairs as queries, got 2 pairs and 3 queries"):
        make_example("mqar", 400, tok, pairs=2, queries=3)
    with pytest.raises(SyntheticError, match="at least 1 query"):
        make_example("mqar", 400, tok, queries=0)
    with pytest.raises(SyntheticError, match="pairs is a parameter of the mqar task, not of retrieval"):
        make_example("retrieval", 400, tok, pairs=5)
    with pytest.raises(SyntheticError, match="choose a longer length"):
        make_example("mqar", 60, tok)
