"""Incremental recognisers over a symbol stream: the grammar half of structured outputs.

A symbol is a byte (an int 0–255) or a special token named by its spelling (a str, "<|open|>"): a special
token can never be spelled by bytes, so a grammar says which one it wants. A grammar is a graph of immutable
nodes built from the combinators below; `grammar.start()` is a State, `state.feed(symbol)` the next State or
None where the symbol is not allowed, `state.can_end()` whether the symbols so far are a complete match.

A state is the set of every way the symbols so far can go on, so nothing is decided early: Text "ends where
the next element begins" because the reading that ends it and the reading that goes on both stay alive
until a symbol tells them apart. Each way is a stack of items (node, progress), top last: the top is the
node reading the next symbol and how far it has got; below it, what follows once it is done. Structural
nodes (Sequence, Choice, Repeat, Rule) only rewrite the top of a stack before a symbol is read ("settling");
consumers (Literal, Special, ByteSet, Text, and the JSON lexemes of k3.structured.json_schema) read
symbols. Every state is settled: each stack's top is a consumer, or the stack is empty (the match may end).
States compare and hash by value, so the masks of k3.structured.matcher are memoised by state.

Nodes compare and hash by their fields (the hash computed once, since a state hashes its stacks' nodes
over and over); a Rule, the one node that may be part of a cycle (recursive JSON schemas), by identity.
"""

from collections.abc import Iterable, Iterator

Symbol = int | str  # a byte 0–255, or a special token's spelling
Item = tuple["Grammar", object]  # (node, its progress)
Stack = tuple[Item, ...]  # top last


class GrammarError(ValueError):
    """A grammar that cannot be used: it matches nothing, or names a special token the vocabulary lacks."""


class _Done:
    """What Consumer.step returns when the symbol completed the node (its item is popped)."""

    def __repr__(self) -> str:
        return "DONE"


DONE = _Done()


class Grammar:
    """Base of every node: immutable, equal when of the same type with equal fields."""

    __slots__ = ("_hash", "_key")

    def __init__(self, *key: object) -> None:
        object.__setattr__(self, "_key", key)
        object.__setattr__(self, "_hash", hash((type(self).__name__, key)))

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(f"{type(self).__name__} is immutable")

    def __eq__(self, other: object) -> bool:
        if self is other:
            return True
        return type(other) is type(self) and self._hash == other._hash and self._key == other._key

    def __hash__(self) -> int:
        return self._hash

    def __repr__(self) -> str:
        return f"{type(self).__name__}({', '.join(map(repr, self._key))})"

    def initial(self) -> object:
        """The progress of this node before it has read anything."""
        return None

    def children(self) -> tuple["Grammar", ...]:
        """The nodes this one is made of (for walks over the graph: trimming, special-token checks)."""
        return ()

    def start(self) -> "State":
        """The state before any symbol: this grammar to be matched, nothing after it."""
        return State.settle([((self, self.initial()),)])


class Consumer(Grammar):
    """A node that reads symbols. step(progress, symbol): the new progress, DONE, or None (refused);
    can_end(progress): whether the node may be complete here without reading more."""

    __slots__ = ()

    def step(self, progress: object, symbol: Symbol) -> object:
        raise NotImplementedError

    def can_end(self, progress: object) -> bool:
        return False


class Structural(Grammar):
    """A node that reads nothing itself: expand(progress, rest) gives the stacks it stands for."""

    __slots__ = ()

    def expand(self, progress: object, rest: Stack) -> Iterable[Stack]:
        raise NotImplementedError


def push(rest: Stack, *nodes: Grammar) -> Stack:
    """rest with `nodes` on top, each from its start, the first of them topmost (read first)."""
    return rest + tuple((n, n.initial()) for n in reversed(nodes))


class Literal(Consumer):
    """Exactly these bytes (a str is taken as its UTF-8). Progress: how many have been read."""

    __slots__ = ("data",)
    data: bytes

    def __init__(self, data: bytes | str) -> None:
        data = data.encode("utf-8") if isinstance(data, str) else data
        if not isinstance(data, bytes) or not data:
            raise GrammarError(f"Literal takes non-empty bytes or str, got {data!r} (Sequence() matches nothing)")
        object.__setattr__(self, "data", data)
        super().__init__(data)

    def initial(self) -> int:
        return 0

    def step(self, progress: int, symbol: Symbol) -> object:
        if type(symbol) is not int or symbol != self.data[progress]:
            return None
        return DONE if progress + 1 == len(self.data) else progress + 1


