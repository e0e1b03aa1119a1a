"""The KV block pool: mechanism only. Free queue, reference counts and the prefix-hash index.

Which blocks a sequence gets is policy and lives in block_manager.py.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Protocol


@dataclass(eq=False)
class Block:
    block_id: int
    ref_count: int = 0
    # What the block was hashed from, kept so a lookup verifies tokens and not the hash alone.
    block_hash: int | None = None
    parent_hash: int | None = None
    token_ids: tuple[int, ...] = ()

    def reset_hash(self) -> None:
        self.block_hash, self.parent_hash, self.token_ids = None, None, ()


class IndexListener(Protocol):
    """Told of every change of the hash index (kv_events.KvEventLog: the router's view of the cache)."""

    def stored(self, block: Block) -> None: ...

    def removed(self, block_hash: int) -> None: ...


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Head = evicted next. Cached blocks are freed to the tail (LRU order), blank ones to the head.
        self.free_queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.hash_to_block: dict[int, int] = {}
        self.listener: IndexListener | None = None  # set while someone follows the index (KV events)

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        """Blocks no sequence holds, cached ones included."""
        return len(self.free_queue)

    @property
    def num_used_blocks(self) -> int:
        return len(self.blocks) - len(self.free_queue)

    def is_cached(self, block: Block) -> bool:
        return block.block_hash is not None and self.hash_to_block.get(block.block_hash) == block.block_id

    def allocate(self) -> int:
        """Take the least recently used free block for new contents; its old hash stops being findable."""
        if not self.free_queue:
            raise RuntimeError("KV block pool exhausted")
        block_id, _ = self.free_queue.popitem(last=False)
        block = self.blocks[block_id]
        if self.is_cached(block):
            del self.hash_to_block[block.block_hash]
            if self.listener is not None:
                self.listener.removed(block.block_hash)
        block.reset_hash()
        block.ref_count = 1
        return block_id

    def lookup(self, block_hash: int, parent_hash: int | None, token_ids: tuple[int, ...]) -> int | None:
        """The cached block holding exactly these tokens after this parent, or None. Takes no reference."""
        block_id = self.hash_to_block.get(block_hash)
        if block_id is None:
            return None
        block = self.blocks[block_id]
        if block.parent_hash != parent_hash or block.token_ids != token_ids:
            return None  # a hash collision: the contents differ
        return block_id

    def ref(self, block_id: int) -> None:
        """Take a reference to a block that is in use or cached and free (reviving it)."""
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self.free_queue[block_id]
        block.ref_count += 1

    def release(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count <= 0:
            raise RuntimeError(f"block {block_id} released more often than referenced")
        block.ref_count -= 1
        if block.ref_count:
            return
        if block.block_hash is not None and block.block_hash not in self.hash_to_block:
            # A duplicate of a block since evicted: it can carry the cache entry now.
            self.hash_to_block[block.block_hash] = block_id
            if self.listener is not None:
                self.listener.stored(block)
        self.free_queue[block_id] = None
        if not self.is_cached(block):
            self.free_queue.move_to_end(block_id, last=False)  # no cache value: reuse first

    def set_hash(self, block_id: int, block_hash: int, parent_hash: int | None, token_ids: tuple[int, ...]) -> bool:
        """Record a full block's contents; index it unless another block already owns the hash.

        Returns whether this block is now the one the index finds.
        """
        block = self.blocks[block_id]
        block.block_hash, block.parent_hash, block.token_ids = block_hash, parent_hash, token_ids
        if block_hash in self.hash_to_block:
            return self.hash_to_block[block_hash] == block_id
        self.hash_to_block[block_hash] = block_id
        if self.listener is not None:
            self.listener.stored(block)
        return True
