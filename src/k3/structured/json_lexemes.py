"""JSON's lexemes as consumers over bytes (RFC 8259): strings, numbers and bounded whitespace.

Each is one deterministic consumer with a small progress value, not a tree of combinators: inside a long
string the state is then one stack whose progress repeats from byte to byte, which the matcher's masks
and transitions are memoised on (k3.structured.matcher).
"""

import json

from k3.structured.grammar import DONE, ByteSet, Choice, Consumer, Grammar, GrammarError, Literal, Sequence, Symbol

WHITESPACE = frozenset(b" \t\n\r")  # JSON's four whitespace bytes


class Whitespace(Consumer):
    """0 … max_bytes JSON whitespace bytes. Progress: how many have been read."""

    __slots__ = ("max_bytes",)
    max_bytes: int

    def __init__(self, max_bytes: int) -> None:
        if not isinstance(max_bytes, int) or max_bytes < 1:
            raise GrammarError(f"Whitespace needs max_bytes >= 1, got {max_bytes!r}")
        object.__setattr__(self, "max_bytes", max_bytes)
        super().__init__(max_bytes)

    def initial(self) -> int:
        return 0

    def can_end(self, progress: int) -> bool:
        return True

    def step(self, progress: int, symbol: Symbol) -> object:
        if type(symbol) is not int or symbol not in WHITESPACE:
            return None
        return DONE if progress + 1 == self.max_bytes else progress + 1


_START, _MINUS, _ZERO, _INT, _DOT, _FRAC, _E, _E_SIGN, _EXP = range(9)
_NUMBER_ENDS = frozenset({_ZERO, _INT, _FRAC, _EXP})


class JsonNumber(Consumer):
    """-?(0|[1-9][0-9]*)(.[0-9]+)?([eE][+-]?[0-9]+)?; integer: no fraction and no exponent (so an integer
    is written 3, never 3.0 or 3e0, which JSON Schema would count as integers too). Digits are not
    bounded: max_tokens bounds them, as it bounds a string. Progress: where in that pattern."""

    __slots__ = ("integer",)
    integer: bool

    def __init__(self, integer: bool = False) -> None:
        object.__setattr__(self, "integer", bool(integer))
        super().__init__(bool(integer))

    def initial(self) -> int:
        return _START

    def can_end(self, progress: int) -> bool:
        return progress in _NUMBER_ENDS

    def step(self, progress: int, symbol: Symbol) -> object:
        if type(symbol) is not int:
            return None
        digit = 0x30 <= symbol <= 0x39
        if progress in (_START, _MINUS):
            if symbol == 0x30:
                return _ZERO
            if digit:
                return _INT
            return _MINUS if progress == _START and symbol == 0x2D else None
        if progress == _INT and digit:
            return _INT
        if progress in (_ZERO, _INT):
            if self.integer:
                return None
            return _DOT if symbol == 0x2E else _E if symbol in (0x45, 0x65) else None
        if progress in (_DOT, _FRAC) and digit:
            return _FRAC
        if progress == _FRAC and symbol in (0x45, 0x65):
            return _E
        if progress == _E and symbol in (0x2B, 0x2D):
            return _E_SIGN
        return _EXP if progress in (_E, _E_SIGN, _EXP) and digit else None