class Special(Consumer):
    """One special token, by its spelling."""

    __slots__ = ("spelling",)
    spelling: str

    def __init__(self, spelling: str) -> None:
        if not isinstance(spelling, str) or not spelling:
            raise GrammarError(f"Special takes a special token's spelling, got {spelling!r}")
        object.__setattr__(self, "spelling", spelling)
        super().__init__(spelling)

    def step(self, progress: None, symbol: Symbol) -> object:
        return DONE if symbol == self.spelling else None


class ByteSet(Consumer):
    """One byte out of a set (bytes, or an iterable of ints 0–255), kept as a 256-bit mask."""

    __slots__ = ("mask",)
    mask: int

    def __init__(self, allowed: bytes | Iterable[int]) -> None:
        mask = 0
        for b in allowed:
            if not isinstance(b, int) or not 0 <= b < 256:
                raise GrammarError(f"ByteSet takes bytes 0-255, got {b!r}")
            mask |= 1 << b
        if not mask:
            raise GrammarError("ByteSet needs at least one byte")
        object.__setattr__(self, "mask", mask)
        super().__init__(mask)

    @classmethod
    def range(cls, lo: int, hi: int) -> "ByteSet":
        """The bytes lo … hi, both included."""
        return cls(range(lo, hi + 1))

    def step(self, progress: None, symbol: Symbol) -> object:
        return DONE if type(symbol) is int and self.mask >> symbol & 1 else None

    def __repr__(self) -> str:
        return f"ByteSet({bytes(b for b in range(256) if self.mask >> b & 1)!r})"


class Text(Consumer):
    """Free text of any length, ending wherever what follows it begins.

    forbid: byte strings that may not occur in the text; to make the first occurrence of a marker end the
    text, forbid the marker. specials: whether special tokens may occur in the text (default no, so a text
    followed by Special("<|close|>") ends at the first special token, which must be that one). Progress:
    the longest end of the text that is a proper start of a forbidden string (b"" without `forbid`).
    """

    __slots__ = ("_starts", "forbid", "specials")
    forbid: tuple[bytes, ...]
    specials: bool

    def __init__(self, forbid: Iterable[bytes | str] = (), specials: bool = False) -> None:
        forbid = tuple(sorted({f.encode("utf-8") if isinstance(f, str) else f for f in forbid}))
        if not all(isinstance(f, bytes) and f for f in forbid):
            raise GrammarError(f"Text's forbid takes non-empty byte strings, got {forbid!r}")
        if not isinstance(specials, bool):
            raise GrammarError(f"Text's specials is a bool, got {specials!r}")
        object.__setattr__(self, "forbid", forbid)
        object.__setattr__(self, "specials", specials)
        object.__setattr__(self, "_starts", frozenset(f[:k] for f in forbid for k in range(1, len(f))))
        super().__init__(forbid, specials)

    def initial(self) -> bytes:
        return b""

    def can_end(self, progress: bytes) -> bool:
        return True

    def step(self, progress: bytes, symbol: Symbol) -> object:
        if type(symbol) is not int:
            return b"" if self.specials else None  # a special token is no part of any byte string
        if not self.forbid:
            return b""
        tail = progress + bytes((symbol,))
        if any(tail.endswith(f) for f in self.forbid):
            return None
        for k in range(len(tail), 0, -1):
            if tail[-k:] in self._starts:
                return tail[-k:]
        return b""


class Sequence(Structural):
    """The parts one after another; Sequence() matches the empty string."""

    __slots__ = ("parts",)
    parts: tuple[Grammar, ...]

    def __init__(self, *parts: Grammar) -> None:
        _check_nodes(parts, "Sequence")
        object.__setattr__(self, "parts", parts)
        super().__init__(*parts)

    def children(self) -> tuple[Grammar, ...]:
        return self.parts

    def expand(self, progress: None, rest: Stack) -> Iterable[Stack]:
        return (push(rest, *self.parts),)


