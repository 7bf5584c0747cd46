"""The JSON recogniser against Python's json module (and jsonschema, for schemas), on generated values.

Oracle: a byte string is JSON for k3 when it is strict UTF-8, json.loads takes it (NaN and Infinity
refused, as JSON does), it has no whitespace around the value and no run of more than max_whitespace
whitespace bytes between tokens (k3's bound). For every serialisation of a generated value every prefix
must be alive, and complete exactly when the oracle says the prefix is itself a JSON value; corrupted
serialisations are accepted exactly when the oracle accepts them. Schemas are generated with values
that satisfy them; strings drawn at random from the grammar itself must satisfy their schema.
"""

import json
import random

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from k3.structured import JSON_MAX_WHITESPACE, Json

jsonschema = pytest.importorskip("jsonschema")

WS = b" \t\n\r"
ANY, OBJECT = Json(True), Json({"type": "object"})


def _no_constant(name: str):
    raise ValueError(f"{name} is not JSON")


def oracle(data: bytes, limit: int = JSON_MAX_WHITESPACE) -> object:
    """The decoded value when `data` is JSON as k3 writes it, else a sentinel."""
    if not data or data[:1] in WS or data[-1:] in WS:
        return INVALID
    try:
        value = json.loads(data.decode("utf-8"), parse_constant=_no_constant)
    except (UnicodeDecodeError, ValueError, RecursionError):
        return INVALID
    run, in_string, escaped = 0, False, False
    for b in data:  # whitespace runs between tokens (the string scan is exact: the JSON is valid)
        if in_string:
            in_string, escaped = (True, False) if escaped else (b != 0x22, b == 0x5C)
            continue
        in_string = b == 0x22
        run = run + 1 if b in WS else 0
        if run > limit:
            return INVALID
    return value


INVALID = object()


def verdict(grammar: Json, data: bytes) -> bool:
    state = grammar.start().feed_all(data)
    return state is not None and state.can_end()


json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(10**30), 10**30)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(st.characters(codec="utf-8"), max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=5), inner, max_size=4),
    max_leaves=12,
)


@st.composite
def serialisations(draw, values=json_values) -> tuple[object, bytes]:
    value = draw(values)
    indent = draw(st.sampled_from([None, 0, 1, 2, "\t", " \r\n"]))
    seps = draw(st.sampled_from([(",", ":"), (", ", ": "), (" ,", " : "), (",\n", ":\t")]))
    ascii_only = draw(st.booleans())
    return value, json.dumps(value, indent=indent, separators=seps, ensure_ascii=ascii_only).encode("utf-8")


@settings(max_examples=250, deadline=None)
@given(serialisations())
def test_every_prefix_of_a_serialisation_lives_and_ends_exactly_where_json_does(case):
    value, data = case
    grammars = [ANY] + ([OBJECT] if isinstance(value, dict) else [])
    for grammar in grammars:
        state = grammar.start()
        for k in range(len(data) + 1):  # the state after every byte: where any token boundary may fall
            assert state is not None, (data, k)
            complete = oracle(data[:k]) is not INVALID and (grammar is ANY or data[:k].startswith(b"{"))
            assert state.can_end() == complete, (data[:k], grammar)
            if k < len(data):
                state = state.feed(data[k])
    assert verdict(ANY, data) == (oracle(data) is not INVALID)


def corrupt(data: bytes, rnd: random.Random) -> bytes:
    i = rnd.randrange(len(data) + 1)
    junk = bytes([rnd.choice(b'{}[],:" \n\\/0123456789.eE+-tfnaul\x00\x1f\x7f\xc3\xa9\xed\xa0\x80\xff\xf4\x90')])
    choice = rnd.randrange(6)
    if choice == 0:
        return data[:i] + junk + data[i:]
    if choice == 1:
        return data[:i] + data[i + 1 :]
    if choice == 2:
        return data[:i] + junk + data[i + 1 :]
    if choice == 3:
        return data[:i]
    if choice == 4:
        j = rnd.randrange(len(data) + 1)
        return data[:i] + data[min(i, j) : max(i, j)] + data[i:]
    return data[:i] + b" " * rnd.randrange(JSON_MAX_WHITESPACE - 2, JSON_MAX_WHITESPACE + 3) + data[i:]


@settings(max_examples=300, deadline=None)
@given(serialisations(), st.integers(0, 2**32), st.integers(1, 3))
def test_corrupted_serialisations_are_accepted_exactly_when_json_accepts_them(case, seed, n):
    _, data = case
    rnd = random.Random(seed)
    for _ in range(n):
        data = corrupt(data, rnd)
    expected = oracle(data)
    assert verdict(ANY, data) == (expected is not INVALID), data
    assert verdict(OBJECT, data) == (isinstance(expected, dict)), data


