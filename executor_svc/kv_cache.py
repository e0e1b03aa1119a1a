"""The KV pool: its size, its one tensor, each layer's view of it, and the block moves a plan asks for
(copy-on-write copies, and swaps to and from the pinned host pool).

The device pool is one tensor [2, L, N, block_size, H_kv_local, D]; attention layer i views
[0, i] as its k_cache and [1, i] as its v_cache, each [N, block_size, H_kv_local, D]. The host pool,
where a sequence preempted by swap keeps its blocks until the scheduler swaps it back in, is
block-major, [N_host, 2, L, block_size, H_kv_local, D], so each host block is one contiguous range
and moves by one DMA copy.

With --kv-cache-dtype fp8 (or int8) both pools are float8_e4m3fn (int8) (kernels/kv_quant.py): a block
takes half the bytes of bf16, so the same memory holds twice the blocks. The pool then also holds each
layer's dequantization scales, [2, L, H_kv] (fp8) or [2, L, H_kv, D] (int8) float32 (K, V), fixed at
start-up (executor_svc/kv_calibration.py). Copies and swaps move the bytes unchanged (fp8 through uint8
views).

The scheduler owns every block id, device and host (invariant 1); this file only copies whole blocks,
every layer, K and V. On CUDA every copy is queued on the current stream, after the previous step's
forward and before the next one, so the host never waits: a host block is only ever read or written
by copies on that same stream.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from executor_svc.copy_costs import CopyTimer
from executor_svc.layers.attention import Attention
from executor_svc.pinned_staging import PinnedStaging
from kernels.kv_quant import KVScales, as_bytes
from scheduler_svc.common.config import EngineConfig

log = logging.getLogger("nanoserve.executor")

BlockPairs = list[tuple[int, int]]  # (source block id, destination block id) per block to move


@dataclass(frozen=True)
class KVLayout:
    num_layers: int
    block_size: int
    num_kv_heads: int  # this rank's
    head_dim: int
    dtype: torch.dtype  # the pool's: the model's, float8_e4m3fn or int8
    device: torch.device

    @property
    def bytes_per_block(self) -> int:
        elem = torch.tensor([], dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * elem

    def shape(self, num_blocks: int) -> tuple[int, ...]:
        return (2, self.num_layers, num_blocks, self.block_size, self.num_kv_heads, self.head_dim)


# ---------------------------------------------------------------------------------------------
# Sizing
# ---------------------------------------------------------------------------------------------


def num_kv_blocks(config: EngineConfig, layout: KVLayout, peak_forward: Callable[[], None],
                  extra_bytes_per_block: int = 0) -> int:
    """--num-gpu-blocks when given (any device); on the CPU what --cpu-kv-cache-gb holds; on a GPU
    what is left of --gpu-memory-utilization after peak_forward, the step that peaks memory.
    extra_bytes_per_block: another pool indexed by the same block ids (a draft model's) shares the memory."""
    if config.num_gpu_blocks is not None:
        return config.num_gpu_blocks
    if layout.device.type == "cpu":
        return max(1, int(config.cpu_kv_cache_gb * 2**30) // (layout.bytes_per_block + extra_bytes_per_block))
    return _gpu_blocks_left(layout, config.gpu_memory_utilization, peak_forward, extra_bytes_per_block)


def _gpu_blocks_left(layout: KVLayout, gpu_memory_utilization: float, peak_forward: Callable[[], None],
                     extra_bytes_per_block: int = 0) -> int:
    """Run peak_forward (which brings and releases its own small pool), then give the KV pool what
    memory is left."""
    device = layout.device
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    peak_forward()
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    used_by_others = total - free - torch.cuda.memory_allocated(device)
    budget = total * gpu_memory_utilization - used_by_others - peak
    num_blocks = int(budget // (layout.bytes_per_block + extra_bytes_per_block))
    if num_blocks <= 0:
        raise RuntimeError(
            f"no GPU memory left for the KV pool (peak {peak / 2**30:.1f} GiB of {total / 2**30:.1f} GiB); "
            "lower --max-num-batched-tokens or raise --gpu-memory-utilization")
    log.info("KV pool: %d blocks (profiled peak %.2f GiB)", num_blocks, peak / 2**30)
    return num_blocks


def num_host_blocks(num_host_blocks: int | None, swap_space_gb: float, bytes_per_block: int) -> int:
    """--num-host-blocks when given, else as many blocks as --swap-space-gb holds; 0: no host pool."""
    if num_host_blocks is not None:
        return num_host_blocks
    return int(swap_space_gb * 2**30) // bytes_per_block


# ---------------------------------------------------------------------------------------------
# The pool
# ---------------------------------------------------------------------------------------------


class KVPool:
    def __init__(self, layout: KVLayout, layers: list[Attention], staging: PinnedStaging) -> None:
        """layers: the model's attention layers, in order; each gets its views of the pool."""
        self.layout = layout
        self.layers = layers
        self.staging = staging
        self.cache: torch.Tensor | None = None  # [2, L, N, block_size, H_kv, D]
        self.host_cache: torch.Tensor | None = None  # [N_host, 2, L, block_size, H_kv, D]; None: no swap
        # quantized pools: [2, L, H_kv] (fp8) or [2, L, H_kv, D] (int8) float32, stored = value / scale
        self.scales: torch.Tensor | None = None

    @property
    def num_blocks(self) -> int:
        return 0 if self.cache is None else self.cache.shape[2]

    @property
    def num_host_blocks(self) -> int:
        return 0 if self.host_cache is None else self.host_cache.shape[0]

    def allocate(self, num_blocks: int) -> None:
        # zeros, never empty: the torch backend reads stale slots under a mask, exact only if finite
        self.cache = torch.zeros(self.layout.shape(num_blocks), dtype=self.layout.dtype, device=self.layout.device)
        for i, attn in enumerate(self.layers):
            attn.k_cache = self.cache[0, i]
            attn.v_cache = self.cache[1, i]

    def set_scales(self, scales: torch.Tensor) -> None:
        """A quantized pool's scales [2, L, H_kv(, D)]; each layer gets its row, read by its kernels in place
        (a CUDA graph captures their addresses)."""
        self.scales = scales.to(device=self.layout.device, dtype=torch.float32).contiguous()
        for i, attn in enumerate(self.layers):
            attn.kv_scales = KVScales(self.scales[0, i], self.scales[1, i])

    def set_rotation(self, rotation: torch.Tensor) -> None:
        """A quantized pool's rotation of K (and q) [D, D], on the device (kernels/kv_rotation.py); every layer
        shares it."""
        for attn in self.layers:
            attn.kv_rotation = rotation

    def release(self) -> None:
        self.cache = None
        for attn in self.layers:
            attn.k_cache = attn.v_cache = torch.tensor([])

    def allocate_host(self, num_blocks: int) -> None:
        # pinned, so copies to and from the device are asynchronous DMA
        per_block = self.layout.shape(0)
        shape = (num_blocks,) + per_block[:2] + per_block[3:]
        self.host_cache = torch.empty(shape, dtype=self.layout.dtype, pin_memory=self._pinned)

    @property
    def _pinned(self) -> bool:
        return self.layout.device.type == "cuda"

    def move_blocks(self, swap_out: BlockPairs, swap_in: BlockPairs, copies: BlockPairs) -> CopyTimer | None:
        """A plan's block moves, before its forward, in this order exactly: a block swapped out may be
        the destination of a swap-in or a copy of the same plan. Returns the timer of its swaps, if any."""
        timer = CopyTimer(self.layout.device) if swap_out or swap_in else None
        self.swap_out(swap_out)
        self.swap_in(swap_in)
        if timer is not None:
            timer.stop()
        self.copy_blocks(copies)
        return timer

    def copy_blocks(self, copies: BlockPairs) -> None:
        """Copy-on-write: duplicate whole blocks, in every layer."""
        if not copies:
            return
        src, dst = _columns(copies)
        dev = self.staging.upload({"src": src, "dst": dst}, "copies")
        cache = as_bytes(self.cache)
        cache[:, :, dev["dst"]] = cache[:, :, dev["src"]]

    def swap_out(self, copies: BlockPairs) -> None:
        """Preemption by swap: KV pool block src -> host block dst, after the work already queued."""
        if not copies:
            return
        host = as_bytes(self._host("swap_out"))
        src, dst = _checked_ids(copies, self.num_blocks, self.num_host_blocks, "swap_out")
        # block-major on the device too, so each block is one contiguous copy
        gathered = as_bytes(self.cache).index_select(2, src.to(self.cache.device)).movedim(2, 0).contiguous()
        for i, block in enumerate(dst.tolist()):
            host[block].copy_(gathered[i], non_blocking=self._pinned)

    def swap_in(self, copies: BlockPairs) -> None:
        """A swapped sequence resumes: host block src -> KV pool block dst, queued before the forward."""
        if not copies:
            return
        host = as_bytes(self._host("swap_in"))
        src, dst = _checked_ids(copies, self.num_host_blocks, self.num_blocks, "swap_in")
        staged = torch.empty((len(src),) + host.shape[1:], dtype=host.dtype, device=self.cache.device)
        for i, block in enumerate(src.tolist()):
            staged[i].copy_(host[block], non_blocking=self._pinned)
        as_bytes(self.cache)[:, :, dst.to(self.cache.device)] = staged.movedim(0, 2)

    def _host(self, what: str) -> torch.Tensor:
        if self.host_cache is None:
            raise RuntimeError(f"the plan asks for {what}, but this executor has no host pool "
                               "(--swap-space-gb 0 and no --num-host-blocks)")
        return self.host_cache


def _columns(pairs: BlockPairs) -> tuple[np.ndarray, np.ndarray]:
    src = np.fromiter((s for s, _ in pairs), np.int64, count=len(pairs))
    dst = np.fromiter((d for _, d in pairs), np.int64, count=len(pairs))
    return src, dst


def _checked_ids(pairs: BlockPairs, num_src: int, num_dst: int, what: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The pairs' block ids, checked on the host: a bad id on the device would be a device assert."""
    src, dst = (torch.from_numpy(ids) for ids in _columns(pairs))
    for ids, n, end in ((src, num_src, "source"), (dst, num_dst, "destination")):
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= n):
            raise RuntimeError(f"{what}: a {end} block id is outside [0, {n}): {ids.tolist()}")
    return src, dst
