"""Per request, which tokens may come next under a grammar: a (V,) bool mask per step, and advance(token).

A CompiledGrammar binds a grammar to a vocabulary. Its states are interned as the nodes of a DFA that is
built only as far as it is walked: each node memoises its transitions (symbol -> node), so feeding the same
byte to the same state twice costs one dict lookup. The mask of a state comes from walking the vocabulary's
trie from it (k3.structured.trie): a refused byte prunes its whole subtree, and a subtree that the state
reads without telling its bytes apart is accepted in one range without being walked. That is the chain
rule: most bytes of a state inside a string lead to one same successor (the state itself in free text or
an unbounded string; the next count in a string with maxLength), and if every byte of a subtree h bytes
deep is one of those for each of the h states of that chain, every node at depth d of the subtree is the
chain's d-th state, so every token in it is allowed.

Masks are memoised by state in a cache of at most mask_cache_bytes, packed: a bit per token, or the allowed
ids when fewer (a structural state allows a handful of tokens). Requests with the same grammar share one
CompiledGrammar (GrammarCompiler), so their states, transitions and masks are shared.

Memory, at the released model's V = 163,840: a packed mask is 20 KiB, so the default 8 MiB holds 400 dense
masks (and thousands of sparse ones), and the UNPACKED_MASKS most recent are also kept as (V,) bool (2.5
MiB); a DFA node is a few hundred bytes plus its transitions, MAX_STATES of them per grammar;
GrammarCompiler keeps MAX_GRAMMARS grammars, so at most 16 × 10.5 MiB of masks in all.
"""

from collections import OrderedDict
from collections.abc import Iterable

import torch

from k3.structured.grammar import Grammar, GrammarError, State, Symbol, special_spellings, trim
from k3.structured.vocabulary import Vocabulary

MASK_CACHE_BYTES = 8 << 20  # per compiled grammar
MAX_STATES = 50_000  # DFA nodes per compiled grammar; past it the DFA is dropped and rebuilt as it is walked
MAX_GRAMMARS = 16  # compiled grammars a GrammarCompiler keeps
UNPACKED_MASKS = 16  # masks per compiled grammar also kept as (V,) bool: 2.5 MiB at V = 163,840
_ALL_BYTES = (1 << 256) - 1
_CHAIN_MIN_NODES = 64  # a subtree this big is worth extending a chain for (256 transitions per chain node)
_MISSING = object()
_BITS = 1 << torch.arange(8, dtype=torch.uint8)


class GrammarViolation(ValueError):
    """A token the grammar does not allow where it was given."""


class _Node:
    """One DFA state: the grammar State and its transitions as far as computed. Once computed (all 256 byte
    transitions): `common`, the successor most bytes lead to, and `common_bytes`, those bytes (a 256-bit
    int); `chain`: for the chain node, u(node), u(u(node)), …, the bytes common to the first d of them
    (entry d - 1), `chain_end` the last node of it so far (None once the chain ends)."""

    __slots__ = ("can_end", "chain", "chain_end", "closed", "common", "common_bytes", "next", "state")

    def __init__(self, state: State) -> None:
        self.state = state
        self.next: dict[Symbol, _Node | None] = {}
        self.can_end, self.closed = state.can_end(), state.is_closed()
        self._forget()

    def _forget(self) -> None:
        self.common: _Node | None = None
        self.common_bytes: int | None = None
        self.chain: list[int] = []
        self.chain_end: _Node | None = self


def _pack(mask_V: torch.Tensor) -> torch.Tensor:
    """(V,) bool -> the allowed ids (int32) when that is smaller, else one bit per token (uint8)."""
    V = mask_V.numel()
    ids = mask_V.nonzero().squeeze(1)
    if 4 * len(ids) < (V + 7) // 8:
        return ids.to(torch.int32)
    padded = torch.cat([mask_V, mask_V.new_zeros((-V) % 8)]).view(-1, 8).to(torch.uint8)
    return (padded * _BITS).sum(1, dtype=torch.uint8)


def _unpack(packed: torch.Tensor, V: int) -> torch.Tensor:
    if packed.dtype == torch.int32:
        mask_V = torch.zeros(V, dtype=torch.bool)
        mask_V[packed.long()] = True
        return mask_V
    return (packed[:, None] & _BITS).bool().view(-1)[:V]