class Choice(Structural):
    """Any one of the options; Choice() matches nothing."""

    __slots__ = ("options",)
    options: tuple[Grammar, ...]

    def __init__(self, *options: Grammar) -> None:
        _check_nodes(options, "Choice")
        object.__setattr__(self, "options", options)
        super().__init__(*options)

    def children(self) -> tuple[Grammar, ...]:
        return self.options

    def expand(self, progress: None, rest: Stack) -> Iterable[Stack]:
        return (push(rest, o) for o in self.options)


class Repeat(Structural):
    """elem, min … max times (max None: no limit). Progress: the repetitions done, kept no higher than min
    when there is no max (more than min is all the same then), so a long repetition is one state."""

    __slots__ = ("elem", "max", "min")
    elem: Grammar
    min: int
    max: int | None

    def __init__(self, elem: Grammar, min: int = 0, max: int | None = None) -> None:
        _check_nodes((elem,), "Repeat")
        if not isinstance(min, int) or min < 0 or (max is not None and (not isinstance(max, int) or max < min)):
            raise GrammarError(f"Repeat needs 0 <= min <= max (max None for no limit), got min={min!r}, max={max!r}")
        object.__setattr__(self, "elem", elem)
        object.__setattr__(self, "min", min)
        object.__setattr__(self, "max", max)
        super().__init__(elem, min, max)

    def initial(self) -> int:
        return 0

    def children(self) -> tuple[Grammar, ...]:
        return (self.elem,)

    def expand(self, progress: int, rest: Stack) -> Iterator[Stack]:
        if progress >= self.min:
            yield rest
        if self.max is None or progress < self.max:
            done = min(progress + 1, self.min) if self.max is None else progress + 1
            yield (*rest, (self, done), (self.elem, self.elem.initial()))


class Rule(Structural):
    """A named node defined after it is made, so that it can refer to itself (a recursive grammar):
    `r = Rule("value"); r.define(Choice(..., Sequence(Literal("["), r, Literal("]"))))`. Compared by
    identity; define it exactly once, before its grammar is used."""

    __slots__ = ("_body", "name")
    name: str

    def __init__(self, name: str) -> None:
        object.__setattr__(self, "name", name)
        object.__setattr__(self, "_body", None)
        super().__init__(name)

    __eq__ = object.__eq__
    __hash__ = object.__hash__

    def define(self, body: Grammar) -> "Rule":
        if self._body is not None:
            raise GrammarError(f"Rule {self.name!r} is already defined")
        _check_nodes((body,), "Rule")
        object.__setattr__(self, "_body", body)
        return self

    @property
    def body(self) -> Grammar:
        if self._body is None:
            raise GrammarError(f"Rule {self.name!r} is used but was never defined")
        return self._body

    def children(self) -> tuple[Grammar, ...]:
        return (self.body,)

    def expand(self, progress: None, rest: Stack) -> Iterable[Stack]:
        return (push(rest, self.body),)


def _check_nodes(nodes: tuple, what: str) -> None:
    for n in nodes:
        if not isinstance(n, Grammar):
            raise GrammarError(f"{what} takes grammar nodes, got {type(n).__name__}: {n!r}")