def test_json_edge_cases():
    good = [b"0", b"-0", b"1e5", b"1E+05", b"-12.50e-3", b'"\\ud800"', b'"\\u00e9\\/"', '"é😀\x7f"'.encode(), b"[]"]
    bad = [b"01", b"1.", b".5", b"+1", b"1e", b"NaN", b"Infinity", b'"\x01"', b'"\\x"', b'"\\u12"', b"[1,]", b"{,}"]
    bad += [b'"\xed\xa0\x80"', b'"\xc0\xaf"', b'"\xf4\x90\x80\x80"', b'"\xe0\x80\xaf"', b"tru", b'{"a"}', b" 1", b"1 "]
    for data in good:
        assert verdict(ANY, data) and oracle(data) is not INVALID, data
    for data in bad:
        assert not verdict(ANY, data) and oracle(data) is INVALID, data
    compact = Json(True, max_whitespace=0)
    assert verdict(compact, b'{"a":[1,2]}') and not verdict(compact, b'{"a": [1,2]}')
    gap = JSON_MAX_WHITESPACE
    assert verdict(ANY, b"[" + b" " * gap + b"1]") and not verdict(ANY, b"[" + b" " * (gap + 1) + b"1]")


KEYS = st.text(st.characters(codec="utf-8"), min_size=1, max_size=6)
ENUM_VALUES = st.one_of(st.integers(-5, 5), st.text(max_size=4), st.booleans(), st.none(), st.floats(-2, 2))
_ABSENT = object()


def _string_schema(bounds: tuple[int, int]) -> dict:
    lo, extra = bounds
    return {"type": "string", "minLength": lo, "maxLength": lo + extra}


LEAF_SCHEMAS = st.one_of(
    st.sampled_from([{"type": "integer"}, {"type": "number"}, {"type": "boolean"}, {"type": "null"}, {}]),
    st.sampled_from([{"type": ["string", "null"]}, {"type": "string", "minLength": 2}]),
    st.tuples(st.integers(0, 3), st.integers(0, 4)).map(_string_schema),
    st.lists(ENUM_VALUES, min_size=1, max_size=4, unique_by=json.dumps).map(lambda v: {"enum": v}),
    st.integers(-3, 3).map(lambda v: {"const": v}),
)


@st.composite
def object_schemas(draw, inner) -> dict:
    names = draw(st.lists(KEYS, max_size=4, unique=True))
    schema = {"type": "object", "properties": {n: draw(inner) for n in names}}
    schema["required"] = [n for n in names if draw(st.booleans())]
    extra = draw(st.sampled_from([_ABSENT, False, True, "schema"]))
    if extra is not _ABSENT:
        schema["additionalProperties"] = draw(inner) if extra == "schema" else extra
    return schema


@st.composite
def array_schemas(draw, inner) -> dict:
    schema = {"type": "array"}
    if draw(st.booleans()):
        schema["prefixItems"] = draw(st.lists(inner, min_size=1, max_size=3))
    items = draw(st.sampled_from([_ABSENT, False, "schema"]))
    if items is not _ABSENT:
        schema["items"] = draw(inner) if items == "schema" else items
    lo = draw(st.integers(0, 3))
    if draw(st.booleans()):
        schema["minItems"] = lo
    if draw(st.booleans()):
        schema["maxItems"] = lo + draw(st.integers(0, 3))
    return schema


SCHEMAS = st.recursive(
    LEAF_SCHEMAS,
    lambda inner: (
        object_schemas(inner)
        | array_schemas(inner)
        | st.lists(inner, min_size=1, max_size=3).map(lambda alts: {"anyOf": alts})
    ),
    max_leaves=6,
)


_SATISFIABLE: dict[str, bool] = {}


def satisfiable(schema: object) -> bool:
    """Whether some value satisfies the schema: Json refuses the ones no value does."""
    key = json.dumps(schema)
    if key not in _SATISFIABLE:
        try:
            Json(schema)
            _SATISFIABLE[key] = True
        except ValueError:
            _SATISFIABLE[key] = False
    return _SATISFIABLE[key]


