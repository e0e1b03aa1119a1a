"""The block pool and block manager: prefix caching, eviction order, verification, fork and copy-on-write."""
from __future__ import annotations

import itertools

import pytest
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from protos import engine_pb2
from scheduler_svc.core import prefix_cache as prefix_cache_module
from scheduler_svc.core.kv_cache_manager import BlockManager
from scheduler_svc.core.prefix_cache import hash_block
from scheduler_svc.core.sequence import Sequence

_ids = itertools.count()


def make_seq(tokens, num_computed=0) -> Sequence:
    seq_id = next(_ids)
    return Sequence(seq_id=seq_id, request_id=f"r{seq_id}", token_ids=list(tokens), num_prompt_tokens=len(tokens),
                    sampling=engine_pb2.SamplingOptions(), stopping=engine_pb2.StoppingOptions(max_tokens=16),
                    num_computed_tokens=num_computed)


def admit(bm: BlockManager, tokens) -> Sequence:
    """Look up the prefix cache, allocate the whole sequence, and mark it computed (as a step would)."""
    seq = make_seq(tokens)
    blocks, num_hit = bm.get_computed_blocks(seq)
    bm.allocate(seq, seq.num_tokens, blocks)
    seq.num_computed_tokens = seq.num_tokens
    bm.hash_full_blocks(seq, seq.num_computed_tokens)
    return seq


def test_a_shared_prefix_hits_the_cached_blocks():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = admit(bm, range(10))
    b = make_seq([*range(8), 99, 98, 97])
    blocks, num_hit = bm.get_computed_blocks(b)
    assert blocks == a.block_table[:2] and num_hit == 8


def test_a_hit_never_covers_the_whole_prompt():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = admit(bm, range(8))
    blocks, num_hit = bm.get_computed_blocks(make_seq(range(8)))
    assert blocks == a.block_table[:1] and num_hit == 4


def test_prefix_caching_disabled_never_hits_nor_indexes():
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    admit(bm, range(10))
    assert bm.get_computed_blocks(make_seq(range(10))) == ([], 0)
    assert bm.pool.hash_to_block == {}


def test_freed_blocks_stay_findable_and_hits_revive_them():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = admit(bm, range(9))
    held = list(a.block_table)
    bm.free(a)
    assert bm.num_free_blocks == 8
    b = admit(bm, [*range(8), 5, 6])
    assert b.block_table[:2] == held[:2]
    assert [bm.pool.blocks[i].ref_count for i in held[:2]] == [1, 1]
    assert bm.num_free_blocks == 8 - 3


def test_a_hit_on_a_used_block_shares_it():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = admit(bm, range(9))
    b = admit(bm, [*range(8), 7])
    assert b.block_table[:2] == a.block_table[:2]
    assert [bm.pool.blocks[i].ref_count for i in a.block_table] == [2, 2, 1]


def test_reviving_free_hit_blocks_is_counted_against_the_free_pool():
    bm = BlockManager(num_blocks=4, block_size=4)
    a = admit(bm, range(9))  # blocks: 2 full + 1 partial
    bm.free(a)
    b = make_seq([*range(8), *range(100, 108)])  # 16 tokens: 2 hits + 2 fresh = the whole pool
    blocks, num_hit = bm.get_computed_blocks(b)
    assert num_hit == 8
    assert bm.can_allocate(b, 16, blocks) and not bm.can_allocate(b, 17, blocks)
    bm.allocate(b, 16, blocks)
    assert b.block_table[:2] == blocks and len(set(b.block_table)) == 4  # fresh blocks never evicted a hit


def test_eviction_takes_least_recently_freed_first_and_tail_blocks_before_prefixes():
    bm = BlockManager(num_blocks=6, block_size=2)
    a = admit(bm, [1, 2, 3, 4, 5, 6])  # three full blocks, all hashed
    b = admit(bm, [7, 8, 9, 10, 11, 12])
    a_table, b_table = list(a.block_table), list(b.block_table)
    bm.free(a)
    bm.free(b)
    order = [bm.pool.allocate() for _ in range(6)]
    assert order == a_table[::-1] + b_table[::-1]


def test_blank_blocks_come_out_of_the_pool_before_cached_ones():
    bm = BlockManager(num_blocks=4, block_size=2)
    cached = admit(bm, [1, 2, 3, 4])
    blank = make_seq([5, 6, 7])
    bm.allocate(blank, 3)
    blank_blocks = list(blank.block_table)
    bm.free(cached)
    bm.free(blank)
    assert {bm.pool.allocate(), bm.pool.allocate()} == set(blank_blocks)
    assert bm.get_computed_blocks(make_seq([1, 2, 3, 4, 9]))[1] == 4


