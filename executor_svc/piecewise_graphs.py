"""CUDA graphs for steps with a prefill chunk: the forward between two attention calls is a graph, attention
runs eagerly between the replays ("piecewise" graphs).

A step that carries a prefill chunk cannot replay a decode graph: its attention is varlen, shaped by the step's
sequences. Run eagerly, a 30-layer model launches about 400 kernels from Python, 16-18 ms a step for SmolLM2-135M
on the H200 against about 1 ms of GPU work (bench/step_profile.py --prefill). Attention is the only op whose launch
depends on the step's sequences; every other op is per token, shaped by the token count alone. So the forward of
a bucket of T tokens is captured as L + 1 graphs, cut where each layer attends:

    graph 0:  embedding, layer 0's norm, qkv projection, q/k norm, RoPE, the K/V store, q into a static buffer
    eager:    layer 0's attention over the step's own metadata, into a static output buffer
    graph 1:  layer 0's o_proj and MLP, layer 1 up to its store
    ...
    graph L:  the last layer's o_proj and MLP, the final norm, the hidden states into a static buffer

A step of T tokens replays the smallest bucket of at least T. Its padding rows compute on stale ids and positions,
store no K/V (slot -1) and are never read: every op inside a graph works row by row, and attention reads only the
first T rows of q. Nothing a graph makes outlives its bucket's capture (q, the attention output and the hidden
states go through static buffers made outside the pool), so every bucket and segment shares one memory pool, as
large as the largest bucket's forward, and the buckets are captured largest first. Replays run in capture order,
which is what lets a segment reuse memory that an earlier one of the same bucket freed.
"""
from __future__ import annotations

import logging
import time

import torch

from kernels.attention.base import AttentionMetadata

log = logging.getLogger("nanoserve.executor")


def token_buckets(max_tokens: int) -> list[int]:
    """Powers of two from 16 to 256, then every 256, up to max_tokens (and max_tokens itself)."""
    if max_tokens <= 0:
        return []
    sizes = [b for b in (16, 32, 64, 128, 256) if b < max_tokens] + list(range(512, max_tokens + 1, 256))
    if not sizes or sizes[-1] != max_tokens:
        sizes.append(max_tokens)
    return sorted(set(sizes))


def bucket_for(buckets: list[int], num_tokens: int) -> int | None:
    """The smallest bucket of at least num_tokens, or None (the step runs eagerly)."""
    return next((b for b in buckets if b >= num_tokens), None)


