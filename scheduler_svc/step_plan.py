"""Turn the scheduler's decision into the StepPlan protobuf that executors run (invariant 4: deltas).

A sequence the executors don't mirror yet is sent in full once; afterwards only its newly appended
block ids, its scheduled token count and, when newly known here, the token it sampled last. Executors
append the tokens they sample to their mirrors themselves, so with async scheduling a step can be
planned before the previous step's tokens reach the scheduler; last_token_id is then left out.
"""
from __future__ import annotations

from protos import engine_pb2
from scheduler_svc.scheduler import SchedulerOutput


def build_step_plan(step_id: int, out: SchedulerOutput, send_last_token: bool = True) -> engine_pb2.StepPlan:
    """send_last_token: cross-check the executors' newest token; only exact when no other step is in
    flight (with async scheduling the executors may already be a token ahead of this scheduler)."""
    plan = engine_pb2.StepPlan(
        step_id=step_id,
        finished_seq_ids=out.finished_seq_ids,
        preempted_seq_ids=out.preempted_seq_ids,
    )
    for item in out.scheduled:
        seq = item.seq
        if item.is_new:
            plan.new_seqs.append(engine_pb2.NewSequence(
                seq_id=seq.seq_id,
                token_ids=seq.token_ids,
                num_prompt_tokens=seq.num_prompt_tokens,
                block_ids=seq.block_table,
                num_computed_tokens=item.start,
                num_scheduled_tokens=item.num_new_tokens,
                sampling=seq.sampling,
            ))
        else:
            cached = engine_pb2.CachedSequence(
                seq_id=seq.seq_id,
                new_block_ids=seq.block_table[seq.num_blocks_sent:],
                num_scheduled_tokens=item.num_new_tokens,
            )
            if seq.last_token_unsent and send_last_token:
                cached.last_token_id = seq.token_ids[-1]
            plan.cached_seqs.append(cached)
        seq.num_blocks_sent = len(seq.block_table)
        seq.last_token_unsent = False
    return plan
