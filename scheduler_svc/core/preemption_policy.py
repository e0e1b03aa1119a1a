"""The scheduler's preemption: whom it preempts (the victim policies, priority preemption), whether by swap
or recompute (preemption_cost.decide, per victim), and the accounting of each decision.

The running loop visits the running queue in order and, when a sequence is short of blocks, preempts from
the tail: sequences the loop has not reached, so nothing already planned is undone. So a policy is an
order: when a step may run out of blocks, the running queue is sorted so that the next victim is last.
- newest: admission order, the most recently admitted last;
- least-progress: fewest computed tokens last (the least work thrown away), ties newest;
- priority: lowest priority (largest number) last, ties newest.
Whatever the policy, a sequence within NEAR_END_TOKENS of its length limit sorts first, so it goes only when
no other victim is left, and a beam idle in its round goes before all of them: it computes nothing until its
siblings report, and they may need the very blocks it holds. Under the priority policy a waiting request
that does not fit also preempts running ones of strictly lower priority, before the step is planned.

Preemption moves sequences between the scheduler's queues only through the scheduler's preempt()
(PreemptionHost), and reorders the running queue.
"""
from __future__ import annotations

import math
from typing import Callable, Protocol

from scheduler_svc.core.kv_cache_manager import BlockManager, cdiv
from scheduler_svc.core.preemption_cost import Decision, PreemptionCosts, decide
from scheduler_svc.core.scheduler_stats import SchedulerCounters
from scheduler_svc.core.sequence import Sequence
from scheduler_svc.core.stop_rules import StopRule

NEAR_END_TOKENS = 4  # a sequence this close to its length limit is the last choice of victim


def is_idle_beam(seq: Sequence) -> bool:
    """A beam that has reported this round and waits for its siblings: it computes nothing until then."""
    return seq.beam is not None and not seq.num_placeholders and seq.num_uncomputed_tokens <= 0


class PreemptionHost(Protocol):
    """What preemption reads of the scheduler (its queues and pool, read-only here) and the calls it makes."""

    running: list[Sequence]  # sorted in place by order_running
    waiting: list[Sequence]
    block_manager: BlockManager
    counters: SchedulerCounters
    stop_rules: dict[int, StopRule]

    def preempt(self, seq: Sequence, preempted: list[int]) -> None:
        """Take a running sequence out of the running queue, by swap or recompute as decide() says."""

    def has_room(self, seq: Sequence, reserved: int) -> bool:
        """Whether seq may join the running queue, reserved slots counted."""

    def slots_reserved(self) -> int:
        """Running-queue slots that started beam searches hold."""


