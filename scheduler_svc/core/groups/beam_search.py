"""Beam search: which continuations of a request's beams survive each step.

The scheduler runs the beams as ordinary sequences that all advance one token per round. When every
live beam of a search has reported its top candidates (raw log-softmax, best first), select() keeps
the best continuations, as HF transformers' beam search does with early_stopping=False:
- the (1 + number of stop tokens) x width best continuations over all beams are considered;
- among them, the best `width` that do not end the hypothesis become the next beams;
- those that end it (a stop token, or the length limit) and rank within the first `width` become
  finished hypotheses, scored sum(logprob) / generated_len ** length_penalty; the best `width` are kept;
- the search ends at the length limit, or once `width` hypotheses are finished and the best beam,
  scored at its current length, cannot beat the worst of them.
Stop tokens before min_tokens are not candidates. With num_logprobs, each token keeps its logprob, its
rank among its beam's candidates and the best num_logprobs of them. This module only decides; the scheduler forks the
chosen beams (sharing blocks, copy-on-write) and frees the others.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass, field

from protos import engine_pb2

STOP = engine_pb2.FINISH_REASON_STOP
LENGTH = engine_pb2.FINISH_REASON_LENGTH


@dataclass(frozen=True, slots=True)
class Hypothesis:
    """A finished beam."""

    output_token_ids: tuple[int, ...]  # generated tokens, the stop token included
    score: float  # cumulative logprob / len(output_token_ids) ** length_penalty
    finish_reason: int  # STOP or LENGTH
    stop_token_id: int = -1
    logprobs: tuple = ()  # per output token: (logprob, rank, top ids, top logprobs), when asked for


@dataclass(frozen=True, slots=True)
class Continuation:
    """A beam chosen for the next round: parent_index's tokens plus token_id."""

    parent_index: int  # into the beams passed to select()
    token_id: int
    cum_logprob: float
    logprobs: tuple | None = None  # the token's (logprob, rank, top ids, top logprobs), when asked for


@dataclass(frozen=True, slots=True)
class BeamRound:
    continuations: list[Continuation]  # the next beams, best first; empty when the search is done
    done: bool


@dataclass
class BeamSearch:
    """One request's search: its options, its members (the requests that receive hypotheses) and state."""

    group_id: str
    width: int
    length_penalty: float
    num_requests: int  # members expected before the search starts
    stop_token_ids: frozenset[int] = frozenset()
    min_tokens: int = 0
    max_output_tokens: int = 1  # generated tokens at which every beam ends with LENGTH
    num_logprobs: int = 0  # top candidates returned per token
    members: list = field(default_factory=list)  # Sequence per member request, in arrival order
    beams: list = field(default_factory=list)  # the live beams (Sequence), best first
    unreported: set[int] = field(default_factory=set)  # seq ids of live beams still to report this round
    reports: dict[int, tuple[list[int], list[float]]] = field(default_factory=dict)  # seq_id -> candidates
    finished: list[Hypothesis] = field(default_factory=list)  # best first, at most width
    started: bool = False
    key: tuple = ()  # (front end, group_id): how the scheduler finds the search
    created_at: float = 0.0  # time.monotonic() when its first member arrived

    @property
    def num_candidates(self) -> int:
        """Continuations considered per round, and so per beam: enough that `width` survive the stops."""
        return max((1 + max(1, len(self.stop_token_ids))) * self.width, self.num_logprobs)

    def select(self, output_lens: int) -> BeamRound:
        """Choose this round's continuations from self.reports. output_lens: tokens each beam has generated."""
        width, penalty = self.width, self.length_penalty
        allow_stop = output_lens + 1 >= self.min_tokens
        pool = []
        for index, beam in enumerate(self.beams):
            token_ids, logprobs = self.reports[beam.seq_id]
            cum = beam.cum_logprob
            for rank, (token, lp) in enumerate(zip(token_ids, logprobs), 1):
                if allow_stop or token not in self.stop_token_ids:
                    pool.append((cum + lp, index, token, rank))
        pool = heapq.nlargest(self.num_candidates, pool, key=lambda c: c[0])
        new_len = output_lens + 1
        at_length = new_len >= self.max_output_tokens
        continuations: list[Continuation] = []
        for place, (cum, index, token, rank) in enumerate(pool):
            stops = token in self.stop_token_ids
            token_logprobs = self._token_logprobs(self.beams[index], rank)
            if stops or at_length:
                if place < width:
                    beam = self.beams[index]
                    tokens = (*beam.output_token_ids, token)
                    logprobs = (*beam.beam_logprobs, token_logprobs) if token_logprobs else ()
                    self._add_finished(Hypothesis(tokens, cum / new_len ** penalty, STOP if stops else LENGTH,
                                                  token if stops else -1, logprobs))
            elif len(continuations) < width:
                continuations.append(Continuation(index, token, cum, token_logprobs))
        done = at_length or not continuations or (
            len(self.finished) == width
            and continuations[0].cum_logprob / new_len ** penalty <= self.finished[-1].score)
        self.reports.clear()
        if done and not self.finished:  # nothing came back to choose from: the beams end as they are
            for beam in self.beams:
                self._add_finished(Hypothesis(tuple(beam.output_token_ids),
                                              beam.cum_logprob / max(1, output_lens) ** penalty, LENGTH,
                                              logprobs=tuple(beam.beam_logprobs)))
        return BeamRound([] if done else continuations, done)

    def _token_logprobs(self, beam, rank: int) -> tuple | None:
        if not self.num_logprobs:
            return None
        token_ids, logprobs = self.reports[beam.seq_id]
        n = self.num_logprobs
        return logprobs[rank - 1], rank, tuple(token_ids[:n]), tuple(logprobs[:n])

    def _add_finished(self, hyp: Hypothesis) -> None:
        self.finished.append(hyp)
        self.finished.sort(key=lambda h: -h.score)  # stable: on a tie the earlier stays ahead
        del self.finished[self.width:]
