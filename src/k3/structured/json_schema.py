"""JSON values matching a JSON Schema, as a grammar node: Json(schema).

The subset (docs/serving.md, "Structured outputs"): type (a name or a list), properties, required,
additionalProperties (a bool or a schema), items, prefixItems, minItems, maxItems, enum, const, anyOf,
oneOf (read as anyOf: a value matching several alternatives is accepted), allOf where its members merge
without conflict, $ref to any place in the same document ("#", "#/$defs/...", "#/definitions/...", recursive
ones too), minLength and maxLength. Annotations are accepted and not enforced (format is an annotation in
2020-12 unless a validator opts in). Every other keyword raises UnsupportedSchema naming it and its place:
a constraint k3 cannot enforce is never dropped silently.

Choices of the grammar, where JSON Schema leaves room:
- properties come in the order the schema lists them; required ones must appear, optional ones may be
  skipped; additional properties, when allowed, come after the listed ones, with keys that are not a
  listed property, however spelled (xgrammar's and llguidance's order).
- an object schema that lists properties and says nothing of additionalProperties is closed, and so is an
  array schema with prefixItems and no items (xgrammar's strict mode, the OpenAI structured-output rule);
  an object or array schema that lists nothing takes any members (so {"type": "object"} is json_object).
- whitespace: at most max_whitespace bytes (default JSON_MAX_WHITESPACE) at each place JSON allows it and
  none around the value, so a model cannot spend its tokens on spaces; max_whitespace=0 is compact JSON.
- enum and const values: strings in any JSON spelling, arrays and objects with whitespace as above and
  members in the value's order, numbers as json.dumps writes them; an integer is written without
  fraction or exponent.
"""

import json
from urllib.parse import unquote

from k3.structured.grammar import (
    Choice,
    Grammar,
    GrammarError,
    Literal,
    Repeat,
    Rule,
    Sequence,
    Stack,
    Structural,
    push,
    trim,
)
from k3.structured.json_lexemes import JsonNumber, JsonString, Whitespace, json_string_literal

JSON_MAX_WHITESPACE = 16  # bytes per gap: pretty-printed JSON to depth 7 at indent 2 ("\n" + 14 spaces)

ANNOTATIONS = frozenset(
    {"title", "description", "default", "examples", "format", "$schema", "$id", "$comment"}
    | {"deprecated", "readOnly", "writeOnly"}
)
# "$defs" and "definitions" hold schemas for $ref to point to; they constrain nothing where they stand
SUPPORTED = frozenset(
    {"type", "properties", "required", "additionalProperties", "items", "prefixItems", "minItems", "maxItems"}
    | {"enum", "const", "anyOf", "oneOf", "allOf", "$ref", "minLength", "maxLength", "$defs", "definitions"}
)
# schemas inside schemas, far more than real ones have: past it the schema is refused (compiling recurses, five
# Python frames a level), and so is a $ref cycle that merging anyOf siblings or allOf members would unroll
MAX_SCHEMA_NESTING = 100
TYPES = ("null", "boolean", "object", "array", "number", "integer", "string")
NOTHING = Choice()  # matches nothing: the `false` schema
EMPTY = Sequence()  # matches the empty string
_ABSENT = object()
_COMMA, _COLON = Literal(b","), Literal(b":")


class UnsupportedSchema(ValueError):
    """A JSON Schema keyword (or a use of one) that k3's structured outputs do not enforce."""

    def __init__(self, keyword: str, path: str, why: str = "") -> None:
        self.keyword, self.path = keyword, path
        known = ", ".join(sorted(SUPPORTED - {"$defs", "definitions"}))
        super().__init__(
            f"JSON schema keyword {keyword!r} at {path} is not supported{': ' + why if why else ''}. k3 enforces "
            f"{known} and accepts annotations; remove the keyword or restate the constraint with those"
        )


class InvalidSchema(ValueError):
    """A schema that is not a JSON Schema, or one that no JSON value satisfies."""


def _seq(*parts: Grammar | None) -> Grammar:
    """The parts in order, leaving out None (a whitespace gap when whitespace is off); NOTHING if one is."""
    parts = tuple(p for p in parts if p is not None and p != EMPTY)
    if NOTHING in parts:
        return NOTHING
    return parts[0] if len(parts) == 1 else Sequence(*parts)


def _choice(*options: Grammar) -> Grammar:
    options = tuple(dict.fromkeys(o for o in options if o != NOTHING))
    return options[0] if len(options) == 1 else Choice(*options)


