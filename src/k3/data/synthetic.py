"""Synthetic long-range tasks (SPEC §2.9): answers that need facts scattered across the whole context.

Four tasks, each a Python-looking block of indented lines, then a query line, then the answer:

- retrieval: every line binds a random 4-letter key to a 4-digit value (`    qvzx = 4821`); the
  query asks for one key's value (`    assert qvzx ==` -> ` 4821`). Every other line is a distractor
  of the same form, so only exact recall of that one line answers it.
- multihop: chains key -> key -> ... -> value (`    abcd = efgh`, `    efgh = 4821`), their lines
  shuffled over the context among the lines of distractor chains; the query names a chain's first key.
- count: lines `    log("abcd")` and, 1 .. max_count of them, `    hit("abcd")` anywhere; the
  answer is how many hits (`    assert hits ==` -> ` 3`): an aggregate over the whole context.
- mqar (multi-query associative recall, as in Zoology/Based): `pairs` bindings `    qvzx = 4821` with
  distinct keys, then `queries` query lines each followed by its answer (`    assert qvzx ==` -> ` 4821`,
  a newline between one answer and the next query), the queried keys distinct, drawn from the pairs, in
  random order. Every pair may be asked for, so the context must be held whole: a fixed-size recurrent
  state (KDA) runs out as `pairs` grows at a fixed length, attention (MLA) does not. `pairs` defaults to as
  many as fit the length (the context is all bindings, as in retrieval); a smaller `pairs` leaves newline
  padding in front, so a sweep over `pairs` at one length varies only how much must be remembered.

An example is defined by its tokens (each line tokenised alone and concatenated, so the length is
exact): `length` tokens in all, the last `len(answer)` of them the answer, padded at the front with
newline tokens where the last line did not fit. An mqar example has one answer span per query, the last
at the end; each is scored given the true tokens before it, earlier queries' answers included.
Everything is a function of (task, split, length, seed): `split` "train" and "eval" draw from disjoint
random streams, so a held-out set per length is `eval_set(task, length, n, tokenizer)` and training never
sees it.

`SyntheticMix` replaces a fixed fraction of training sequences with examples, chosen by data position,
so a resumed run reads exactly the same mix.
"""

import hashlib
import itertools
import random
from dataclasses import dataclass

import torch

TASKS = ("retrieval", "multihop", "count", "mqar")
# what `k3 train --synthetic-ratio` mixes in by default (`--synthetic-tasks` names others): the tasks that were
# there before mqar, so that a run's mix (and the measurements made with it) stays as it was
MIX_TASKS = ("retrieval", "multihop", "count")
DEFAULT_QUERIES = 4
SPLITS = ("train", "eval")
LETTERS = "abcdefghijklmnopqrstuvwxyz"
INDENT = "    "


class SyntheticError(ValueError):
    """A synthetic task was asked for with arguments it cannot be made with."""


@dataclass(frozen=True)
class SyntheticExample:
    task: str
    tokens: list[int]  # the prompt followed by the answer, exactly `length` ids
    answer_start: int  # index of the first answer token
    answer: str  # the answer as text (" 4821"); mqar: every query's answer, concatenated in order
    # mqar: (start, end) token indices of each query's answer, in order; the other tasks: empty, their one
    # answer is tokens[answer_start:]
    answer_spans: tuple[tuple[int, int], ...] = ()

    @property
    def spans(self) -> tuple[tuple[int, int], ...]:
        """(start, end) of every answer, in order: what scoring checks, one span for every task but mqar."""
        return self.answer_spans or ((self.answer_start, len(self.tokens)),)

    @property
    def answer_tokens(self) -> list[int]:
        return [t for start, end in self.spans for t in self.tokens[start:end]]


def _rng(task: str, split: str, length: int, seed: int) -> random.Random:
    digest = hashlib.sha256(f"k3.synthetic/{task}/{split}/{length}/{seed}".encode()).digest()
    return random.Random(int.from_bytes(digest[:8], "big"))


class _Names:
    """Distinct random 4-letter names for one example."""

    def __init__(self, rng: random.Random):
        self.rng, self.used = rng, set()

    def __call__(self) -> str:
        while True:
            name = "".join(self.rng.choice(LETTERS) for _ in range(4))
            if name not in self.used and name not in ("hits", "assert"):
                self.used.add(name)
                return name


