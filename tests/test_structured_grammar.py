"""k3.structured's combinators over bytes and special tokens: what each accepts and refuses, states equal by
value, Text ending where the next element begins, recursion, trimming of dead ends, and the two K3 chat
shapes the server builds on them (reasoning, then a JSON response; a tools section of typed calls)."""

import ast
import re
import sys
from pathlib import Path

import pytest

from k3.structured import (
    ByteSet,
    Choice,
    GrammarError,
    Json,
    Literal,
    Repeat,
    Rule,
    Sequence,
    Special,
    Text,
    trim,
)

OPEN, CLOSE, SEP, END = "<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>"
_SPECIAL = re.compile(r"(<\|open\|>|<\|close\|>|<\|sep\|>|<\|end_of_msg\|>)")


def symbols(text: str) -> list:
    """A rendered chat string as symbols: its four structural tokens as specials, the rest as UTF-8 bytes."""
    out = []
    for part in _SPECIAL.split(text):
        out.extend([part] if _SPECIAL.fullmatch(part) else part.encode("utf-8"))
    return out


def accepts(grammar, data) -> bool:
    state = grammar.start().feed_all(data)
    return state is not None and state.can_end()


def alive(grammar, data) -> bool:
    return grammar.start().feed_all(data) is not None


def test_literals_specials_and_byte_sets():
    g = Sequence(Literal("ab"), Special(SEP), ByteSet(b"xy"))
    assert accepts(g, [*b"ab", SEP, ord("y")])
    assert not accepts(g, [*b"ab", SEP]) and alive(g, [*b"ab", SEP])
    assert not alive(g, [*b"ab", *SEP.encode()])  # a special token is never its spelling's bytes
    assert not alive(g, [ord("a"), CLOSE]) and not alive(g, b"ax")
    assert accepts(ByteSet.range(0x30, 0x39), b"7") and not alive(ByteSet.range(0x30, 0x39), b"a")


def test_choice_repeat_bounds_and_empty_matches():
    g = Repeat(Literal("ab"), 2, 3)
    assert [accepts(g, b"ab" * n) for n in range(5)] == [False, False, True, True, False]
    assert not alive(g, b"ab" * 4)
    star = Repeat(Choice(Literal("a"), Sequence()))  # repeats something that matches nothing: still finite
    assert accepts(star, b"") and accepts(star, b"aaaa") and not alive(star, b"b")
    assert accepts(Sequence(), b"") and not alive(Sequence(), b"x")
    opt = Sequence(Literal("x"), Choice(Literal("y"), Sequence()), Literal("z"))
    assert accepts(opt, b"xz") and accepts(opt, b"xyz") and not accepts(opt, b"xyyz")


def test_states_compare_and_hash_by_value():
    g = Sequence(Repeat(Choice(Literal("ab"), Literal("a"))), Literal("c"))
    s1, s2 = g.start().feed_all(b"ab"), g.start().feed_all(b"aab")
    assert s1 == s2 and hash(s1) == hash(s2)  # two ways to the same remaining work: one state
    assert Sequence(Literal("a"), Text()) == Sequence(Literal(b"a"), Text()) and hash(Literal("a")) == hash(
        Literal(b"a")
    )
    assert Literal("a") != Literal("b") and Text(forbid=["x"]) != Text()
    with pytest.raises(AttributeError, match="immutable"):
        Literal("a").data = b"b"


def test_text_ends_where_the_next_element_begins():
    think = Sequence(Text(), Special(CLOSE), Literal("think"), Special(SEP))
    assert accepts(think, symbols("some <thought> é<|close|>think<|sep|>"))
    assert accepts(think, symbols("<|close|>think<|sep|>"))  # empty reasoning
    assert not alive(think, symbols("a<|sep|>"))  # no special token inside the text
    assert not alive(think, symbols("a<|close|>response"))  # the first special token ends it
    loose = Sequence(Text(specials=True), Special(CLOSE), Literal("think"), Special(SEP))
    assert accepts(loose, symbols("a<|sep|>b<|close|>thin<|close|>think<|sep|>"))
    marked = Sequence(Text(forbid=[b"END"]), Literal("END"))
    assert accepts(marked, b"abcEND") and accepts(marked, b"EEND") and not alive(marked, b"abENDc")
    assert accepts(Sequence(Text(), Literal("END")), b"abENDcEND")  # without forbid both readings live on
    split = Text(forbid=["<|close|>"])
    assert accepts(split, b"<|clos") and not alive(split, b"a<|close|>") and accepts(split, b"<|close")


