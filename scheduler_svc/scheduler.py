"""Iteration-level continuous batching: schedule() picks this step's work, postprocess() applies its result.

Running sequences go first (decodes and unfinished prefill chunks), then waiting ones are admitted with
chunked prefill, so decodes and several prefill chunks share one step. When blocks run out the most
recently admitted sequence is preempted by recompute.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from protos import engine_pb2
from scheduler_svc.block_manager import BlockManager
from scheduler_svc.sequence import Sequence, SequenceStatus

STOP = engine_pb2.FINISH_REASON_STOP
LENGTH = engine_pb2.FINISH_REASON_LENGTH
ABORT = engine_pb2.FINISH_REASON_ABORT
UNFINISHED = engine_pb2.FINISH_REASON_UNSPECIFIED


@dataclass
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    block_size: int
    num_blocks: int
    enable_prefix_caching: bool = True
    eos_token_ids: tuple[int, ...] = ()


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int  # compute tokens [num_computed_tokens, num_computed_tokens + num_new_tokens)
    is_new: bool  # the executors must receive it in full (first admission or after preemption)


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq]
    preempted_seq_ids: list[int]  # dropped from the executors; they come back as new
    finished_seq_ids: list[int]  # finished or aborted since the last schedule(), mirrored by executors
    num_batched_tokens: int


@dataclass
class StepUpdate:
    seq: Sequence
    new_token_id: int | None  # None for a prefill chunk that did not reach the end
    finish_reason: int  # engine_pb2.FinishReason; UNSPECIFIED while running


@dataclass
class _Counters:
    num_preemptions: int = 0
    num_finished: int = 0
    num_aborted: int = 0
    num_generated_tokens: int = 0
    num_steps: int = 0


class Scheduler:
    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.block_manager = BlockManager(config.num_blocks, config.block_size, config.enable_prefix_caching)
        # A sequence never holds more tokens than one of them fits in the whole pool.
        self.max_seq_len = min(config.max_model_len, config.num_blocks * config.block_size)
        self.eos_token_ids = frozenset(config.eos_token_ids)
        self.waiting: list[Sequence] = []  # sorted by (priority, arrival_order)
        self.running: list[Sequence] = []  # in admission order
        self.requests: dict[str, Sequence] = {}  # unfinished, by request_id
        self.finished_to_drop: list[int] = []  # ids for the next SchedulerOutput.finished_seq_ids
        self.counters = _Counters()
        self._next_arrival = 0

    def add(self, seq: Sequence) -> None:
        """Queue a new sequence. Raises ValueError for one that could never run."""
        n, cfg = seq.num_prompt_tokens, self.config
        if n <= 0 or n != seq.num_tokens:
            raise ValueError(f"seq {seq.seq_id}: prompt must be non-empty and hold every token, got {n}")
        if n >= cfg.max_model_len:
            raise ValueError(f"prompt of {n} tokens leaves no room to generate within max_model_len={cfg.max_model_len}")
        if n >= cfg.num_blocks * cfg.block_size:
            raise ValueError(
                f"prompt of {n} tokens leaves no room to generate within the KV pool: num_blocks={cfg.num_blocks}"
                f" x block_size={cfg.block_size} = {cfg.num_blocks * cfg.block_size} tokens")
        if seq.request_id in self.requests:
            raise ValueError(f"request_id {seq.request_id!r} is already in flight")
        seq.arrival_order = self._next_arrival
        self._next_arrival += 1
        seq.status = SequenceStatus.WAITING
        self.requests[seq.request_id] = seq
        self._push_waiting(seq)

    def abort(self, request_id: str) -> Sequence | None:
        """Finish a request now, its blocks back to the pool. None if it is unknown or already finished."""
        seq = self.requests.get(request_id)
        if seq is None:
            return None
        if seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        else:
            self.running.remove(seq)
        self._finish(seq, ABORT)
        self.counters.num_aborted += 1
        return seq

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        scheduled: list[ScheduledSeq] = []
        preempted: list[int] = []
        bm = self.block_manager

        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            num_new = min(seq.num_uncomputed_tokens, budget)
            if num_new == 0:
                i += 1
                continue
            num_tokens = seq.num_computed_tokens + num_new
            while not bm.can_allocate(seq, num_tokens):
                victim = self.running[-1]  # the most recently admitted
                self._preempt(victim, preempted)
                if victim is seq:
                    break
            if seq.status is not SequenceStatus.RUNNING:
                break  # it preempted itself: nothing after it can run either
            bm.allocate(seq, num_tokens)
            scheduled.append(ScheduledSeq(seq, num_new, is_new=False))
            budget -= num_new
            i += 1

        # Admit waiting sequences in order; stopping at the first that does not fit avoids starving it.
        while not preempted and self.waiting and len(self.running) < self.config.max_num_seqs and budget > 0:
            seq = self.waiting[0]
            computed_blocks, num_hit = bm.get_computed_blocks(seq)
            num_new = min(seq.num_tokens - num_hit, budget)
            if not bm.can_allocate(seq, num_hit + num_new, computed_blocks):
                break
            bm.allocate(seq, num_hit + num_new, computed_blocks)
            self.waiting.pop(0)
            seq.num_computed_tokens = num_hit
            if not seq.admitted_once:
                seq.admitted_once, seq.num_cached_tokens = True, num_hit
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            scheduled.append(ScheduledSeq(seq, num_new, is_new=True))
            budget -= num_new

        for s in scheduled:
            s.is_new = not s.seq.in_executor
            s.seq.in_executor = True
        finished, self.finished_to_drop = self.finished_to_drop, []
        return SchedulerOutput(scheduled, preempted, finished, self.config.max_num_batched_tokens - budget)

    def postprocess(self, out: SchedulerOutput, sampled: dict[int, int]) -> list[StepUpdate]:
        """Apply a successful step: advance computed tokens, hash full blocks, append samples, check stops."""
        live = [s for s in out.scheduled if not s.seq.is_finished]  # skip ones aborted while in flight
        for s in live:
            reaches_end = s.seq.num_computed_tokens + s.num_new_tokens == s.seq.num_tokens
            if reaches_end and s.seq.seq_id not in sampled:
                raise ValueError(f"seq {s.seq.seq_id} reached its end but no token was sampled for it")
        self.counters.num_steps += 1
        updates: list[StepUpdate] = []
        for s in live:
            seq = s.seq
            seq.num_computed_tokens += s.num_new_tokens
            self.block_manager.hash_full_blocks(seq, seq.num_computed_tokens)
            if seq.num_computed_tokens < seq.num_tokens:
                updates.append(StepUpdate(seq, None, UNFINISHED))  # a prefill chunk
                continue
            token = sampled[seq.seq_id]
            seq.token_ids.append(token)
            seq.last_token_unsent = True
            self.counters.num_generated_tokens += 1
            reason = self._check_stop(seq, token)
            if reason != UNFINISHED:
                self._finish(seq, reason)
                self.counters.num_finished += 1
            updates.append(StepUpdate(seq, token, reason))
        if any(u.finish_reason != UNFINISHED for u in updates):
            self.running = [seq for seq in self.running if not seq.is_finished]
        return updates

    def stats(self) -> dict:
        """Counters, named as the fields of engine_pb2.SchedulerStats."""
        bm = self.block_manager
        return dict(
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            total_kv_blocks=bm.num_blocks,
            free_kv_blocks=bm.num_free_blocks,
            prefix_cache_query_tokens=bm.prefix_query_tokens,
            prefix_cache_hit_tokens=bm.prefix_hit_tokens,
            **vars(self.counters),
        )

    def _check_stop(self, seq: Sequence, token: int) -> int:
        stopping = seq.stopping
        if seq.num_output_tokens >= stopping.min_tokens:
            is_eos = token in self.eos_token_ids and not stopping.ignore_eos
            if is_eos or token in stopping.stop_token_ids:
                seq.stop_token_id = token
                return STOP
        # max_tokens <= 0 means unset: only the length limit applies.
        if 0 < stopping.max_tokens <= seq.num_output_tokens or seq.num_tokens >= self.max_seq_len:
            return LENGTH
        return UNFINISHED

    def _push_waiting(self, seq: Sequence) -> None:
        # A preempted sequence is older than every waiting one of its priority, so it lands at the front.
        bisect.insort(self.waiting, seq, key=lambda s: (s.priority, s.arrival_order))

    def _preempt(self, seq: Sequence, preempted: list[int]) -> None:
        """Preempt by recompute: drop its KV and send it back to waiting."""
        self.running.remove(seq)
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        if seq.in_executor:
            preempted.append(seq.seq_id)
        self._drop_mirror(seq)
        self._push_waiting(seq)
        self.counters.num_preemptions += 1

    def _finish(self, seq: Sequence, reason: int) -> None:
        """Terminal: blocks go back to the pool in this same step (invariant 7). Caller unlinks the queue."""
        self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        del self.requests[seq.request_id]
        if seq.in_executor:
            self.finished_to_drop.append(seq.seq_id)
        self._drop_mirror(seq)

    @staticmethod
    def _drop_mirror(seq: Sequence) -> None:
        seq.in_executor = False
        seq.num_blocks_sent = 0
        seq.last_token_unsent = False
