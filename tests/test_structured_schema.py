"""Json(schema): the supported keywords' meaning as k3 reads them, each unsupported keyword refused by name
with its place in the schema, and malformed or unsatisfiable schemas refused."""

import re

import pytest

from k3.structured import JSON_MAX_WHITESPACE, InvalidSchema, Json, UnsupportedSchema


def accepts(schema, text: str | bytes, **kwargs) -> bool:
    data = text.encode("utf-8") if isinstance(text, str) else text
    state = Json(schema, **kwargs).start().feed_all(data)
    return state is not None and state.can_end()


REFUSED = [
    "pattern",
    "minimum",
    "maximum",
    "exclusiveMinimum",
    "exclusiveMaximum",
    "multipleOf",
    "dependentSchemas",
    "dependentRequired",
    "if",
    "then",
    "else",
    "not",
    "patternProperties",
    "propertyNames",
    "minProperties",
    "maxProperties",
    "uniqueItems",
    "contains",
    "minContains",
    "maxContains",
    "unevaluatedProperties",
    "unevaluatedItems",
    "additionalItems",
    "$anchor",
    "$dynamicRef",
    "$dynamicAnchor",
    "$vocabulary",
    "contentSchema",
    "dependencies",
    "x-vendor",
    "requird",
]


@pytest.mark.parametrize("keyword", REFUSED)
def test_each_unsupported_keyword_is_refused_by_name_and_place(keyword):
    nested = {"type": "object", "properties": {"a/b": {"type": "array", "items": {"type": "string", keyword: 1}}}}
    with pytest.raises(UnsupportedSchema, match=re.escape(f"'{keyword}' at #/properties/a~1b/items")) as e:
        Json(nested)
    assert e.value.keyword == keyword and e.value.path == "#/properties/a~1b/items"
    with pytest.raises(UnsupportedSchema, match=re.escape(f"'{keyword}' at #/$defs/x")):
        Json({"$ref": "#/$defs/x", "$defs": {"x": {keyword: 1}}})
    with pytest.raises(UnsupportedSchema, match=re.escape(f"'{keyword}' at #/anyOf/1")):
        Json({"anyOf": [{"type": "null"}, {keyword: 2}]})


@pytest.mark.parametrize(
    ("schema", "keyword", "message"),
    [
        ({"$ref": "https://example.com/s.json"}, "$ref", "not in this document"),
        ({"$ref": "#/$defs/a", "type": "object", "$defs": {"a": {}}}, "$ref", "beside type"),
        ({"type": "array", "items": [{"type": "string"}]}, "items", "prefixItems"),
        ({"anyOf": [{}], "oneOf": [{}]}, "oneOf", "beside anyOf"),
        ({"enum": ["a"], "minLength": 1}, "minLength", "beside enum"),
        ({"allOf": [{"type": "string"}, {"type": "integer"}], "minLength": 1}, None, None),
        ({"allOf": [{"items": {"type": "string"}}, {"items": {"type": "integer"}}]}, "allOf", "'items'"),
        (
            {"allOf": [{"properties": {"a": {}}, "additionalProperties": False}, {"properties": {"b": {}}}]},
            "allOf",
            "additionalProperties",
        ),
        ({"$defs": {"t": {"allOf": [{"$ref": "#/$defs/t"}]}}, "$ref": "#/$defs/t"}, "allOf", "recursive"),
    ],
)
def test_unsupported_uses_name_the_keyword(schema, keyword, message):
    if keyword is None:  # type string AND integer: nothing, so it is invalid, not unsupported
        with pytest.raises(InvalidSchema, match="no JSON value"):
            Json(schema)
        return
    with pytest.raises(UnsupportedSchema, match=message) as e:
        Json(schema)
    assert e.value.keyword == keyword


def test_annotations_are_accepted_and_not_enforced():
    schema = {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "$id": "https://k3/x",
        "$comment": "c",
        "title": "T",
        "description": "D",
        "type": "string",
        "format": "email",
        "default": "x",
        "examples": ["y"],
        "deprecated": False,
        "readOnly": True,
        "writeOnly": False,
    }
    assert accepts(schema, '"not an email"')