class State:
    """The settled stacks after some symbols: immutable and hashable. feed(symbol) -> State | None."""

    __slots__ = ("_hash", "stacks")
    stacks: frozenset[Stack]

    def __init__(self, stacks: frozenset[Stack]) -> None:
        object.__setattr__(self, "stacks", stacks)
        object.__setattr__(self, "_hash", hash(stacks))

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError("State is immutable")

    def __eq__(self, other: object) -> bool:
        return self is other or (type(other) is State and self._hash == other._hash and self.stacks == other.stacks)

    def __hash__(self) -> int:
        return self._hash

    def __repr__(self) -> str:
        return f"State({len(self.stacks)} stacks, can_end={self.can_end()})"

    @staticmethod
    def settle(stacks: Iterable[Stack]) -> "State":
        """Expand structural tops until every stack's top is a consumer or the stack is empty. A consumer
        that may end here also stands for the stack below it. Stacks already seen are skipped, which is
        what stops a Repeat of something that can match the empty string."""
        out, seen, todo = set(), set(), list(stacks)
        while todo:
            stack = todo.pop()
            if stack in seen:
                continue
            seen.add(stack)
            if not stack:
                out.add(stack)
                continue
            node, progress = stack[-1]
            if isinstance(node, Consumer):
                out.add(stack)
                if node.can_end(progress):
                    todo.append(stack[:-1])
            else:
                todo.extend(node.expand(progress, stack[:-1]))
        return State(frozenset(out))

    def feed(self, symbol: Symbol) -> "State | None":
        """The state after `symbol`, or None if no way of going on reads it (nor ends after it)."""
        moved = []
        for stack in self.stacks:
            if not stack:
                continue
            node, progress = stack[-1]
            after = node.step(progress, symbol)
            if after is None:
                continue
            moved.append(stack[:-1] if after is DONE else (*stack[:-1], (node, after)))
        state = State.settle(moved) if moved else None
        return state if state is not None and state.stacks else None

    def feed_all(self, symbols: Iterable[Symbol]) -> "State | None":
        state = self
        for s in symbols:
            state = state.feed(s)
            if state is None:
                return None
        return state

    def can_end(self) -> bool:
        """Whether the symbols so far are a complete match."""
        return () in self.stacks

    def is_closed(self) -> bool:
        """Complete, and nothing more can be read: only a stop token can follow."""
        return self.stacks == _CLOSED

    def is_dead(self) -> bool:
        """No way at all (only a grammar that matches nothing starts here)."""
        return not self.stacks


_CLOSED = frozenset({()})


def _nodes(root: Grammar) -> list[Grammar]:
    """Every node reachable from root, each once (by identity: a Rule may close a cycle)."""
    seen, order, todo = set(), [], [root]
    while todo:
        node = todo.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        order.append(node)
        todo.extend(node.children())
    return order


def special_spellings(grammar: Grammar) -> set[str]:
    """The special tokens the grammar names (a vocabulary must have each of them)."""
    return {n.spelling for n in _nodes(grammar) if isinstance(n, Special)}


def _productive(nodes: list[Grammar]) -> set[int]:
    """The ids of the nodes that match at least one finite symbol string: a least fixpoint, since a Rule is
    productive only through a body that does not need the rule itself."""
    good: set[int] = set()
    changed = True
    while changed:
        changed = False
        for n in nodes:
            if id(n) in good:
                continue
            if isinstance(n, Sequence):
                ok = all(id(p) in good for p in n.parts)
            elif isinstance(n, Choice):
                ok = any(id(o) in good for o in n.options)
            elif isinstance(n, Repeat):
                ok = n.min == 0 or id(n.elem) in good
            elif isinstance(n, Rule):
                ok = id(n.body) in good
            else:
                ok = True  # consumers, and opaque nodes (Json) that trim their own graph when built
            if ok:
                good.add(id(n))
                changed = True
    return good


def trim(grammar: Grammar) -> Grammar:
    """An equivalent grammar with no dead ends: every part that can never be completed (a Choice(), a
    recursion that never bottoms out) is removed with everything that needs it, so that every state
    reachable by feeding symbols can still be completed. Raises GrammarError if nothing is left."""
    nodes = _nodes(grammar)
    good = _productive(nodes)
    if id(grammar) not in good:
        raise GrammarError(f"the grammar matches no finite input: {grammar!r}")
    if len(good) == len(nodes):
        return grammar
    memo: dict[int, Grammar] = {}

    def rebuild(n: Grammar) -> Grammar:
        if id(n) in memo:
            return memo[id(n)]
        if isinstance(n, Rule):
            new = memo[id(n)] = Rule(n.name)  # before its body: the body may refer to it
            return new.define(rebuild(n.body))
        if isinstance(n, Sequence):
            new = Sequence(*map(rebuild, n.parts))
        elif isinstance(n, Choice):
            new = Choice(*(rebuild(o) for o in n.options if id(o) in good))
        elif isinstance(n, Repeat):
            new = Repeat(rebuild(n.elem), n.min, n.max) if id(n.elem) in good else Sequence()
        else:
            new = n
        memo[id(n)] = new
        return new

    return rebuild(grammar)
