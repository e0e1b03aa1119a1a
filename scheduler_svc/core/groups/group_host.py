"""The small interface through which request groups (parallel samples, beam search) act on the scheduler.

Groups read the queues but change them only through these calls, so the scheduler stays the one owner
of its queues, its requests and the executors' mirrors.
"""
from __future__ import annotations

from typing import Protocol

from scheduler_svc.core.kv_cache_manager import BlockManager
from scheduler_svc.core.scheduler_config import SchedulerConfig
from scheduler_svc.core.scheduler_output import ScheduledSeq
from scheduler_svc.core.sequence import Sequence


class GroupHost(Protocol):
    waiting: list[Sequence]  # read-only for groups, except removing a sample it forks
    block_manager: BlockManager
    config: SchedulerConfig

    def push_waiting(self, seq: Sequence) -> None:
        """Queue a sequence to be admitted (by priority, then arrival)."""

    def run_forked(self, seq: Sequence, num_computed_tokens: int) -> None:
        """Start a sequence that holds forked blocks covering num_computed_tokens; sent in full next step."""

    def running_has_room(self) -> bool:
        """Whether one more sequence may join the running queue now (started beam searches' slots counted)."""

    def retire(self, seq: Sequence, reason: int) -> None:
        """The one way a sequence ends: out of its queue, its blocks back to the pool, its mirror dropped."""

    def hash_computed(self, s: ScheduledSeq) -> None:
        """Make the blocks a successful step filled findable in the prefix cache."""
