"""What block copies and prefill cost on this executor, for the scheduler's preemption cost model
(scheduler_svc/core/preemption_cost.py): measured once at start-up and sent in the handshake. Also the
timing of each plan's swaps, which the scheduler sets against its estimates.

A swap copies each KV block on its own (the host pool is block-major), so the model is per block copy:
fixed + block bytes / bandwidth. The bandwidth comes from plain copies of one block and of COPY_FIT_BLOCKS
blocks, both ways, between the device and pinned host memory (on the CPU: host to host); the fixed cost from
the pool's own swap-out and swap-in of 1 and COPY_FIT_BLOCKS blocks (free at start-up), so that it holds
what a swap really pays per block beyond its bytes (the copy's set-up, its launch, the gather around it).
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Callable

import torch

log = logging.getLogger("nanoserve.executor")

COPY_FIT_BLOCKS = 8  # the larger copy of the fit, in blocks
COPY_REPEATS = 8  # copies timed per size and direction


@dataclass(frozen=True)
class PreemptionCalibration:
    """ExecutorHandshake's kv_block_bytes, host_link_bytes_per_s, copy_fixed_seconds, prefill_tokens_per_s."""

    kv_block_bytes: int
    host_link_bytes_per_s: float = 0.0  # 0: not measured (no host pool)
    copy_fixed_seconds: float = 0.0
    prefill_tokens_per_s: float = 0.0  # 0: not measured


class CopyTimer:
    """Wall time of work queued on the device between start() and stop(), read once it has run."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        if self.cuda:
            self.begin, self.end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            self.begin.record()
        else:
            self.t0 = time.perf_counter()

    def stop(self) -> "CopyTimer":
        if self.cuda:
            self.end.record()
        else:
            self.elapsed = time.perf_counter() - self.t0
        return self

    def seconds(self) -> float:
        """Blocks until the timed work has run (on CUDA)."""
        if self.cuda:
            self.end.synchronize()
            return self.begin.elapsed_time(self.end) / 1e3
        return self.elapsed


def _time_copies(device_buf: torch.Tensor, host_buf: torch.Tensor, num_bytes: int) -> float:
    """Seconds per copy of num_bytes, averaged over both directions."""
    dev, host = device_buf[:num_bytes], host_buf[:num_bytes]
    pinned = device_buf.device.type == "cuda"
    for _ in range(2):  # warm-up
        host.copy_(dev, non_blocking=pinned)
        dev.copy_(host, non_blocking=pinned)
    timer = CopyTimer(device_buf.device)
    for _ in range(COPY_REPEATS):
        host.copy_(dev, non_blocking=pinned)
        dev.copy_(host, non_blocking=pinned)
    return timer.stop().seconds() / (2 * COPY_REPEATS)


def measure_copy_costs(pool) -> tuple[float, float]:
    """(bytes per second, fixed seconds per block copy) of swapping blocks of a kv_cache.KVPool to its host
    pool and back. Uses its first blocks and host blocks, all free at start-up (they hold zeros after)."""
    block_bytes, device = pool.layout.bytes_per_block, pool.layout.device
    n = COPY_FIT_BLOCKS
    device_buf = torch.empty(n * block_bytes, dtype=torch.uint8, device=device)
    host_buf = torch.empty(n * block_bytes, dtype=torch.uint8, pin_memory=device.type == "cuda")
    one, many = _time_copies(device_buf, host_buf, block_bytes), _time_copies(device_buf, host_buf, n * block_bytes)
    bandwidth = (n - 1) * block_bytes / (many - one) if many > one else n * block_bytes / many
    n = min(COPY_FIT_BLOCKS, pool.num_blocks, pool.num_host_blocks)
    if n < 2:
        return bandwidth, max(0.0, one - block_bytes / bandwidth)
    per_block = (_time_swaps(pool, n) - _time_swaps(pool, 1)) / (2 * (n - 1))
    pool.cache[:, :, :n].zero_()
    return bandwidth, max(0.0, per_block - block_bytes / bandwidth)


def _time_swaps(pool, n: int) -> float:
    """Seconds of swapping KV blocks [0, n) out to host blocks [0, n) and back in, averaged."""
    pairs = [(b, b) for b in range(n)]
    pool.swap_out(pairs)  # warm-up
    pool.swap_in(pairs)
    timer = CopyTimer(pool.layout.device)
    for _ in range(COPY_REPEATS):
        pool.swap_out(pairs)
        pool.swap_in(pairs)
    return timer.stop().seconds() / COPY_REPEATS


def measure_prefill_rate(prefill: Callable[[int], None], num_tokens: int, device: torch.device) -> float:
    """Tokens per second of prefill(num_tokens), a forward over one sequence: timed the second time."""
    prefill(num_tokens)  # warm-up: kernels compiled and caches allocated
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    prefill(num_tokens)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return num_tokens / max(time.perf_counter() - t0, 1e-9)


def calibrate(pool, prefill: Callable[[int], None] | None, num_prefill_tokens: int,
              rank: int = 0) -> PreemptionCalibration:
    """What the scheduler needs to choose between swap and recompute: a kv_cache.KVPool's copy costs where it
    has a host pool, the prefill rate when prefill is given (a forward is cheap on a GPU; on the CPU it is run
    only when auto mode needs it)."""
    block_bytes, device = pool.layout.bytes_per_block, pool.layout.device
    bandwidth, fixed = measure_copy_costs(pool) if pool.num_host_blocks else (0.0, 0.0)
    rate = measure_prefill_rate(prefill, num_prefill_tokens, device) if prefill is not None else 0.0
    log.info("rank %d preemption costs: KV block %.0f KiB, host link %s, prefill %s", rank, block_bytes / 1024,
             f"{bandwidth / 1e9:.2f} GB/s + {fixed * 1e6:.1f} us per copy" if bandwidth else "not measured",
             f"{rate:.0f} tok/s ({num_prefill_tokens} tokens)" if rate else "not measured")
    return PreemptionCalibration(block_bytes, bandwidth, fixed, rate)
