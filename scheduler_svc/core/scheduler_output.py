"""What one step schedules (SchedulerOutput) and what its result does to each sequence (StepUpdate).

The scheduler fills these; step_plan.py turns a SchedulerOutput into the StepPlan protobuf.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from protos import engine_pb2
from scheduler_svc.core.sequence import Sequence


@dataclass(slots=True)
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int  # compute tokens [start, start + num_new_tokens)
    is_new: bool  # the executors must receive it in full (first admission or after preemption)
    start: int = 0  # num_computed_tokens before this step
    samples: bool = False  # the chunk reaches the sequence's end, so the step samples a token for it
    epoch: int = 0  # seq.epoch when planned
    # speculative decoding: tokens proposed after the sequence's last one, verified by this step (counted in
    # num_new_tokens, and in the sequence's num_computed_tokens as if accepted until the verdict says otherwise)
    proposal: list[int] | tuple[int, ...] = ()
    # async verification: the token the chunk's pending input is guessed to be (its proposals follow the guess); -1
    # none. void: an earlier step of the sequence accepted fewer proposals than this step was planned on, so its
    # positions are wrong: it yields nothing (DESIGN.md, "Verification inside async scheduling")
    guess: int = -1
    void: bool = False
    # draft method: the proposal is len(proposal) DRAFTED entries, the tokens the executors draw from the draft model;
    # the scheduler learns them from the verdict (accepted_token_ids)
    drafted: bool = False


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq]
    preempted_seq_ids: list[int]  # dropped from the executors; they come back as new
    finished_seq_ids: list[int]  # finished or aborted since the last step that ran, mirrored by executors
    num_batched_tokens: int
    block_copies: list[tuple[int, int]] = field(default_factory=list)  # (src, dst), run before the forward
    swap_out: list[tuple[int, int]] = field(default_factory=list)  # (KV block, host block), run first
    swap_in: list[tuple[int, int]] = field(default_factory=list)  # (host block, KV block), run second
    num_prefill_tokens: int = 0  # tokens of chunks that are not decodes (prompt tokens, or several new tokens)
    token_bitmasks: engine_pb2.TokenBitmasks | None = None  # structured output: masks of constrained samples
    # constrained samples planned while an earlier sample of theirs is in flight: masks sent late (LateTokenMasks)
    late_masked: list[Sequence] = field(default_factory=list)

    @property
    def has_prefill(self) -> bool:
        return self.num_prefill_tokens > 0


@dataclass(slots=True)
class StepUpdate:
    seq: Sequence
    new_token_id: int | None  # None for a prefill chunk that did not reach the end
    finish_reason: int  # engine_pb2.FinishReason; UNSPECIFIED while running
    error: str = ""  # why, when finish_reason is ERROR
    accepted_token_ids: list[int] = field(default_factory=list)  # speculative decoding: appended before new_token_id