class PiecewiseGraphs:
    def __init__(self, model, max_tokens: int, block_size: int, hidden_size: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.model = model
        self.layers = model.attention_layers()
        self.buckets = token_buckets(max_tokens)
        self.block_size = block_size
        n = self.buckets[-1]
        width = self.layers[0].num_heads * self.layers[0].head_dim  # this rank's heads
        if any(a.num_heads * a.head_dim != width for a in self.layers):
            raise ValueError("piecewise CUDA graphs need every layer to attend over the same number of heads")
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.int64, device=device)
        self.q = torch.zeros(n, width, dtype=dtype, device=device)  # each layer's q, read by its eager attention
        self.attn_out = torch.zeros(n, width, dtype=dtype, device=device)  # its output, read by the next graph
        self.hidden = torch.zeros(n, hidden_size, dtype=dtype, device=device)
        self.segments: dict[int, list[torch.cuda.CUDAGraph]] = {}
        self.pool = None
        self._capturing: torch.cuda.CUDAGraph | None = None
        self._bucket = 0

    def _capture_meta(self, tb: int) -> AttentionMetadata:
        """What the graphed part of a layer reads of the metadata: the slots (static); the rest is unused there."""
        device = self.input_ids.device
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:tb], cu_seqlens_q=torch.tensor([0, tb], dtype=torch.int32, device=device),
            seqlens_k=torch.tensor([tb], dtype=torch.int32, device=device),
            block_tables=torch.zeros(1, 1, dtype=torch.int32, device=device), max_seqlen_q=tb, max_seqlen_k=tb,
            block_size=self.block_size)

    def _cut(self, layer, q: torch.Tensor) -> torch.Tensor:
        """Attention.forward's place for attention while a bucket is warmed up or captured: q goes to the static
        buffer, the segment ends and the next begins; the next segment reads the static output buffer."""
        tb = self._bucket
        self.q[:tb].copy_(q.reshape(tb, -1))
        if self._capturing is not None:
            self._end_segment(tb)
            self._capturing = torch.cuda.CUDAGraph()
            self._capturing.capture_begin(pool=self.pool)
        return self.attn_out[:tb]

    def _end_segment(self, tb: int) -> None:
        self._capturing.capture_end()
        self.segments[tb].append(self._capturing)
        if self.pool is None:  # the first graph's pool is every later one's
            self.pool = self._capturing.pool()

    def _forward(self, tb: int, meta: AttentionMetadata) -> None:
        hidden = self.model(self.input_ids[:tb], self.positions[:tb], meta)
        self.hidden[:tb].copy_(hidden)

    @torch.inference_mode()
    def capture(self) -> None:
        t0 = time.perf_counter()
        stream = torch.cuda.Stream()
        torch.cuda.synchronize()
        for layer in self.layers:
            layer.cut = self._cut
        try:
            with torch.cuda.stream(stream):
                for tb in reversed(self.buckets):
                    self._bucket = tb
                    meta = self._capture_meta(tb)  # before capturing: its tensors are copied from the host
                    self._forward(tb, meta)  # warm up outside the graphs: Triton compiles and autotunes here
                    torch.cuda.synchronize()
                    self.segments[tb] = []
                    self._capturing = torch.cuda.CUDAGraph()
                    self._capturing.capture_begin(pool=self.pool)
                    self._forward(tb, meta)
                    self._end_segment(tb)
                    self._capturing = None
        except Exception:
            if self._capturing is not None:  # end the broken capture, so that the device stays usable
                try:
                    self._capturing.capture_end()
                except RuntimeError:
                    pass
            raise
        finally:
            for layer in self.layers:
                layer.cut = None
            self._capturing = None
        torch.cuda.synchronize()
        log.info("captured piecewise CUDA graphs for steps with a prefill chunk: %d token buckets (%d..%d), %d "
                 "graphs each, in %.1fs", len(self.buckets), self.buckets[0], self.buckets[-1], len(self.layers) + 1,
                 time.perf_counter() - t0)

    def bucket(self, num_tokens: int) -> int | None:
        """The bucket for a step of num_tokens tokens, or None when it must run eagerly."""
        return bucket_for(self.buckets, num_tokens)

    def run(self, tb: int, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """The step's hidden states [T, hidden]: bucket tb's segments replayed, each layer's attention eagerly over
        meta between them. Valid until the next run."""
        t = input_ids.shape[0]
        self.input_ids[:t].copy_(input_ids)
        self.positions[:t].copy_(positions)
        self.slot_mapping[:t].copy_(meta.slot_mapping)
        self.slot_mapping[t:tb].fill_(-1)  # padding rows store nothing
        segments = self.segments[tb]
        q = self.q[:t].view(t, self.layers[0].num_heads, self.layers[0].head_dim)
        for segment, layer in zip(segments, self.layers):
            segment.replay()
            self.attn_out[:t].copy_(layer.attend(q, meta))
        segments[-1].replay()
        return self.hidden[:t]


def capture_or_fall_back(graphs: PiecewiseGraphs, rank: int, world_size: int) -> PiecewiseGraphs | None:
    """The captured graphs; None, with a warning, where capture failed on a single GPU (a model with a layer that
    cannot be captured still serves, those steps eagerly). Under tensor parallelism a failure ends start-up instead:
    each bucket's warm-up forward all-reduces across the ranks, so a rank that stopped capturing alone would leave
    the others waiting in the next bucket's warm-up."""
    try:
        graphs.capture()
    except Exception as e:
        if world_size > 1:
            raise RuntimeError(f"rank {rank}: piecewise CUDA graphs failed to capture ({type(e).__name__}: {e}); under "
                               "tensor parallelism every rank must capture them or none: --cuda-graph-max-tokens 0 "
                               "turns them off") from e
        log.warning("piecewise CUDA graphs were not captured (%s: %s): steps with a prefill chunk run eagerly",
                    type(e).__name__, e)
        return None
    return graphs
