"""A stand-in executor for scheduler tests: it keeps which token each KV slot (and host swap slot) holds,
runs a plan's swaps and copies in the executor's order, and checks that every read sees the reader's own
history, so a block shared, copied, swapped or reused wrongly is caught. MirroringExecutor also feeds the
serialized StepPlan to the executor's own sequence mirrors."""
from __future__ import annotations

from executor_svc.seq_mirror import SequenceMirrors  # the executor's own (it imports torch, for the sampler)
from protos import engine_pb2


class FakeExecutor:
    def __init__(self, num_blocks: int, block_size: int, num_host_blocks: int = 0, token_at=None,
                 proposed_at=None) -> None:
        self.block_size = block_size
        self.slots = [[None] * block_size for _ in range(num_blocks)]
        self.host = [[None] * block_size for _ in range(num_host_blocks)]
        # token_at(seq, position): the token there, also for samples still in flight (default: known tokens)
        self.token_at = token_at or (lambda seq, pos: seq.token_ids[pos])
        # proposed_at(seq, proposal, j): what a step verifying proposals writes at its proposal j (speculative
        # decoding); such a slot holds the right contents only where the proposal is accepted
        self.proposed_at = proposed_at or (lambda seq, proposal, j: proposal[j])
        self.num_copies = 0
        self.drawn: dict[int, list[int]] = {}  # draft method: the step's proposals the executors drew, by seq id

    def proposal_of(self, s):
        """The tokens a step verifies after the sequence's known ones: the plan's, or for a draft the drawn ones."""
        return self.drawn[s.seq.seq_id] if s.drafted else s.proposal

    def expected_at(self, s, pos: int):
        """What the step of ScheduledSeq s writes and reads at position pos."""
        first_proposed = s.start + s.num_new_tokens - len(s.proposal)
        if pos >= first_proposed:
            return self.proposed_at(s.seq, self.proposal_of(s), pos - first_proposed)
        return self.token_at(s.seq, pos)

    def run(self, out, void=frozenset()) -> None:
        """void: seq ids whose chunk is void (planned on a verdict that came back short): it writes K/V no one reads
        as a token of that sequence, and its own reads are not checked (it yields nothing)."""
        bs = self.block_size
        for src, dst in out.swap_out:  # the executor's order: swap out, swap in, copies, forward
            self.host[dst] = list(self.slots[src])
        for src, dst in out.swap_in:
            self.slots[dst] = list(self.host[src])
        for src, dst in out.block_copies:
            self.slots[dst] = list(self.slots[src])
            self.num_copies += 1
        for s in out.scheduled:
            seq, end = s.seq, s.start + s.num_new_tokens
            for pos in range(s.start, end):
                self.slots[seq.block_table[pos // bs]][pos % bs] = ("void", pos) if seq.seq_id in void \
                    else self.expected_at(s, pos)
        for s in out.scheduled:  # attention reads after every write of the step
            seq, end = s.seq, s.start + s.num_new_tokens
            if seq.seq_id in void:
                continue
            seen = [self.slots[seq.block_table[p // bs]][p % bs] for p in range(end)]
            assert seen == [self.expected_at(s, p) for p in range(end)], f"seq {seq.seq_id} reads another history"


class MirroringExecutor(FakeExecutor):
    """The executor's SequenceMirrors follow each plan's deltas (invariant 4), and every chunk they yield
    must be the one the scheduler planned, read through the block table the scheduler holds."""

    def __init__(self, num_blocks: int, block_size: int, num_host_blocks: int = 0, token_at=None,
                 proposed_at=None, draft=None) -> None:
        super().__init__(num_blocks, block_size, num_host_blocks, token_at, proposed_at)
        self.mirrors = SequenceMirrors()
        self.launched: list[list] = []  # each step in flight's sampling chunks, oldest first
        # draft method: draft(seq, k) -> the k tokens the draft model proposes after seq's tokens; draft_slots: what
        # the draft's own pool holds at each slot of the shared block ids (the prefix its K/V was computed from)
        self.draft = draft
        self.draft_slots = [[None] * block_size for _ in range(num_blocks)]

    def run_plan(self, plan: engine_pb2.StepPlan, out, void=frozenset()) -> None:
        chunks = self.mirrors.apply(engine_pb2.StepPlan.FromString(plan.SerializeToString()))
        planned = {s.seq.seq_id: s for s in out.scheduled}
        assert sorted(c.seq.seq_id for c in chunks) == sorted(planned)
        self.drawn = {}
        for c in chunks:
            s = planned[c.seq.seq_id]
            assert (c.start, c.end, c.samples) == (s.start, s.start + s.num_new_tokens, s.samples)
            if s.drafted:
                assert c.num_draft == len(s.proposal) and not c.proposal
                self.run_draft(c, s)
            assert list(c.proposal) == list(self.proposal_of(s))
            assert c.seq.block_table == s.seq.block_table, f"seq {s.seq.seq_id}: mirrored block table differs"
        self.run(out, void)
        self.launched.append([c for c in chunks if c.samples])
        self.mirrors.commit(chunks)

    def run_draft(self, c, s) -> None:
        """The draft model's part of a step (executor_svc/draft_model.py): it catches up on the tokens its mirror
        has not computed, then writes its proposals but the last; every read must see the sequence's own history
        (so draft_computed, kept across verdicts, never claims a slot it did not fill with the right prefix)."""
        bs, m, k = self.block_size, c.seq, c.num_draft
        assert m.draft_computed <= c.start, "the draft is past the chunk's input"
        proposal = self.draft(s.seq, k)
        self.drawn[s.seq.seq_id] = proposal
        for pos in range(m.draft_computed, c.start + k):
            at = self.token_at(s.seq, pos) if pos <= c.start else self.proposed_at(s.seq, proposal, pos - c.start - 1)
            self.draft_slots[m.block_table[pos // bs]][pos % bs] = at
        seen = [self.draft_slots[m.block_table[p // bs]][p % bs] for p in range(c.start + k)]
        assert seen == [self.token_at(s.seq, p) if p <= c.start else self.proposed_at(s.seq, proposal, p - c.start - 1)
                        for p in range(c.start + k)], f"seq {s.seq.seq_id}: the draft reads another history"
        m.draft_computed = c.start + 1
        c.proposal = proposal

    def reply(self, sampled: dict[int, int], accepted: dict[int, list[int]] | None = None,
              void=frozenset()) -> None:
        """A step's sampled tokens (after the proposals it accepted) reach the host: the mirrors append them
        (before the scheduler hears); a void chunk's is -1, which appends nothing. The executors' own rule
        (settle, once the step before is appended) must find the same chunks void."""
        if self.launched:
            # (a sequence dropped since, finished or preempted, is the scheduler's to discard)
            chunks = [c for c in self.launched.pop(0) if self.mirrors.seqs.get(c.seq.seq_id) is c.seq]
            SequenceMirrors.settle(chunks)
            assert {c.seq.seq_id for c in chunks if c.void} == set(void) & {c.seq.seq_id for c in chunks}, \
                "the executors find other chunks void"
            for c in chunks:
                if c.proposals_dropped:
                    assert not (accepted or {}).get(c.seq.seq_id), "proposals after a failed guess were accepted"
        for seq_id, token in sampled.items():
            self.mirrors.append_sampled(seq_id, token, (accepted or {}).get(seq_id, ()))
        for seq_id in void:
            self.mirrors.append_sampled(seq_id, -1)

    def check_mirrors(self, sched, tokens_of, sampled_in_flight: dict[int, int] | None = None) -> None:
        """The executors mirror the running sequences sent to them, and the finished ones until told to drop
        them; each mirror holds the scheduler's block table and a prefix of tokens_of(seq), every token
        the executors sampled for it."""
        mirrored = {s.seq_id: s for s in sched.running if s.in_executor}
        assert set(self.mirrors.seqs) == set(mirrored) | set(sched.finished_to_drop) | set(sched.preempted_to_drop)
        for seq_id, seq in mirrored.items():
            m, tokens = self.mirrors.seqs[seq_id], tokens_of(seq)
            # lookahead blocks the scheduler took back after a verification leave the mirror with its next plan
            assert m.block_table == seq.block_table or (
                seq.blocks_kept == len(seq.block_table) and m.block_table[: seq.blocks_kept] == seq.block_table)
            # (a short verdict moved the scheduler's count back: the next plan tells the executors)
            assert m.num_computed_tokens == seq.num_computed_tokens or seq.start_unsent
            if seq.beam is None:
                assert m.token_ids == tokens[: len(m.token_ids)]
                # the rest are what steps in flight yield: their samples and the proposals they accepted
                assert len(m.token_ids) + (sampled_in_flight or {}).get(seq_id, 0) == len(tokens)
            else:  # a beam that has reported holds its sample too; its search's children carry it on
                assert m.token_ids[: len(tokens)] == tokens and len(m.token_ids) + m.num_pending <= len(tokens) + 1


def check_block_references(sched) -> None:
    """Every KV and host block's reference count equals the number of sequences holding it."""
    bm = sched.block_manager
    holders = [0] * bm.num_blocks
    for seq in sched.running + sched.waiting + sched.swapped:
        for b in seq.block_table:
            holders[b] += 1
    assert [blk.ref_count for blk in bm.pool.blocks] == holders
    if bm.host_pool is not None:
        host = [0] * bm.host_pool.num_blocks
        for seq in sched.swapped:
            assert not seq.block_table
            for b in seq.host_block_table:
                host[b] += 1
        assert [blk.ref_count for blk in bm.host_pool.blocks] == host
    assert len(sched.running) <= sched.config.max_num_seqs
