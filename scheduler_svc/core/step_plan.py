"""Turn the scheduler's decision into the StepPlan protobuf that executors run (invariant 4: deltas).

A sequence the executors don't mirror yet is sent in full once; afterwards only its newly appended
block ids, its scheduled token count and, when newly known here, the token it sampled last. Executors
append the tokens they sample to their mirrors themselves, so with async scheduling a step can be
planned before the previous step's tokens reach the scheduler; last_token_id is then left out.
"""
from __future__ import annotations

from protos import engine_pb2
from scheduler_svc.core.scheduler_output import SchedulerOutput


def build_step_plan(step_id: int, out: SchedulerOutput, send_last_token: bool = True) -> engine_pb2.StepPlan:
    """send_last_token: cross-check the executors' newest token; only exact when no other step is in
    flight (with async scheduling the executors may already be a token ahead of this scheduler)."""
    plan = engine_pb2.StepPlan(
        step_id=step_id,
        finished_seq_ids=out.finished_seq_ids,
        preempted_seq_ids=out.preempted_seq_ids,
    )
    seq_ids, num_scheduled, num_new_blocks, new_block_ids, last_tokens = [], [], [], [], []
    num_proposed, proposed, kept = [], [], []  # speculative decoding: filled from the first sequence that needs them
    guesses, starts = [], []  # async verification: likewise
    num_drafted = []  # draft method: likewise
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
            seq_ids.append(seq.seq_id)
            num_scheduled.append(item.num_new_tokens)
            new = seq.block_table[seq.num_blocks_sent:]
            num_new_blocks.append(len(new))
            new_block_ids += new
            last_tokens.append(seq.token_ids[-1] if seq.last_token_unsent and send_last_token else -1)
            if item.proposal or seq.blocks_kept >= 0 or num_proposed:
                if not num_proposed:  # the sequences before it have neither
                    num_proposed, kept = [0] * (len(seq_ids) - 1), [-1] * (len(seq_ids) - 1)
                num_proposed.append(0 if item.drafted else len(item.proposal))
                proposed += () if item.drafted else item.proposal
                kept.append(seq.blocks_kept)
                seq.blocks_kept = -1
            if item.drafted or num_drafted:
                num_drafted += [0] * (len(seq_ids) - 1 - len(num_drafted)) + [len(item.proposal) if item.drafted else 0]
            if item.guess >= 0 or seq.start_unsent or guesses:
                if not guesses:
                    guesses, starts = [-1] * (len(seq_ids) - 1), [-1] * (len(seq_ids) - 1)
                guesses.append(item.guess)
                starts.append(item.start if seq.start_unsent else -1)
                seq.start_unsent = False
        seq.num_blocks_sent = len(seq.block_table)
        seq.last_token_unsent = False
    for copies, field in ((out.block_copies, plan.block_copies), (out.swap_out, plan.swap_out),
                          (out.swap_in, plan.swap_in)):
        field.extend(engine_pb2.BlockCopy(src_block_id=src, dst_block_id=dst) for src, dst in copies)
    if out.token_bitmasks is not None:
        plan.token_bitmasks.CopyFrom(out.token_bitmasks)
    if out.late_masked:
        plan.late_mask_seq_ids.extend(seq.seq_id for seq in out.late_masked)
    if seq_ids:
        plan.cached.CopyFrom(engine_pb2.CachedSequences(
            seq_ids=seq_ids, num_scheduled_tokens=num_scheduled, num_new_blocks=num_new_blocks,
            new_block_ids=new_block_ids, last_token_ids=last_tokens, num_proposed_tokens=num_proposed,
            proposed_token_ids=proposed, num_blocks_kept=kept, guessed_token_ids=guesses, chunk_starts=starts,
            num_draft_tokens=num_drafted))
    return plan