@pytest.mark.parametrize(
    ("schema", "message"),
    [
        ({"type": "strnig"}, "must be one of"),
        ({"type": []}, "must be one of"),
        ("[1", "not JSON"),
        (3, "a JSON object or a boolean"),
        ({"minLength": -1, "type": "string"}, "integer >= 0"),
        ({"maxItems": 1.5, "type": "array"}, "integer >= 0"),
        ({"required": "a", "type": "object"}, "list of property names"),
        ({"anyOf": []}, "non-empty list"),
        ({"$ref": "#/$defs/missing"}, "points to nothing"),
        ({"$ref": "#"}, "refers back to itself"),
        ({"anyOf": [{"$ref": "#"}, {"type": "null"}]}, "refers back to itself"),
        ({"enum": [float("nan")]}, "cannot be written as JSON"),
        (False, "no JSON value"),
        ({"type": "string", "minLength": 3, "maxLength": 2}, "no JSON value"),
        ({"type": "object", "properties": {"a": False}, "required": ["a"]}, "no JSON value"),
        ({"type": "object", "properties": {"next": {"$ref": "#"}}, "required": ["next"]}, "no JSON value"),
        ({"type": "object", "required": ["a"], "properties": {"b": {}}, "additionalProperties": False}, "no JSON"),
    ],
)
def test_invalid_schemas(schema, message):
    with pytest.raises(InvalidSchema, match=message):
        Json(schema)


def test_deep_or_endless_nesting_is_refused_not_a_recursion_error():
    deep: dict = {"type": "string"}
    for _ in range(150):
        deep = {"type": "array", "items": deep}
    with pytest.raises(InvalidSchema, match="nests deeper than"):
        Json(deep)
    with pytest.raises(InvalidSchema, match="not JSON"):
        Json("[" * 100_000)
    assert accepts({"type": "array", "items": {"type": "array", "items": {}}}, "[[1],[]]")


def test_properties_come_in_order_required_ones_always():
    schema = {
        "type": "object",
        "properties": {"a": {"type": "integer"}, "b": {"type": "string"}, "c": {}},
        "required": ["b"],
    }
    for text in ['{"b":"x"}', '{"a":1,"b":"x"}', '{"a": 1, "b": "x", "c": [null]}', '{"b":"","c":{}}']:
        assert accepts(schema, text), text
    for text in ['{"a":1}', '{"b":"x","a":1}', '{"b":"x","b":"y"}', '{"b":"x","d":1}', "{}", '{"a":"1","b":"x"}']:
        assert not accepts(schema, text), text
    spelled = '{"\\u0061":1,"\\u0062":"x"}'  # a listed key in any JSON spelling is that key
    assert accepts(schema, spelled) and accepts(schema, '{"\\u0062":"x"}')


def test_additional_properties():
    listed = {"a": {"type": "integer"}}
    assert not accepts({"type": "object", "properties": listed}, '{"a":1,"z":2}')  # closed when listing
    assert accepts({"type": "object"}, '{"z":[{"y":null}],"z":1}')  # lists nothing: any object
    assert accepts({"type": "object", "required": ["q"]}, '{"q":1}')  # a name only in required
    assert not accepts({"type": "object", "required": ["q"]}, "{}")
    open_ = {"type": "object", "properties": listed, "additionalProperties": {"type": "boolean"}}
    assert accepts(open_, '{"a":1,"z":true,"y":false}') and accepts(open_, '{"z":true}')
    assert not accepts(open_, '{"z":1}') and not accepts(open_, '{"z":true,"a":1}')
    # an additional key may not repeat a listed one, however it is spelled
    for key in ['"a"', '"\\u0061"', '"\\u0061"'.upper().replace("\\U", "\\u")]:
        assert not accepts(open_, '{"a":1,' + key + ":true}"), key
    assert accepts(open_, '{"ab":true,"\\u0062":false,"A":true}')
    emoji = {"type": "object", "properties": {"😀": {"type": "null"}}, "additionalProperties": True}
    assert accepts(emoji, '{"\\ud83d\\ude00":null,"x":1}')  # the listed key, spelled as a surrogate pair
    assert not accepts(emoji, '{"😀":null,"\\ud83d\\ude00":2}') and not accepts(emoji, '{"😀":null,"\\ud83d":2}')
    assert accepts(emoji, '{"😀":null,"\\ud83d\\ude01":2}')


def test_arrays():
    assert accepts({"type": "array"}, '[1,"a",[{}]]')
    tuple_ = {"type": "array", "prefixItems": [{"type": "integer"}, {"type": "string"}]}
    assert accepts(tuple_, "[1]") and accepts(tuple_, '[1, "a"]') and accepts(tuple_, "[]")
    assert not accepts(tuple_, '[1,"a",2]') and not accepts(tuple_, '["a"]')  # closed after its prefixItems
    rest = {**tuple_, "items": {"type": "null"}, "minItems": 2, "maxItems": 4}
    assert [accepts(rest, t) for t in ["[1]", '[1,"a"]', '[1,"a",null,null]', '[1,"a",null,null,null]']] == [
        False,
        True,
        True,
        False,
    ]
    assert not accepts(rest, '[1,"a",3]')
    bounded = {"type": "array", "items": {"type": "integer"}, "minItems": 1, "maxItems": 2}
    assert [accepts(bounded, t) for t in ["[]", "[1]", "[1,2]", "[1,2,3]"]] == [False, True, True, False]
    assert accepts({"type": "array", "items": False}, "[]") and not accepts({"type": "array", "items": False}, "[1]")


