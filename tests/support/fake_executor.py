"""A stand-in executor for scheduler tests: it keeps which token each KV slot (and host swap slot) holds,
runs a plan's swaps and copies in the executor's order, and checks that every read sees the reader's own
history, so a block shared, copied, swapped or reused wrongly is caught."""
from __future__ import annotations


class FakeExecutor:
    def __init__(self, num_blocks: int, block_size: int, num_host_blocks: int = 0, token_at=None) -> None:
        self.block_size = block_size
        self.slots = [[None] * block_size for _ in range(num_blocks)]
        self.host = [[None] * block_size for _ in range(num_host_blocks)]
        # token_at(seq, position): the token there, also for samples still in flight (default: known tokens)
        self.token_at = token_at or (lambda seq, pos: seq.token_ids[pos])
        self.num_copies = 0

    def run(self, out) -> None:
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
                self.slots[seq.block_table[pos // bs]][pos % bs] = self.token_at(seq, pos)
        for s in out.scheduled:  # attention reads after every write of the step
            seq, end = s.seq, s.start + s.num_new_tokens
            seen = [self.slots[seq.block_table[p // bs]][p % bs] for p in range(end)]
            assert seen == [self.token_at(seq, p) for p in range(end)], f"seq {seq.seq_id} reads another history"


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
