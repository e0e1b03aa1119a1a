"""The host pool: where a sequence preempted by swap keeps its KV blocks, in CPU memory, until the
scheduler swaps it back in. Block-major, [N_host, 2, L, block_size, H_kv_local, D], so each host block
is one contiguous range and moves by one DMA copy.

The scheduler owns the host block ids as it owns the KV ones; the executor only copies whole blocks,
every layer, K and V, in the order the plan gives: swap_out, then swap_in, then copy-on-write. On CUDA
every copy is queued on the current stream, after the previous step's forward and before the next one,
so the host never waits: a host block is only ever read or written by copies on that same stream.
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
        # pinned, so copies to and from the device are asynchronous DMA
        self.pinned = kv_cache.device.type == "cuda"
        shape = (num_blocks,) + kv_cache.shape[:2] + kv_cache.shape[3:]
        self.cache = torch.empty(shape, dtype=kv_cache.dtype, pin_memory=self.pinned)

    def swap_out(self, kv_cache: torch.Tensor, copies) -> None:
        """KV pool block src -> host block dst, ordered after the work already queued on the stream."""
        src, dst = _ids(copies, kv_cache.shape[2], self.num_blocks, "swap_out")
        # block-major on the device too, so each block is one contiguous copy
        gathered = kv_cache.index_select(2, src.to(kv_cache.device)).movedim(2, 0).contiguous()
        for i, block in enumerate(dst.tolist()):
            self.cache[block].copy_(gathered[i], non_blocking=self.pinned)

    def swap_in(self, kv_cache: torch.Tensor, copies) -> None:
        """Host block src -> KV pool block dst, queued before the forward."""
        src, dst = _ids(copies, self.num_blocks, kv_cache.shape[2], "swap_in")
        staged = torch.empty((len(src),) + self.cache.shape[1:], dtype=kv_cache.dtype, device=kv_cache.device)
        for i, block in enumerate(src.tolist()):
            staged[i].copy_(self.cache[block], non_blocking=self.pinned)
        kv_cache[:, :, dst.to(kv_cache.device)] = staged.movedim(0, 2)


def _ids(copies, num_src: int, num_dst: int, what: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The copies' block ids, checked on the host: a bad id on the device would be a device assert."""
    src = torch.tensor([c.src_block_id for c in copies], dtype=torch.int64)
    dst = torch.tensor([c.dst_block_id for c in copies], dtype=torch.int64)
    for ids, n, end in ((src, num_src, "source"), (dst, num_dst, "destination")):
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= n):
            raise RuntimeError(f"{what}: a {end} block id is outside [0, {n}): {ids.tolist()}")
    return src, dst
