"""Structured output end to end on the embedded SmolLM2, through the real scheduler and executor processes:
every output of 14 JSON schemas (greedy and seeded) parses and validates, regex and choice outputs match in
full, arithmetic from a grammar parses, free requests batched with constrained ones give the tokens they
give alone, and constrained requests stay valid under preemption, chunked prefill and n > 1. Few engines and
few tokens: each engine serves its whole batch at once."""
from __future__ import annotations

import ast
import json
import re

import jsonschema
import pytest

from scheduler_svc.entrypoints.llm import LLM
from scheduler_svc.frontend.sampling_params import SamplingParams
from scheduler_svc.text.tokenizer import Tokenizer

INT = {"type": "integer", "minimum": 0, "maximum": 120}


def obj(required: list[str], **properties) -> dict:
    return {"type": "object", "properties": properties, "required": required, "additionalProperties": False}


SCHEMAS = {  # name -> (schema, what the prompt asks for)
    "person": (obj(["name", "age"], name={"type": "string", "maxLength": 16}, age=INT), "a person"),
    "nested address": (obj(["user"], user=obj(["name", "address"], name={"type": "string", "maxLength": 16},
                                              address=obj(["city", "zip"], city={"type": "string", "maxLength": 20},
                                                          zip={"type": "string", "pattern": "^[0-9]{5}$"}))),
                       "a user and their address"),
    "integer array": ({"type": "array", "items": INT, "minItems": 1, "maxItems": 4}, "a few ages"),
    "enums": (obj(["color", "size"], color={"enum": ["red", "green", "blue"]}, size={"enum": ["S", "M", "L"]}),
              "a T-shirt"),
    "bounded number": (obj(["celsius"], celsius={"type": "number", "minimum": -50, "maximum": 50,
                                                 "multipleOf": 0.5}), "today's temperature"),
    "optional field": (obj(["done"], done={"type": "boolean"}, note={"type": "string", "maxLength": 20}), "a task"),
    "array of objects": ({"type": "array", "minItems": 1, "maxItems": 3, "items": obj(
        ["id", "tag"], id={"type": "integer", "minimum": 1, "maximum": 99}, tag={"enum": ["new", "old"]})},
        "a list of items"),
    "any of": ({"anyOf": [{"type": "integer", "minimum": 0, "maximum": 9}, {"type": "string", "maxLength": 5}]},
               "a digit or a short word"),
    "pattern": (obj(["date"], date={"type": "string", "pattern": "^20[0-9]{2}-[01][0-9]-[0-3][0-9]$"}), "a date"),
    "nested arrays": (obj(["matrix"], matrix={"type": "array", "minItems": 2, "maxItems": 2, "items": {
        "type": "array", "minItems": 2, "maxItems": 2, "items": {"type": "integer", "minimum": 0, "maximum": 9}}}),
        "a 2x2 matrix"),
    "refs": ({"$defs": {"point": obj(["x", "y"], x=INT, y=INT)}, **obj(
        ["start", "end"], start={"$ref": "#/$defs/point"}, end={"$ref": "#/$defs/point"})}, "a line segment"),
    "const and nullable": (obj(["version", "parent"], version={"const": 1},
                               parent={"type": ["integer", "null"], "minimum": 0, "maximum": 999}), "a record"),
    "all optional": (obj([], a={"type": "integer", "minimum": 0, "maximum": 5}, b={"type": "boolean"}), "settings"),
    "top-level enum": ({"enum": ["yes", "no", "maybe"]}, "an answer to: is it raining?"),
}
# each schema three times: greedy on one prompt, seeded samples on two
RUNS = [("Reply with JSON describing {}.", dict(temperature=0.0)),
        ("Write {} as JSON, nothing else.", dict(temperature=0.8, seed=1)),
        ("Reply with JSON describing {}.", dict(temperature=1.0, seed=2))]
JSON_MAX_TOKENS = 96

PHONE = r"\(?[0-9]{3}\)? [0-9]{3}-[0-9]{4}"
NAME = r"[A-Z][a-z]{1,9} [A-Z][a-z]{1,9}"
ARITHMETIC = """start: expr
expr: term (("+" | "-") term)~0..3
term: factor (("*" | "/") factor)~0..2
factor: NUMBER | "(" expr ")"
NUMBER: /[0-9]{1,3}/
"""
CHOICES = {"What is the capital of France?": ["Paris", "London", "Berlin"],
           "Is this review positive or negative? 'I loved it.'": ["positive", "negative", "neutral"]}
FREE = ["What is 2 + 2?", "Name a color.", "Say hello in French."]
FREE_PARAMS = SamplingParams(temperature=0.0, max_tokens=16)


def chat(tokenizer: Tokenizer, text: str) -> list[int]:
    return tokenizer.encode_chat([{"role": "user", "content": text}])


def is_arithmetic(text: str) -> bool:
    """The text parses as integers combined by + - * / and parentheses, and nothing else."""
    try:
        tree = ast.parse(re.sub(r"\b0+([0-9])", r"\1", text), mode="eval")  # Python refuses 07; the grammar not
    except SyntaxError:
        return False
    allowed = (ast.Expression, ast.BinOp, ast.Constant, ast.Add, ast.Sub, ast.Mult, ast.Div)
    return all(isinstance(n, allowed) for n in ast.walk(tree)) and re.fullmatch(r"[0-9+\-*/()]+", text) is not None


def assert_valid_json(outputs, schema: dict, label: str) -> None:
    for out in outputs:
        assert out.finish_reason == "stop", f"{label}: {out.finish_reason} after {out.text!r}"
        jsonschema.validate(json.loads(out.text), schema)


