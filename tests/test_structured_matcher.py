"""The matcher's mask against a brute-force check of every token, on random states of several grammars;
end tokens where the grammar may end, never an empty mask, the bounded caches, packing, and advance."""

import json
import random
import re

import pytest
import torch

from k3.formats.tokenizer import train_tokenizer
from k3.structured import (
    Choice,
    CompiledGrammar,
    GrammarCompiler,
    GrammarError,
    GrammarViolation,
    Json,
    Literal,
    Repeat,
    Sequence,
    Special,
    Text,
    Vocabulary,
)
from k3.structured.matcher import _pack, _unpack

TEXTS = [
    json.dumps({"city": f"Oslo {i}", "days": i, "unit": ["celsius", "fahrenheit"][i % 2], "note": "é🙂" * (i % 3)})
    for i in range(300)
] + ["reasoning about the weather in <b>Oslo</b> and Rome\n"] * 30
TOK = train_tokenizer(TEXTS, vocab_size=600)
VOCAB = Vocabulary.of(TOK)
EOS = TOK.eos_id
OPEN, CLOSE, SEP, END = "<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>"
TOOL = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "days": {"type": "integer"},
        "unit": {"enum": ["celsius", "fahrenheit"]},
        "extra": {"type": "array", "items": {"type": ["number", "null"]}, "maxItems": 3},
    },
    "required": ["city"],
    "additionalProperties": {"type": "boolean"},
}
GRAMMARS = {
    "json_object": Json({"type": "object"}),
    "tool": Json(TOOL, max_whitespace=2),
    "chat": Sequence(
        Text(),
        Special(CLOSE),
        Literal("think"),
        Special(SEP),
        Special(OPEN),
        Literal("response"),
        Special(SEP),
        Json(TOOL),
        Special(CLOSE),
        Literal("response"),
        Special(SEP),
        Special(END),
    ),
    "forbid": Sequence(Text(forbid=["</b>"]), Literal("</b>"), Repeat(Literal(" ok"), 1, 3)),
}


def brute_force(state, end_token_ids) -> torch.Tensor:
    """Feed every token's symbols to the state: the mask the matcher must give."""
    mask = torch.zeros(VOCAB.size, dtype=torch.bool)
    for i in range(VOCAB.size):
        symbols = VOCAB.symbols(i)
        mask[i] = bool(symbols) and state.feed_all(symbols) is not None
    if state.can_end():
        mask[list(end_token_ids)] = True
    return mask


@pytest.mark.parametrize("name", GRAMMARS)
@pytest.mark.parametrize("seed", [0, 1])
def test_the_mask_is_every_token_the_grammar_reads_on_random_states(name, seed):
    rnd = random.Random(seed)
    compiled = CompiledGrammar(GRAMMARS[name], VOCAB, max_states=3 if seed else 50_000)  # seed 1: DFA dropped often
    matcher = compiled.matcher([EOS])
    checked = 0
    for step in range(60):
        if matcher.finished:
            break
        mask = matcher.mask()
        assert mask.any()
        if step % 3 == 0 or matcher.node.can_end:
            assert torch.equal(mask, brute_force(matcher.state, [EOS])), (name, step)
            checked += 1
        allowed = mask.nonzero().squeeze(1).tolist()
        # special tokens and single bytes now and then (they reach states long tokens jump over), eos rarely
        choices = [t for t in allowed if t != EOS] or allowed
        specials = [t for t in choices if t in VOCAB.specials]
        single = [t for t in choices if len(VOCAB.symbols(t)) == 1]
        r = rnd.random()
        token = rnd.choice(specials if specials and r < 0.15 else single if single and r < 0.45 else choices)
        assert matcher.accepts(token)
        matcher.advance(token)
    assert checked >= 5 and (compiled.resets > 0 if seed == 1 and compiled.misses > 1 else compiled.resets == 0)


