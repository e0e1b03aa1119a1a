"""Iteration-level continuous batching: schedule() picks this step's work, postprocess() applies its result.

Running sequences go first (decodes and unfinished prefill chunks), then waiting ones are admitted with
chunked prefill, so decodes and several prefill chunks share one step. When blocks run out the most
recently admitted sequence is preempted: swapped to the executors' host pool when it has room (its KV
comes back with swap-in copies, before waiting sequences are admitted), else by recompute.

Beam search runs its beams as sequences of the scheduler's own (beam_scheduler.py); parallel samples
fork their first sibling's computed prompt. Forked sequences copy the shared block they write first.

schedule() may run again before the previous step's result is back (async scheduling): it advances
num_computed_tokens at once and counts each sample still in flight as a placeholder token, which the
executors fill in on their side; postprocess() later replaces the placeholder with the real token.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from protos import engine_pb2
from scheduler_svc.core.groups.beam_scheduler import BeamScheduler
from scheduler_svc.core.kv_cache_manager import BlockManager
from scheduler_svc.core.sequence import Sequence, SequenceStatus

STOP = engine_pb2.FINISH_REASON_STOP
LENGTH = engine_pb2.FINISH_REASON_LENGTH
ABORT = engine_pb2.FINISH_REASON_ABORT
UNFINISHED = engine_pb2.FINISH_REASON_UNSPECIFIED


def _queue_order(seq: Sequence) -> tuple[int, int]:
    """Waiting and swapped sequences are served by priority, then arrival."""
    return seq.priority, seq.arrival_order


@dataclass
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    block_size: int
    num_blocks: int
    enable_prefix_caching: bool = True
    eos_token_ids: tuple[int, ...] = ()
    num_host_blocks: int = 0  # the executors' host (swap) pool; 0 preempts by recompute only

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len", "block_size", "num_blocks"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")


@dataclass(slots=True)
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int  # compute tokens [start, start + num_new_tokens)
    is_new: bool  # the executors must receive it in full (first admission or after preemption)
    start: int = 0  # num_computed_tokens before this step
    samples: bool = False  # the chunk reaches the sequence's end, so the step samples a token for it
    epoch: int = 0  # seq.epoch when planned


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq]
    preempted_seq_ids: list[int]  # dropped from the executors; they come back as new
    finished_seq_ids: list[int]  # finished or aborted since the last step that ran, mirrored by executors
    num_batched_tokens: int
    block_copies: list[tuple[int, int]] = field(default_factory=list)  # (src, dst), run before the forward
    swap_out: list[tuple[int, int]] = field(default_factory=list)  # (KV block, host block), run first
    swap_in: list[tuple[int, int]] = field(default_factory=list)  # (host block, KV block), run second


@dataclass(slots=True)
class StepUpdate:
    seq: Sequence
    new_token_id: int | None  # None for a prefill chunk that did not reach the end
    finish_reason: int  # engine_pb2.FinishReason; UNSPECIFIED while running


@dataclass(frozen=True, slots=True)
class StopRule:
    """A sequence's stop conditions, resolved once at add() so checking a token is cheap."""

    token_ids: frozenset[int]  # EOS (unless ignore_eos) and the request's stop token ids
    min_tokens: int  # outputs before which those tokens do not stop it
    max_num_tokens: int  # total length at which it ends with LENGTH (max_tokens or the length limit)


@dataclass
class _Counters:
    num_preemptions: int = 0
    num_swap_outs: int = 0
    num_finished: int = 0
    num_aborted: int = 0
    num_generated_tokens: int = 0
    num_steps: int = 0


