"""Automatic prefix caching: a full block is named by a hash chained over its parent's hash and its
own tokens, so equal prefixes find each other's blocks (invariant 6).

The index itself (hash -> block, LRU eviction of freed blocks) is the block pool's mechanism; this file
says what a hash means, how a new sequence's leading blocks are looked up, and when blocks are hashed.
"""
from __future__ import annotations

import secrets
from array import array

import xxhash

from scheduler_svc.core.block_pool import BlockPool
from scheduler_svc.core.sequence import Sequence

# A per-process seed, so colliding token blocks cannot be prepared offline. Lookups verify tokens anyway.
_HASH_SEED = secrets.randbits(64)


def hash_block(parent_hash: int | None, token_ids: tuple[int, ...] | list[int]) -> int:
    """Chained hash of one full block: it names the block's tokens and everything before them."""
    parent = b"" if parent_hash is None else parent_hash.to_bytes(16, "little")
    return xxhash.xxh3_128_intdigest(parent + array("i", token_ids).tobytes(), seed=_HASH_SEED)


def find_cached_prefix(pool: BlockPool, block_size: int, token_ids: list[int]) -> list[int]:
    """Cached blocks holding the leading full blocks of token_ids, verified token by token.

    Never covers every token: the last one must be computed to get logits. Takes no references.
    """
    block_ids: list[int] = []
    parent = None
    for i in range((len(token_ids) - 1) // block_size):
        block_tokens = tuple(token_ids[i * block_size : (i + 1) * block_size])
        block_hash = hash_block(parent, block_tokens)
        block_id = pool.lookup(block_hash, parent, block_tokens)
        if block_id is None:
            break
        block_ids.append(block_id)
        parent = block_hash
    return block_ids


def hash_full_blocks(pool: BlockPool, block_size: int, seq: Sequence, num_computed_tokens: int) -> None:
    """Make seq's full blocks covered by computed tokens findable. Call only after their step succeeded."""
    for i in range(len(seq.block_hashes), num_computed_tokens // block_size):  # usually empty: cheap to call
        parent = seq.block_hashes[i - 1] if i else None
        block_tokens = tuple(seq.token_ids[i * block_size : (i + 1) * block_size])
        block_hash = hash_block(parent, block_tokens)
        # If another block already holds these contents, it keeps the index entry.
        pool.set_hash(seq.block_table[i], block_hash, parent, block_tokens)
        seq.block_hashes.append(block_hash)
