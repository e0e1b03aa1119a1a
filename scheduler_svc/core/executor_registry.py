"""The executors the scheduler serves with: their handshakes, their liveness, and the engine facts
(EngineReady) once every rank has joined."""
from __future__ import annotations

import logging
import time

from protos import engine_pb2

log = logging.getLogger("nanoserve.scheduler")


class EngineLostError(Exception):
    """An executor died or stopped answering."""


class ExecutorReplaced(EngineLostError):
    """A rank shook hands again from a new process: the old one is gone, with its KV pool."""

    def __init__(self, handshake: engine_pb2.ExecutorHandshake) -> None:
        super().__init__(f"executor rank {handshake.rank} restarted (now pid {handshake.pid})")
        self.handshake = handshake


class ExecutorRegistry:
    def __init__(self, world_size: int, timeout_s: float) -> None:
        self.world_size = world_size
        self.timeout_s = timeout_s
        self.handshakes: dict[int, engine_pb2.ExecutorHandshake] = {}
        self.last_seen: dict[int, float] = {}  # rank -> monotonic time of its last heartbeat or handshake

    @property
    def complete(self) -> bool:
        return len(self.handshakes) == self.world_size

    def heard_from(self, rank: int) -> None:
        self.last_seen[rank] = time.monotonic()

    def join(self, hs: engine_pb2.ExecutorHandshake, serving: bool) -> None:
        """Record a checked handshake. While serving, a rank's new process means its KV pool is gone."""
        log.info("executor rank %d/%d joined (pid %d): %d blocks of %d (%s) on %s, %s, backend %s", hs.rank,
                 hs.world_size, hs.pid, hs.num_blocks, hs.block_size, hs.kv_cache_dtype, hs.device, hs.dtype,
                 hs.attention_backend)
        old = self.handshakes.get(hs.rank)
        if old is not None and old.pid != hs.pid and serving:
            raise ExecutorReplaced(hs)
        self.handshakes[hs.rank] = hs
        self.heard_from(hs.rank)

    def check_liveness(self) -> None:
        now = time.monotonic()
        for rank in self.handshakes:
            if now - self.last_seen.get(rank, now) > self.timeout_s:
                raise EngineLostError(f"executor rank {rank} sent no heartbeat for {self.timeout_s:.0f}s")

    def engine_facts(self, max_model_len: int | None, max_num_seqs: int) -> engine_pb2.EngineReady:
        """What the engine serves with: rank 0's model facts, the smallest KV pool over the ranks, the scheduler's
        limits."""
        rank0 = self.handshakes[0]
        facts = engine_pb2.ExecutorHandshake()
        facts.CopyFrom(rank0)
        facts.num_blocks = min(h.num_blocks for h in self.handshakes.values())
        facts.num_host_blocks = min(h.num_host_blocks for h in self.handshakes.values())
        # the preemption cost model's constants: the slowest rank's (ranks swap and compute together)
        facts.kv_block_bytes = max(h.kv_block_bytes for h in self.handshakes.values())
        facts.host_link_bytes_per_s = min(h.host_link_bytes_per_s for h in self.handshakes.values())
        facts.copy_fixed_seconds = max(h.copy_fixed_seconds for h in self.handshakes.values())
        facts.prefill_tokens_per_s = min(h.prefill_tokens_per_s for h in self.handshakes.values())
        limit = rank0.max_position_embeddings
        return engine_pb2.EngineReady(model=facts, max_model_len=min(max_model_len or limit, limit),
                                      max_num_seqs=max_num_seqs)

    def forget(self) -> list[int]:
        """Drop every rank (the engine is lost); returns the ranks that had joined."""
        ranks = list(self.handshakes)
        self.handshakes.clear()
        self.last_seen.clear()
        return ranks
