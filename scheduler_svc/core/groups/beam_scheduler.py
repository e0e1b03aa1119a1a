"""Beam search on the scheduler: a group of member requests shares one search, whose beams run as the
scheduler's own sequences. Each round, once every live beam has reported its top candidates, the
chosen continuations are forked from their parents (shared blocks, copy-on-write on their first write)
and the parents are dropped; at the end member i gets the i-th best hypothesis. beam_search.py decides
which continuations survive; this file moves sequences and blocks accordingly.
"""
from __future__ import annotations

import time

from protos import engine_pb2
from scheduler_svc.core.groups.beam_search import BeamSearch
from scheduler_svc.core.groups.group_host import GroupHost
from scheduler_svc.core.scheduler_output import ScheduledSeq
from scheduler_svc.core.sequence import Sequence, SequenceStatus
from scheduler_svc.core.stop_rules import StopRule

BEAM_SEQ_ID_BASE = 1 << 62  # beams get seq ids from here, apart from those of requests


class BeamScheduler:
    def __init__(self, host: GroupHost) -> None:
        self.host = host
        self.searches: dict[tuple[bytes, str], BeamSearch] = {}  # group key -> its search, from its first member on
        self._next_seq_id = BEAM_SEQ_ID_BASE

    def check(self, member: Sequence, rule: StopRule) -> BeamSearch:
        """The search a new member joins (made with the first one). Raises ValueError for a bad member."""
        opts, cfg = member.beam_options, self.host.config
        if not 1 <= opts.num_requests <= opts.beam_width:
            raise ValueError(f"beam search: num_requests must be in [1, beam_width={opts.beam_width}], "
                             f"got {opts.num_requests}")
        if opts.beam_width > cfg.max_num_seqs:
            raise ValueError(f"beam_width {opts.beam_width} exceeds max_num_seqs={cfg.max_num_seqs}")
        if not member.group_id:
            raise ValueError("a beam search request needs a group_id")
        # Beams re-admitted after a preemption may not share blocks, so the pool must hold them apart.
        need = opts.beam_width * -(-rule.max_num_tokens // cfg.block_size)
        if need > cfg.num_blocks:
            raise ValueError(f"beam search of width {opts.beam_width} over {rule.max_num_tokens} tokens leaves no room "
                             f"within the KV pool: it may need {need} blocks, the pool has {cfg.num_blocks}")
        search = self.searches.get(member.group_key)
        if search is None:
            return BeamSearch(member.group_id, opts.beam_width, opts.length_penalty, opts.num_requests,
                              rule.token_ids, rule.min_tokens, rule.max_num_tokens - member.num_prompt_tokens,
                              num_logprobs=member.sampling.logprobs, key=member.group_key,
                              created_at=time.monotonic())
        first = search.members[0]
        if search.started or first.beam_options != opts or first.token_ids != member.token_ids:
            raise ValueError(f"request {member.request_id!r} does not match beam search group {member.group_id!r}")
        return search

    def join(self, search: BeamSearch, member: Sequence) -> None:
        """A checked member waits outside the queues; the search starts once all its members are here."""
        self.searches[search.key] = search
        search.members.append(member)
        if len(search.members) == search.num_requests:
            self._start(search)

    def leave(self, member: Sequence) -> None:
        """An aborted member leaves its search; the last one to leave ends it."""
        search = self.searches[member.group_key]
        search.members.remove(member)
        if not search.members:
            for beam in search.beams:
                self.drop(beam)
            del self.searches[search.key]
        elif not search.started:
            search.num_requests -= 1
            if len(search.members) == search.num_requests:
                self._start(search)

    @staticmethod
    def is_running(search: BeamSearch) -> bool:
        """Some beam of the search runs: the search holds room for its whole width."""
        return any(b.status is SequenceStatus.RUNNING for b in search.beams)

    def incomplete_members(self, older_than: float) -> list[Sequence]:
        """Members of searches still gathering their members since before older_than (monotonic seconds): a
        front end that never sends the rest must not hold them forever."""
        return [m for s in self.searches.values() if not s.started and s.created_at < older_than for m in s.members]

    def slots_reserved(self) -> int:
        """Room in the running queue that running searches will fill: width minus their running beams. A search
        with no beam running reserves nothing (so it cannot wedge the requests queued ahead of it); its first
        beam admitted must find room for the whole width."""
        return sum(s.width - sum(b.status is SequenceStatus.RUNNING for b in s.beams)
                   for s in self.searches.values() if s.started and self.is_running(s))

    def room_needed(self, beam: Sequence) -> int:
        """Running-queue slots admitting this beam takes beyond those already reserved for it."""
        return 0 if self.is_running(beam.beam) else beam.beam.width

    def report(self, s: ScheduledSeq, candidates, rounds: list[BeamSearch]) -> None:
        """A beam's step is back: hash its full blocks; a sampling step reports its candidates to the search."""
        seq, search = s.seq, s.seq.beam
        self.host.hash_computed(s)
        if not s.samples:
            return
        seq.num_placeholders -= 1
        if candidates is None or seq.seq_id not in candidates:
            raise ValueError(f"beam {seq.seq_id} reached its end but no candidates came back for it")
        search.reports[seq.seq_id] = candidates[seq.seq_id]
        if seq.seq_id in search.unreported:  # a beam recomputed after a preemption may report again
            search.unreported.remove(seq.seq_id)
            if not search.unreported:
                rounds.append(search)

    def advance(self, search: BeamSearch) -> list[Sequence]:
        """Every beam has reported: fork the chosen continuations and drop the parents, or end the search.
        Returns the members that finished."""
        parents = search.beams
        round_ = search.select(parents[0].num_output_tokens)
        if round_.done:
            return self._finish(search)
        children = []
        for c in round_.continuations:
            parent = parents[c.parent_index]
            child = self._new_beam(search, [*parent.token_ids, c.token_id], parent, c.cum_logprob)
            if c.logprobs is not None:
                child.beam_logprobs = [*parent.beam_logprobs, c.logprobs]
            if parent.status is SequenceStatus.RUNNING:
                self.host.block_manager.fork(parent, child)
                self.host.run_forked(child, parent.num_computed_tokens)
            else:  # preempted: it recomputes from the prefix cache like any preempted sequence
                self.host.push_waiting(child)
            children.append(child)
        for parent in parents:
            self.drop(parent)
        search.beams = children
        search.unreported = {c.seq_id for c in children}
        return []

    def drop(self, beam: Sequence) -> None:
        """A beam that no continuation chose, or one of an ended search: retire it."""
        if beam.status is not SequenceStatus.FINISHED:
            self.host.retire(beam, engine_pb2.FINISH_REASON_ABORT)

    def _start(self, search: BeamSearch) -> None:
        first = search.members[0]
        root = self._new_beam(search, list(first.token_ids), first, 0.0)
        search.started = True
        search.beams = [root]
        search.unreported = {root.seq_id}
        self.host.push_waiting(root)

    def _new_beam(self, search: BeamSearch, token_ids: list[int], like: Sequence, cum_logprob: float) -> Sequence:
        beam = Sequence(
            seq_id=self._next_seq_id, request_id=search.group_id, token_ids=token_ids,
            num_prompt_tokens=like.num_prompt_tokens,
            sampling=engine_pb2.SamplingOptions(temperature=0.0, logprobs=search.num_candidates),
            stopping=like.stopping, priority=like.priority, arrival_order=like.arrival_order,
            beam=search, cum_logprob=cum_logprob, num_cached_tokens=like.num_cached_tokens,
            admitted_once=like.admitted_once, num_preempted_tokens=like.num_preempted_tokens)
        self._next_seq_id += 1
        return beam

    def _finish(self, search: BeamSearch) -> list[Sequence]:
        """Member i gets the i-th best hypothesis, as its whole output."""
        for beam in search.beams:
            self.drop(beam)
        del self.searches[search.key]
        num_cached = search.beams[0].num_cached_tokens
        for i, member in enumerate(search.members):
            hyp = search.finished[min(i, len(search.finished) - 1)]
            member.token_ids[member.num_prompt_tokens:] = hyp.output_token_ids
            member.stop_token_id = hyp.stop_token_id
            member.beam_logprobs = list(hyp.logprobs)
            member.num_cached_tokens = num_cached
            self.host.retire(member, hyp.finish_reason)
        return search.members