def test_masks_come_from_the_cache_the_second_time():
    compiled = CompiledGrammar(GRAMMARS["tool"], VOCAB)
    path = [*TOK.encode('{"city": "Oslo", "days": 3'), *TOK.encode("}")]
    first, again = compiled.matcher([EOS]), compiled.matcher([EOS])
    masks = []
    for token in path:
        masks.append(first.mask())
        first.advance(token)
    misses = compiled.misses
    for token, mask in zip(path, masks, strict=True):
        assert torch.equal(again.mask(), mask)
        again.advance(token)
    assert compiled.misses == misses and compiled.hits >= len(path)
    assert first.node.can_end and torch.equal(first.mask(), brute_force(first.state, [EOS]))


def test_end_tokens_where_the_grammar_may_end_and_only_them_where_it_is_complete():
    compiled = CompiledGrammar(Json({"type": "integer"}), VOCAB)
    m = compiled.matcher([EOS, 7])
    m.advance(TOK.encode("1")[0])
    mask = m.mask()  # "1" may end or go on: digits and the end tokens
    assert mask[EOS] and mask[7] and mask[TOK.encode("2")[0]] and not mask[TOK.encode("a")[0]]
    closed = CompiledGrammar(Sequence(Literal("ab")), VOCAB).matcher([EOS])
    for t in TOK.encode("ab"):
        closed.advance(t)
    assert closed.mask().nonzero().squeeze(1).tolist() == [EOS] and not closed.finished
    closed.advance(EOS)
    assert closed.finished and not closed.accepts(EOS)
    with pytest.raises(GrammarError, match="complete"):
        closed.mask()
    no_stop = CompiledGrammar(Literal("a"), VOCAB).matcher([])
    no_stop.advance(TOK.encode("a")[0])
    assert no_stop.finished  # complete and nothing to stop with: the request is done
    with pytest.raises(GrammarViolation, match="not allowed"):
        CompiledGrammar(Literal("a"), VOCAB).matcher([EOS]).advance(EOS)  # not before the grammar may end


def test_a_refused_token_raises_and_changes_nothing():
    m = CompiledGrammar(GRAMMARS["tool"], VOCAB).matcher([EOS])
    m.advance(TOK.encode("{")[0])
    before = m.state
    with pytest.raises(GrammarViolation, match="not allowed by the request's grammar"):
        m.advance(TOK.encode("]")[0])
    assert m.state == before and not m.accepts(EOS)


def test_compile_errors():
    with pytest.raises(GrammarError, match=re.escape("<|nope|>")):
        CompiledGrammar(Sequence(Literal("a"), Special("<|nope|>")), VOCAB)
    with pytest.raises(GrammarError, match="matches no finite input"):
        CompiledGrammar(Choice(), VOCAB)
    with pytest.raises(GrammarError, match=r"expected a k3\.structured grammar"):
        CompiledGrammar({"type": "object"}, VOCAB)
    compiler = GrammarCompiler(VOCAB, max_grammars=2)
    a = compiler.compile(Json({"type": "object"}))
    assert compiler.compile(Json({"type": "object"})) is a  # equal grammars share one compilation
    compiler.compile(Literal("x"))
    compiler.compile(Literal("y"))
    assert len(compiler.compiled) == 2 and compiler.compile(Json({"type": "object"})) is not a
    assert compiler.matcher(Sequence(), [EOS]).mask().nonzero().squeeze(1).tolist() == [EOS]
    with pytest.raises(GrammarError, match="only an empty output"):
        compiler.matcher(Sequence(), [])


def test_the_mask_cache_stays_within_its_bytes():
    compiled = CompiledGrammar(GRAMMARS["json_object"], VOCAB, mask_cache_bytes=400)
    m = compiled.matcher([EOS])
    for token in TOK.encode('{"a": [1, 2, {"b": "xyz"}], "c": null}'):
        m.mask()
        assert compiled.cached_bytes <= 400
        assert compiled.cached_bytes == sum(p.numel() * p.element_size() for p in compiled.masks.values())
        m.advance(token)


@pytest.mark.parametrize("V", [1, 7, 8, 600, 1001])
def test_packing_round_trips(V):
    g = torch.Generator().manual_seed(V)
    for density in (0.0, 0.01, 0.5, 1.0):
        mask = torch.rand(V, generator=g) < density
        packed = _pack(mask)
        assert torch.equal(_unpack(packed, V), mask)
        assert packed.numel() * packed.element_size() <= max(4 * int(mask.sum()), (V + 7) // 8)
