"""The host pool: where a sequence preempted by swap keeps its KV blocks, in CPU memory, until the
scheduler swaps it back in. Same layout as the KV pool, [2, L, N_host, block_size, H_kv_local, D].

The scheduler owns the host block ids as it owns the KV ones; the executor only copies whole blocks,
every layer, K and V, in the order the plan gives: swap_out, then swap_in, then copy-on-write.
Swapping is rare, so each copy waits for the device: correctness over overlap.
"""
from __future__ import annotations

import torch


def num_host_blocks(num_host_blocks: int | None, swap_space_gb: float, bytes_per_block: int) -> int:
    """--num-host-blocks when given, else as many blocks as --swap-space-gb holds; 0: no host pool."""
    if num_host_blocks is not None:
        return num_host_blocks
    return int(swap_space_gb * 2**30) // bytes_per_block


class HostKVPool:
    def __init__(self, kv_cache: torch.Tensor, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        # pinned, so the device copies it by DMA rather than through a pageable bounce buffer
        self.pinned = kv_cache.device.type == "cuda"
        shape = kv_cache.shape[:2] + (num_blocks,) + kv_cache.shape[3:]
        self.cache = torch.empty(shape, dtype=kv_cache.dtype, pin_memory=self.pinned)

    def _staging(self, num_blocks: int) -> torch.Tensor:
        shape = self.cache.shape[:2] + (num_blocks,) + self.cache.shape[3:]
        return torch.empty(shape, dtype=self.cache.dtype, pin_memory=self.pinned)

    def swap_out(self, kv_cache: torch.Tensor, copies) -> None:
        """KV pool block src -> host block dst. Returns with the host blocks written, so a later copy
        in the same plan may overwrite the source blocks."""
        src, dst = _ids(copies, kv_cache.shape[2], self.num_blocks, "swap_out")
        gathered = kv_cache.index_select(2, src.to(kv_cache.device))
        if self.pinned:
            staged = self._staging(len(src))
            staged.copy_(gathered)  # blocking: after whatever the stream had queued (the last forward)
            gathered = staged
        self.cache[:, :, dst] = gathered

    def swap_in(self, kv_cache: torch.Tensor, copies) -> None:
        """Host block src -> KV pool block dst, queued on the current stream before the forward."""
        src, dst = _ids(copies, self.num_blocks, kv_cache.shape[2], "swap_in")
        if not self.pinned:
            kv_cache[:, :, dst] = self.cache.index_select(2, src)
            return
        staged = self._staging(len(src))
        torch.index_select(self.cache, 2, src, out=staged)
        # the caching host allocator keeps `staged` alive until this copy is done
        kv_cache[:, :, dst.to(kv_cache.device)] = staged.to(kv_cache.device, non_blocking=True)


def _ids(copies, num_src: int, num_dst: int, what: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The copies' block ids, checked on the host: a bad id on the device would be a device assert."""
    src = torch.tensor([c.src_block_id for c in copies], dtype=torch.int64)
    dst = torch.tensor([c.dst_block_id for c in copies], dtype=torch.int64)
    for ids, n, end in ((src, num_src, "source"), (dst, num_dst, "destination")):
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= n):
            raise RuntimeError(f"{what}: a {end} block id is outside [0, {n}): {ids.tolist()}")
    return src, dst