class CompiledGrammar:
    """A grammar bound to a vocabulary. Raises GrammarError when the grammar matches nothing or names a
    special token the vocabulary lacks."""

    def __init__(
        self,
        grammar: Grammar,
        vocab: Vocabulary,
        mask_cache_bytes: int = MASK_CACHE_BYTES,
        max_states: int = MAX_STATES,
    ) -> None:
        if not isinstance(grammar, Grammar):
            raise GrammarError(f"expected a k3.structured grammar, got {type(grammar).__name__}")
        missing = sorted(special_spellings(grammar) - set(vocab.special_ids))
        if missing:
            raise GrammarError(f"the grammar needs special tokens the tokenizer does not have: {', '.join(missing)}")
        self.grammar, self.vocab = trim(grammar), vocab
        self.mask_cache_bytes, self.max_states = mask_cache_bytes, max_states
        self.nodes: dict[State, _Node] = {}
        self.masks: OrderedDict[State, torch.Tensor] = OrderedDict()
        self.cached_bytes = 0
        self.unpacked: OrderedDict[State, torch.Tensor] = OrderedDict()
        self.hits = self.misses = self.resets = 0
        self.start = self._intern(self.grammar.start())

    def _intern(self, state: State) -> _Node:
        node = self.nodes.get(state)
        if node is None:
            node = self.nodes[state] = _Node(state)
        return node

    def _forget_states(self) -> None:
        """Past max_states: drop the DFA (matchers keep their nodes; their transitions are recomputed)."""
        for node in self.nodes.values():
            node.next.clear()
            node._forget()
        self.nodes.clear()
        self.start = self._intern(self.start.state)
        self.resets += 1

    def step(self, node: _Node, symbol: Symbol) -> "_Node | None":
        """The node after one symbol (None: refused), memoised on the node."""
        nxt = node.next.get(symbol, _MISSING)
        if nxt is _MISSING:
            state = node.state.feed(symbol)
            nxt = node.next[symbol] = None if state is None else self._intern(state)
        return nxt

    def feed_token(self, node: _Node, token_id: int) -> "_Node | None":
        symbols = self.vocab.symbols(token_id)
        if not symbols:
            return None
        for s in symbols:
            node = self.step(node, s)
            if node is None:
                return None
        return node

    def _common(self, node: _Node) -> None:
        """node's most common successor over the 256 bytes, and the bytes that lead to it."""
        by_successor: dict[_Node, int] = {}
        for b in range(256):
            nxt = self.step(node, b)
            if nxt is not None:
                by_successor[nxt] = by_successor.get(nxt, 0) | 1 << b
        node.common = max(by_successor, key=lambda n: by_successor[n].bit_count(), default=None)
        node.common_bytes = 0 if node.common is None else by_successor[node.common]

    def _reads_whole(self, node: _Node, height: int, below: int) -> bool:
        """Whether every byte of a subtree `height` deep, whose bytes are `below`, is one of the common bytes
        of each of the first `height` nodes of node's chain (the chain rule of the module's docstring)."""
        chain = node.chain
        while len(chain) < height:
            last = node.chain_end
            if last is None or (chain and below & ~chain[-1]):
                return False
            if last.common_bytes is None:
                self._common(last)
            chain.append(last.common_bytes & (chain[-1] if chain else _ALL_BYTES))
            if last.common is last:  # a loop: the chain stays on it, so every later entry is this one
                chain.extend([chain[-1]] * (height - len(chain)))
            node.chain_end = last.common
        return not below & ~chain[height - 1]

    def allowed(self, node: _Node) -> torch.Tensor:
        """(V,) bool, a fresh tensor: the tokens whose symbols the grammar reads from node (stop tokens are
        the matcher's business). The last UNPACKED_MASKS masks are also kept unpacked: a batch of requests
        in the same few states (one schema's structure) then costs a copy each, not an unpack."""
        state = node.state
        mask_V = self.unpacked.get(state)
        if mask_V is not None:
            self.hits += 1
            self.unpacked.move_to_end(state)
            return mask_V.clone()
        packed = self.masks.get(state)
        if packed is not None:
            self.hits += 1
            self.masks.move_to_end(state)
            mask_V = _unpack(packed, self.vocab.size)
        else:
            mask_V = self._miss(node)
        self.unpacked[state] = mask_V
        if len(self.unpacked) > UNPACKED_MASKS:
            self.unpacked.popitem(last=False)
        return mask_V.clone()

    def _miss(self, node: _Node) -> torch.Tensor:
        self.misses += 1
        if len(self.nodes) > self.max_states:
            self._forget_states()
        mask_V = self._walk(node)
        packed = _pack(mask_V)
        size = packed.numel() * packed.element_size()
        if size <= self.mask_cache_bytes:
            self.masks[node.state] = packed
            self.cached_bytes += size
            while self.cached_bytes > self.mask_cache_bytes:
                _, old = self.masks.popitem(last=False)
                self.cached_bytes -= old.numel() * old.element_size()
        return mask_V

    def _walk(self, start: _Node) -> torch.Tensor:
        """Every token from `start`, through the trie in preorder with the node reached at each depth."""
        trie = self.vocab.trie
        byte, depth, end, first, below, height = trie.byte, trie.depth, trie.end, trie.first, trie.below, trie.height
        los: list[int] = []
        his: list[int] = []
        at = [start] * (trie.max_depth + 1)
        step = self.step
        if start.common_bytes is None:
            self._common(start)  # the walk reads every first byte from start anyway
        i, n = 1, trie.num_nodes
        while i < n:
            parent = at[depth[i] - 1]
            size = end[i] - i
            # a subtree the parent's chain reads whole is one range; the chain's nodes get their common bytes
            # computed only for subtrees big enough to be worth 256 transitions (they are a string's next states)
            whole = (
                size > 1
                and parent.common_bytes is not None
                and not below[i] & ~parent.common_bytes
                and (size >= _CHAIN_MIN_NODES or len(parent.chain) >= height[i] or parent.common is parent)
                and self._reads_whole(parent, height[i], below[i])
            )
            if whole:
                lo, hi, i = first[i], first[end[i]], end[i]
            else:
                node = parent.next.get(byte[i], _MISSING)
                if node is _MISSING:
                    node = step(parent, byte[i])
                if node is None:  # refused: the whole subtree with it
                    i = end[i]
                    continue
                if node is parent and parent.common_bytes is None and size > 1:
                    self._common(parent)  # a loop: free text or a string; its subtrees may be read whole
                    continue
                lo, hi = first[i], first[i + 1]
                at[depth[i]] = node
                i += 1
            if hi > lo:
                if los and his[-1] == lo:
                    his[-1] = hi
                else:
                    los.append(lo)
                    his.append(hi)
        T = trie.num_tokens
        inside_T = torch.zeros(T + 1, dtype=torch.int32)
        if los:
            inside_T.index_add_(0, torch.tensor(los), torch.ones(len(los), dtype=torch.int32))
            inside_T.index_add_(0, torch.tensor(his), torch.full((len(his),), -1, dtype=torch.int32))
        mask_V = torch.zeros(self.vocab.size, dtype=torch.bool)
        mask_V[trie.order] = inside_T.cumsum(0)[:T].bool()
        specials = [i for i, s in self.vocab.specials.items() if step(start, s) is not None]
        if specials:
            mask_V[specials] = True
        return mask_V

    def matcher(self, end_token_ids: Iterable[int] = ()) -> "GrammarMatcher":
        return GrammarMatcher(self, end_token_ids)


