"""Structured output on the scheduler: each constrained sequence's matcher, the token masks a step carries,
and the matcher following every sampled token.

The scheduler calls it through a few hooks: add() when a request arrives (its grammar compiles in the
background), is_ready() before admitting it (it waits, without blocking others, until its grammar is
compiled), plan_masks() for the step's constrained samples, late_masks() for those planned on a token
still in flight once it is known, accept() with each token sampled, release() when it ends. A matcher
lives as long as its sequence: preemption by recompute or swap keeps it as it is (the tokens it consumed
are still the sequence's), and it advances only once per sampled token, so recomputing a sequence never
replays its tokens into it. Unconstrained sequences never reach this file. With async scheduling a
constrained sequence is planned on its placeholder like a free one, and its mask, which depends on the
token in flight, follows the plan once that token is known (a late mask: DESIGN.md "Structured output").
Rank 0 waits on those masks, so the scheduler advances their matchers first (accept_ahead(), before the
rest of the result is applied); accept() then takes the verdict reached then and advances nothing again.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import llguidance

from protos import engine_pb2
from scheduler_svc.core.scheduler_output import ScheduledSeq
from scheduler_svc.core.sequence import Sequence
from scheduler_svc.core.structured.compiler import CompiledGrammar, GrammarCompiler
from scheduler_svc.core.structured.grammars import INVALID, grammar_of
from scheduler_svc.core.structured.mask_fill import MaskFiller

# llguidance's words for a grammar that outgrew its limits while it ran (a{1000000} passes the compile and fails
# at its first token: "lexer error: too many expressions constructed"), not for a token outside the mask
LLGUIDANCE_LIMITS = ("too many", "fuel", "max is", "too big", "too large")

STOP = engine_pb2.FINISH_REASON_STOP
ERROR = engine_pb2.FINISH_REASON_ERROR
UNFINISHED = engine_pb2.FINISH_REASON_UNSPECIFIED


@dataclass
class StructuredCounters:
    """Named as the fields of engine_pb2.SchedulerStats."""

    num_constrained_requests: int = 0
    num_grammar_compile_errors: int = 0
    num_masked_steps: int = 0
    num_token_masks: int = 0
    token_mask_seconds: float = 0.0
    num_late_token_masks: int = 0  # of num_token_masks, those sent after their plan


@dataclass
class _InUse:
    """A compiled grammar held by live sequences, so a sibling or a repeat starts at once, whatever the
    compiler's cache has dropped since."""

    templates: tuple[llguidance.LLMatcher, ...]  # one initial state per lexer (CompiledGrammar.initial_states)
    num_seqs: int = 0
    num_started: int = 0


