"""A structured-output constraint as the grammar llguidance compiles, and the check of one.

The front end's validator checks a request's constraint with grammar_error() (no tokenizer needed, so a
bad schema is INVALID_ARGUMENT before it reaches the engine); the scheduler compiles the same grammar text
with the model's tokenizer (compiler.py), keyed by that text.
"""
from __future__ import annotations

import llguidance

from protos import engine_pb2
from scheduler_svc.core.structured import grammar_threads

# JSON is generated compactly, one space after ':' and ',' (as json.dumps writes it): with any whitespace
# allowed, a small model can fill max_tokens with newlines. A schema's "x-guidance" overrides these.
JSON_OPTIONS = {"whitespace_flexible": False, "key_separator": ": ", "item_separator": ", "}
ANY_JSON_OBJECT = '{"type": "object"}'

# A constraint's wire size at most: compiling is the costly part of a request (the front end validates it
# on its event loop, the scheduler compiles it again), and real schemas are a few KiB.
MAX_CONSTRAINT_BYTES = 2**18

# A choice's strings at most: llguidance's parser keeps one item per string still possible (max_items_in_row,
# 2000), so more strings that share their first token passed the checks and failed after the prompt's prefill.
MAX_CHOICES = 2000

INVALID = "invalid constraint: "  # how an error the request caused begins: the front end answers INVALID_ARGUMENT
OVERLOADED = "structured output is overloaded: "  # how a refusal for lack of room begins: RESOURCE_EXHAUSTED

# How long the front end's check of a constraint may take (grammar_threads.py: some schemas take hours);
# real ones take milliseconds, the heaviest that fit in MAX_CONSTRAINT_BYTES under a second on one core.
VALIDATE_TIMEOUT_S = 5.0


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
        if len(choices) > MAX_CHOICES:
            raise ValueError(f"choice has {len(choices)} strings; the limit is {MAX_CHOICES}")
        return llguidance.grammar_from("choice", choices)
    raise ValueError("the constraint has no kind set")


def grammar_error(constraint: engine_pb2.Constraint) -> str:
    """llguidance's message for a constraint that does not compile; "" for a valid one. Raises
    grammar_threads.GrammarBusy while too many checks of earlier constraints still run past their time."""
    try:
        grammar = grammar_of(constraint)
    except ValueError as exc:
        return str(exc)
    try:  # on a deep stack, bounded in time (grammar_threads.py): a hostile grammar overflows or never ends
        return grammar_threads.build_grammar(llguidance.LLMatcher.validate_grammar, grammar,
                                             timeout_s=VALIDATE_TIMEOUT_S)
    except grammar_threads.GrammarTimeout as exc:
        return f"too complex: {exc}"