def test_a_repurposed_block_drops_its_stale_hash():
    bm = BlockManager(num_blocks=2, block_size=2)
    a = admit(bm, [1, 2, 3])
    first = a.block_table[0]
    bm.free(a)
    admit(bm, [7, 8, 9, 10])  # takes both blocks, the cached one included
    assert hash_block(None, (1, 2)) not in bm.pool.hash_to_block
    assert bm.get_computed_blocks(make_seq([1, 2, 3])) == ([], 0)
    assert bm.pool.blocks[first].token_ids in {(7, 8), (9, 10)}


def test_a_forged_hash_collision_is_rejected_by_token_verification(monkeypatch):
    monkeypatch.setattr(prefix_cache_module, "hash_block", lambda parent, tokens: 42)
    bm = BlockManager(num_blocks=8, block_size=2)
    a = admit(bm, [1, 2, 3, 4, 5])
    assert bm.pool.hash_to_block == {42: a.block_table[0]}  # the colliding second block is not indexed
    assert bm.get_computed_blocks(make_seq([9, 9, 3, 4, 5])) == ([], 0)
    assert bm.get_computed_blocks(make_seq([1, 2, 9, 9, 5])) == (a.block_table[:1], 2)


def test_duplicate_contents_keep_the_first_index_entry_and_hand_it_over_on_eviction():
    bm = BlockManager(num_blocks=4, block_size=2)
    a = make_seq([1, 2, 3])
    b = make_seq([1, 2, 4])
    for seq in (a, b):  # both computed in the same step: neither could hit the other
        bm.allocate(seq, 3)
    for seq in (a, b):
        seq.num_computed_tokens = 3
        bm.hash_full_blocks(seq, 3)
    h = hash_block(None, (1, 2))
    assert bm.pool.hash_to_block[h] == a.block_table[0]
    b_first = b.block_table[0]
    bm.free(a)
    bm.pool.allocate(), bm.pool.allocate()  # evicts a's blocks (blank one first, then the cached one)
    assert h not in bm.pool.hash_to_block
    bm.free(b)
    assert bm.pool.hash_to_block[h] == b_first
    assert bm.get_computed_blocks(make_seq([1, 2, 5])) == ([b_first], 2)


def test_prefix_stats_count_each_admission_once():
    bm = BlockManager(num_blocks=8, block_size=4)
    admit(bm, range(10))
    b = make_seq([*range(8), 1, 2])
    blocks, num_hit = bm.get_computed_blocks(b)
    bm.get_computed_blocks(b)  # a retried lookup is not counted
    bm.allocate(b, 9, blocks)
    bm.allocate(b, 10)  # growing the table is not an admission
    assert (bm.prefix_query_tokens, bm.prefix_hit_tokens) == (20, 8)


def test_allocation_beyond_the_free_pool_fails_without_side_effects():
    bm = BlockManager(num_blocks=2, block_size=2)
    seq = make_seq(range(5))
    assert not bm.can_allocate(seq, 5)
    with pytest.raises(RuntimeError):
        bm.allocate(seq, 5)
    assert seq.block_table == [] and bm.num_free_blocks == 2


def test_fork_shares_blocks_and_copy_on_write_swaps_the_shared_last_block():
    bm = BlockManager(num_blocks=8, block_size=4)
    parent = admit(bm, range(6))  # one full block, one partial
    child = make_seq(range(6), num_computed=6)
    bm.fork(parent, child)
    assert child.block_table == parent.block_table
    assert [bm.pool.blocks[i].ref_count for i in parent.block_table] == [2, 2]
    assert bm.num_copy_on_write_blocks(child) == 1
    copies = bm.copy_on_write(child)
    assert copies == [(parent.block_table[1], child.block_table[1])]
    assert child.block_table[0] == parent.block_table[0] and child.block_table[1] != parent.block_table[1]
    assert [bm.pool.blocks[i].ref_count for i in parent.block_table] == [2, 1]
    assert bm.copy_on_write(child) == [] and bm.copy_on_write(parent) == []
    bm.free(parent)
    bm.free(child)
    assert bm.num_free_blocks == 8


# ---------------------------------------------------------------- stateful: random operations

PREFIXES = [(), (1, 2, 3, 4), (1, 2, 3, 4, 5, 6, 7), (9, 9)]
BLOCK_SIZE = 2


def chained_hash(tokens) -> int | None:
    h = None
    for i in range(0, len(tokens), BLOCK_SIZE):
        h = hash_block(h, tuple(tokens[i : i + BLOCK_SIZE]))
    return h