def _dumps(value: object, path: str) -> bytes:
    try:
        return json.dumps(value, ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode("utf-8")
    except (TypeError, ValueError, UnicodeEncodeError, RecursionError) as e:
        raise InvalidSchema(f"{path}: a {type(value).__name__} that cannot be written as JSON ({e})") from e


def _json_type(value: object) -> str:
    """The JSON Schema type of a JSON value ("integer" for any number with no fraction, 1.0 included)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int) or (isinstance(value, float) and value.is_integer()):
        return "integer"
    return {float: "number", str: "string", list: "array", dict: "object"}[type(value)]


def _count(schema: dict, key: str, path: str) -> int | None:
    n = schema.get(key)
    if n is not None and (not isinstance(n, int) or isinstance(n, bool) or n < 0):
        raise InvalidSchema(f"{path}/{key} must be an integer >= 0, got {n!r}")
    return n


def _types(schema: dict, path: str) -> set[str]:
    """The instance types the schema allows ("number" includes "integer")."""
    t = schema.get("type", _ABSENT)
    if t is _ABSENT:
        return set(TYPES)
    names = [t] if isinstance(t, str) else t
    if not isinstance(names, list) or not names or any(n not in TYPES for n in names):
        raise InvalidSchema(f"{path}/type must be one of {', '.join(TYPES)} or a non-empty list of them, got {t!r}")
    return set(names) | ({"integer"} if "number" in names else set())


def _pointer_token(name: str) -> str:
    """A property name as a JSON pointer token (RFC 6901), for the paths in error messages."""
    return name.replace("~", "~0").replace("/", "~1")


def _check_keywords(schema: object, path: str) -> None:
    if not isinstance(schema, bool | dict):
        raise InvalidSchema(f"{path}: a schema is a JSON object or a boolean, got {type(schema).__name__}")
    for key in schema if isinstance(schema, dict) else ():
        if key not in SUPPORTED and key not in ANNOTATIONS:
            raise UnsupportedSchema(key, path)


def _schemas(value: object, kind: type, path: str) -> object:
    if not isinstance(value, kind) or (kind is list and not value):
        what = "a non-empty list of schemas" if kind is list else "an object of schemas"
        raise InvalidSchema(f"{path} must be {what}, got {value!r}")
    return value


class _Compiler:
    """One schema document to a grammar.

    rules: one Rule per $ref target, which is what makes recursive schemas finite graphs. open: the targets
    being compiled, with the container depth each started at: a $ref back to one of them at the same depth
    would recurse without reading a byte. inline: the targets being merged into an allOf right now.
    """

    def __init__(self, root: object, max_whitespace: int) -> None:
        self.root = root
        self.ws = Whitespace(max_whitespace) if max_whitespace else None
        self.rules: dict[str, Rule] = {}
        self.open: dict[str, int] = {}
        self.inline: list[str] = []
        self.depth = 0
        self.nesting = 0
        self._any: Rule | None = None

    def any_value(self) -> Rule:
        """Any JSON value, one recursive rule per document."""
        if self._any is None:
            value = self._any = Rule("any JSON value")
            ws = self.ws
            member = _seq(JsonString(), ws, _COLON, ws, value, ws)
            members = _seq(member, Repeat(_seq(_COMMA, ws, member)), Literal(b"}"))
            obj = _seq(Literal(b"{"), ws, _choice(Literal(b"}"), members))
            items = _seq(value, ws, Repeat(_seq(_COMMA, ws, value, ws)), Literal(b"]"))
            arr = _seq(Literal(b"["), ws, _choice(Literal(b"]"), items))
            words = (Literal(b"true"), Literal(b"false"), Literal(b"null"))
            value.define(Choice(obj, arr, JsonString(), JsonNumber(), *words))
        return self._any

    def value(self, schema: object, path: str) -> Grammar:
        self.nesting += 1
        try:
            return self._value(schema, path)
        finally:
            self.nesting -= 1

    def _value(self, schema: object, path: str) -> Grammar:
        _check_keywords(schema, path)
        if self.nesting > MAX_SCHEMA_NESTING:
            raise InvalidSchema(
                f"{path[:60]}…: the schema nests deeper than {MAX_SCHEMA_NESTING} (or its $refs expand forever)"
            )
        if schema is True:
            return self.any_value()
        if schema is False:
            return NOTHING
        schema = {k: v for k, v in schema.items() if k in SUPPORTED and k not in ("$defs", "definitions")}
        if not schema:
            return self.any_value()
        if "$ref" in schema:
            if len(schema) > 1:
                others = ", ".join(sorted(set(schema) - {"$ref"}))
                raise UnsupportedSchema("$ref", path, f"beside {others} (write them inside an allOf with the $ref)")
            return self.ref(schema["$ref"], path)
        if "allOf" in schema:
            return self.value(self.merge_all(schema, path), path)
        if "anyOf" in schema or "oneOf" in schema:
            return self.alternatives(schema, path)
        if "enum" in schema or "const" in schema:
            return self.enum(schema, path)
        types = _types(schema, path)
        if "number" in types:
            types.discard("integer")
        return _choice(*(self.typed(t, schema, path) for t in TYPES if t in types))

    def typed(self, t: str, schema: dict, path: str) -> Grammar:
        if t == "null":
            return Literal(b"null")
        if t == "boolean":
            return Choice(Literal(b"true"), Literal(b"false"))
        if t in ("integer", "number"):
            return JsonNumber(integer=t == "integer")
        if t == "string":
            lo, hi = _count(schema, "minLength", path) or 0, _count(schema, "maxLength", path)
            return NOTHING if hi is not None and hi < lo else JsonString(lo, hi)
        return self.array(schema, path) if t == "array" else self.object(schema, path)

    def object(self, schema: dict, path: str) -> Grammar:
        props = _schemas(schema.get("properties", {}), dict, f"{path}/properties")
        required = schema.get("required", [])
        if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
            raise InvalidSchema(f"{path}/required must be a list of property names, got {required!r}")
        explicit = schema.get("additionalProperties", _ABSENT)
        # closed when it lists properties (the module's docstring); a name only in `required` is declared by it
        extra = (not props) if explicit is _ABSENT else explicit
        unlisted = True if explicit is _ABSENT else explicit
        ws = self.ws
        self.depth += 1
        names = list(props) + [r for r in dict.fromkeys(required) if r not in props]
        entries = []
        for name in names:
            where = f"{path}/properties/{_pointer_token(name)}" if name in props else f"{path}/additionalProperties"
            _dumps(name, where)  # refuses names that are not Unicode text (lone surrogates)
            key = json_string_literal(name)
            entries.append(_seq(key, ws, _COLON, ws, self.value(props.get(name, unlisted), where), ws))
        more = NOTHING if extra is False else self.value(extra, f"{path}/additionalProperties")
        self.depth -= 1
        if more != NOTHING:
            key = JsonString(exclude=frozenset(names))
            more = _seq(key, ws, _COLON, ws, more, ws)
        memo: dict[tuple[int, bool], Grammar] = {}

        def members(i: int, first: bool) -> Grammar:
            """The members from property i on; first: none has been written yet (no comma before the next)."""
            if (i, first) not in memo:
                if i == len(names):
                    tail = Repeat(_seq(_COMMA, ws, more)) if more != NOTHING else EMPTY
                    memo[i, first] = _choice(EMPTY, _seq(more, tail)) if first and more != NOTHING else tail
                else:
                    take = _seq(None if first else _seq(_COMMA, ws), entries[i], members(i + 1, False))
                    skip = NOTHING if names[i] in required else members(i + 1, first)
                    memo[i, first] = _choice(take, skip)
            return memo[i, first]

        return _seq(Literal(b"{"), ws, members(0, True), Literal(b"}"))

    def array(self, schema: dict, path: str) -> Grammar:
        prefix = _schemas(schema["prefixItems"], list, f"{path}/prefixItems") if "prefixItems" in schema else []
        items = schema.get("items", _ABSENT)
        if isinstance(items, list):
            raise UnsupportedSchema("items", path, "as a list (a draft-7 tuple); write prefixItems")
        if items is _ABSENT:
            items = not prefix  # closed after its prefixItems (the module's docstring)
        lo, hi = _count(schema, "minItems", path) or 0, _count(schema, "maxItems", path)
        if hi is not None and hi < lo:
            return NOTHING
        ws = self.ws
        self.depth += 1
        heads = [self.value(s, f"{path}/prefixItems/{i}") for i, s in enumerate(prefix)]
        rest = NOTHING if items is False else self.value(items, f"{path}/items")
        self.depth -= 1

        def after(k: int) -> Grammar:
            """What may follow the k-th item (k >= 1): more items, each after a comma, or the end."""
            if k >= len(heads):
                if rest == NOTHING:
                    return EMPTY if k >= lo else NOTHING
                more_hi = None if hi is None else hi - k
                return EMPTY if more_hi == 0 else Repeat(_seq(_COMMA, ws, rest, ws), max(0, lo - k), more_hi)
            more = _seq(_COMMA, ws, heads[k], ws, after(k + 1)) if hi is None or k < hi else NOTHING
            return _choice(EMPTY if k >= lo else NOTHING, more)

        first = heads[0] if heads else rest
        some = _seq(first, ws, after(1)) if hi is None or hi >= 1 else NOTHING
        return _seq(Literal(b"["), ws, _choice(EMPTY if lo == 0 else NOTHING, some), Literal(b"]"))

    def enum(self, schema: dict, path: str) -> Grammar:
        others = sorted(set(schema) - {"enum", "const", "type"})
        if others:
            raise UnsupportedSchema(others[0], path, "beside enum or const (k3 matches their values alone or by type)")
        values = schema.get("enum", _ABSENT)
        if values is not _ABSENT and not isinstance(values, list):
            raise InvalidSchema(f"{path}/enum must be a list of values, got {values!r}")
        if "const" in schema:
            const = _dumps(schema["const"], f"{path}/const")
            values = [schema["const"]] if values is _ABSENT or any(_dumps(v, path) == const for v in values) else []
        types = _types(schema, path)
        return _choice(*(self.literal(v, f"{path}/enum") for v in values if _json_type(v) in types))

    def literal(self, value: object, path: str) -> Grammar:
        """Exactly this JSON value: strings in any spelling, containers with any (bounded) whitespace,
        object members in the value's order, numbers as json.dumps writes them."""
        _dumps(value, path)  # refuses NaN and values that are not JSON
        ws = self.ws
        if isinstance(value, str):
            return json_string_literal(value)
        if isinstance(value, list):
            items = [_seq(self.literal(v, path), ws) for v in value]
            commas = [_seq(_COMMA, ws, item) for item in items[1:]]
            return _seq(Literal(b"["), ws, *items[:1], *commas, Literal(b"]"))
        if isinstance(value, dict):
            members = [
                _seq(json_string_literal(k), ws, _COLON, ws, self.literal(v, path), ws) for k, v in value.items()
            ]
            commas = [_seq(_COMMA, ws, m) for m in members[1:]]
            return _seq(Literal(b"{"), ws, *members[:1], *commas, Literal(b"}"))
        return Literal(_dumps(value, path))

    def alternatives(self, schema: dict, path: str) -> Grammar:
        if "anyOf" in schema and "oneOf" in schema:
            raise UnsupportedSchema("oneOf", path, "beside anyOf (nest one inside an allOf)")
        key = "anyOf" if "anyOf" in schema else "oneOf"
        siblings = {k: v for k, v in schema.items() if k != key}
        options = []
        for i, alt in enumerate(_schemas(schema[key], list, f"{path}/{key}")):
            where = f"{path}/{key}/{i}"
            # beside other keywords an alternative is their intersection with them: merged into each one
            options.append(self.value(self.merge(siblings, self.flat(alt, where), where) if siblings else alt, where))
        return _choice(*options)

    def resolve(self, ref: object, path: str) -> tuple[str, object]:
        if not isinstance(ref, str) or not ref.startswith("#"):
            raise UnsupportedSchema("$ref", path, f"{ref!r} is not in this document (only refs that start with #)")
        target = self.root
        for token in filter(None, unquote(ref[1:]).split("/")):
            token = token.replace("~1", "/").replace("~0", "~")
            if isinstance(target, dict) and token in target:
                target = target[token]
            elif isinstance(target, list) and token.isdigit() and int(token) < len(target):
                target = target[int(token)]
            else:
                raise InvalidSchema(f"{path}/$ref {ref!r} points to nothing in the schema")
        return ref, target

    def ref(self, ref: object, path: str) -> Rule:
        pointer, target = self.resolve(ref, path)
        rule = self.rules.get(pointer)
        if rule is None:
            rule = self.rules[pointer] = Rule(pointer)
            self.open[pointer] = self.depth
            rule.define(self.value(target, pointer))
            del self.open[pointer]
        elif self.open.get(pointer) == self.depth:
            raise InvalidSchema(f"{path}/$ref {pointer!r} refers back to itself before any object or array")
        return rule

    def flat(self, schema: object, path: str) -> object:
        """schema with its $ref and allOf merged in, for merging into another schema."""
        _check_keywords(schema, path)
        if isinstance(schema, bool):
            return schema
        schema = {k: v for k, v in schema.items() if k in SUPPORTED and k not in ("$defs", "definitions")}
        if "$ref" in schema:
            pointer, target = self.resolve(schema.pop("$ref"), path)
            if pointer in self.inline:
                raise UnsupportedSchema("allOf", path, f"merging the recursive $ref {pointer!r}")
            self.inline.append(pointer)
            target = self.flat(target, pointer)
            self.inline.pop()
            return self.merge(target, self.flat(schema, path), path) if schema else target
        return self.merge_all(schema, path) if "allOf" in schema else schema

    def merge_all(self, schema: dict, path: str) -> object:
        merged: object = {k: v for k, v in schema.items() if k != "allOf"}
        for i, member in enumerate(_schemas(schema["allOf"], list, f"{path}/allOf")):
            merged = self.merge(merged, self.flat(member, f"{path}/allOf/{i}"), f"{path}/allOf/{i}")
        return merged

    def merge(self, a: object, b: object, path: str) -> object:
        """The intersection of two flat schemas, where it is one schema without new keywords; anything
        else raises UnsupportedSchema("allOf", ...)."""
        if a is False or b is False:
            return False
        if a is True or b is True:
            return b if a is True else a
        out = dict(a)
        for key, v in b.items():
            u = out.get(key, _ABSENT)
            if u is _ABSENT or u == v:
                out[key] = v
            elif key == "required":
                out[key] = list(dict.fromkeys(u + v))
            elif key == "properties":
                both = {n: self.merge(self.flat(u[n], path), self.flat(s, path), path) for n, s in v.items() if n in u}
                out[key] = {**u, **v, **both}
            elif key == "type":
                common = _types(a, path) & _types(b, path)
                if not common:
                    return False
                out[key] = sorted(common - {"integer"} if "number" in common else common)
            elif key in ("minItems", "minLength"):
                out[key] = max(u, v)
            elif key in ("maxItems", "maxLength"):
                out[key] = min(u, v)
            else:
                raise UnsupportedSchema("allOf", path, f"its members give {key!r} different values")
        for side, other in ((a, b), (b, a)):
            # a side's additionalProperties also judges the other side's properties: only mergeable when
            # it admits everything, or the other side names no property it does not
            closed = side.get("additionalProperties", True) is not True
            names = set(other.get("properties", {})) | set(other.get("required", []))
            if closed and names - set(side.get("properties", {})):
                raise UnsupportedSchema(
                    "allOf", path, "a member's additionalProperties would judge another's properties"
                )
        return out


class Json(Structural):
    """A JSON value matching `schema` (a dict, a bool, or its JSON text), nothing before or after it.

    max_whitespace: the whitespace bytes allowed at each gap (0: compact). root: the document that $ref
    pointers resolve in, when `schema` is a part of it (a tool's argument inside its parameters); default
    the schema itself. Compiled when made: UnsupportedSchema or InvalidSchema are raised here. Two Json
    are equal when their schemas are the same JSON text (property order included, which is significant).
    """

    __slots__ = ("grammar", "max_whitespace", "schema_text")
    schema_text: str
    max_whitespace: int
    grammar: Grammar

    def __init__(
        self, schema: dict | bool | str, max_whitespace: int = JSON_MAX_WHITESPACE, root: dict | None = None
    ) -> None:
        if not isinstance(max_whitespace, int) or isinstance(max_whitespace, bool) or max_whitespace < 0:
            raise InvalidSchema(f"max_whitespace must be an int >= 0, got {max_whitespace!r}")
        text = schema if isinstance(schema, str) else _dumps(schema, "#").decode("utf-8")
        root_text = None if root is None else _dumps(root, "#").decode("utf-8")
        try:
            document = json.loads(text)
        except (json.JSONDecodeError, RecursionError) as e:
            raise InvalidSchema(f"the schema is not JSON: {e}") from e
        compiler = _Compiler(document if root is None else json.loads(root_text), max_whitespace)
        try:
            grammar = trim(compiler.value(document, "#"))
        except GrammarError as e:
            raise InvalidSchema(f"no JSON value matches the schema {text[:200]}") from e
        object.__setattr__(self, "schema_text", _dumps(document, "#").decode("utf-8"))
        object.__setattr__(self, "max_whitespace", max_whitespace)
        object.__setattr__(self, "grammar", grammar)
        super().__init__(self.schema_text, max_whitespace, root_text)

    def expand(self, progress: None, rest: Stack) -> tuple[Stack]:
        return (push(rest, self.grammar),)