# string phases; a UTF-8 continuation phase is _UTF8 + 5 * (bytes still needed) + (index of the range the next
# byte must be in), after the well-formed byte sequences of Unicode's table 3-7 (no overlongs, no surrogates)
_OPEN, _BODY, _ESC, _HEX0, _HEX1, _HEX2, _HEX3, _HEX_D, _HIGH2, _HIGH3 = range(10)
# where lone surrogates are refused, the \uDCxx that must follow a \uD8xx-\uDBxx: backslash, u, d, c-f, 2 hex digits
_LOW_BACKSLASH, _LOW_U, _LOW_D, _LOW_C, _LOW2, _LOW3 = range(30, 36)
_UTF8 = 10
_UTF8_RANGES = ((0x80, 0xBF), (0xA0, 0xBF), (0x80, 0x9F), (0x90, 0xBF), (0x80, 0x8F))
_UTF8_LEAD = {
    **{b: _UTF8 + 5 + 0 for b in range(0xC2, 0xE0)},
    0xE0: _UTF8 + 10 + 1,
    **{b: _UTF8 + 10 + 0 for b in range(0xE1, 0xED)},
    0xED: _UTF8 + 10 + 2,
    0xEE: _UTF8 + 10 + 0,
    0xEF: _UTF8 + 10 + 0,
    0xF0: _UTF8 + 15 + 3,
    **{b: _UTF8 + 15 + 0 for b in range(0xF1, 0xF4)},
    0xF4: _UTF8 + 15 + 4,
}
_HEX_DIGITS = frozenset(b"0123456789abcdefABCDEF")
# the byte after a backslash -> the character it stands for
_SHORT_ESCAPES = {ord(k): v for k, v in zip('"\\/bfnrt', '"\\/\b\f\n\r\t', strict=True)}


def canonical(text: str) -> bytes:
    """The spelling json.dumps(ensure_ascii=False) gives text between its quotes: how k3 compares keys."""
    return json.dumps(text, ensure_ascii=False)[1:-1].encode("utf-8")


class JsonString(Consumer):
    r"""A JSON string, quotes included: UTF-8 characters, escapes, no raw control characters.

    min_length / max_length count characters as JSON Schema does, as Python decodes them: a code point
    each, an escape one, a surrogate pair of \u escapes one. exclude: strings it may not be, however
    spelled (the keys of additional properties may not repeat a listed property's). A counted or excluding
    string refuses lone surrogate escapes, whose meaning would depend on what follows them (no valid
    Unicode text needs them). Progress: (phase, characters, the canonical spelling of what has been decoded
    while it still begins an excluded string (else None), the hex digits of the \u escape being read then).
    """

    __slots__ = ("_names", "_pairs", "_prefixes", "exclude", "max_length", "min_length")
    min_length: int
    max_length: int | None
    exclude: frozenset[str]

    def __init__(self, min_length: int = 0, max_length: int | None = None, exclude: frozenset[str] = frozenset()):
        if not isinstance(min_length, int) or min_length < 0 or (max_length is not None and max_length < min_length):
            raise GrammarError(f"JsonString needs 0 <= min_length <= max_length, got {min_length!r}, {max_length!r}")
        exclude = frozenset(exclude)
        names = frozenset(canonical(n) for n in exclude)
        for name, value in {"min_length": min_length, "max_length": max_length, "exclude": exclude}.items():
            object.__setattr__(self, name, value)
        object.__setattr__(self, "_names", names)
        object.__setattr__(self, "_prefixes", frozenset(n[:k] for n in names for k in range(len(n) + 1)))
        object.__setattr__(self, "_pairs", min_length > 0 or max_length is not None or bool(exclude))
        super().__init__(min_length, max_length, exclude)

    def initial(self) -> tuple:
        return _OPEN, 0, b"" if self.exclude else None, b""

    def _chars(self, count: int) -> int:
        """Characters worth remembering: past min_length with no max_length, all counts are alike."""
        return count if self.max_length is not None else min(count, self.min_length)

    def _decoded(self, key: bytes | None, spelling: bytes) -> bytes | None:
        """key with one more decoded character's canonical spelling, while it still begins an excluded name."""
        if key is None:
            return None
        key += spelling
        return key if key in self._prefixes else None

    def _escaped(self, key: bytes | None, digits: bytes) -> bytes | None:
        if key is None:
            return None
        code = int(digits[:4], 16)
        if len(digits) == 8:
            code = 0x10000 + ((code - 0xD800) << 10) + int(digits[4:], 16) - 0xDC00
        return self._decoded(key, canonical(chr(code)))

    def step(self, progress: tuple, symbol: Symbol) -> object:
        if type(symbol) is not int:
            return None
        phase, count, key, digits = progress
        if phase == _OPEN:
            return (_BODY, 0, key, b"") if symbol == 0x22 else None
        if phase == _BODY:
            if symbol == 0x22:
                return None if count < self.min_length or key in self._names else DONE
            if self.max_length is not None and count >= self.max_length:
                return None
            if symbol == 0x5C:
                return _ESC, count, key, b""
            if symbol < 0x20:
                return None
            if symbol < 0x80:
                return _BODY, self._chars(count + 1), self._decoded(key, bytes((symbol,))), b""
            lead = _UTF8_LEAD.get(symbol)
            return None if lead is None else (lead, count, self._decoded(key, bytes((symbol,))), b"")
        if phase == _ESC:
            if symbol in _SHORT_ESCAPES:
                return _BODY, self._chars(count + 1), self._decoded(key, canonical(_SHORT_ESCAPES[symbol])), b""
            return (_HEX0, count, key, b"") if symbol == 0x75 else None
        if _UTF8 < phase < _LOW_BACKSLASH:
            need, r = divmod(phase - _UTF8, 5)
            lo, hi = _UTF8_RANGES[r]
            if not lo <= symbol <= hi:
                return None
            key = self._decoded(key, bytes((symbol,)))  # UTF-8 bytes are their own canonical spelling
            return (_BODY, self._chars(count + 1), key, b"") if need == 1 else (_UTF8 + 5 * (need - 1), count, key, b"")
        wanted = {_LOW_BACKSLASH: b"\\", _LOW_U: b"u", _LOW_D: b"dD", _LOW_C: b"cdefCDEF"}.get(phase, _HEX_DIGITS)
        if symbol not in wanted:
            return None
        if key is not None and symbol in _HEX_DIGITS and phase not in (_LOW_BACKSLASH, _LOW_U):
            digits += bytes((symbol,))
        if phase == _HEX0:
            return (_HEX_D if self._pairs and symbol in b"dD" else _HEX1), count, key, digits
        if phase == _HEX_D:  # D0-D7 is a character; D8-DB begins a surrogate pair; DC-DF would be a lone low half
            if symbol <= 0x37:
                return _HEX2, count, key, digits
            return (_HIGH2, count, key, digits) if symbol in b"89abAB" else None
        if phase in (_HEX3, _LOW3):
            return _BODY, self._chars(count + 1), self._escaped(key, digits), b""
        return (_LOW_BACKSLASH if phase == _HIGH3 else phase + 1), count, key, digits


