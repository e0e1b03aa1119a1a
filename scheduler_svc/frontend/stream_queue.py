"""The engine outputs of one client stream, waiting for its handler to send them.

The front end's one reader task puts every output here and must never wait for a client, so a put
never blocks. A client that reads slower than the engine writes leaves its handler stuck in a gRPC
write while outputs keep coming; past `max_per_request` queued outputs of one engine request, a new
output is merged into that request's latest queued one (its tokens and logprobs appended, its finish
taken). The client then gets the same tokens, in order, in fewer and larger messages; the stream holds
at most max_per_request outputs per engine request, and never more tokens than its requests generate.

Coalescing (`get_coalesced`): a handler that fell behind takes, with the output it waited for, the
outputs of the same engine request that queued up behind it, as one message. It never waits for more
(a token is never delayed), never merges across engine requests (completions) or past another
request's output (so nothing is reordered), and never past a final output.
"""
from __future__ import annotations

import asyncio
from collections import deque

from protos import engine_pb2


def merge_into(queued: engine_pb2.RequestOutput, later: engine_pb2.RequestOutput) -> None:
    """Make `queued` say what it and the later output of the same request say together."""
    queued.new_token_ids.extend(later.new_token_ids)
    queued.logprobs.extend(later.logprobs)
    # the latest state wins: a finish (with its stop token and error) comes last, once (invariant 7)
    queued.finish_reason, queued.stop_token_id, queued.error = later.finish_reason, later.stop_token_id, later.error
    queued.num_prompt_tokens, queued.num_cached_tokens = later.num_prompt_tokens, later.num_cached_tokens
    queued.num_proposed_tokens, queued.num_accepted_tokens = later.num_proposed_tokens, later.num_accepted_tokens


def is_final(output: engine_pb2.RequestOutput) -> bool:
    return output.finish_reason != engine_pb2.FINISH_REASON_UNSPECIFIED


class StreamQueue:
    """The asyncio.Queue calls the service uses (put_nowait, get, qsize), bounded by merging.

    Items other than RequestOutputs (EngineLost) are queued as they come, never merged.
    """

    def __init__(self, max_per_request: int) -> None:
        if max_per_request < 1:
            raise ValueError(f"max_per_request must be >= 1, got {max_per_request}")
        self.max_per_request = max_per_request
        self._items: deque = deque()
        self._count: dict[str, int] = {}  # engine request id -> its outputs in _items
        self._latest: dict[str, engine_pb2.RequestOutput] = {}  # engine request id -> its last one in _items
        self._nonempty = asyncio.Event()

    def put_nowait(self, item) -> None:
        rid = item.request_id if isinstance(item, engine_pb2.RequestOutput) else None
        if rid is not None and self._count.get(rid, 0) >= self.max_per_request:
            merge_into(self._latest[rid], item)
            return
        self._items.append(item)
        if rid is not None:
            self._count[rid] = self._count.get(rid, 0) + 1
            self._latest[rid] = item
        self._nonempty.set()

    async def get(self):
        while not self._items:
            self._nonempty.clear()
            await self._nonempty.wait()
        return self._take_head()

    def _take_head(self):
        item = self._items.popleft()
        if isinstance(item, engine_pb2.RequestOutput):
            rid = item.request_id
            self._count[rid] -= 1
            if self._latest.get(rid) is item:  # the request has nothing queued now
                del self._latest[rid], self._count[rid]
        return item

    async def get_coalesced(self):
        """get(), merged with the same request's outputs queued right behind it (see the module doc)."""
        item = await self.get()
        if not isinstance(item, engine_pb2.RequestOutput):
            return item
        while (self._items and not is_final(item) and isinstance(self._items[0], engine_pb2.RequestOutput)
               and self._items[0].request_id == item.request_id):
            merge_into(item, self._take_head())
        return item

    def qsize(self) -> int:
        return len(self._items)

    def queued(self, request_id: str) -> int:
        """Outputs of this engine request waiting here."""
        return self._count.get(request_id, 0)
