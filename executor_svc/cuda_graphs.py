"""CUDA graphs for decode steps: one graph per batch-size bucket, replayed over static buffers.

An eager decode step of a 28-layer model spends milliseconds on kernel launches alone; a replay
launches the whole forward at once. Graphs are captured largest bucket first so the smaller ones
reuse its memory pool. A step whose batch is not a bucket runs in the next bucket up, the padding
rows writing nowhere (slot -1) and reading one real block.

A step's per-row inputs sit in one static buffer, packed per bucket, so the host fills them in one
pinned array and one copy lands them; the block tables follow in the same copy and take one more
device copy into their static table. Inputs whose token the previous step sampled are gathered
inside the graph from the previous step's ids, which stay on the device.

On a single rank the graph also computes the logits and samples every row with the fused Gumbel-max
kernel, from static temperature and noise-seed rows. A step whose rows all sample plainly
(temperature only) then launches nothing else, or, when some rows have structured-output token masks
(known only after the replay was launched, for late ones), one more draw over the same logits with the
masks; any other step samples eagerly from the graph's logits, and the in-graph tokens go unused.
"""
from __future__ import annotations

import logging
import time

import numpy as np
import torch

from kernels.attention.base import AttentionMetadata

log = logging.getLogger("nanoserve.executor")

# Per-row graph inputs in their packed order (8-byte fields first keeps every field aligned), and
# what a padding row holds. "tokens" are the ids the host knows; "gather" picks each row's input id
# from [previous step's ids | tokens], so a row the previous step sampled never waits for the host.
ROW_FIELDS: tuple[tuple[str, np.dtype], ...] = (
    ("tokens", np.dtype(np.int64)), ("gather", np.dtype(np.int64)), ("positions", np.dtype(np.int64)),
    ("slot_mapping", np.dtype(np.int64)), ("noise_seeds", np.dtype(np.int64)), ("seqlens_k", np.dtype(np.int32)),
    ("decode_order", np.dtype(np.int32)), ("temperature", np.dtype(np.float32)),
)
ROW_BYTES = sum(dtype.itemsize for _, dtype in ROW_FIELDS)
PADDING = {"tokens": 0, "positions": 0, "slot_mapping": -1, "noise_seeds": 0, "seqlens_k": 1, "temperature": 1.0}