def test_recursive_rules_and_trim():
    parens = Rule("parens")
    parens.define(Repeat(Sequence(Literal("("), parens, Literal(")"))))
    assert accepts(parens, b"(()(()))") and not accepts(parens, b"(()") and not alive(parens, b"())")
    dead_end = Choice(Literal("a"), Sequence(Literal("b"), Literal("c"), Choice()))
    assert alive(dead_end, b"b") and not alive(dead_end, b"bc")  # untrimmed: "b" is read, then nothing completes it
    assert not alive(trim(dead_end), b"b") and accepts(trim(dead_end), b"a")
    assert not alive(Sequence(Literal("b"), Choice()), b"b")  # a symbol after which nothing can come is refused
    forever = Rule("forever")
    forever.define(Sequence(Literal("("), forever, Literal(")")))
    with pytest.raises(GrammarError, match="matches no finite input"):
        trim(forever)
    with pytest.raises(GrammarError, match="matches no finite input"):
        trim(Choice())


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: Literal(b""), "non-empty"),
        (lambda: Special(""), "spelling"),
        (lambda: ByteSet([]), "at least one byte"),
        (lambda: ByteSet([256]), "0-255"),
        (lambda: Repeat(Literal("a"), 3, 2), "min <= max"),
        (lambda: Sequence("a"), "grammar nodes"),
        (lambda: Text(forbid=[b""]), "non-empty"),
        (lambda: Rule("r").start(), "never defined"),
        (lambda: Rule("r").define(Literal("a")).define(Literal("b")), "already defined"),
    ],
)
def test_bad_grammars_raise_grammar_error(make, message):
    with pytest.raises(GrammarError, match=message):
        make()


WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}


def element(header: str, body) -> Sequence:
    name = header.split(" ")[0]
    return Sequence(Special(OPEN), Literal(header), Special(SEP), body, Special(CLOSE), Literal(name), Special(SEP))


def test_reasoning_then_a_json_response():
    reply = Sequence(
        Text(),
        Special(CLOSE),
        Literal("think"),
        Special(SEP),
        element("response", Json(WEATHER)),
        Special(CLOSE),
        Literal("message"),
        Special(SEP),
        Special(END),
    )
    good = '<|close|>think<|sep|><|open|>response<|sep|>{"city": "Oslo"}<|close|>response<|sep|>'
    assert accepts(reply, symbols("let me see" + good + "<|close|>message<|sep|><|end_of_msg|>"))
    assert not alive(reply, symbols('x<|close|>think<|sep|><|open|>response<|sep|>{"town"'))
    assert not alive(reply, symbols('x<|close|>think<|sep|><|open|>response<|sep|>{"city": 3'))
    state = reply.start().feed_all(symbols("x" + good + "<|close|>message<|sep|><|end_of_msg|>"))
    assert state.is_closed()  # the stop token ended it: nothing more may be read


# docs/chat.md's example reply (one call), after its generation prompt <|open|>think<|sep|>
EXAMPLE = (
    "look it up<|close|>think<|sep|><|open|>response<|sep|><|close|>response<|sep|><|open|>tools<|sep|>"
    '<|open|>call tool="get_weather" index="1"<|sep|><|open|>argument key="city" type="string"<|sep|>Oslo'
    "<|close|>argument<|sep|><|close|>call<|sep|><|close|>tools<|sep|><|close|>message<|sep|><|end_of_msg|>"
)


def call(index: int) -> Sequence:
    city = element('argument key="city" type="string"', Text())
    days = element('argument key="days" type="number"', Json({"type": "integer"}))
    return element(f'call tool="get_weather" index="{index}"', Sequence(city, Choice(days, Sequence())))


def test_a_tools_section_of_typed_calls():
    # as k3.chat renders them: the response first (empty here), then one or two numbered calls
    tools = element("tools", Sequence(call(1), Choice(call(2), Sequence())))
    reply = Sequence(
        Text(),
        Special(CLOSE),
        Literal("think"),
        Special(SEP),
        element("response", Text()),
        tools,
        Special(CLOSE),
        Literal("message"),
        Special(SEP),
        Special(END),
    )
    assert accepts(reply, symbols(EXAMPLE))
    two = EXAMPLE.replace(
        "<|close|>call<|sep|><|close|>tools",
        '<|close|>call<|sep|><|open|>call tool="get_weather" index="2"<|sep|><|open|>argument key="city" '
        'type="string"<|sep|>Rome<|close|>argument<|sep|><|open|>argument key="days" type="number"<|sep|>3'
        "<|close|>argument<|sep|><|close|>call<|sep|><|close|>tools",
    )
    assert two != EXAMPLE and accepts(reply, symbols(two))
    assert not alive(reply, symbols(two.replace('index="2"', 'index="3"')))
    assert not alive(reply, symbols(two.replace("<|sep|>3<|close|>", "<|sep|>3.5<|close|>")))


def test_the_package_is_a_leaf():
    """k3.structured imports torch, tokenizers and the standard library only: serve, server and chat build
    on it, so it may use none of them."""
    root = Path(__file__).resolve().parents[1] / "src" / "k3" / "structured"
    for path in root.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            names += [node.module] if isinstance(node, ast.ImportFrom) and node.module else []
            for name in names:
                top = name.split(".")[0]
                ok = (
                    top in {"torch", "tokenizers"} or top in sys.stdlib_module_names or name.startswith("k3.structured")
                )
                assert ok, f"{path.name} imports {name}"