def _digit(d: str) -> bytes | ByteSet:
    return d.encode() if d.isdigit() else ByteSet(d.lower().encode() + d.upper().encode())


def _u_escape(code: int) -> Sequence:
    """\\uXXXX for one UTF-16 code unit, hex digits in either case."""
    parts: list = [b"\\u"]
    for d in f"{code:04x}":
        piece = _digit(d)
        if isinstance(piece, bytes) and isinstance(parts[-1], bytes):
            parts[-1] += piece
        else:
            parts.append(piece)
    return Sequence(*(Literal(p) if isinstance(p, bytes) else p for p in parts))


def json_string_literal(text: str) -> Grammar:
    """The JSON string `text` in every spelling JSON has for it: each character raw (when JSON allows it
    raw), as its short escape, or as \\u escapes (a surrogate pair past U+FFFF), hex digits in either case."""
    parts: list[Grammar] = [Literal(b'"')]
    for c in text:
        code = ord(c)
        spellings: list[Grammar] = []
        if code >= 0x20 and c not in '"\\':
            spellings.append(Literal(c.encode("utf-8")))
        short = next((chr(k) for k, v in _SHORT_ESCAPES.items() if v == c), None)
        if short is not None:
            spellings.append(Literal(b"\\" + short.encode()))
        if code < 0x10000:
            spellings.append(_u_escape(code))
        else:
            spellings.append(Sequence(_u_escape(0xD800 + ((code - 0x10000) >> 10)), _u_escape(0xDC00 + (code & 0x3FF))))
        parts.append(Choice(*spellings))
    parts.append(Literal(b'"'))
    return Sequence(*parts)
