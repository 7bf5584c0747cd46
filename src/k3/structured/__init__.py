"""Structured outputs: grammars over bytes and special tokens (JSON Schema among them), and the per-request
matcher that turns a grammar into a mask of the tokens allowed next. A leaf package: it imports torch and
`tokenizers`, nothing else of k3. docs/serving.md, "Structured outputs"."""

from k3.structured.grammar import (
    ByteSet,
    Choice,
    Grammar,
    GrammarError,
    Literal,
    Repeat,
    Rule,
    Sequence,
    Special,
    State,
    Text,
    trim,
)
from k3.structured.json_lexemes import JsonNumber, JsonString, Whitespace
from k3.structured.json_schema import JSON_MAX_WHITESPACE, InvalidSchema, Json, UnsupportedSchema
from k3.structured.matcher import CompiledGrammar, GrammarCompiler, GrammarMatcher, GrammarViolation
from k3.structured.vocabulary import UnsupportedTokenizer, Vocabulary

__all__ = [
    "JSON_MAX_WHITESPACE",
    "ByteSet",
    "Choice",
    "CompiledGrammar",
    "Grammar",
    "GrammarCompiler",
    "GrammarError",
    "GrammarMatcher",
    "GrammarViolation",
    "InvalidSchema",
    "Json",
    "JsonNumber",
    "JsonString",
    "Literal",
    "Repeat",
    "Rule",
    "Sequence",
    "Special",
    "State",
    "Text",
    "UnsupportedSchema",
    "UnsupportedTokenizer",
    "Vocabulary",
    "Whitespace",
    "trim",
]
