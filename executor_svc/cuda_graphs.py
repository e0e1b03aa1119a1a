"""CUDA graphs for decode steps: one graph per batch-size bucket, replayed over static buffers.

An eager decode step of a 28-layer model spends milliseconds on kernel launches alone; a replay
launches the whole forward at once. Graphs are captured largest bucket first so the smaller ones
reuse its memory pool. A step whose batch is not a bucket runs in the next bucket up, the padding
rows writing nowhere (slot -1) and reading one real block.

On a single rank the graph also computes the logits and samples every row with the fused Gumbel-max
kernel, from static temperature and noise-seed buffers. A step whose rows all sample plainly
(temperature only) then launches nothing else; any other step samples eagerly from the graph's
logits, and the in-graph tokens go unused.
"""
from __future__ import annotations

import logging
import time

import torch

from kernels.attention_backend import AttentionMetadata

log = logging.getLogger("nanoserve.executor")


def batch_size_buckets(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, 16, then every 16 up to max_num_seqs (and max_num_seqs itself)."""
    sizes = [b for b in (1, 2, 4, 8) if b < max_num_seqs] + list(range(16, max_num_seqs + 1, 16))
    if not sizes or sizes[-1] != max_num_seqs:
        sizes.append(max_num_seqs)
    return sorted(set(sizes))


class DecodeGraphs:
    def __init__(self, model, max_num_seqs: int, max_model_len: int, block_size: int, hidden_size: int,
                 dtype: torch.dtype, device: torch.device, vocab_size: int | None = None) -> None:
        """vocab_size: capture the logits and the sampling too (one rank holding the whole vocab)."""
        self.model = model
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.max_blocks = -(-max_model_len // block_size)
        self.buckets = batch_size_buckets(max_num_seqs)
        n = self.buckets[-1]
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.int64, device=device)
        self.seqlens_k = torch.ones(n, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(n, self.max_blocks, dtype=torch.int32, device=device)
        self.cu_seqlens_q = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.rows = torch.arange(n, dtype=torch.int32, device=device)
        self.decode_order = self.rows.clone()
        self.hidden = torch.zeros(n, hidden_size, dtype=dtype, device=device)
        self.samples = vocab_size is not None
        if self.samples:
            self.temperature = torch.zeros(n, dtype=torch.float32, device=device)
            self.noise_seeds = torch.zeros(n, dtype=torch.int64, device=device)
            self.logits = torch.zeros(n, vocab_size, dtype=dtype, device=device)
            self.sampled = torch.zeros(n, dtype=torch.int64, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.pool = None

    def _meta(self, bs: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:bs], cu_seqlens_q=self.cu_seqlens_q[: bs + 1],
            seqlens_k=self.seqlens_k[:bs], block_tables=self.block_tables[:bs], max_seqlen_q=1,
            max_seqlen_k=self.max_model_len, block_size=self.block_size, decode_order=self.decode_order[:bs])

    def _forward(self, bs: int) -> None:
        self.hidden[:bs] = self.model(self.input_ids[:bs], self.positions[:bs], self._meta(bs))
        if self.samples:
            from kernels.sampling import sample_tokens

            self.model.compute_logits(self.hidden[:bs], out=self.logits[:bs])
            sample_tokens(self.logits[:bs], self.temperature[:bs], self.noise_seeds[:bs], out=self.sampled[:bs])

    @torch.inference_mode()
    def capture(self) -> None:
        t0 = time.perf_counter()
        for bs in reversed(self.buckets):
            self._forward(bs)  # warm up outside the graph: Triton compiles and autotunes here
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                self._forward(bs)
            if self.pool is None:
                self.pool = graph.pool()
            self.graphs[bs] = graph
        torch.cuda.synchronize()
        log.info("captured %d decode CUDA graphs (batch %d..%d%s) in %.1fs", len(self.graphs), self.buckets[0],
                 self.buckets[-1], ", with logits and sampling" if self.samples else "", time.perf_counter() - t0)

    def bucket(self, num_seqs: int, max_seqlen_k: int) -> int | None:
        """The graph batch size for a decode step, or None when it must run eagerly."""
        if num_seqs > self.buckets[-1] or max_seqlen_k > self.max_model_len:
            return None
        for bs in self.buckets:
            if bs >= num_seqs:
                return bs
        return None

    def run(self, bs: int, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
            temperature: torch.Tensor | None = None, noise_seeds: torch.Tensor | None = None) -> torch.Tensor:
        """Copy a decode step into the static buffers of bucket bs, replay, return [B, hidden].

        With temperature and noise seeds, self.logits[:B] and self.sampled[:B] hold the step's logits
        and tokens until the next replay."""
        b = input_ids.shape[0]
        nb = meta.block_tables.shape[1]
        self.input_ids[:b].copy_(input_ids, non_blocking=True)
        self.positions[:b].copy_(positions, non_blocking=True)
        self.slot_mapping[:b].copy_(meta.slot_mapping, non_blocking=True)
        self.slot_mapping[b:bs].fill_(-1)
        self.seqlens_k[:b].copy_(meta.seqlens_k, non_blocking=True)
        self.seqlens_k[b:bs].fill_(1)
        self.block_tables[:b, :nb].copy_(meta.block_tables, non_blocking=True)
        # a permutation of 0..bs-1: the step's order for its rows, then the padding rows in place
        self.decode_order[:b].copy_(meta.decode_order if meta.decode_order is not None else self.rows[:b])
        self.decode_order[b:bs].copy_(self.rows[b:bs])
        if temperature is not None:
            self.temperature[:b].copy_(temperature, non_blocking=True)
            self.noise_seeds[:b].copy_(noise_seeds, non_blocking=True)
        self.graphs[bs].replay()
        return self.hidden[:b]