class GrammarMatcher:
    """One request's position in its grammar.

    end_token_ids: the tokens that end the request (its eos and stop tokens): allowed wherever the grammar
    may end, and then only where it is complete and can read nothing more. finished: an end token was
    accepted, or the grammar is complete with no end token to offer (the request is done; nothing may follow).
    """

    def __init__(self, compiled: CompiledGrammar, end_token_ids: Iterable[int] = ()) -> None:
        self.compiled, self.node = compiled, compiled.start
        self.end_token_ids = tuple(sorted(set(end_token_ids)))
        self.ended = False

    @property
    def state(self) -> State:
        return self.node.state

    @property
    def finished(self) -> bool:
        return self.ended or (self.node.closed and not self.end_token_ids)

    def mask(self) -> torch.Tensor:
        """(V,) bool on the CPU: the tokens that may come next. Never empty (raises GrammarError instead,
        which only a vocabulary lacking a byte the grammar needs can cause)."""
        if self.finished:
            raise GrammarError("the grammar is complete; no token may follow")
        mask_V = self.compiled.allowed(self.node)
        if self.node.can_end and self.end_token_ids:
            mask_V[list(self.end_token_ids)] = True
        if not mask_V.any():
            raise GrammarError("no token of the vocabulary continues the grammar here")
        return mask_V

    def accepts(self, token_id: int) -> bool:
        if self.finished:
            return False
        end = self.node.can_end and token_id in self.end_token_ids
        return end or self.compiled.feed_token(self.node, token_id) is not None

    def advance(self, token_id: int) -> None:
        """Move past token_id; GrammarViolation if the grammar does not allow it here."""
        nxt = None if self.finished else self.compiled.feed_token(self.node, token_id)
        if nxt is not None:
            self.node = nxt
        elif not self.finished and self.node.can_end and token_id in self.end_token_ids:
            self.ended = True
        else:
            symbols = self.compiled.vocab.symbols(token_id)
            raise GrammarViolation(f"token {token_id} {symbols!r} is not allowed by the request's grammar here")


class GrammarCompiler:
    """The compiled grammars of one vocabulary, the least recently used dropped past max_grammars."""

    def __init__(
        self, vocab: Vocabulary, max_grammars: int = MAX_GRAMMARS, mask_cache_bytes: int = MASK_CACHE_BYTES
    ) -> None:
        self.vocab, self.max_grammars, self.mask_cache_bytes = vocab, max_grammars, mask_cache_bytes
        self.compiled: OrderedDict[Grammar, CompiledGrammar] = OrderedDict()

    def compile(self, grammar: Grammar) -> CompiledGrammar:
        hit = self.compiled.get(grammar)
        if hit is not None:
            self.compiled.move_to_end(grammar)
            return hit
        compiled = self.compiled[grammar] = CompiledGrammar(grammar, self.vocab, self.mask_cache_bytes)
        while len(self.compiled) > self.max_grammars:
            self.compiled.popitem(last=False)
        return compiled

    def matcher(self, grammar: Grammar, end_token_ids: Iterable[int] = ()) -> GrammarMatcher:
        """A matcher at the start of grammar (compiled once); GrammarError for a grammar that only matches the
        empty output of a request with no end token, which could sample nothing."""
        matcher = self.compile(grammar).matcher(end_token_ids)
        if matcher.finished:
            raise GrammarError("the grammar matches only an empty output, and the request has no stop token to end it")
        return matcher
