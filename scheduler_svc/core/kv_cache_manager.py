"""The KV cache manager: policy over the block pool. Which blocks a sequence gets (prefix-cache hits first),
fork and copy-on-write, and swapping a sequence's blocks to the executors' host pool and back."""
from __future__ import annotations

from scheduler_svc.core.block_pool import BlockPool
from scheduler_svc.core.prefix_cache import find_cached_prefix, hash_full_blocks
from scheduler_svc.core.sequence import Sequence

BlockIds = list[int] | tuple[int, ...]


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 num_host_blocks: int = 0) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.pool = BlockPool(num_blocks)
        self.host_pool = BlockPool(num_host_blocks) if num_host_blocks > 0 else None  # swap space
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.prefix_query_tokens = 0
        self.prefix_hit_tokens = 0

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def get_computed_blocks(self, seq: Sequence) -> tuple[list[int], int]:
        """Cached blocks that hold seq's leading full blocks (prefix_cache.py), and how many tokens they cover.

        Takes no references; pass the blocks to allocate().
        """
        if not self.enable_prefix_caching:
            return [], 0
        block_ids = find_cached_prefix(self.pool, self.block_size, seq.token_ids)
        return block_ids, len(block_ids) * self.block_size

    def num_blocks_to_take(self, seq: Sequence, num_tokens: int, computed_blocks: BlockIds = ()) -> int:
        """Free-pool blocks that growing seq to num_tokens tokens would use (revived hits included)."""
        fresh = cdiv(num_tokens, self.block_size) - len(seq.block_table) - len(computed_blocks)
        revived = sum(1 for b in computed_blocks if self.pool.blocks[b].ref_count == 0) if computed_blocks else 0
        return max(fresh, 0) + revived

    def can_allocate(self, seq: Sequence, num_tokens: int, computed_blocks: BlockIds = ()) -> bool:
        """Whether seq's block table can grow to hold num_tokens tokens (after the computed blocks)."""
        return self.num_blocks_to_take(seq, num_tokens, computed_blocks) <= self.pool.num_free_blocks

    def can_append(self, seq: Sequence, num_tokens: int) -> bool:
        """Whether seq can compute up to num_tokens: fresh blocks to grow, and copies of the shared ones it writes."""
        needed = self.num_copy_on_write_blocks(seq) + self.num_blocks_to_take(seq, num_tokens)
        return needed <= self.pool.num_free_blocks

    def allocate(self, seq: Sequence, num_tokens: int, computed_blocks: BlockIds = ()) -> None:
        """Grow seq.block_table to ceil(num_tokens / block_size) blocks, prefix-cache hits first.

        computed_blocks come from get_computed_blocks() and only go to an empty table.
        """
        if computed_blocks and seq.block_table:
            raise ValueError(f"seq {seq.seq_id}: cached blocks go only to an empty block table")
        if not self.can_allocate(seq, num_tokens, computed_blocks):
            raise RuntimeError(f"seq {seq.seq_id}: not enough free KV blocks for {num_tokens} tokens")
        if not seq.block_table and self.enable_prefix_caching:
            self.prefix_query_tokens += seq.num_tokens  # an empty table means a fresh admission
            self.prefix_hit_tokens += len(computed_blocks) * self.block_size
        # Revive the hits before taking fresh blocks, so a fresh one never evicts a hit.
        for block_id in computed_blocks:
            self.pool.ref(block_id)
            seq.block_table.append(block_id)
            seq.block_hashes.append(self.pool.blocks[block_id].block_hash)
        for _ in range(cdiv(num_tokens, self.block_size) - len(seq.block_table)):
            seq.block_table.append(self.pool.allocate())

    def trim(self, seq: Sequence, num_tokens: int) -> None:
        """Give back the blocks past those that hold num_tokens tokens: the lookahead slots of proposals a
        verification rejected. Never hashed (they hold no accepted token), so they go first in eviction order."""
        keep = cdiv(num_tokens, self.block_size)
        for block_id in reversed(seq.block_table[keep:]):
            self.pool.release(block_id)
        del seq.block_table[keep:]

    def free(self, seq: Sequence) -> None:
        """Drop seq's references. Tail blocks go first in eviction order, so shared prefixes live longer."""
        for block_id in reversed(seq.block_table):
            self.pool.release(block_id)
        for block_id in seq.host_block_table:
            self.host_pool.release(block_id)
        seq.block_table.clear()
        seq.block_hashes.clear()
        seq.host_block_table.clear()

    def swap_out(self, seq: Sequence) -> list[tuple[int, int]]:
        """Move the blocks of seq's computed tokens to host blocks (preemption_cost.decide checked the room);
        returns (KV block, host block) copies.

        The KV blocks go back to the pool at once (their hashed contents stay findable): the copies run
        before anything else in the next plan, so a block reused in that plan is read first.
        """
        n = cdiv(seq.num_computed_tokens, self.block_size)
        host = [self.host_pool.allocate() for _ in range(n)]
        copies = list(zip(seq.block_table[:n], host))
        self.free(seq)
        seq.host_block_table = host
        return copies

    def can_swap_in(self, seq: Sequence, num_tokens: int) -> bool:
        return cdiv(num_tokens, self.block_size) <= self.pool.num_free_blocks

    def swap_in(self, seq: Sequence, num_tokens: int) -> list[tuple[int, int]]:
        """Give seq fresh KV blocks for num_tokens tokens; returns (host block, KV block) copies of its saved ones."""
        if seq.block_table:
            raise ValueError(f"seq {seq.seq_id}: swap-in needs an empty block table")
        seq.block_table = [self.pool.allocate() for _ in range(cdiv(num_tokens, self.block_size))]
        copies = list(zip(seq.host_block_table, seq.block_table))
        for block_id in seq.host_block_table:  # read by the plan that carries the copies, before any later write
            self.host_pool.release(block_id)
        seq.host_block_table = []
        return copies

    def hash_full_blocks(self, seq: Sequence, num_computed_tokens: int) -> None:
        """Make the full blocks covered by computed tokens findable. Call only after their step succeeded."""
        if self.enable_prefix_caching:
            hash_full_blocks(self.pool, self.block_size, seq, num_computed_tokens)

    def fork(self, parent: Sequence, child: Sequence, num_tokens: int | None = None) -> None:
        """Give child the blocks holding parent's first num_tokens tokens (all by default), shared.

        Writes into a shared block go through copy_on_write().
        """
        if child.block_table:
            raise ValueError(f"seq {child.seq_id}: fork needs an empty block table")
        num_blocks = len(parent.block_table) if num_tokens is None else cdiv(num_tokens, self.block_size)
        num_full = len(parent.block_hashes) if num_tokens is None else num_tokens // self.block_size
        for block_id in parent.block_table[:num_blocks]:
            self.pool.ref(block_id)
        child.block_table = parent.block_table[:num_blocks]
        child.block_hashes = parent.block_hashes[:num_full]

    def _must_copy(self, block_id: int) -> bool:
        """A block a sequence is about to write must be its own: not shared, and not holding contents the
        prefix index records (a fork can inherit a block its sibling filled and hashed, then held alone)."""
        block = self.pool.blocks[block_id]
        return block.ref_count > 1 or block.block_hash is not None

    def num_copy_on_write_blocks(self, seq: Sequence) -> int:
        """Fresh blocks copy_on_write(seq) will take."""
        first = seq.num_computed_tokens // self.block_size
        return sum(1 for b in seq.block_table[first:] if self._must_copy(b))

    def copy_on_write(self, seq: Sequence) -> list[tuple[int, int]]:
        """Before seq writes from num_computed_tokens on, swap each shared block it will write for a fresh one.

        Returns (src, dst) block copies the executors must run before the forward.
        """
        if self.num_copy_on_write_blocks(seq) > self.pool.num_free_blocks:
            raise RuntimeError(f"seq {seq.seq_id}: not enough free KV blocks for copy-on-write")
        copies = []
        for i in range(seq.num_computed_tokens // self.block_size, len(seq.block_table)):
            src = seq.block_table[i]
            if self._must_copy(src):
                dst = self.pool.allocate()
                self.pool.release(src)  # still held by the other sequences
                seq.block_table[i] = dst
                copies.append((src, dst))
        return copies
