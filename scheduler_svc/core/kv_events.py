"""The prefix index's changes as events, published by the scheduler (its single writer) to the front ends
that subscribed, which relay them to a cache-aware router (SMG's SubscribeKvEvents).

The block pool tells an attached KvEventLog each time a block becomes findable or stops being findable;
the engine core drains the log once per turn of its loop into one KvEvents message per subscriber. A new
subscriber first gets a snapshot: `cleared` and every indexed block, parents before children. Nothing is
recorded while no front end subscribes.
"""
from __future__ import annotations

from protos import engine_pb2
from scheduler_svc.core.block_pool import Block, BlockPool

MASK64 = (1 << 64) - 1


def short_hash(block_hash: int) -> int:
    """The published form of a chained block hash: its low 64 bits (a router's key, not a lookup's proof)."""
    return block_hash & MASK64


def stored_event(block: Block) -> engine_pb2.KvEvent:
    stored = engine_pb2.KvBlockStored(block_hash=short_hash(block.block_hash), token_ids=block.token_ids)
    if block.parent_hash is not None:
        stored.parent_hash = short_hash(block.parent_hash)
    return engine_pb2.KvEvent(stored=stored)


class KvEventLog:
    """What the pool's index gained and lost since the last drain, in order."""

    def __init__(self) -> None:
        self.events: list[engine_pb2.KvEvent] = []

    def stored(self, block: Block) -> None:
        self.events.append(stored_event(block))

    def removed(self, block_hash: int) -> None:
        self.events.append(engine_pb2.KvEvent(removed=short_hash(block_hash)))

    def drain(self) -> engine_pb2.KvEvents | None:
        """The events since the last drain as one message; None when there were none."""
        if not self.events:
            return None
        events, self.events = self.events, []
        return engine_pb2.KvEvents(events=events)


def parents_first(parents: dict[int, int | None]) -> list[int]:
    """The hashes of an index (hash -> parent hash) ordered so that each comes after its parent, where the
    parent is in the index too: a subscriber can then rebuild the chains in one pass."""
    done: set[int] = set()
    order = []
    for block_hash in parents:
        chain = []  # this block and its ancestors not placed yet, child first
        while block_hash in parents and block_hash not in done:
            done.add(block_hash)
            chain.append(block_hash)
            block_hash = parents[block_hash]
        order.extend(reversed(chain))
    return order


def snapshot(pool: BlockPool) -> engine_pb2.KvEvents:
    """The whole index as `cleared` and a stored event per findable block, parents first."""
    indexed = {h: pool.blocks[b] for h, b in pool.hash_to_block.items()}
    order = parents_first({h: block.parent_hash for h, block in indexed.items()})
    return engine_pb2.KvEvents(cleared=True, events=[stored_event(indexed[h]) for h in order])