class Preemption:
    def __init__(self, host: PreemptionHost, mode: str, policy: str, costs: PreemptionCosts, world_size: int) -> None:
        self.host = host
        self.mode, self.policy, self.costs = mode, policy, costs
        self.world_size = world_size  # every rank copies its own shard of a swapped block

    # ------------------------------------------------------------------ whom

    def tokens_left(self, seq: Sequence) -> int:
        """Tokens seq may still generate before its length limit."""
        if seq.beam is not None:
            limit = seq.num_prompt_tokens + seq.beam.max_output_tokens
        else:
            limit = self.host.stop_rules[seq.seq_id].max_num_tokens
        return limit - seq.num_tokens - seq.num_placeholders

    def _keep_key(self, seq: Sequence):
        """The running queue's sort key: the larger, the sooner preempted."""
        far = self.tokens_left(seq) > NEAR_END_TOKENS
        if self.policy == "least-progress":
            return far, -seq.num_computed_tokens
        if self.policy == "priority":
            return far, seq.priority
        return far

    def before_step(self, budget: int, preempted: list[int]) -> None:
        """Before the running loop: under the priority policy, room for a waiting head of higher priority;
        then the running queue in victim order."""
        if self.policy == "priority" and self.host.waiting:
            head = self.waiting_head()
            if head is not None:
                self.make_room_for(head, budget, preempted)
        self.order_running(budget)

    def waiting_head(self) -> Sequence | None:
        """The first waiting sequence admission would try (a parallel sample waiting to fork is passed over)."""
        return next((s for s in self.host.waiting if s.leader is None), None)

    def order_running(self, budget: int) -> None:
        """Sort the running queue (stably: ties keep admission order) so that the next victim is last, when
        this step may run out of blocks: a sequence takes at most a block per block_size tokens it runs plus
        one, and a fork as many again for copy-on-write."""
        running, bm = self.host.running, self.host.block_manager
        if bm.num_free_blocks < 2 * (cdiv(budget, bm.block_size) + len(running)):
            running.sort(key=self._keep_key)

    def make_room(self, seq: Sequence, fits: Callable[[], bool], preempted: list[int]) -> bool:
        """Preempt until fits(): beams idle in their round first, then from the running queue's tail. False if
        seq itself had to go."""
        running = self.host.running
        while not fits():
            victim = next((s for s in reversed(running) if s is not seq and is_idle_beam(s)), running[-1])
            self.host.preempt(victim, preempted)
            if victim is seq:
                return False
        return True

    def idle_beams_give_way(self, preempted: list[int]) -> bool:
        """When nothing can run and nothing is in flight, every running sequence is a beam that has reported
        and waits for its round: preempt them all, so no search holds slots or blocks another one needs (each
        fits the engine alone, as add() checked). False when that is not the case."""
        running = self.host.running
        if not running or not all(is_idle_beam(s) for s in running):
            return False
        for seq in reversed(list(running)):
            self.host.preempt(seq, preempted)
        return True

    def make_room_for(self, head: Sequence, budget: int, preempted: list[int]) -> None:
        """Priority policy: a waiting head that does not fit preempts running sequences of strictly lower
        priority, in victim order, until it does; none when even all of them would not make room."""
        host, bm = self.host, self.host.block_manager

        def blocks_short() -> int:  # of the head's first chunk
            computed, hit = bm.get_computed_blocks(head)
            return bm.num_blocks_to_take(head, hit + min(head.num_tokens - hit, budget), computed) - bm.num_free_blocks

        def fits() -> bool:
            return blocks_short() <= 0 and host.has_room(head, host.slots_reserved())

        if head.num_placeholders or fits():
            return
        lower = [s for s in reversed(host.running) if s.priority > head.priority]  # newest first among equals
        victims = sorted(lower, key=self._keep_key, reverse=True)
        blocks = bm.pool.blocks
        if not victims or sum(1 for s in victims for b in s.block_table if blocks[b].ref_count == 1) < blocks_short():
            return  # throwing their work away would not let the head in
        for victim in victims:
            host.preempt(victim, preempted)
            host.counters.num_priority_preemptions += 1
            if fits():
                return

    def resumes_first(self, seq: Sequence) -> bool:
        """Whether a swapped sequence resumes before the waiting queue's head: always, except that under the
        priority policy a waiting request of strictly higher priority goes first."""
        if self.policy != "priority" or not self.host.waiting:
            return True
        head = self.waiting_head()
        return head is None or seq.priority <= head.priority

    # ------------------------------------------------------------------ how, and its accounting

    def decide(self, seq: Sequence) -> Decision:
        """Swap or recompute this victim (preemption_cost.decide), from the blocks it holds now."""
        bm = self.host.block_manager
        num_blocks = cdiv(seq.num_computed_tokens, bm.block_size)
        free_host = bm.host_pool.num_free_blocks if bm.host_pool is not None else 0
        return decide(self.mode, num_blocks, free_host, seq.num_computed_tokens, self.cached_tokens(seq), self.costs)

    def cached_tokens(self, seq: Sequence) -> int:
        """Computed tokens the prefix cache will still hold when seq is admitted again: its leading hashed
        blocks that another sequence holds too (a block only seq holds may be reused before it returns)."""
        bm = self.host.block_manager
        if not bm.enable_prefix_caching:
            return 0
        num_shared = 0
        for block_id, _ in zip(seq.block_table, seq.block_hashes):
            if bm.pool.blocks[block_id].ref_count < 2:
                break
            num_shared += 1
        return min(seq.num_computed_tokens, num_shared * bm.block_size)

    def on_swap_out(self, decision: Decision, copies: list[tuple[int, int]]) -> None:
        c = self.host.counters
        c.num_swap_outs += 1
        c.num_swapped_bytes += self._bytes(copies)
        c.estimated_swap_seconds += _finite(decision.swap_s)

    def on_swap_in(self, copies: list[tuple[int, int]]) -> None:
        self.host.counters.num_swapped_bytes += self._bytes(copies)

    def on_recompute(self, seq: Sequence, decision: Decision) -> None:
        c = self.host.counters
        c.num_recompute_preemptions += 1
        c.estimated_recompute_seconds += _finite(decision.recompute_s)
        seq.num_preempted_tokens = max(seq.num_preempted_tokens, seq.num_computed_tokens)

    def on_admitted(self, seq: Sequence, num_hit: int) -> None:
        """A sequence preempted by recompute is admitted again with num_hit tokens from the prefix cache: the
        rest of what it had computed is computed again, which costs it at the measured prefill rate."""
        recomputed = max(0, seq.num_preempted_tokens - num_hit)
        seq.num_preempted_tokens = 0
        c = self.host.counters
        c.num_recomputed_tokens += recomputed
        if self.costs.prefill_tokens_per_s > 0:
            c.measured_recompute_seconds += recomputed / self.costs.prefill_tokens_per_s

    def _bytes(self, copies: list[tuple[int, int]]) -> int:
        return len(copies) * self.costs.block_bytes * self.world_size


def _finite(seconds: float) -> float:
    return seconds if seconds != math.inf else 0.0
