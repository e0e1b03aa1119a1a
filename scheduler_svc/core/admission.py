"""Admission, the second half of Scheduler.schedule(): swapped sequences resume first, then waiting ones
start, in queue order, while the step's token budget, max_num_seqs and the free blocks allow.

Functions of the scheduler they are given (AdmissionHost), which owns the queues and the blocks; they move
sequences from its waiting and swapped queues to running.
"""
from __future__ import annotations

from typing import Protocol

from scheduler_svc.core.groups.beam_scheduler import BeamScheduler
from scheduler_svc.core.kv_cache_manager import BlockManager
from scheduler_svc.core.preemption_policy import Preemption
from scheduler_svc.core.scheduler_output import ScheduledSeq
from scheduler_svc.core.sequence import Sequence, SequenceStatus
from scheduler_svc.core.structured.structured_outputs import StructuredOutputs


class AdmissionHost(Protocol):
    """What admission reads and moves of the scheduler (scheduler.py's Scheduler)."""

    running: list[Sequence]  # admitted sequences are appended
    waiting: list[Sequence]  # admitted ones are taken out
    swapped: list[Sequence]  # resumed ones are taken out
    block_manager: BlockManager
    structured: StructuredOutputs
    preemption: Preemption
    beams: BeamScheduler
    speculator: object | None  # speculative decoding's (core/speculative/speculator.py), or None

    def has_room(self, seq: Sequence, reserved: int) -> bool:
        """Whether seq may join the running queue, reserved slots counted."""

    def slots_reserved(self) -> int:
        """Running-queue slots that started beam searches hold."""


def admit(sched: AdmissionHost, budget: int, scheduled: list[ScheduledSeq], swap_in: list[tuple[int, int]]) -> int:
    """Resume swapped sequences, then admit waiting ones in order while they fit. Stopping at the first
    that does not fit keeps it from starving. Returns the token budget left."""
    reserved = sched.slots_reserved()
    if sched.swapped:
        budget, reserved = _resume_swapped(sched, scheduled, swap_in, budget, reserved)
    bm = sched.block_manager
    index = 0
    while index < len(sched.waiting) and budget > 0:
        seq = sched.waiting[index]
        if not sched.has_room(seq, reserved):
            break
        if seq.leader is not None or (seq.constraint is not None and not sched.structured.is_ready(seq)):
            index += 1  # a parallel sample waits for its first sibling's prompt; a constrained one for its grammar
            continue
        if seq.num_placeholders:
            break  # preempted while a step was in flight: its token must arrive before it is resent
        computed_blocks, num_hit = bm.get_computed_blocks(seq)
        num_new = min(seq.num_tokens - num_hit, budget)
        if not bm.can_allocate(seq, num_hit + num_new, computed_blocks):
            break
        bm.allocate(seq, num_hit + num_new, computed_blocks)
        sched.waiting.pop(index)
        seq.num_computed_tokens = num_hit
        if not seq.admitted_once:
            seq.admitted_once, seq.num_cached_tokens = True, num_hit
        if seq.num_preempted_tokens:
            sched.preemption.on_admitted(seq, num_hit)
        _run_new(sched, seq, num_new, scheduled)
        reserved = _reserved_after_admitting(sched, seq, reserved)
        budget -= num_new
    return budget


def _resume_swapped(sched: AdmissionHost, scheduled: list[ScheduledSeq], swap_in: list[tuple[int, int]], budget: int,
                    reserved: int) -> tuple[int, int]:
    """Swap sequences back in, in order, while they fit; each computes its next chunk in this step."""
    bm = sched.block_manager
    for seq in list(sched.swapped):
        if budget <= 0 or seq.num_placeholders or not sched.preemption.resumes_first(seq):
            break  # a sample in flight must arrive before it is resent; a waiting one may go first
        if not sched.has_room(seq, reserved):
            break
        num_new = min(seq.num_uncomputed_tokens, budget)
        if num_new <= 0:
            continue  # a beam that has reported: its search's round decides what comes of it
        if not bm.can_swap_in(seq, seq.num_computed_tokens + num_new):
            break
        copies = bm.swap_in(seq, seq.num_computed_tokens + num_new)
        sched.preemption.on_swap_in(copies)
        swap_in += copies
        sched.swapped.remove(seq)
        _run_new(sched, seq, num_new, scheduled)
        reserved = _reserved_after_admitting(sched, seq, reserved)
        budget -= num_new
    return budget, reserved


def _reserved_after_admitting(sched: AdmissionHost, seq: Sequence, reserved: int) -> int:
    return reserved if seq.beam is None else sched.beams.slots_reserved()


def _run_new(sched: AdmissionHost, seq: Sequence, num_new: int, scheduled: list[ScheduledSeq]) -> None:
    """Move an admitted or swapped-in sequence to running; it is sent in full with this chunk."""
    seq.status = SequenceStatus.RUNNING
    sched.running.append(seq)
    start = seq.num_computed_tokens  # a chunk that reaches the end leaves a placeholder token
    samples = start + num_new == len(seq.token_ids) + seq.num_placeholders
    seq.num_computed_tokens = start + num_new
    seq.num_placeholders += samples
    scheduled.append(ScheduledSeq(seq, num_new, True, start, samples, seq.epoch))
    if samples and seq.speculate and sched.speculator is not None:  # speculation keeps each sequence's sampling steps in flight
        seq.steps_in_flight.append(scheduled[-1])