class Scheduler:
    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.block_manager = BlockManager(config.num_blocks, config.block_size, config.enable_prefix_caching,
                                          config.num_host_blocks)
        # A sequence never holds more tokens than one of them fits in the whole pool.
        self.max_seq_len = min(config.max_model_len, config.num_blocks * config.block_size)
        self.eos_token_ids = frozenset(config.eos_token_ids)
        self.waiting: list[Sequence] = []  # sorted by (priority, arrival_order)
        self.running: list[Sequence] = []  # in admission order
        self.swapped: list[Sequence] = []  # sorted like waiting; resumed before waiting ones are admitted
        self.pending_swap_outs: list[tuple[int, int]] = []  # for the next plan that runs
        self.requests: dict[str, Sequence] = {}  # unfinished, by request_id
        self.finished_to_drop: list[int] = []  # ids for the next SchedulerOutput.finished_seq_ids
        self.stop_rules: dict[int, StopRule] = {}  # by seq_id, unfinished only
        self.group_leaders: dict[str, Sequence] = {}  # group_id -> the first of its parallel samples
        self.num_waiting_samples = 0  # parallel samples waiting to fork their first sibling's prompt
        self.beams = BeamScheduler(self)
        self.counters = _Counters()
        self._next_arrival = 0

    def add(self, seq: Sequence) -> None:
        """Queue a new sequence. Raises ValueError for one that could never run."""
        n, cfg = seq.num_prompt_tokens, self.config
        if n <= 0 or n != seq.num_tokens:
            raise ValueError(f"seq {seq.seq_id}: prompt must be non-empty and hold every token, got {n}")
        if n >= cfg.max_model_len:
            raise ValueError(
                f"prompt of {n} tokens leaves no room to generate within max_model_len={cfg.max_model_len}")
        if n >= cfg.num_blocks * cfg.block_size:
            raise ValueError(
                f"prompt of {n} tokens leaves no room to generate within the KV pool: num_blocks={cfg.num_blocks}"
                f" x block_size={cfg.block_size} = {cfg.num_blocks * cfg.block_size} tokens")
        if seq.request_id in self.requests:
            raise ValueError(f"request_id {seq.request_id!r} is already in flight")
        rule = self._stop_rule(seq)
        search = self.beams.check(seq, rule) if seq.beam_options is not None else None
        seq.arrival_order = self._next_arrival
        self._next_arrival += 1
        seq.status = SequenceStatus.WAITING
        self.requests[seq.request_id] = seq
        self.stop_rules[seq.seq_id] = rule
        if search is not None:  # a member waits outside the queues; its search's beams run for it
            self.beams.join(search, seq)
            return
        if seq.group_id:
            leader = self.group_leaders.setdefault(seq.group_id, seq)
            if leader is not seq:
                seq.leader = leader
                self.num_waiting_samples += 1
        self.push_waiting(seq)

    def abort(self, request_id: str) -> Sequence | None:
        """Finish a request now, its blocks back to the pool. None if it is unknown or already finished."""
        seq = self.requests.get(request_id)
        if seq is None:
            return None
        if seq.beam_options is not None:
            self.beams.leave(seq)
        else:
            self.unlink(seq)
        self.finish(seq, ABORT)
        self.counters.num_aborted += 1
        return seq

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def schedule(self) -> SchedulerOutput:
        """This step's work. Build the plan from it right away: an abort changes the sequences it names."""
        budget = self.config.max_num_batched_tokens
        scheduled: list[ScheduledSeq] = []
        preempted: list[int] = []
        block_copies: list[tuple[int, int]] = []
        num_preemptions = self.counters.num_preemptions
        bm = self.block_manager

        bs = self.config.block_size
        if self.num_waiting_samples:
            self._fork_parallel_samples()
        running, stop_rules = self.running, self.stop_rules
        i = 0
        while i < len(running) and budget > 0:  # the hot loop: a few hundred decodes per step
            seq = running[i]
            start, placeholders = seq.num_computed_tokens, seq.num_placeholders
            total = len(seq.token_ids) + placeholders
            num_new = min(total - start, budget)
            if num_new <= 0 or (placeholders and (
                    seq.beam is not None or total >= stop_rules[seq.seq_id].max_num_tokens)):
                i += 1  # nothing to compute, a beam waiting for its round, or samples in flight reach its limit
                continue
            end = start + num_new
            is_new = not seq.in_executor  # forked since the last step: it may write a shared block
            if is_new:
                if not self._make_room(seq, lambda: bm.can_append(seq, end), preempted):
                    break  # it preempted itself: nothing after it can run either
                block_copies += bm.copy_on_write(seq)
                bm.allocate(seq, end)
                seq.in_executor = True
            elif end > len(seq.block_table) * bs:  # most decodes fit in the table they have
                if not self._make_room(seq, lambda: bm.can_allocate(seq, end), preempted):
                    break
                bm.allocate(seq, end)
            samples = end == total
            seq.num_computed_tokens = end
            if samples:
                seq.num_placeholders = placeholders + 1
            scheduled.append(ScheduledSeq(seq, num_new, is_new, start, samples, seq.epoch))
            budget -= num_new
            i += 1

        num_running_scheduled = len(scheduled)
        # Admit waiting sequences in order, unless memory is already short (something was preempted).
        # Stopping at the first that does not fit keeps it from starving.
        admit = self.counters.num_preemptions == num_preemptions
        index = 0
        # started beam searches hold room for all their beams, so forking never passes max_num_seqs
        reserved = self.beams.slots_reserved() if self.beams.searches else 0
        swap_in: list[tuple[int, int]] = []
        if admit and self.swapped:
            budget, reserved = self._resume_swapped(scheduled, swap_in, budget, reserved)
        while admit and index < len(self.waiting) and budget > 0:
            seq = self.waiting[index]
            if not self._has_room(seq, reserved):
                break
            if seq.leader is not None:
                index += 1  # a parallel sample waits for its first sibling to schedule the prompt, then forks
                continue
            if seq.num_placeholders:
                break  # preempted while a step was in flight: its token must arrive before it is resent
            computed_blocks, num_hit = bm.get_computed_blocks(seq)
            num_new = min(seq.num_tokens - num_hit, budget)
            if not bm.can_allocate(seq, num_hit + num_new, computed_blocks):
                break
            bm.allocate(seq, num_hit + num_new, computed_blocks)
            self.waiting.pop(index)
            seq.num_computed_tokens = num_hit
            if not seq.admitted_once:
                seq.admitted_once, seq.num_cached_tokens = True, num_hit
            self._run_new(seq, num_new, scheduled)
            reserved -= seq.beam is not None
            budget -= num_new

        for s in scheduled[num_running_scheduled:]:  # running ones are mirrored; admitted ones are sent in full now
            s.seq.in_executor = True
        # Drops and swap-outs ride on a step that runs. (Nothing scheduled means nothing ran.)
        finished, swap_out = [], []
        if scheduled:
            finished, self.finished_to_drop = self.finished_to_drop, []
            swap_out, self.pending_swap_outs = self.pending_swap_outs, []
        return SchedulerOutput(scheduled, preempted, finished, self.config.max_num_batched_tokens - budget,
                               block_copies, swap_out, swap_in)

    def _resume_swapped(self, scheduled: list[ScheduledSeq], swap_in: list[tuple[int, int]], budget: int,
                        reserved: int) -> tuple[int, int]:
        """Swap sequences back in, in order, while they fit; each computes its next chunk in this step."""
        bm = self.block_manager
        for seq in list(self.swapped):
            if budget <= 0 or seq.num_placeholders:
                break  # a sample in flight must arrive before the sequence is resent
            if not self._has_room(seq, reserved):
                break
            num_new = min(seq.num_uncomputed_tokens, budget)
            if num_new <= 0:
                continue  # a beam that has reported: its search's round decides what comes of it
            if not bm.can_swap_in(seq, seq.num_computed_tokens + num_new):
                break
            swap_in += bm.swap_in(seq, seq.num_computed_tokens + num_new)
            self.swapped.remove(seq)
            self._run_new(seq, num_new, scheduled)
            reserved -= seq.beam is not None
            budget -= num_new
        return budget, reserved

    def _has_room(self, seq: Sequence, reserved: int) -> bool:
        """Whether seq may join the running queue: a beam's slot is already among the reserved ones."""
        return len(self.running) + reserved + (seq.beam is None) <= self.config.max_num_seqs

    def _run_new(self, seq: Sequence, num_new: int, scheduled: list[ScheduledSeq]) -> None:
        """Move an admitted or swapped-in sequence to running; it is sent in full with this chunk."""
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)
        scheduled.append(self._advance(seq, num_new, is_new=True))

    def _make_room(self, seq: Sequence, fits, preempted: list[int]) -> bool:
        """Preempt the most recently admitted sequences until fits(); False if seq itself had to go."""
        while not fits():
            victim = self.running[-1]
            self._preempt(victim, preempted)
            if victim is seq:
                return False
        return True

    def _advance(self, seq: Sequence, num_new: int, is_new: bool) -> ScheduledSeq:
        """Commit a chunk at schedule time; a chunk that reaches the end leaves a placeholder token."""
        start = seq.num_computed_tokens
        samples = start + num_new == len(seq.token_ids) + seq.num_placeholders
        seq.num_computed_tokens = start + num_new
        seq.num_placeholders += samples
        return ScheduledSeq(seq, num_new, is_new, start, samples, seq.epoch)

    def postprocess(self, out: SchedulerOutput, sampled: dict[int, int],
                    candidates: dict[int, tuple[list[int], list[float]]] | None = None) -> list[StepUpdate]:
        """Apply a successful step: hash newly full blocks, append samples, check stops.

        candidates: a beam's top continuations (token ids, logprobs; best first), by seq id.
        """
        finished = SequenceStatus.FINISHED
        live = [s for s in out.scheduled if s.seq.status is not finished]  # skip ones aborted while in flight
        for s in live:
            if s.samples and s.seq.seq_id not in sampled:
                raise ValueError(f"seq {s.seq.seq_id} reached its end but no token was sampled for it")
        updates: list[StepUpdate] = []
        num_finished = 0
        rounds = []  # beam searches whose every beam has reported
        for s in live:
            seq = s.seq
            token, reason = None, UNFINISHED
            if seq.beam is not None:
                self.beams.report(s, candidates, rounds)
                continue
            if s.samples:
                token = sampled[seq.seq_id]
                seq.num_placeholders -= 1
                seq.token_ids.append(token)
                seq.last_token_unsent = True
                reason = self._check_stop(seq, token)
            self.hash_computed(s)
            if not seq.prompt_computed and s.start + s.num_new_tokens >= seq.num_prompt_tokens \
                    and s.epoch == seq.epoch and seq.status is SequenceStatus.RUNNING:
                seq.prompt_computed = True  # its parallel samples may fork it now
            if reason != UNFINISHED:
                if seq.status is not SequenceStatus.RUNNING:  # preempted after this step was sent
                    self.unlink(seq)
                self.finish(seq, reason)
                num_finished += 1
            updates.append(StepUpdate(seq, token, reason))
        for search in rounds:
            members = self.beams.advance(search)  # those that got their hypotheses
            updates += [StepUpdate(m, None, m.finish_reason) for m in members]
            num_finished += len(members)
        c = self.counters
        c.num_steps += 1
        c.num_finished += num_finished
        c.num_generated_tokens += sum(u.new_token_id is not None for u in updates)
        if num_finished:
            self.running = [seq for seq in self.running if seq.status is not finished]
        return updates

    def hash_computed(self, s: ScheduledSeq) -> None:
        """Blocks this step filled, with every token known, are now safe to share."""
        seq = s.seq
        computed = min(s.start + s.num_new_tokens, len(seq.token_ids))
        if computed // self.config.block_size > len(seq.block_hashes) and seq.status is SequenceStatus.RUNNING \
                and s.epoch == seq.epoch:
            self.block_manager.hash_full_blocks(seq, computed)

    def stats(self) -> dict:
        """Counters, named as the fields of engine_pb2.SchedulerStats."""
        bm = self.block_manager
        return dict(
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            num_swapped=len(self.swapped),
            total_kv_blocks=bm.num_blocks,
            free_kv_blocks=bm.num_free_blocks,
            prefix_cache_query_tokens=bm.prefix_query_tokens,
            prefix_cache_hit_tokens=bm.prefix_hit_tokens,
            **vars(self.counters),
        )

    def _stop_rule(self, seq: Sequence) -> StopRule:
        stopping = seq.stopping
        token_ids = set(stopping.stop_token_ids)
        if not stopping.ignore_eos:
            token_ids |= self.eos_token_ids
        max_num_tokens = self.max_seq_len
        if stopping.max_tokens > 0:  # 0 means unset: only the length limit applies
            max_num_tokens = min(max_num_tokens, seq.num_prompt_tokens + stopping.max_tokens)
        return StopRule(frozenset(token_ids), stopping.min_tokens, max_num_tokens)

    def _check_stop(self, seq: Sequence, token: int) -> int:
        rule = self.stop_rules[seq.seq_id]
        if token in rule.token_ids and len(seq.token_ids) - seq.num_prompt_tokens >= rule.min_tokens:
            seq.stop_token_id = token
            return STOP
        if len(seq.token_ids) >= rule.max_num_tokens:
            return LENGTH
        return UNFINISHED

    def request_ids(self, seq: Sequence) -> list[str]:
        """The requests a sequence serves: its own, or for a beam its search's members."""
        if seq.beam is None:
            return [seq.request_id]
        return [m.request_id for m in seq.beam.members]

    # ------------------------------------------------------------------ parallel samples

    def _fork_parallel_samples(self) -> None:
        """Parallel samples share one prompt: once a step that computed all of it for the first sibling has
        succeeded, the others fork its prompt blocks and compute only the prompt's last token, for their own
        logits. The running loop then copies the block they write (copy-on-write)."""
        reserved = self.beams.slots_reserved() if self.beams.searches else 0
        for seq in [s for s in self.waiting if s.leader is not None]:
            leader = seq.leader
            if leader.status is SequenceStatus.FINISHED:
                seq.leader = None  # admitted on its own, through the prefix cache
                self.num_waiting_samples -= 1
                continue
            if leader.status is not SequenceStatus.RUNNING or not leader.prompt_computed:
                continue
            if len(self.running) + reserved >= self.config.max_num_seqs:
                return
            self.waiting.remove(seq)
            self.block_manager.fork(leader, seq, seq.num_prompt_tokens)
            seq.leader = None
            self.num_waiting_samples -= 1
            seq.num_computed_tokens = seq.num_prompt_tokens - 1
            seq.status = SequenceStatus.RUNNING
            if not seq.admitted_once:
                seq.admitted_once, seq.num_cached_tokens = True, seq.num_computed_tokens
            self.running.append(seq)  # sent in full with its first step (in_executor is False)

    def push_waiting(self, seq: Sequence) -> None:
        # A preempted sequence is older than every waiting one of its priority, so it lands at the front.
        bisect.insort(self.waiting, seq, key=_queue_order)

    def unlink(self, seq: Sequence) -> None:
        """Take an unfinished sequence out of its queue."""
        queue = {SequenceStatus.RUNNING: self.running, SequenceStatus.WAITING: self.waiting,
                 SequenceStatus.SWAPPED: self.swapped}[seq.status]
        queue.remove(seq)

    def _preempt(self, seq: Sequence, preempted: list[int]) -> None:
        """Swap it out when the host pool has room, else preempt by recompute: drop its KV and send it back
        to waiting."""
        self.running.remove(seq)
        if seq.in_executor:
            preempted.append(seq.seq_id)  # resent in full when it runs again, with its new block table
        self.drop_mirror(seq)
        seq.epoch += 1  # steps in flight wrote blocks it no longer has: they must not hash them
        self.counters.num_preemptions += 1
        if self.block_manager.can_swap_out(seq):
            self.pending_swap_outs += self.block_manager.swap_out(seq)
            seq.status = SequenceStatus.SWAPPED
            bisect.insort(self.swapped, seq, key=_queue_order)
            self.counters.num_swap_outs += 1
            return
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0
        seq.prompt_computed = False
        seq.status = SequenceStatus.WAITING
        self.push_waiting(seq)

    def finish(self, seq: Sequence, reason: int) -> None:
        """Terminal: blocks go back to the pool in this same step (invariant 7). Caller unlinks the queue."""
        self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        seq.num_placeholders = 0  # samples still in flight for it are discarded
        if seq.leader is not None:
            self.num_waiting_samples -= 1
            seq.leader = None
        if self.group_leaders.get(seq.group_id) is seq:
            del self.group_leaders[seq.group_id]
        del self.requests[seq.request_id]
        del self.stop_rules[seq.seq_id]
        if seq.in_executor:
            self.finished_to_drop.append(seq.seq_id)
        self.drop_mirror(seq)

    @staticmethod
    def drop_mirror(seq: Sequence) -> None:
        seq.in_executor = False
        seq.num_blocks_sent = 0
        seq.last_token_unsent = False
