"""Who speculates in a step, what is proposed for them, and the counts of what was accepted.

The scheduler asks propose() for each running sequence whose next chunk is a decode with every token known;
the proposals ride in the plan after the sequence's last token (lookahead slots, allocated by the scheduler),
the executors verify all of them in one forward, and record() counts the verdict. A sequence speculates only
when it opted in (the default), samples without penalties and logprobs, is no beam and has no structured-output
constraint: those would need a verdict per proposed position that this file does not make (DESIGN.md).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from protos import engine_pb2
from scheduler_svc.core.sequence import Sequence
from scheduler_svc.core.speculative.ngram import ngram_proposer
from scheduler_svc.core.speculative.policy import SpeculationPolicy

# (a sequence, its tokens (known, or assumed while its steps are in flight), how many at most) -> tokens proposed
# to follow them
Proposer = Callable[[Sequence, list[int], int], list[int]]

# A draft model's proposal as the scheduler plans it: the executors draw the tokens, so the plan holds only how many
# (CachedSequences.num_draft_tokens); the scheduler learns the accepted ones from the verdict.
DRAFTED = -1


@dataclass
class SpeculationCounters:
    """Named as the fields of engine_pb2.SchedulerStats."""

    num_speculative_steps: int = 0  # sequence steps that verified proposals
    num_proposed_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)  # entry i: accepted at position i


def can_speculate(add: engine_pb2.AddRequest) -> bool:
    """Whether a request's tokens may be verified in batches: sampling that one verdict per position decides
    (temperature, top-k, top-p, min-p, seed), no beam search, no constraint, and it did not opt out."""
    o = add.sampling
    return not (add.disable_speculation or add.HasField("beam_search") and add.beam_search.beam_width > 0
                or add.HasField("constraint") or o.logprobs > 0 or o.presence_penalty or o.frequency_penalty
                or o.repetition_penalty not in (0.0, 1.0))


class Speculator:
    def __init__(self, num_tokens: int, propose: Proposer, max_batch_size: int, planned_ahead: bool = False,
                 drafts: bool = False) -> None:
        self.num_tokens = num_tokens  # K: proposals per sequence and step, at most
        self.propose = propose
        self.drafts = drafts  # the executors' draft model proposes: propose() gives DRAFTED placeholders
        self.max_batch_size = max_batch_size
        self.policy = SpeculationPolicy(num_tokens, planned_ahead)  # how many each sequence proposes (policy.py)
        self.counters = SpeculationCounters(accepted_per_position=[0] * num_tokens)

    @staticmethod
    def ngram(num_tokens: int, n_min: int, n_max: int, max_batch_size: int,
              planned_ahead: bool = False) -> "Speculator":
        return Speculator(num_tokens, ngram_proposer(n_min, n_max), max_batch_size, planned_ahead)

    @staticmethod
    def draft(num_tokens: int, max_batch_size: int) -> "Speculator":
        """A draft model proposes, in the executors, once per step: every sequence that speculates gets k DRAFTED
        slots, and its proposals are known here only once verified."""
        return Speculator(num_tokens, lambda seq, tokens, k: [DRAFTED] * k, max_batch_size, drafts=True)

    def active(self, num_running: int) -> bool:
        """Speculation pays while a step is bound by launches and weight reads, i.e. at small batches."""
        return num_running <= self.max_batch_size

    def record(self, num_proposed: int, num_accepted: int) -> None:
        c = self.counters
        c.num_speculative_steps += 1
        c.num_proposed_tokens += num_proposed
        c.num_accepted_tokens += num_accepted
        for i in range(num_accepted):
            c.accepted_per_position[i] += 1

    def stats(self) -> dict:
        return dict(vars(self.counters))
