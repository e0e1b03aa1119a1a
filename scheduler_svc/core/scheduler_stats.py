"""The scheduler's cumulative counters, and how a step's shape is counted."""
from __future__ import annotations

from dataclasses import dataclass

from scheduler_svc.core.scheduler_output import ScheduledSeq


@dataclass
class SchedulerCounters:
    """Cumulative counts, named as the fields of engine_pb2.SchedulerStats."""

    num_preemptions: int = 0
    num_swap_outs: int = 0
    num_finished: int = 0
    num_aborted: int = 0
    num_generated_tokens: int = 0
    num_steps: int = 0  # steps whose result was applied (failed ones included)
    num_partial_prefill_chunks: int = 0  # chunks that did not reach their sequence's end
    num_mixed_steps: int = 0  # steps with both decodes and prefill chunks
    num_prefill_tokens: int = 0


def count_step(c: SchedulerCounters, scheduled: list[ScheduledSeq]) -> bool:
    """Count a step's shape; True when it computes prefill tokens."""
    decodes = prefills = 0
    for s in scheduled:
        c.num_partial_prefill_chunks += not s.samples
        if s.num_new_tokens == 1 and s.start >= s.seq.num_prompt_tokens:
            decodes += 1
        else:
            prefills += 1
            c.num_prefill_tokens += s.num_new_tokens
    c.num_mixed_steps += bool(decodes and prefills)
    return prefills > 0
