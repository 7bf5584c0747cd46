"""The JSON values a chat request carries in free-form fields (tool declarations, dict arguments, a
response_format schema) and the ones the parser reads back from typed arguments: what k3 accepts, and how
they are written.

Bounds: at most MAX_JSON_DEPTH nested containers, finite numbers only, string keys only. The depth bound
exists because every step that walks a value (the key sort, json.dumps, json.loads) takes one Python
frame per level: a client's 10,000-deep array would end in RecursionError, a 500. Hand-written and
generated JSON Schemas stay well under 20 levels; 64 leaves room for the tool wrapper around a schema
and is far below Python's recursion limit (1000), so the walks above it can never hit that limit.
NaN and infinities are refused because they are not JSON (RFC 8259 has no spelling for them), and the
rest of k3's API refuses them too (`allow_inf_nan=False` in k3.server.protocol)."""

import json
import math
from typing import Any

from k3.chat.errors import ChatFormatError

MAX_JSON_DEPTH = 64


def json_problem(value: Any) -> str | None:
    """Why value is not JSON data within the bounds above, or None when it is. Walks with an explicit
    stack, so an over-deep value is reported, not recursed into."""
    stack = [(value, 0)]
    while stack:
        v, depth = stack.pop()
        if isinstance(v, dict | list | tuple):
            if depth == MAX_JSON_DEPTH:
                return f"is nested deeper than {MAX_JSON_DEPTH} levels"
            if isinstance(v, dict):
                bad = next((k for k in v if not isinstance(k, str)), None)
                if bad is not None:
                    return f"has a key {bad!r} that is not a string"
            stack.extend((c, depth + 1) for c in (v.values() if isinstance(v, dict) else v))
        elif isinstance(v, float) and not math.isfinite(v):
            return f"holds {v}, which is not a JSON number"
        elif not isinstance(v, str | int | float | bool) and v is not None:
            return f"holds a Python {type(v).__name__}, which is not JSON"
    return None


def check_json(value: Any, where: str) -> Any:
    """value, or ChatFormatError naming `where` when it is not JSON data within the bounds."""
    problem = json_problem(value)
    if problem is not None:
        raise ChatFormatError(f"{where} {problem}")
    return value


class _NonFinite(Exception):
    """Raised out of json.loads for NaN/Infinity; not a ValueError, so it is never mistaken for bad JSON."""


def _refuse_constant(token: str):
    raise _NonFinite(token)


def loads_json(raw: str, where: str) -> Any:
    """json.loads of a client's JSON text, with the bounds above. Invalid JSON raises json.JSONDecodeError
    (the caller decides what that means); NaN, Infinity, `1e999`, or nesting past the bound raise
    ChatFormatError naming `where`."""
    try:
        value = json.loads(raw, parse_constant=_refuse_constant)
    except _NonFinite as e:
        raise ChatFormatError(f"{where} holds {e}, which is not a JSON number") from None
    except RecursionError:
        raise ChatFormatError(f"{where} is nested deeper than {MAX_JSON_DEPTH} levels") from None
    except json.JSONDecodeError:
        raise
    except ValueError as e:  # valid JSON Python will not read: an integer past its 4300-digit limit
        raise ChatFormatError(f"{where}: {e}") from None
    return check_json(value, where)


def parse_json_value(raw: str) -> tuple[bool, Any]:
    """(True, value) when the model's raw text is one JSON value within the bounds, else (False, None):
    the parser then keeps the text as a string rather than fail on what a model wrote."""
    try:
        value = json.loads(raw, parse_constant=_refuse_constant)
    except (ValueError, RecursionError, _NonFinite):
        return False, None
    return json_problem(value) is None, value


def dumps(value: Any, *, compact: bool) -> str:
    """Non-ASCII kept, as the released renderer writes it. compact: `,` `:` (tool declarations and the
    response schema); else json.dumps' default `, ` `: ` (argument values, as the released renderer)."""
    seps = (",", ":") if compact else (", ", ": ")
    return json.dumps(value, ensure_ascii=False, separators=seps, allow_nan=False)


def deep_sort(value: Any) -> Any:
    """Every object's keys sorted, recursively (the released renderer sorts tools and the schema)."""
    if isinstance(value, dict):
        return {k: deep_sort(value[k]) for k in sorted(value)}
    if isinstance(value, list | tuple):
        return [deep_sort(v) for v in value]
    return value