@st.composite
def instances(draw, schema) -> object:
    """A value satisfying a satisfiable `schema` under k3's reading (listed properties in order, closed
    objects and arrays closed)."""
    if not schema:
        return draw(json_values)
    if "enum" in schema:
        return draw(st.sampled_from(schema["enum"]))
    if "const" in schema:
        return schema["const"]
    if "anyOf" in schema:
        return draw(instances(draw(st.sampled_from([s for s in schema["anyOf"] if satisfiable(s)]))))
    t = schema["type"]
    t = draw(st.sampled_from(t)) if isinstance(t, list) else t
    if t in ("integer", "number"):
        whole = st.integers(-(10**6), 10**6)
        return draw(whole if t == "integer" else whole | st.floats(allow_nan=False, allow_infinity=False))
    if t in ("boolean", "null"):
        return draw(st.booleans()) if t == "boolean" else None
    if t == "string":
        lo, hi = schema.get("minLength", 0), schema.get("maxLength", 6)
        return draw(st.text(st.characters(codec="utf-8"), min_size=lo, max_size=max(lo, hi)))
    if t == "array":
        prefix, items = schema.get("prefixItems", []), schema.get("items", _ABSENT)
        items = (not prefix) if items is _ABSENT else items
        usable = next((i for i, s in enumerate(prefix) if not satisfiable(s)), len(prefix))
        lo, hi = schema.get("minItems", 0), schema.get("maxItems", len(prefix) + 3)
        if usable < len(prefix) or not satisfiable(items):
            hi = min(hi, usable)
        n = draw(st.integers(lo, hi))
        return [draw(instances(prefix[i] if i < len(prefix) else {} if items is True else items)) for i in range(n)]
    props, required = schema["properties"], schema["required"]
    out = {}
    for name, s in props.items():
        if name in required or (satisfiable(s) and draw(st.booleans())):
            out[name] = draw(instances(s))
    extra = schema.get("additionalProperties", not props)
    if extra is not False and satisfiable(extra):
        for key in draw(st.lists(KEYS.filter(lambda k: k not in props), max_size=2, unique=True)):
            out[key] = draw(instances({} if extra is True else extra))
    return out


@st.composite
def schema_cases(draw) -> tuple[dict, Json, object]:
    schema = draw(SCHEMAS)
    assume(satisfiable(schema))  # some generated schemas have no value (minItems past closed prefixItems)
    grammar = Json(schema)
    value = draw(instances(schema))
    jsonschema.validate(value, schema)  # the generator's values satisfy their schema
    return schema, grammar, value


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(schema_cases(), st.sampled_from([None, 1, 2]), st.sampled_from([(",", ":"), (", ", ": ")]), st.booleans())
def test_every_serialisation_of_a_matching_value_is_accepted(case, indent, seps, ascii_only):
    schema, grammar, value = case
    data = json.dumps(value, indent=indent, separators=seps, ensure_ascii=ascii_only).encode("utf-8")
    assume(oracle(data) is not INVALID)  # within the whitespace bound (deep indents pass it)
    state = grammar.start()
    for k, b in enumerate(data):
        state = state.feed(b)
        assert state is not None, (schema, data[: k + 1])
    assert state.can_end(), (schema, data)


def walk(grammar: Json, rnd: random.Random, soft_limit: int = 60, hard_limit: int = 3000) -> bytes | None:
    """A random string of the grammar, byte by byte; past soft_limit, bytes that close things go first."""
    state, out, menus = grammar.start(), bytearray(), {}
    while len(out) < hard_limit:
        if state.can_end() and (len(out) > soft_limit or rnd.random() < 0.1):
            return bytes(out)
        menu = menus.get(state)
        if menu is None:
            menu = menus[state] = [b for b in range(256) if state.feed(b) is not None]
        assert menu or state.can_end(), (grammar, bytes(out))  # trimmed: a live state always goes on or ends
        if not menu:
            return bytes(out)
        closing = [b for b in b'"}]0n' if b in menu] if len(out) > soft_limit else []
        b = closing[0] if closing else rnd.choice(menu)
        out.append(b)
        state = state.feed(b)
    return None


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(schema_cases(), st.integers(0, 2**32))
def test_what_the_grammar_generates_is_json_that_satisfies_the_schema(case, seed):
    schema, grammar, _ = case
    rnd = random.Random(seed)
    for _ in range(3):
        data = walk(grammar, rnd)
        if data is None:
            continue
        value = oracle(data)
        assert value is not INVALID, (schema, data)
        jsonschema.validate(value, schema)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(schema_cases(), st.integers(0, 2**32))
def test_a_corrupted_value_is_accepted_only_if_it_still_satisfies_the_schema(case, seed):
    schema, grammar, value = case
    rnd = random.Random(seed)
    data = json.dumps(value).encode("utf-8")
    for _ in range(rnd.randrange(1, 4)):
        data = corrupt(data, rnd)
    if verdict(grammar, data):
        decoded = oracle(data)
        assert decoded is not INVALID, (schema, data)
        jsonschema.validate(decoded, schema)