def _fill(units: list[list[str]], more, budget: int, encode) -> list[list[int]]:
    """The token lines of `units` (each a group of lines that must all appear), then of more() units
    while they fit in `budget` tokens. Returns the lines' token lists (groups flattened)."""
    lines: list[list[int]] = []
    used = 0
    for unit in units:
        ids = [encode(line) for line in unit]
        used += sum(map(len, ids))
        lines += ids
    if used > budget:
        raise SyntheticError(
            f"the task's required lines take {used} tokens, more than the {budget} left for the "
            f"context: choose a longer length"
        )
    while True:
        ids = [encode(line) for line in more()]
        size = sum(map(len, ids))
        if used + size > budget:
            return lines
        used += size
        lines += ids


def make_example(
    task: str,
    length: int,
    tokenizer,
    seed: int = 0,
    split: str = "eval",
    hops: int = 2,
    max_count: int | None = None,
    pairs: int | None = None,
    queries: int = DEFAULT_QUERIES,
) -> SyntheticExample:
    """One example of `task` exactly `length` tokens long (tokenizer: anything with `encode(str) -> ids`).

    hops: key -> key links before the value in multihop (2: key -> key -> value); max_count: the most
    marked lines in count (the answer is uniform in 1 .. max_count; default min(9, length // 64), so
    that short sequences have room for the context around the marked lines); pairs, queries: mqar's
    bindings (default: as many as fit) and queries."""
    if max_count is None:
        max_count = min(9, max(1, length // 64))
    if task not in TASKS:
        raise SyntheticError(f"unknown task {task!r}; choose one of {', '.join(TASKS)}")
    if split not in SPLITS:
        raise SyntheticError(f"unknown split {split!r}; choose one of {', '.join(SPLITS)}")
    if hops < 1 or max_count < 1:
        raise SyntheticError(f"hops and max_count must be at least 1, got {hops} and {max_count}")
    if task != "mqar" and pairs is not None:
        raise SyntheticError(f"pairs is a parameter of the mqar task, not of {task}")
    rng = _rng(task, split, length, seed)
    name = _Names(rng)
    encode = tokenizer.encode

    def value() -> str:
        return str(rng.randrange(1000, 10000))

    if task == "mqar":
        return _mqar(length, encode, name, value, rng, pairs, queries)
    if task == "retrieval":
        key, answer = name(), " " + value()
        required = [[f"{INDENT}{key} ={answer}\n"]]
        query = f"{INDENT}assert {key} =="

        def more() -> list[str]:
            return [f"{INDENT}{name()} = {value()}\n"]
    elif task == "multihop":
        chain = [name() for _ in range(hops + 1)]
        answer = " " + value()
        links = [f"{INDENT}{a} = {b}\n" for a, b in itertools.pairwise(chain)]
        required = [[*links, f"{INDENT}{chain[-1]} ={answer}\n"]]
        query = f"{INDENT}assert {chain[0]} =="

        def more() -> list[str]:
            names = [name() for _ in range(hops + 1)]
            return [
                *(f"{INDENT}{a} = {b}\n" for a, b in itertools.pairwise(names)),
                f"{INDENT}{names[-1]} = {value()}\n",
            ]
    else:
        hits = rng.randint(1, max_count)
        answer = f" {hits}"
        required = [[f'{INDENT}hit("{name()}")\n'] for _ in range(hits)]
        query = f"{INDENT}assert hits =="

        def more() -> list[str]:
            return [f'{INDENT}log("{name()}")\n']

    query_ids, answer_ids = encode(query), encode(answer)
    lines = _fill(required, more, length - len(query_ids) - len(answer_ids), encode)
    rng.shuffle(lines)  # the required lines land anywhere in the context
    body = [t for line in lines for t in line]
    newline = encode("\n")
    pad = newline * (length - len(body) - len(query_ids) - len(answer_ids))
    tokens = pad + body + query_ids + answer_ids
    return SyntheticExample(task, tokens, len(tokens) - len(answer_ids), answer)


def _mqar(length: int, encode, name, value, rng: random.Random, pairs: int | None, queries: int) -> SyntheticExample:
    """An mqar example (see the module docstring): the bindings, shuffled, then the queries with answers."""
    if queries < 1 or (pairs is not None and pairs < queries):
        raise SyntheticError(
            f"mqar needs at least 1 query and at least as many pairs as queries, got {pairs} pairs and "
            f"{queries} queries"
        )
    # the queried pairs come first and are always in; the others only fill the context
    asked = [(name(), " " + value()) for _ in range(queries)]
    tail: list[int] = []
    spans: list[tuple[int, int]] = []
    for i, (key, answer) in enumerate(asked):
        tail += encode(f"{INDENT}assert {key} ==")
        answer_ids = encode(answer)
        spans.append((len(tail), len(tail) + len(answer_ids)))
        tail += answer_ids + (encode("\n") if i < queries - 1 else [])
    required = [[f"{INDENT}{key} ={answer}\n"] for key, answer in asked]

    def more() -> list[str]:
        return [f"{INDENT}{name()} = {value()}\n"]

    budget = length - len(tail)
    if pairs is None:
        lines = _fill(required, more, budget, encode)
    else:
        units = required + [more() for _ in range(pairs - queries)]
        lines = [encode(line) for unit in units for line in unit]
        used = sum(map(len, lines))
        if used > budget:
            raise SyntheticError(
                f"mqar with {pairs} pairs and {queries} queries takes {used + len(tail)} tokens, more than the "
                f"length of {length}: choose fewer pairs or a longer length"
            )
    rng.shuffle(lines)  # the queried bindings land anywhere among the others
    body = [t for line in lines for t in line]
    prompt = encode("\n") * (budget - len(body)) + body
    tokens = prompt + tail
    spans = [(len(prompt) + start, len(prompt) + end) for start, end in spans]
    answer = "".join(answer for _, answer in asked)
    return SyntheticExample("mqar", tokens, spans[0][0], answer, tuple(spans))


def eval_set(task: str, length: int, count: int, tokenizer, **kwargs) -> list[SyntheticExample]:
    """The held-out examples 0 .. count-1 of `task` at `length` (split "eval": never used in training)."""
    return [make_example(task, length, tokenizer, seed=i, split="eval", **kwargs) for i in range(count)]


def _unit(seed: int, position: int) -> float:
    """A deterministic number in [0, 1) for a data position."""
    digest = hashlib.sha256(f"k3.mix/{seed}/{position}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


class SyntheticMix:
    """A fraction `ratio` of training sequences replaced by synthetic examples of the sequence's length.

    Whether data position p is synthetic, and which task and example it holds, depend only on
    (seed, p): the mix is the same on every machine and after a resume."""

    def __init__(self, tokenizer, ratio: float, seed: int = 0, tasks: tuple[str, ...] = MIX_TASKS):
        if not 0 <= ratio <= 1:
            raise SyntheticError(f"the synthetic ratio must be in [0, 1], got {ratio}")
        unknown = [t for t in tasks if t not in TASKS]
        if unknown or not tasks:
            raise SyntheticError(f"unknown synthetic tasks {unknown or tasks}; choose from {', '.join(TASKS)}")
        self.tokenizer, self.ratio, self.seed, self.tasks = tokenizer, ratio, seed, tuple(tasks)

    def check_length(self, seq_len: int) -> None:
        """A readable SyntheticError when one of the tasks cannot be made `seq_len` tokens long."""
        for task in self.tasks:
            try:
                make_example(task, seq_len, self.tokenizer)
            except SyntheticError as e:
                raise SyntheticError(
                    f"--synthetic-ratio: the {task} task does not fit in sequences of {seq_len} "
                    f"tokens ({e}); train on longer sequences or without it"
                ) from None

    def example_at(self, position: int, seq_len: int) -> SyntheticExample | None:
        """The example that replaces data position `position`, or None to keep the corpus sequence."""
        u = _unit(self.seed, position)
        if u >= self.ratio:
            return None
        task = self.tasks[int(u / self.ratio * len(self.tasks)) % len(self.tasks)]
        return make_example(task, seq_len, self.tokenizer, seed=self.seed * 1_000_003 + position, split="train")

    def apply(self, batch_BT: torch.Tensor, position: int) -> torch.Tensor:
        """batch (B, T) of the sequences at positions position .. position + B - 1, with the synthetic
        ones replaced (a new tensor when any is; the input otherwise)."""
        out = batch_BT
        for row in range(batch_BT.shape[0]):
            ex = self.example_at(position + row, batch_BT.shape[1])
            if ex is not None:
                out = out.clone() if out is batch_BT else out
                out[row] = torch.tensor(ex.tokens, dtype=batch_BT.dtype)
        return out