class BlockManagerMachine(RuleBasedStateMachine):
    """Random admissions, computes, appends, forks and frees against a fake KV pool.

    The fake pool stores, at each written slot, the whole prefix whose K/V that slot would hold. A sequence
    must always read back its own prefix: that is what "paging changes where bytes live, never what is
    computed" means for the block manager.
    """

    def __init__(self):
        super().__init__()
        self.bm = BlockManager(num_blocks=6, block_size=BLOCK_SIZE)
        self.seqs: list[Sequence] = []
        self.kv: dict[tuple[int, int], tuple[int, ...]] = {}

    def write(self, seq, start, end):
        for p in range(start, end):
            self.kv[(seq.block_table[p // BLOCK_SIZE], p % BLOCK_SIZE)] = tuple(seq.token_ids[: p + 1])

    @rule(prefix=st.sampled_from(PREFIXES), suffix=st.lists(st.integers(0, 3), min_size=1, max_size=5),
          chunk=st.integers(1, 8))
    def admit(self, prefix, suffix, chunk):
        seq = make_seq([*prefix, *suffix])
        blocks, num_hit = self.bm.get_computed_blocks(seq)
        assert num_hit < seq.num_tokens
        num_new = min(chunk, seq.num_tokens - num_hit)
        if not self.bm.can_allocate(seq, num_hit + num_new, blocks):
            event("admission refused: pool full")
            return
        event(f"admitted with {num_hit} hit tokens" if num_hit else "admitted without a hit")
        self.bm.allocate(seq, num_hit + num_new, blocks)
        seq.num_computed_tokens = num_hit
        self.check_reads(seq)
        self.write(seq, num_hit, num_hit + num_new)
        seq.num_computed_tokens += num_new
        self.bm.hash_full_blocks(seq, seq.num_computed_tokens)
        self.seqs.append(seq)

    @precondition(lambda self: self.seqs)
    @rule(data=st.data(), chunk=st.integers(1, 8))
    def compute(self, data, chunk):
        seq = data.draw(st.sampled_from(self.seqs))
        if seq.num_uncomputed_tokens == 0:
            seq.token_ids.append(data.draw(st.integers(0, 3)))
        num_new = min(chunk, seq.num_uncomputed_tokens)
        end = seq.num_computed_tokens + num_new
        needed = self.bm.num_copy_on_write_blocks(seq) + max(0, -(-end // BLOCK_SIZE) - len(seq.block_table))
        if needed > self.bm.num_free_blocks:
            return
        for src, dst in self.bm.copy_on_write(seq):
            event("copy-on-write")
            for off in range(BLOCK_SIZE):
                if (src, off) in self.kv:
                    self.kv[(dst, off)] = self.kv[(src, off)]
        self.bm.allocate(seq, end)
        self.check_reads(seq)
        self.write(seq, seq.num_computed_tokens, end)
        seq.num_computed_tokens = end
        self.bm.hash_full_blocks(seq, end)

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def fork(self, data):
        parent = data.draw(st.sampled_from(self.seqs))
        child = make_seq(parent.token_ids, num_computed=parent.num_computed_tokens)
        self.bm.fork(parent, child)
        self.seqs.append(child)

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def free(self, data):
        seq = data.draw(st.sampled_from(self.seqs))
        self.seqs.remove(seq)
        self.bm.free(seq)

    def check_reads(self, seq):
        for p in range(seq.num_computed_tokens):
            assert self.kv[(seq.block_table[p // BLOCK_SIZE], p % BLOCK_SIZE)] == tuple(seq.token_ids[: p + 1])

    @invariant()
    def ref_counts_match_block_tables(self):
        held = [0] * self.bm.num_blocks
        for seq in self.seqs:
            for b in seq.block_table:
                held[b] += 1
        assert [blk.ref_count for blk in self.bm.pool.blocks] == held

    @invariant()
    def free_and_used_partition_the_pool(self):
        free = set(self.bm.pool.free_queue)
        assert free == {blk.block_id for blk in self.bm.pool.blocks if blk.ref_count == 0}
        assert self.bm.pool.num_free_blocks + self.bm.pool.num_used_blocks == self.bm.num_blocks
        if not self.seqs:
            assert self.bm.num_free_blocks == self.bm.num_blocks

    @invariant()
    def every_index_entry_names_the_contents_it_hashes(self):
        for h, b in self.bm.pool.hash_to_block.items():
            blk = self.bm.pool.blocks[b]
            assert blk.block_hash == h == hash_block(blk.parent_hash, blk.token_ids)
            prefix = self.kv[(b, BLOCK_SIZE - 1)]  # the K/V really stored there
            assert prefix[-BLOCK_SIZE:] == blk.token_ids and chained_hash(prefix) == h

    @invariant()
    def every_sequence_reads_back_its_own_prefix(self):
        for seq in self.seqs:
            self.check_reads(seq)
            assert seq.block_hashes == [chained_hash(seq.token_ids[: (i + 1) * BLOCK_SIZE])
                                        for i in range(len(seq.block_hashes))]


TestBlockManagerMachine = BlockManagerMachine.TestCase
TestBlockManagerMachine.settings = settings(max_examples=50, stateful_step_count=40, deadline=None,
                                            suppress_health_check=[HealthCheck.too_slow])
