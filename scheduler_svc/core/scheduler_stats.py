"""The scheduler's cumulative counters, and how a step's shape is counted."""
from __future__ import annotations

from dataclasses import dataclass

from scheduler_svc.core.scheduler_output import ScheduledSeq


@dataclass
class SchedulerCounters:
    """Cumulative counts, named as the fields of engine_pb2.SchedulerStats."""

    num_preemptions: int = 0
    num_swap_outs: int = 0  # preemptions that swapped to the host pool
    num_recompute_preemptions: int = 0  # preemptions that dropped the KV, to recompute it
    num_priority_preemptions: int = 0  # preemptions that made room for a waiting request of higher priority
    num_recomputed_tokens: int = 0  # tokens computed again after a preemption by recompute
    num_swapped_bytes: int = 0  # KV bytes copied to the host pool and back, over every rank
    estimated_swap_seconds: float = 0.0  # the cost model's estimate of the swaps it chose (out and in)
    estimated_recompute_seconds: float = 0.0  # and of the recomputes it chose
    measured_recompute_seconds: float = 0.0  # the tokens actually recomputed, at the measured prefill rate
    num_finished: int = 0
    num_aborted: int = 0
    num_generated_tokens: int = 0
    num_steps: int = 0  # steps whose result was applied (failed ones included)
    num_partial_prefill_chunks: int = 0  # chunks that did not reach their sequence's end
    num_mixed_steps: int = 0  # steps with both decodes and prefill chunks
    num_prefill_steps: int = 0  # steps with a prefill chunk, mixed or not (eager on CUDA: no decode graph)
    num_prefill_tokens: int = 0


def count_step(c: SchedulerCounters, scheduled: list[ScheduledSeq]) -> int:
    """Count a step's shape; returns its prefill tokens."""
    decodes = prefills = num_prefill_tokens = 0
    for s in scheduled:
        c.num_partial_prefill_chunks += not s.samples
        if s.num_new_tokens - len(s.proposal) == 1 and s.start >= s.seq.num_prompt_tokens:  # (a verified decode too)
            decodes += 1
        else:
            prefills += 1
            num_prefill_tokens += s.num_new_tokens
    c.num_prefill_tokens += num_prefill_tokens
    c.num_mixed_steps += bool(decodes and prefills)
    c.num_prefill_steps += bool(prefills)
    return num_prefill_tokens


def stats_of(sched) -> dict:
    """A Scheduler's queue sizes, KV blocks, counters and cost-model rate, named as the fields of
    engine_pb2.SchedulerStats."""
    bm = sched.block_manager
    return dict(
        num_running=len(sched.running),
        num_waiting=len(sched.waiting),
        num_swapped=len(sched.swapped),
        total_kv_blocks=bm.num_blocks,
        free_kv_blocks=bm.num_free_blocks,
        prefix_cache_query_tokens=bm.prefix_query_tokens,
        prefix_cache_hit_tokens=bm.prefix_hit_tokens,
        prefill_tokens_per_s=sched.preemption.costs.prefill_tokens_per_s,
        prefill_step_premium_seconds=sched.preemption.costs.prefill_step_premium_s,
        **vars(sched.counters),
        **sched.structured.stats(),
    )
