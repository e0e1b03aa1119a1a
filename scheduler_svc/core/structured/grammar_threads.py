"""Where llguidance builds a grammar: on a thread of its own, with a deep stack, for a bounded time.

Building (LLMatcher.validate_grammar, the LLMatcher constructor) is where a hostile constraint hurts, and
neither llguidance's ParserLimits nor MAX_CONSTRAINT_BYTES bound it (invariant 8: no request may crash or
hang a role):
- It recurses once per link of a chain of rules or `$ref`s: ~3 KiB of stack a lark rule, ~9 KiB a JSON
  object, so a thread's 8 MiB overflow at ~2,600 rules (60 KB of grammar) or ~900 nested `$ref` objects
  (90 KB), and the overflow is a segfault that kills the front end or the scheduler. The longest chains
  that fit in MAX_CONSTRAINT_BYTES need ~85 MiB (27k rules) and ~40 MiB (4.3k objects): GRAMMAR_STACK_BYTES
  leaves 3x room. Only the pages the recursion touches are ever mapped.
- Some schemas take unbounded time: 200 patternProperties validate in 1.5 s, 400 in 24 s (n^4). A Rust
  call cannot be interrupted, so the caller stops waiting after its timeout and the build is abandoned,
  left to finish on its own thread (counted: at most MAX_OVERDUE at once, then GrammarBusy).
"""
from __future__ import annotations

import threading
from typing import Callable, TypeVar

T = TypeVar("T")

GRAMMAR_STACK_BYTES = 256 << 20
MAX_OVERDUE = 4  # abandoned builds still running; more would each hold a core for as long as they take

_start_lock = threading.Lock()  # threading.stack_size is process-wide: set, start, restore as one
_overdue_lock = threading.Lock()
_num_overdue = 0


class GrammarTimeout(Exception):
    """The build did not finish in time (it goes on, abandoned, on its thread)."""


class GrammarBusy(Exception):
    """MAX_OVERDUE abandoned builds still run: no new build starts until one ends."""


def num_overdue() -> int:
    return _num_overdue


def build_grammar(fn: Callable[..., T], *args, timeout_s: float, **kwargs) -> T:
    """fn(*args, **kwargs) on a fresh thread with GRAMMAR_STACK_BYTES of stack: its result, or the exception
    it raised; GrammarTimeout after timeout_s, GrammarBusy without starting when too many are overdue."""
    global _num_overdue
    if _num_overdue >= MAX_OVERDUE:
        raise GrammarBusy(f"{_num_overdue} grammars are still compiling past their time limit")
    done = threading.Event()
    outcome: list = []  # [result, exception]
    state = {"abandoned": False}

    def run() -> None:
        global _num_overdue
        try:
            outcome[:] = [fn(*args, **kwargs), None]
        except BaseException as exc:  # handed to the caller, who raises it
            outcome[:] = [None, exc]
        with _overdue_lock:
            done.set()
            if state["abandoned"]:
                _num_overdue -= 1

    with _start_lock:
        previous = threading.stack_size(GRAMMAR_STACK_BYTES)
        try:
            threading.Thread(target=run, name="grammar-build", daemon=True).start()
        finally:
            threading.stack_size(previous)
    if not done.wait(timeout_s):
        with _overdue_lock:
            if not done.is_set():
                state["abandoned"] = True
                _num_overdue += 1
                raise GrammarTimeout(f"building it took longer than {timeout_s:g} s")
    result, exc = outcome
    if exc is not None:
        raise exc
    return result
