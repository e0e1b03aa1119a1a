"""Grammars compiled with the model's tokenizer off the step loop: one worker thread, a bounded LRU cache.

Compiling a grammar builds its lexer over the whole vocabulary: about a millisecond for a small JSON
schema, up to a second for a heavy one. The step loop only asks (request, get); the worker compiles
in the background (llguidance releases the GIL while it builds), so a heavy schema never stalls the
other requests, and a request whose grammar is still compiling simply waits (structured_outputs.py).
A compiled grammar is a matcher in its initial state, and later one per lexer (num_lexers, as many as
threads fill masks, compiled when nothing else waits): each sequence gets a copy of one of them.
"""
from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, replace
from typing import Callable

import llguidance

from scheduler_svc.core.structured import grammar_threads
from scheduler_svc.core.structured.grammars import INVALID, OVERLOADED

log = logging.getLogger("nanoserve.scheduler")

DEFAULT_CACHE_SIZE = 256  # compiled grammars kept, least recently used dropped first
# A compile that takes longer fails its requests, and the worker goes on to the next grammar (grammar_threads.py:
# one that never ends would otherwise hold every later constrained request in the waiting queue).
COMPILE_TIMEOUT_S = 20.0


@dataclass(frozen=True)
class CompiledGrammar:
    matcher: llguidance.LLMatcher | None  # the initial state; None when compiling failed
    error: str  # why it failed ("invalid constraint: " and llguidance's message, for the request's own fault), else ""
    seconds: float  # how long compiling took
    # The initial state again, compiled on its own up to num_lexers - 1 times, after the first (the worker adds
    # them when no requested grammar waits): copies of one matcher share its lexer, which builds new states
    # under a lock, so a parallel mask fill over rows of one grammar would wait on it.
    more_lexers: tuple[llguidance.LLMatcher, ...] = ()

    @property
    def initial_states(self) -> tuple[llguidance.LLMatcher, ...]:
        """One matcher per lexer: sequences of this grammar are spread over them."""
        return (self.matcher, *self.more_lexers) if self.matcher is not None else ()


def tokenizer_loader(tokenizer_dir: str, vocab_size: int, eos_token_ids: tuple[int, ...]
                     ) -> Callable[[], llguidance.LLTokenizer]:
    """Loads the model's tokenizer.json for llguidance, with masks as wide as the logits (vocab_size)."""
    def load() -> llguidance.LLTokenizer:
        path = os.path.join(tokenizer_dir, "tokenizer.json")
        if not os.path.exists(path):
            raise RuntimeError(f"structured output needs the model's tokenizer: {path} does not exist")
        return llguidance.LLTokenizer(path, n_vocab=vocab_size, eos_token=list(eos_token_ids) or None)
    return load