class StructuredOutputs:
    def __init__(self, compiler: GrammarCompiler, vocab_size: int, num_fill_threads: int = 0) -> None:
        self.compiler = compiler
        self.filler = MaskFiller(vocab_size, num_fill_threads)  # num_fill_threads 0: default_fill_threads()
        self.matchers: dict[int, llguidance.LLMatcher] = {}  # seq_id -> its matcher, once its grammar compiled
        self.compiling: dict[int, tuple[Sequence, str]] = {}  # seq_id -> (seq, grammar) waiting for the compiler
        self._grammar_of: dict[int, str] = {}  # seq_id -> its grammar text, for every live constrained sequence
        self._in_use: dict[str, _InUse] = {}
        self._unspread: dict[int, str] = {}  # seq_id -> its grammar, for sequences whose matcher has had no mask yet
        self._lexer_of: dict[int, int] = {}  # seq_id -> which of its grammar's lexers its matcher shares
        # seq_id -> (token, finish reason, error): its matcher has taken a token that postprocess has not applied yet
        self._ahead: dict[int, tuple[int, int, str]] = {}
        self.counters = StructuredCounters()

    # ------------------------------------------------------------------ lifecycle of a constrained sequence

    def add(self, seq: Sequence) -> None:
        """A new constrained sequence: start it at once if its grammar is compiled, else compile it in the
        background. Raises ValueError for a request the engine cannot constrain."""
        if seq.beam_options is not None:
            raise ValueError(INVALID + "structured output does not apply to beam search")
        try:
            grammar = grammar_of(seq.constraint)
        except ValueError as exc:
            raise ValueError(INVALID + str(exc)) from exc
        compiled = None if grammar in self._in_use else self.compiler.get(grammar)
        if compiled is not None and compiled.error:
            self.counters.num_grammar_compile_errors += 1
            raise ValueError(compiled.error)
        self.counters.num_constrained_requests += 1
        self._grammar_of[seq.seq_id] = grammar
        if grammar in self._in_use or compiled is not None:
            self._start(seq.seq_id, grammar, compiled)
        else:
            self.compiling[seq.seq_id] = (seq, grammar)
            self.compiler.request(grammar)

    def is_ready(self, seq: Sequence) -> bool:
        """Whether a constrained sequence's grammar is compiled, so it may be admitted."""
        return seq.seq_id in self.matchers

    def poll(self) -> list[tuple[Sequence, str]]:
        """Start the sequences whose grammar has compiled since; returns those whose grammar failed, with
        the reason (the caller ends them)."""
        failed = []
        for seq_id, (seq, grammar) in list(self.compiling.items()):
            compiled = None if grammar in self._in_use else self.compiler.get(grammar)
            if compiled is None and grammar not in self._in_use:
                self.compiler.request(grammar)  # no-op while it compiles; again if the cache dropped it meanwhile
                continue
            del self.compiling[seq_id]
            if compiled is not None and compiled.error:
                self.counters.num_grammar_compile_errors += 1
                failed.append((seq, compiled.error))
                continue
            self._start(seq_id, grammar, compiled)
        return failed

    def _start(self, seq_id: int, grammar: str, compiled: CompiledGrammar | None) -> None:
        entry = self._in_use.get(grammar)
        if entry is None:
            entry = self._in_use[grammar] = _InUse(compiled.initial_states)
        entry.num_seqs += 1
        self.matchers[seq_id] = entry.templates[0].deep_copy()  # microseconds: the copy shares its template's lexer
        self._unspread[seq_id] = grammar  # until its first mask, which takes a copy of the next lexer in turn

    def _spread(self, seq_id: int) -> None:
        """At a sequence's first mask, before it has taken a token: a copy of its grammar's next lexer in turn,
        counting those the compiler has added since the sequence started (a burst of new requests would
        otherwise all start on the first)."""
        grammar = self._unspread.pop(seq_id)
        entry = self._in_use[grammar]
        latest = self.compiler.get(grammar)
        if latest is not None and len(latest.initial_states) > len(entry.templates):
            entry.templates = latest.initial_states
        lexer = entry.num_started % len(entry.templates)
        entry.num_started += 1
        self._lexer_of[seq_id] = lexer
        if lexer:
            self.matchers[seq_id] = entry.templates[lexer].deep_copy()

    def release(self, seq: Sequence) -> None:
        """The sequence ended: its matcher goes, and its grammar's hold once no live sequence uses it."""
        self.compiling.pop(seq.seq_id, None)
        self._ahead.pop(seq.seq_id, None)
        self._unspread.pop(seq.seq_id, None)
        self._lexer_of.pop(seq.seq_id, None)
        grammar = self._grammar_of.pop(seq.seq_id, None)
        if self.matchers.pop(seq.seq_id, None) is not None:
            entry = self._in_use[grammar]
            entry.num_seqs -= 1
            if not entry.num_seqs:
                del self._in_use[grammar]

    # ------------------------------------------------------------------ each step

    def plan_masks(self, scheduled: list[ScheduledSeq]) -> tuple[engine_pb2.TokenBitmasks | None, list[Sequence]]:
        """The masks of this step's constrained samples: (those filled now, for the plan; the sequences planned
        while a sample of theirs is still in flight, whose masks late_masks() fills once it is known)."""
        now, late = [], []
        for s in scheduled:
            if s.samples and s.seq.constraint is not None:
                # num_placeholders counts this step's sample too: more means an earlier one is in flight
                (late if s.seq.num_placeholders > 1 else now).append(s.seq)
        if not now and not late:
            return None, late
        self.counters.num_masked_steps += 1
        masks = None
        if now:
            masks = engine_pb2.TokenBitmasks()
            self._fill(now, masks)
        return masks, late

    def late_masks(self, into: engine_pb2.LateTokenMasks, step_id: int, seqs: list[Sequence]) -> None:
        """Fill `into` (a fresh message, in the envelope that carries it) with the masks of a step's late rows,
        once every earlier sample of theirs is known: the steps before are applied (results come in order),
        and the one just answered has gone through accept_ahead(). A sequence that ended meanwhile (stop,
        length, grammar end, abort, a failed step), or ends by the token it just took, is listed as dropped:
        the executor samples it free and its token is discarded."""
        live, dropped = [], []
        for seq in seqs:
            ahead = self._ahead.get(seq.seq_id)
            ended = seq.is_finished or seq.seq_id not in self.matchers or (ahead is not None and ahead[1] != UNFINISHED)
            (dropped if ended else live).append(seq)
        into.step_id = step_id
        into.dropped_seq_ids.extend(seq.seq_id for seq in dropped)
        if live:
            self._fill(live, into.masks)
            self.counters.num_late_token_masks += len(live)

    def _fill(self, seqs: list[Sequence], into: engine_pb2.TokenBitmasks) -> None:
        """Each sequence's allowed tokens after its output so far, and any token accept_ahead() gave it."""
        t0 = time.perf_counter()
        for seq in seqs:
            if seq.seq_id in self._unspread:
                self._spread(seq.seq_id)
        self.filler.fill([self.matchers[seq.seq_id] for seq in seqs], [seq.seq_id for seq in seqs], into,
                         [self._lexer_of.get(seq.seq_id, 0) for seq in seqs])
        c = self.counters
        c.num_token_masks += len(seqs)
        c.token_mask_seconds += time.perf_counter() - t0

    def accept_ahead(self, seq: Sequence, token: int, stop_reason: int) -> None:
        """Advance the matcher by a sampled token before postprocess applies it, so the next mask can be filled
        first. stop_reason: what the stop rules say of the token (UNFINISHED, or the reason it ends the
        sequence: then the grammar never sees it, as in postprocess)."""
        reason, error = (stop_reason, "") if stop_reason != UNFINISHED else self._consume(seq, token)
        self._ahead[seq.seq_id] = (token, reason, error)

    def accept(self, seq: Sequence, token: int) -> tuple[int, str]:
        """Advance the sequence's matcher by the token it sampled: (finish reason, error). STOP once the
        grammar is complete and admits nothing more (EOS consumed, or the text can only end). A token that
        accept_ahead() took already is not consumed again: its verdict stands."""
        ahead = self._ahead.pop(seq.seq_id, None)
        if ahead is None:
            return self._consume(seq, token)
        assert ahead[0] == token, "accept_ahead() and postprocess() apply the same result"
        return ahead[1], ahead[2]

    def _consume(self, seq: Sequence, token: int) -> tuple[int, str]:
        matcher = self.matchers[seq.seq_id]
        if not matcher.consume_token(token):
            # the first line only: llguidance's verbose error goes on with the parser's state and the grammar
            error = matcher.get_error().split("\n", 1)[0]
            if any(mark in error for mark in LLGUIDANCE_LIMITS):  # the constraint's doing: INVALID_ARGUMENT
                return ERROR, f"{INVALID}too complex: {error}"
            return ERROR, f"structured output: token {token} does not fit the grammar: {error}"
        return (STOP if matcher.is_stopped() else UNFINISHED), ""

    def stats(self) -> dict:
        """Counters named as the fields of engine_pb2.SchedulerStats."""
        return dict(vars(self.counters), num_grammar_compiles=self.compiler.num_compiles,
                    grammar_compile_seconds=self.compiler.compile_seconds)
