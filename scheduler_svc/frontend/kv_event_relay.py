"""The scheduler's prefix-index events relayed to the gateways that subscribe (SMG's SubscribeKvEvents).

The scheduler is the single writer of the index and publishes its changes (core/kv_events.py); the front
end subscribes while at least one gateway stream is open, keeps a copy of the index (so that a second
gateway starts from a snapshot too), and hands each batch, in SMG's event form, to every stream's queue.
A stream that falls MAX_QUEUED_BATCHES behind is ended; its gateway subscribes again and starts afresh.
"""
from __future__ import annotations

import asyncio
import itertools
from typing import Callable

from smg_grpc_proto.generated import common_pb2 as smg

from protos import engine_pb2
from scheduler_svc.core.kv_events import parents_first

MAX_QUEUED_BATCHES = 1024
Follow = Callable[[Callable[[engine_pb2.KvEvents], None] | None], None]


class Overrun(Exception):
    """A subscriber's queue overflowed: its view of the index is incomplete."""


def signed64(h: int) -> int:
    """SMG's hashes are int64: the same 64 bits."""
    return h - (1 << 64) if h >= 1 << 63 else h


class KvEventRelay:
    def __init__(self, follow: Follow, block_size: Callable[[], int]) -> None:
        self.follow = follow  # follow(callback) subscribes the front end to the scheduler; follow(None) ends it
        self.block_size = block_size  # the engine's tokens per block
        self.index: dict[int, tuple[int | None, tuple[int, ...]]] = {}  # hash -> (parent, tokens), as published
        self.queues: set[asyncio.Queue] = set()
        self.event_ids = itertools.count(1)

    def subscribe(self) -> asyncio.Queue:
        """A queue that receives lists of smg KvCacheEvents (or Overrun), starting with the whole index."""
        queue: asyncio.Queue = asyncio.Queue(MAX_QUEUED_BATCHES)
        if not self.queues:
            self.follow(self.on_kv_events)  # the scheduler answers with a snapshot, which every queue gets
        else:
            queue.put_nowait(self._snapshot())
        self.queues.add(queue)
        return queue

    def unsubscribe(self, queue: asyncio.Queue) -> None:
        self.queues.discard(queue)
        if not self.queues:
            self.follow(None)
            self.index.clear()

    def on_kv_events(self, msg: engine_pb2.KvEvents) -> None:
        events = []
        if msg.cleared:
            self.index.clear()
            events.append(smg.KvCacheEvent(event_id=next(self.event_ids), cleared=smg.KvCacheCleared()))
        for event in msg.events:
            if event.WhichOneof("kind") == "stored":
                s = event.stored
                parent = s.parent_hash if s.HasField("parent_hash") else None
                self.index[s.block_hash] = (parent, tuple(s.token_ids))
                self._stored(events, s.block_hash, parent, s.token_ids)
            else:
                self.index.pop(event.removed, None)
                self._removed(events, event.removed)
        for queue in list(self.queues):
            try:
                queue.put_nowait(events)
            except asyncio.QueueFull:
                self.queues.discard(queue)
                queue.get_nowait()  # room for the news that it is dropped
                queue.put_nowait(Overrun())

    def _snapshot(self) -> list[smg.KvCacheEvent]:
        events = [smg.KvCacheEvent(event_id=next(self.event_ids), cleared=smg.KvCacheCleared())]
        for block_hash in parents_first({h: parent for h, (parent, _) in self.index.items()}):
            parent, tokens = self.index[block_hash]
            self._stored(events, block_hash, parent, tokens)
        return events

    def _stored(self, events: list, block_hash: int, parent: int | None, tokens) -> None:
        """A stored block; one that continues the chain of the previous event joins it, as vLLM publishes."""
        block = smg.KvBlock(block_hash=signed64(block_hash), token_ids=tokens, block_size=self.block_size())
        last = events[-1] if events else None
        if (parent is not None and last is not None and last.WhichOneof("data") == "stored"
                and last.stored.blocks[-1].block_hash == signed64(parent)):
            last.stored.blocks.append(block)
            return
        stored = smg.KvBlocksStored(blocks=[block])
        if parent is not None:
            stored.parent_block_hash = signed64(parent)
        events.append(smg.KvCacheEvent(event_id=next(self.event_ids), stored=stored))

    def _removed(self, events: list, block_hash: int) -> None:
        last = events[-1] if events else None
        if last is not None and last.WhichOneof("data") == "removed":
            last.removed.block_hashes.append(signed64(block_hash))
            return
        events.append(smg.KvCacheEvent(event_id=next(self.event_ids),
                                       removed=smg.KvBlocksRemoved(block_hashes=[signed64(block_hash)])))