def batch_size_buckets(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, 16, then every 16 up to max_num_seqs (and max_num_seqs itself)."""
    sizes = [b for b in (1, 2, 4, 8) if b < max_num_seqs] + list(range(16, max_num_seqs + 1, 16))
    if not sizes or sizes[-1] != max_num_seqs:
        sizes.append(max_num_seqs)
    return sorted(set(sizes))


def row_offsets(bs: int) -> dict[str, int]:
    """Byte offset of each row field inside a bucket's packed rows."""
    offsets, at = {}, 0
    for name, dtype in ROW_FIELDS:
        offsets[name] = at
        at += bs * dtype.itemsize
    return offsets


def stage_rows(raw: np.ndarray, bs: int, b: int, rows: dict[str, np.ndarray], capacity: int) -> int:
    """Write bucket bs's packed rows into the byte array raw: the step's b rows, then padding.
    Returns the bytes written. A field missing from rows keeps its padding value on every row."""
    for (name, dtype), off in zip(ROW_FIELDS, row_offsets(bs).values()):
        col = raw[off: off + bs * dtype.itemsize].view(dtype)
        if name == "gather":  # a padding row reads its own (zero) token
            col[:b] = rows[name]
            col[b:] = np.arange(capacity + b, capacity + bs)
        elif name == "decode_order":  # and runs in place
            col[:b] = rows[name]
            col[b:] = np.arange(b, bs)
        else:
            col[:b] = rows.get(name, PADDING[name])
            col[b:] = PADDING[name]
    return bs * ROW_BYTES


class DecodeGraphs:
    def __init__(self, model, max_num_seqs: int, max_model_len: int, block_size: int, hidden_size: int,
                 dtype: torch.dtype, device: torch.device, vocab_size: int | None = None,
                 host_buffers: int = 2) -> None:
        """vocab_size: capture the logits and the sampling too (one rank holding the whole vocab). host_buffers:
        pinned staging buffers used in turn (more than two where several loads go out before the host waits)."""
        self.model = model
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.max_blocks = -(-max_model_len // block_size)
        self.buckets = batch_size_buckets(max_num_seqs)
        n = self.buckets[-1]
        self.capacity = n
        # [previous ids: n int64 | a bucket's packed rows | landing for its block tables]
        self.rows_at = n * 8
        self.static = torch.zeros(self.rows_at + n * ROW_BYTES + n * self.max_blocks * 4, dtype=torch.uint8,
                                  device=device)
        self.prev_tokens = self.static[: self.rows_at].view(torch.int64)  # the last sampled step's ids
        self.block_tables = torch.zeros(n, self.max_blocks, dtype=torch.int32, device=device)
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.cu_seqlens_q = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.hidden = torch.zeros(n, hidden_size, dtype=dtype, device=device)
        self._views = {bs: self._bucket_views(bs) for bs in self.buckets}
        self._host = [torch.zeros(self.static.numel() - self.rows_at, dtype=torch.uint8).pin_memory()
                      for _ in range(host_buffers)]  # double-buffered: the previous step's copy may be in flight
        self._parity = 0
        self.samples = vocab_size is not None
        if self.samples:
            self.logits = torch.zeros(n, vocab_size, dtype=dtype, device=device)
            self.sampled = self.prev_tokens  # sampled ids land where the next step gathers them
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.pool = None

    def _bucket_views(self, bs: int) -> dict[str, torch.Tensor]:
        views = {}
        for (name, dtype), off in zip(ROW_FIELDS, row_offsets(bs).values()):
            at = self.rows_at + off
            views[name] = self.static[at: at + bs * dtype.itemsize].view(torch.from_numpy(np.empty(0, dtype)).dtype)
        views["token_pool"] = self.static[: self.rows_at + bs * 8].view(torch.int64)  # [prev ids | tokens]
        return views

    def _meta(self, bs: int) -> AttentionMetadata:
        v = self._views[bs]
        return AttentionMetadata(
            slot_mapping=v["slot_mapping"], cu_seqlens_q=self.cu_seqlens_q[: bs + 1], seqlens_k=v["seqlens_k"],
            block_tables=self.block_tables[:bs], max_seqlen_q=1, max_seqlen_k=self.max_model_len,
            block_size=self.block_size, decode_order=v["decode_order"])

    def _forward(self, bs: int) -> None:
        v = self._views[bs]
        torch.index_select(v["token_pool"], 0, v["gather"], out=self.input_ids[:bs])
        self.hidden[:bs] = self.model(self.input_ids[:bs], v["positions"], self._meta(bs))
        if self.samples:
            from kernels.sampling import sample_tokens

            self.model.compute_logits(self.hidden[:bs], out=self.logits[:bs])
            sample_tokens(self.logits[:bs], v["temperature"], v["noise_seeds"], out=self.sampled[:bs])

    @torch.inference_mode()
    def capture(self) -> None:
        t0 = time.perf_counter()
        for bs in reversed(self.buckets):
            self.load(bs, {name: np.zeros(0, dtype) for name, dtype in ROW_FIELDS}, np.zeros((0, 1), np.int32))
            torch.cuda.synchronize()
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

    def load(self, bs: int, rows: dict[str, np.ndarray], block_tables: np.ndarray) -> None:
        """Stage a decode step of len(rows['positions']) rows into bucket bs's static inputs.

        rows: ROW_FIELDS by name for the step's rows; "gather" indexes [previous ids (capacity) |
        tokens], so a row whose id the host knows gathers capacity + its row. Rows absent from
        `rows` (temperature and noise seeds when the graph's tokens go unused) keep the padding."""
        b = len(rows["positions"])
        host = self._host[self._parity]
        self._parity = (self._parity + 1) % len(self._host)
        raw = host.numpy()
        nbytes = stage_rows(raw, bs, b, rows, self.capacity)
        raw[nbytes: nbytes + block_tables.nbytes] = block_tables.reshape(-1).view(np.uint8)
        total = nbytes + block_tables.nbytes
        landed = self.static[self.rows_at: self.rows_at + total]
        landed.copy_(host[:total], non_blocking=True)
        nb = block_tables.shape[1]
        self.block_tables[:b, :nb].copy_(landed[nbytes:].view(torch.int32).view(b, nb))

    def run(self, bs: int, b: int) -> torch.Tensor:
        """Replay bucket bs over the loaded inputs; returns the hidden states [b, hidden].

        When the graph samples, self.logits[:b] and self.sampled[:b] hold the step's logits and ids
        until the next replay."""
        self.graphs[bs].replay()
        return self.hidden[:b]

    def redraw_masked(self, bs: int, b: int, mask_rows: torch.Tensor, mask_words: torch.Tensor) -> None:
        """After bucket bs's replay: draw its b rows again from the same logits, temperatures and noise seeds,
        with token masks (mask_rows int32 [b] into mask_words, -1 for a free row, which draws what it drew),
        into self.sampled, where the next step gathers them."""
        from kernels.sampling import sample_tokens

        v = self._views[bs]
        sample_tokens(self.logits[:b], v["temperature"][:b], v["noise_seeds"][:b], out=self.sampled[:b],
                      mask_rows=mask_rows, mask_words=mask_words)

    def step_inputs(self, bs: int, b: int) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """Views of a loaded step's inputs: input ids (valid after the replay), positions, metadata."""
        meta = self._meta(bs)
        return self.input_ids[:b], self._views[bs]["positions"][:b], meta
