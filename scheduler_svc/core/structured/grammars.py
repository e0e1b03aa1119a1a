"""A structured-output constraint as the grammar llguidance compiles, and the check of one.

The front end's validator checks a request's constraint with grammar_error() (no tokenizer needed, so a
bad schema is INVALID_ARGUMENT before it reaches the engine); the scheduler compiles the same grammar text
with the model's tokenizer (compiler.py), keyed by that text.
"""
from __future__ import annotations

import llguidance

from protos import engine_pb2

# JSON is generated compactly, one space after ':' and ',' (as json.dumps writes it): with any whitespace
# allowed, a small model can fill max_tokens with newlines. A schema's "x-guidance" overrides these.
JSON_OPTIONS = {"whitespace_flexible": False, "key_separator": ": ", "item_separator": ", "}
ANY_JSON_OBJECT = '{"type": "object"}'

# A constraint's wire size at most: compiling is the costly part of a request (the front end validates it
# on its event loop, the scheduler compiles it again), and real schemas are a few KiB.
MAX_CONSTRAINT_BYTES = 2**18

INVALID = "invalid constraint: "  # how an error the request caused begins: the front end answers INVALID_ARGUMENT


def grammar_of(constraint: engine_pb2.Constraint) -> str:
    """The llguidance grammar (its JSON text) that a constraint compiles to. Raises ValueError for one that
    cannot even be written as a grammar (a schema that is not JSON, an empty choice)."""
    kind = constraint.WhichOneof("kind")
    if kind == "json_schema":
        return llguidance.LLMatcher.grammar_from_json_schema(constraint.json_schema, defaults=JSON_OPTIONS)
    if kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema(ANY_JSON_OBJECT, defaults=JSON_OPTIONS)
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(constraint.regex)
    if kind == "grammar":
        return llguidance.LLMatcher.grammar_from_lark(constraint.grammar)
    if kind == "choice":
        choices = list(constraint.choice.choices)
        if not choices or not all(choices):
            raise ValueError("choice needs at least one string, and no empty one")
        return llguidance.grammar_from("choice", choices)
    raise ValueError("the constraint has no kind set")


def grammar_error(constraint: engine_pb2.Constraint) -> str:
    """llguidance's message for a constraint that does not compile; "" for a valid one."""
    try:
        grammar = grammar_of(constraint)
    except ValueError as exc:
        return str(exc)
    return llguidance.LLMatcher.validate_grammar(grammar)