class GrammarCompiler:
    def __init__(self, load_tokenizer: Callable[[], llguidance.LLTokenizer],
                 cache_size: int = DEFAULT_CACHE_SIZE, num_lexers: int = 1,
                 compile_timeout_s: float = COMPILE_TIMEOUT_S) -> None:
        self._load_tokenizer = load_tokenizer
        self.compile_timeout_s = compile_timeout_s
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._tokenizer_error = ""
        self._cache: OrderedDict[str, CompiledGrammar] = OrderedDict()  # by grammar text; guarded by _lock
        self._cache_size = cache_size
        self.num_lexers = max(1, num_lexers)  # lexers per grammar: as many as threads fill its masks at once
        self._more_lexers: deque[str] = deque()  # grammars to compile once more, for a lexer of their own; worker-only
        self._queued: set[str] = set()  # requested and not compiled yet; guarded by _lock
        self._jobs: queue.SimpleQueue[str | None] = queue.SimpleQueue()  # None: stop
        self._lock = threading.Lock()
        self._worker: threading.Thread | None = None
        self.num_compiles = 0  # written by the worker, read for stats
        self.compile_seconds = 0.0

    def get(self, grammar: str) -> CompiledGrammar | None:
        """The compiled grammar, or None while it is not compiled (call request() first)."""
        with self._lock:
            compiled = self._cache.get(grammar)
            if compiled is not None:
                self._cache.move_to_end(grammar)
                if compiled.error.startswith(OVERLOADED):  # told once: a later request of it compiles afresh
                    del self._cache[grammar]
            return compiled

    def request(self, grammar: str) -> None:
        """Compile in the background unless cached or on its way already."""
        with self._lock:
            if grammar in self._cache or grammar in self._queued:
                return
            self._queued.add(grammar)
            if self._worker is None:  # started by the first constraint: an engine without one pays nothing
                self._worker = threading.Thread(target=self._work, name="grammar-compiler", daemon=True)
                self._worker.start()
        self._jobs.put(grammar)

    def close(self) -> None:
        """Stop the worker once it has compiled what it was asked (an engine lost starts a new scheduler)."""
        self._jobs.put(None)

    def _work(self) -> None:
        while True:
            try:  # requested grammars first; extra lexers when none waits
                grammar = self._jobs.get(block=not self._more_lexers)
            except queue.Empty:
                self._add_lexer(self._more_lexers.popleft())
                continue
            if grammar is None:
                return
            compiled = self._compile(grammar)
            with self._lock:
                self._queued.discard(grammar)
                self._cache[grammar] = compiled
                while len(self._cache) > self._cache_size:
                    self._cache.popitem(last=False)
            self.num_compiles += 1
            self.compile_seconds += compiled.seconds
            if compiled.matcher is not None and self.num_lexers > 1:
                self._more_lexers.append(grammar)

    def _add_lexer(self, grammar: str) -> None:
        """One more lexer for a cached grammar (its sequences start on the first meanwhile), until num_lexers."""
        t0 = time.perf_counter()
        try:
            matcher = self._build(self._tokenizer, grammar)
        except Exception:  # it compiled once: this is not the request's fault, and the others serve it
            log.exception("compiling another lexer for a grammar failed")
            return
        with self._lock:
            compiled = self._cache.get(grammar)
            if compiled is None or matcher.is_error():
                return  # dropped from the cache meanwhile, or (never seen) compiled wrong this time
            compiled = replace(compiled, more_lexers=compiled.more_lexers + (matcher,))
            self._cache[grammar] = compiled
        self.compile_seconds += time.perf_counter() - t0
        if len(compiled.initial_states) < self.num_lexers:
            self._more_lexers.append(grammar)

    def _compile(self, grammar: str) -> CompiledGrammar:
        t0 = time.perf_counter()
        tokenizer = self._tokenizer_or_error()
        if tokenizer is None:
            return CompiledGrammar(None, self._tokenizer_error, 0.0)
        try:
            matcher = self._build(tokenizer, grammar)
            error = INVALID + matcher.get_error() if matcher.is_error() else ""
        except grammar_threads.GrammarTimeout as exc:
            matcher, error = None, f"{INVALID}too complex: {exc}"
        except grammar_threads.GrammarBusy as exc:
            matcher, error = None, f"{OVERLOADED}{exc}"
        except Exception as exc:  # llguidance reports grammar errors in the matcher; this is anything else
            log.exception("compiling a grammar failed")
            matcher, error = None, f"{type(exc).__name__}: {exc}"
        return CompiledGrammar(None if error else matcher, error, time.perf_counter() - t0)

    def _build(self, tokenizer: llguidance.LLTokenizer, grammar: str) -> llguidance.LLMatcher:
        """On a deep stack, bounded in time: a hostile grammar overflows a thread's stack or never ends."""
        return grammar_threads.build_grammar(llguidance.LLMatcher, tokenizer, grammar, log_level=0,
                                             timeout_s=self.compile_timeout_s)

    def _tokenizer_or_error(self) -> llguidance.LLTokenizer | None:
        """The tokenizer, loaded on first use (about a second for a large vocabulary), in the worker."""
        if self._tokenizer is None and not self._tokenizer_error:
            try:
                self._tokenizer = self._load_tokenizer()
            except Exception as exc:
                self._tokenizer_error = f"structured output is unavailable: {exc}"
                log.error("%s", self._tokenizer_error)
        return self._tokenizer