def test_strings_count_characters_as_json_schema_does():
    two = {"type": "string", "minLength": 2, "maxLength": 2}
    for text in ['"ab"', '"éü"', '"😀😀"', '"\\n\\u00e9"', '"\\ud83d\\ude00x"']:
        assert accepts(two, text), text
    for text in ['"a"', '"abc"', '"😀"', '"\\ud83d\\ude00"', '"\\ud83dx"', '"\\ude00x"']:
        assert not accepts(two, text), text
    assert accepts({"type": "string"}, '"\\ud83d"')  # uncounted: a lone surrogate escape, as json.loads takes it


def test_numbers_enum_const_and_type_lists():
    assert accepts({"type": "integer"}, "-12") and not accepts({"type": "integer"}, "1.0")
    assert accepts({"type": "number"}, "1.5e-3") and accepts({"type": ["number", "integer"]}, "7")
    assert accepts({"type": ["string", "null"]}, "null") and not accepts({"type": ["string", "null"]}, "1")
    enum = {"enum": ["red", 1, None, [1, {"a": "é"}]]}
    for text in ['"red"', '"\\u0072ed"', "1", "null", '[1, {"a": "\\u00e9"}]', '[1,{"a":"é"}]']:
        assert accepts(enum, text), text
    for text in ['"blue"', "1.0", "true", '[1,{"a":"e"}]']:
        assert not accepts(enum, text), text
    assert accepts({"const": "x", "type": "string"}, '"x"')
    assert not accepts({"enum": ["x", 2], "type": "integer"}, '"x"') and accepts(
        {"enum": ["x", 2], "type": "integer"}, "2"
    )
    assert accepts({"const": 3, "enum": [3, 4]}, "3") and not accepts({"const": 3, "enum": [3, 4]}, "4")


def test_refs_recursion_and_combinators():
    tree = {
        "$defs": {
            "node": {
                "type": "object",
                "properties": {"v": {"type": "integer"}, "kids": {"type": "array", "items": {"$ref": "#/$defs/node"}}},
                "required": ["v"],
            }
        },
        "$ref": "#/$defs/node",
    }
    assert accepts(tree, '{"v":1,"kids":[{"v":2},{"v":3,"kids":[{"v":4,"kids":[]}]}]}')
    assert not accepts(tree, '{"v":1,"kids":[{"kids":[]}]}')
    self_ref = {"type": ["object", "null"], "properties": {"next": {"$ref": "#"}}}
    assert accepts(self_ref, '{"next":{"next":{"next":null}}}')
    assert accepts({"definitions": {"s": {"type": "string"}}, "$ref": "#/definitions/s"}, '"x"')
    merged = {
        "allOf": [
            {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
            {"properties": {"b": {"type": "string"}}, "required": ["b"]},
        ]
    }
    assert accepts(merged, '{"a":1,"b":"x"}') and not accepts(merged, '{"a":1}')
    narrowed = {"type": "string", "anyOf": [{"maxLength": 1}, {"minLength": 3}]}  # siblings apply to each
    assert [accepts(narrowed, t) for t in ['"a"', '"ab"', '"abc"', "1"]] == [True, False, True, False]
    assert accepts({"oneOf": [{"type": "integer"}, {"type": "number"}]}, "1")  # read as anyOf


def test_whitespace_is_bounded_per_gap():
    gap = " " * JSON_MAX_WHITESPACE
    assert accepts({"type": "object"}, "{" + gap + '"a"' + gap + ":" + gap + "1" + gap + "}")
    assert not accepts({"type": "object"}, "{" + gap + ' "a":1}')
    assert not accepts({"type": "object"}, ' {"a":1}') and not accepts({"type": "object"}, '{"a":1}\n')
    assert accepts({"type": "object"}, '{"a":1}', max_whitespace=0) and not accepts(
        {"type": "object"}, '{"a": 1}', max_whitespace=0
    )
    with pytest.raises(InvalidSchema, match="max_whitespace"):
        Json({}, max_whitespace=-1)


def test_equality_follows_the_schema_text_and_a_root_document():
    a = Json({"type": "object", "properties": {"x": {}, "y": {}}})
    assert a == Json('{"type":"object","properties":{"x":{},"y":{}}}') and hash(a) == hash(Json(a.schema_text))
    assert a != Json({"type": "object", "properties": {"y": {}, "x": {}}})  # property order is significant
    root = {"$defs": {"city": {"type": "string", "maxLength": 3}}}
    part = Json({"$ref": "#/$defs/city"}, root=root)
    assert part.start().feed_all(b'"Osl"').can_end() and part.start().feed_all(b'"Oslo"') is None
