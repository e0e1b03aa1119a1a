"""The prefix index's events (core/kv_events.py): whatever the block pool does, a subscriber that applies a
snapshot and then every event holds exactly the pool's index, with each block's parent and tokens."""
from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from protos import engine_pb2
from scheduler_svc.core.block_pool import BlockPool
from scheduler_svc.core.kv_events import KvEventLog, parents_first, short_hash, snapshot
from scheduler_svc.core.prefix_cache import hash_block

NUM_BLOCKS = 6


def apply(index: dict, events: engine_pb2.KvEvents) -> None:
    """What a subscriber does with a message."""
    if events.cleared:
        index.clear()
    for event in events.events:
        if event.WhichOneof("kind") == "stored":
            s = event.stored
            index[s.block_hash] = (s.parent_hash if s.HasField("parent_hash") else None, tuple(s.token_ids))
        else:
            assert event.removed in index, "a removal of a block never stored"
            del index[event.removed]


def pool_index(pool: BlockPool) -> dict:
    out = {}
    for block_hash, block_id in pool.hash_to_block.items():
        block = pool.blocks[block_id]
        parent = short_hash(block.parent_hash) if block.parent_hash is not None else None
        out[short_hash(block_hash)] = (parent, block.token_ids)
    return out


operations = st.lists(st.tuples(st.sampled_from(["allocate", "hash", "release", "revive", "snapshot"]),
                                st.integers(0, 2**16)), max_size=60)


@settings(max_examples=150, deadline=None)
@given(operations)
def test_a_subscriber_replaying_snapshot_and_events_holds_the_pool_index(ops):
    pool, log = BlockPool(NUM_BLOCKS), KvEventLog()
    pool.listener = log
    mirror: dict = {}
    apply(mirror, snapshot(pool))
    held: list[int] = []  # block ids we hold a reference to
    chains: dict[int, int | None] = {}  # block id -> the hash its parent had when we hashed it
    for op, x in ops:
        if op == "allocate" and pool.num_free_blocks:
            held.append(pool.allocate())
        elif op == "hash" and held:
            block_id = held[x % len(held)]
            if pool.blocks[block_id].block_hash is None:
                parents = [b.block_hash for b in pool.blocks if b.block_hash is not None]
                parent = parents[x % len(parents)] if parents and x % 3 else None
                tokens = (x % 5, x % 7)  # few distinct contents: duplicates of one hash happen
                pool.set_hash(block_id, hash_block(parent, tokens), parent, tokens)
        elif op == "release" and held:
            pool.release(held.pop(x % len(held)))
        elif op == "revive":
            cached = [b for b in pool.blocks if b.ref_count == 0 and pool.is_cached(b)]
            if cached:
                block = cached[x % len(cached)]
                pool.ref(block.block_id)
                held.append(block.block_id)
        elif op == "snapshot":  # a new subscriber, after the old one took what was logged
            drained = log.drain()
            if drained is not None:
                apply(mirror, drained)
            fresh: dict = {}
            apply(fresh, snapshot(pool))
            assert fresh == pool_index(pool)
        drained = log.drain()
        if drained is not None:
            apply(mirror, drained)
        assert mirror == pool_index(pool)


def test_a_snapshot_lists_every_block_after_its_parent():
    pool = BlockPool(8)
    parent = None
    ids = [pool.allocate() for _ in range(4)]
    hashes = []  # a chain of four, hashed child first below
    for i, block_id in enumerate(ids):
        tokens = (i, i + 1)
        h = hash_block(parent, tokens)
        hashes.append((block_id, h, parent, tokens))
        parent = h
    for block_id, h, p, tokens in reversed(hashes):
        pool.set_hash(block_id, h, p, tokens)
    events = snapshot(pool)
    assert events.cleared
    order = [e.stored.block_hash for e in events.events]
    assert order == [short_hash(h) for _, h, _, _ in hashes]


def test_parents_first_keeps_chains_whose_parent_is_gone():
    assert parents_first({3: 2, 2: 1, 1: None, 9: 42}) == [1, 2, 3, 9]


def test_nothing_is_recorded_without_a_listener():
    pool = BlockPool(2)
    block_id = pool.allocate()
    pool.set_hash(block_id, hash_block(None, (1,)), None, (1,))  # no listener: no error, no log
    log = KvEventLog()
    pool.listener = log
    pool.release(block_id)
    assert log.drain() is None  # releasing keeps it findable: nothing changed in the index
    pool.allocate()
    pool.allocate()  # the LRU end: the cached block is reused and stops being findable
    assert [e.WhichOneof("kind") for e in log.drain().events] == ["removed"]