@pytest.fixture(scope="module")
def mixed_batch(embedded_model):
    """One engine: the 42 JSON requests, the regex, choice and grammar ones and the free ones in one batch,
    then each free request alone."""
    tokenizer = Tokenizer(embedded_model)
    prompts, params, labels = [], [], []
    for name, (schema, what) in SCHEMAS.items():
        for template, sampling in RUNS:
            prompts.append(chat(tokenizer, template.format(what)))
            params.append(SamplingParams(max_tokens=JSON_MAX_TOKENS, json_schema=schema, **sampling))
            labels.append(("json", name))
    for pattern, ask in ((PHONE, "Give me a phone number."), (NAME, "Give me a person's full name.")):
        for sampling in (dict(temperature=0.0), dict(temperature=1.0, seed=3)):
            prompts.append(chat(tokenizer, ask))
            params.append(SamplingParams(max_tokens=24, regex=pattern, **sampling))
            labels.append(("regex", pattern))
    for question, choices in CHOICES.items():
        prompts.append(chat(tokenizer, question))
        params.append(SamplingParams(temperature=0.0, max_tokens=8, choice=choices))
        labels.append(("choice", question))
    for seed in (4, 5, 6):
        prompts.append(chat(tokenizer, "Write an arithmetic expression."))
        params.append(SamplingParams(temperature=1.0, seed=seed, max_tokens=48, grammar=ARITHMETIC))
        labels.append(("grammar", seed))
    for question in FREE:
        prompts.append(chat(tokenizer, question))
        params.append(FREE_PARAMS)
        labels.append(("free", question))
    with LLM(embedded_model, device="cpu", num_gpu_blocks=1024, max_model_len=512) as llm:
        results = llm.generate(prompts, params, use_tqdm=False)
        alone = {q: llm.generate([chat(tokenizer, q)], FREE_PARAMS, use_tqdm=False)[0].outputs[0] for q in FREE}
        stats = llm.stats()
    return [(label, r.outputs[0]) for label, r in zip(labels, results)], alone, stats


def test_every_output_of_fourteen_json_schemas_parses_and_validates(mixed_batch):
    outputs, _, stats = mixed_batch
    for name, (schema, _) in SCHEMAS.items():
        assert_valid_json([out for (kind, n), out in outputs if (kind, n) == ("json", name)], schema, name)
    assert sum(kind == "json" for (kind, _), _ in outputs) == 3 * len(SCHEMAS) >= 36
    assert stats.num_constrained_requests == sum(kind != "free" for (kind, _), _ in outputs)
    assert stats.num_grammar_compile_errors == 0 and stats.num_token_masks > 0
    # async scheduling (the default): constrained rows run in every step, most masks sent after their plan
    assert stats.num_late_token_masks > stats.num_token_masks / 2


def test_regex_and_choice_outputs_match_in_full(mixed_batch):
    outputs, _, _ = mixed_batch
    regex_outs = [(pattern, out) for (kind, pattern), out in outputs if kind == "regex"]
    assert len(regex_outs) == 4
    for pattern, out in regex_outs:
        assert re.fullmatch(pattern, out.text), (pattern, out.text)
    for (kind, question), out in outputs:
        if kind == "choice":
            assert out.text in CHOICES[question] and out.finish_reason == "stop"


def test_an_arithmetic_grammars_outputs_parse(mixed_batch):
    outputs, _, _ = mixed_batch
    exprs = [out for (kind, _), out in outputs if kind == "grammar"]
    assert len(exprs) == 3
    for out in exprs:
        assert out.finish_reason == "stop" and is_arithmetic(out.text), out.text


def test_free_requests_batched_with_constrained_ones_give_their_tokens_alone(mixed_batch):
    outputs, alone, _ = mixed_batch
    free = {question: out for (kind, question), out in outputs if kind == "free"}
    assert set(free) == set(FREE)
    for question, out in free.items():
        assert out.token_ids == alone[question].token_ids and len(out.token_ids) > 0


PRESSED = ["person", "nested address", "array of objects", "refs"]


def test_constrained_requests_stay_valid_under_preemption_chunked_prefill_and_n_samples(embedded_model):
    """A KV pool of 24 blocks of 16 for 12 sequences of up to ~200 tokens preempts; a 64-token budget
    chunks the prompts; each request has n = 3 samples, forked from its first."""
    tokenizer = Tokenizer(embedded_model)
    preamble = "Please answer carefully, in JSON only, and think about every detail of the request. "
    prompts = [chat(tokenizer, preamble * 2 + f"Reply with JSON describing {SCHEMAS[n][1]}.") for n in PRESSED]
    params = [SamplingParams(temperature=1.0, seed=10 + i, n=3, max_tokens=JSON_MAX_TOKENS,
                             json_schema=SCHEMAS[n][0]) for i, n in enumerate(PRESSED)]
    assert all(len(p) > 64 for p in prompts)
    with LLM(embedded_model, device="cpu", num_gpu_blocks=24, max_num_batched_tokens=64, max_model_len=256,
             num_host_blocks=8) as llm:
        results = llm.generate(prompts, params, use_tqdm=False)
        stats = llm.stats()
    for name, result in zip(PRESSED, results):
        assert len(result.outputs) == 3
        assert_valid_json(result.outputs, SCHEMAS[name][0], name)
    assert stats.num_preemptions > 0 and stats.num_partial_prefill_chunks > 0 and stats.num_late_token_masks > 0
    assert stats.free_kv_blocks == stats.total_kv_blocks
