"""Hostile constraints cannot crash or stall the roles that build their grammars (invariant 8): a grammar
chained deeper than a thread's stack is built, one that takes too long fails alone while later grammars
compile, and abandoned builds are bounded in number."""
from __future__ import annotations

import json
import threading
import time

import pytest

from protos import engine_pb2
from scheduler_svc.core.structured import grammar_threads
from scheduler_svc.core.structured.compiler import GrammarCompiler, tokenizer_loader
from scheduler_svc.core.structured.grammars import INVALID, grammar_error, grammar_of

VOCAB, EOS = 49152, 2


def rule_chain(length: int) -> engine_pb2.Constraint:
    """start -> r0 -> r1 -> ... -> "z": llguidance recurses once per rule (~3 KiB of stack each)."""
    rules = "\n".join(f"r{i}: r{i + 1}" for i in range(length))
    return engine_pb2.Constraint(grammar=f'start: r0\n{rules}\nr{length}: "z"')


def pattern_properties(n: int) -> engine_pb2.Constraint:
    """llguidance checks patternProperties pairwise for overlap, in ~n^4: 200 of them take ~1.5 s, 400 ~24 s."""
    patterns = {f"^k{i}[a-z]*$": {"type": "integer"} for i in range(n)}
    return engine_pb2.Constraint(json_schema=json.dumps({"type": "object", "patternProperties": patterns}))


def test_a_grammar_chained_deeper_than_a_threads_stack_is_checked_and_compiled(embedded_model):
    deep = rule_chain(5000)  # 8 MiB of stack overflow at ~2,600 rules: a segfault before
    assert deep.ByteSize() < 2**18
    assert grammar_error(deep) == ""
    compiler = GrammarCompiler(tokenizer_loader(embedded_model, VOCAB, (EOS,)))
    grammar = grammar_of(deep)
    compiler.request(grammar)
    deadline = time.monotonic() + 30
    while (compiled := compiler.get(grammar)) is None:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    compiler.close()
    assert compiled.error == "" and compiled.matcher is not None


def test_a_grammar_that_compiles_too_long_fails_and_the_next_one_compiles(embedded_model):
    compiler = GrammarCompiler(tokenizer_loader(embedded_model, VOCAB, (EOS,)), compile_timeout_s=0.3)
    slow, quick = grammar_of(pattern_properties(200)), grammar_of(engine_pb2.Constraint(regex="[0-9]{3}"))
    compiler.request(slow)
    compiler.request(quick)
    deadline = time.monotonic() + 30
    while compiler.get(quick) is None:
        assert time.monotonic() < deadline, "the grammar after the slow one never compiled"
        time.sleep(0.01)
    compiler.close()
    failed = compiler.get(slow)
    assert failed.matcher is None and failed.error.startswith(INVALID + "too complex")
    assert compiler.get(quick).error == ""


def test_a_constraint_that_validates_too_long_is_refused_as_too_complex(monkeypatch):
    monkeypatch.setattr("scheduler_svc.core.structured.grammars.VALIDATE_TIMEOUT_S", 0.3)
    started = time.monotonic()
    assert grammar_error(pattern_properties(200)).startswith("too complex: building it took longer than 0.3 s")
    assert time.monotonic() - started < 1.0


def wait_no_overdue(timeout_s: float = 30) -> None:
    """Until the builds abandoned so far (by this test or the ones before) have ended."""
    deadline = time.monotonic() + timeout_s
    while grammar_threads.num_overdue():
        assert time.monotonic() < deadline
        time.sleep(0.005)


def test_builds_abandoned_past_their_time_are_bounded_and_counted_until_they_end(monkeypatch):
    wait_no_overdue()
    monkeypatch.setattr(grammar_threads, "MAX_OVERDUE", 2)
    release = threading.Event()
    for _ in range(2):
        with pytest.raises(grammar_threads.GrammarTimeout):
            grammar_threads.build_grammar(release.wait, timeout_s=0.01)
    assert grammar_threads.num_overdue() == 2
    with pytest.raises(grammar_threads.GrammarBusy):
        grammar_threads.build_grammar(lambda: "never started", timeout_s=1)
    release.set()
    wait_no_overdue(5)
    assert grammar_threads.build_grammar(lambda x: x + 1, 41, timeout_s=5) == 42


def test_a_build_raises_what_its_function_raised():
    with pytest.raises(ZeroDivisionError):
        grammar_threads.build_grammar(lambda: 1 / 0, timeout_s=5)
