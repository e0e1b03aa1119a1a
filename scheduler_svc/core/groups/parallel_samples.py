"""Parallel samples (n > 1) of one request share its prompt: the first sample computes it, and once a step
that computed all of it has succeeded, the others fork its prompt blocks and compute only the prompt's
last token, for their own logits. The scheduler's running loop then copies the shared block each of
them writes first (copy-on-write)."""
from __future__ import annotations

from scheduler_svc.core.groups.group_host import GroupHost
from scheduler_svc.core.sequence import Sequence, SequenceStatus


class ParallelSamples:
    def __init__(self, host: GroupHost) -> None:
        self.host = host
        self.leaders: dict[tuple[bytes, str], Sequence] = {}  # group key -> the first of its samples
        self.num_waiting = 0  # samples waiting to fork their leader's prompt

    def add(self, seq: Sequence) -> None:
        """A grouped sample joins its group before it is queued; all but the first wait for the leader."""
        leader = self.leaders.setdefault(seq.group_key, seq)
        if leader is not seq:
            seq.leader = leader
            self.num_waiting += 1

    def fork_ready(self) -> None:
        """Fork every waiting sample whose leader's prompt is computed, while the running queue has room."""
        host = self.host
        for seq in [s for s in host.waiting if s.leader is not None]:
            leader = seq.leader
            if leader.status is SequenceStatus.FINISHED:
                self._release_follower(seq)  # admitted on its own, through the prefix cache
                continue
            if leader.status is not SequenceStatus.RUNNING or not leader.prompt_computed:
                continue
            if not host.running_has_room():
                return
            host.waiting.remove(seq)
            host.block_manager.fork(leader, seq, seq.num_prompt_tokens)
            self._release_follower(seq)
            host.run_forked(seq, seq.num_prompt_tokens - 1)

    def on_retire(self, seq: Sequence) -> None:
        if seq.leader is not None:
            self._release_follower(seq)
        if self.leaders.get(seq.group_key) is seq:
            del self.leaders[seq.group_key]

    def _release_follower(self, seq: Sequence) -> None:
        seq.leader = None
        self.num_waiting -= 1
