"""The model runner: owns the weights and the paged KV pool, turns a step's chunks into tensors,
runs the forward and samples (rank 0)."""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import numpy as np
import torch

from executor_svc.model_loader import ModelFacts, load_model
from executor_svc.sampler import Sampler, SamplingBatch
from executor_svc.seq_mirror import ScheduledChunk
from kernels.attention_backend import AttentionMetadata, get_backend
from protos import engine_pb2
from scheduler_svc.config import EngineConfig

log = logging.getLogger("nanoserve.executor")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str, rank: int) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError("--device cuda was asked for, but torch sees no CUDA device")
        return torch.device("cuda", rank % torch.cuda.device_count())
    return torch.device("cpu")


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return DTYPES[name]


@dataclass
class StepInputs:
    input_ids: torch.Tensor  # int64 [T]
    positions: torch.Tensor  # int64 [T]
    meta: AttentionMetadata
    logits_indices: torch.Tensor  # int64 [S]: the last token of each chunk that samples
    sampling_chunks: list[ScheduledChunk]  # aligned with logits_indices


def compute_slot_mapping(block_table: np.ndarray, start: int, end: int, block_size: int) -> np.ndarray:
    """The KV pool slot of every token position in [start, end): block_id * block_size + offset."""
    positions = np.arange(start, end)
    return block_table[positions // block_size].astype(np.int64) * block_size + positions % block_size


class ModelRunner:
    def __init__(self, config: EngineConfig, rank: int = 0, world_size: int = 1) -> None:
        self.config = config
        self.rank = rank
        self.world_size = world_size
        self.device = resolve_device(config.device, rank)
        self.dtype = resolve_dtype(config.dtype, self.device)
        self.block_size = config.block_size
        torch.manual_seed(config.seed)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        self.backend = get_backend(config.attention_backend, self.device)
        self.model, self.facts = load_model(config.model, self.dtype, self.device, self.backend)
        self.sampler = Sampler()
        self.num_blocks = self._size_kv_pool()
        self._allocate_kv_pool(self.num_blocks)

    # ------------------------------------------------------------------ KV pool

    @property
    def num_kv_heads_local(self) -> int:
        return max(1, self.facts.num_kv_heads // self.world_size)

    def _bytes_per_block(self) -> int:
        f = self.facts
        elem = torch.tensor([], dtype=self.dtype).element_size()
        return 2 * f.num_layers * self.block_size * self.num_kv_heads_local * f.head_dim * elem

    def _size_kv_pool(self) -> int:
        if self.config.num_gpu_blocks is not None:
            return self.config.num_gpu_blocks
        if self.device.type == "cpu":
            return max(1, int(self.config.cpu_kv_cache_gb * 2**30) // self._bytes_per_block())
        return self._profile_gpu_blocks()

    def _profile_gpu_blocks(self) -> int:
        """Run one forward at max_num_batched_tokens, then give the KV pool what memory is left."""
        cfg = self.config
        num_tokens = cfg.max_num_batched_tokens
        num_seqs = max(1, min(cfg.max_num_seqs, num_tokens))
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        blocks_needed = num_seqs * (-(-(num_tokens // num_seqs + 1) // self.block_size))
        self._allocate_kv_pool(blocks_needed)
        per_seq = num_tokens // num_seqs
        lengths = [per_seq] * num_seqs
        lengths[-1] += num_tokens - per_seq * num_seqs
        ids = torch.randint(0, self.facts.vocab_size, (num_tokens,), device=self.device)
        chunks_meta = self._profile_meta(lengths)
        hidden = self.model(ids, chunks_meta[0], chunks_meta[1])
        self.model.compute_logits(hidden[chunks_meta[2]])
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device)
        self.kv_cache = None
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(self.device)
        used_by_others = total - free - torch.cuda.memory_allocated(self.device)
        budget = total * cfg.gpu_memory_utilization - used_by_others - peak
        num_blocks = int(budget // self._bytes_per_block())
        if num_blocks <= 0:
            raise RuntimeError(
                f"no GPU memory left for the KV pool (peak {peak / 2**30:.1f} GiB of {total / 2**30:.1f} GiB); "
                "lower --max-num-batched-tokens or raise --gpu-memory-utilization")
        log.info("KV pool: %d blocks (profiled peak %.2f GiB)", num_blocks, peak / 2**30)
        return num_blocks

    def _profile_meta(self, lengths: list[int]):
        positions, slots, tables = [], [], []
        next_block = 0
        for n in lengths:
            nb = -(-n // self.block_size)
            table = np.arange(next_block, next_block + nb, dtype=np.int32)
            next_block += nb
            positions.append(np.arange(n))
            slots.append(compute_slot_mapping(table, 0, n, self.block_size))
            tables.append(table)
        meta = self._metadata(lengths, lengths, tables, np.concatenate(slots))
        last = np.cumsum(lengths) - 1
        return (torch.from_numpy(np.concatenate(positions)).to(self.device), meta,
                torch.from_numpy(last).to(self.device))

    def _allocate_kv_pool(self, num_blocks: int) -> None:
        f = self.facts
        shape = (2, f.num_layers, num_blocks, self.block_size, self.num_kv_heads_local, f.head_dim)
        self.kv_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
        for i, attn in enumerate(self.model.attention_layers()):
            attn.k_cache = self.kv_cache[0, i]
            attn.v_cache = self.kv_cache[1, i]

    def copy_blocks(self, copies) -> None:
        """Copy-on-write: duplicate whole blocks, in every layer, before the forward."""
        if not copies:
            return
        src = torch.tensor([c.src_block_id for c in copies], device=self.device)
        dst = torch.tensor([c.dst_block_id for c in copies], device=self.device)
        self.kv_cache[:, :, dst] = self.kv_cache[:, :, src]

    # ------------------------------------------------------------------ inputs

    def _metadata(self, q_lens, k_lens, tables, slot_mapping: np.ndarray) -> AttentionMetadata:
        max_blocks = max(len(t) for t in tables)
        block_tables = np.zeros((len(tables), max_blocks), dtype=np.int32)
        for i, t in enumerate(tables):
            block_tables[i, : len(t)] = t
        cu_q = np.zeros(len(q_lens) + 1, dtype=np.int32)
        np.cumsum(q_lens, out=cu_q[1:])
        to_dev = lambda a: torch.from_numpy(a).to(self.device, non_blocking=True)  # noqa: E731
        return AttentionMetadata(
            slot_mapping=to_dev(slot_mapping.astype(np.int64)),
            cu_seqlens_q=to_dev(cu_q),
            seqlens_k=to_dev(np.asarray(k_lens, dtype=np.int32)),
            block_tables=to_dev(block_tables),
            max_seqlen_q=int(max(q_lens)),
            max_seqlen_k=int(max(k_lens)),
            block_size=self.block_size,
        )

    def prepare_inputs(self, chunks: list[ScheduledChunk]) -> StepInputs:
        bs = self.block_size
        ids, positions, slots, tables, q_lens, k_lens, logits_idx, sampling = [], [], [], [], [], [], [], []
        offset = 0
        for c in chunks:
            seq = c.seq
            num_blocks = -(-c.end // bs)
            if len(seq.block_table) < num_blocks:
                raise RuntimeError(f"seq {seq.seq_id}: {len(seq.block_table)} blocks cannot hold {c.end} tokens")
            table = np.asarray(seq.block_table[:num_blocks], dtype=np.int32)
            ids.append(np.asarray(seq.token_ids[c.start:c.end], dtype=np.int64))
            positions.append(np.arange(c.start, c.end, dtype=np.int64))
            slots.append(compute_slot_mapping(table, c.start, c.end, bs))
            tables.append(table)
            q_lens.append(c.end - c.start)
            k_lens.append(c.end)
            offset += c.end - c.start
            if c.samples:
                logits_idx.append(offset - 1)
                sampling.append(c)
        meta = self._metadata(q_lens, k_lens, tables, np.concatenate(slots))
        to_dev = lambda a: torch.from_numpy(a).to(self.device, non_blocking=True)  # noqa: E731
        return StepInputs(
            input_ids=to_dev(np.concatenate(ids)),
            positions=to_dev(np.concatenate(positions)),
            meta=meta,
            logits_indices=to_dev(np.asarray(logits_idx, dtype=np.int64)),
            sampling_chunks=sampling,
        )

    # ------------------------------------------------------------------ step

    @torch.inference_mode()
    def execute(self, chunks: list[ScheduledChunk]) -> list[engine_pb2.SampledToken]:
        """Run one step. Every rank runs the forward; rank 0 samples and returns the tokens."""
        if not chunks:
            return []
        inputs = self.prepare_inputs(chunks)
        hidden = self.model(inputs.input_ids, inputs.positions, inputs.meta)
        if not inputs.sampling_chunks:
            return []
        logits = self.model.compute_logits(hidden[inputs.logits_indices])
        if self.rank != 0:
            return []
        return self._sample(logits, inputs.sampling_chunks)

    def _sample(self, logits: torch.Tensor, chunks: list[ScheduledChunk]) -> list[engine_pb2.SampledToken]:
        seqs = [c.seq for c in chunks]
        batch = SamplingBatch.build(
            [s.sampling for s in seqs],
            [s.token_ids[: s.num_prompt_tokens] for s in seqs],
            [s.token_ids[s.num_prompt_tokens:] for s in seqs],
            self.facts.vocab_size,
            self.device,
        )
        out = self.sampler(logits.float(), batch)
        token_ids = out.token_ids.tolist()
        want = [s.sampling.logprobs for s in seqs]
        lp = None
        if any(want) and out.top_token_ids is not None:
            lp = (out.sampled_logprobs.tolist(), out.sampled_ranks.tolist(),
                  out.top_token_ids.tolist(), out.top_logprobs.tolist())
        results = []
        for i, seq in enumerate(seqs):
            sampled = engine_pb2.SampledToken(seq_id=seq.seq_id, token_id=token_ids[i])
            if lp is not None and want[i] > 0:
                n = want[i]
                sampled.logprobs.CopyFrom(engine_pb2.TokenLogprobs(
                    sampled_logprob=lp[0][i], sampled_rank=lp[1][i],
                    top_token_ids=lp[2][i][:n], top_logprobs=lp[3][i][:n]))
            results.append(sampled)
        return results

    def handshake(self) -> engine_pb2.ExecutorHandshake:
        f: ModelFacts = self.facts
        return engine_pb2.ExecutorHandshake(
            rank=self.rank, world_size=self.world_size, num_blocks=self.num_blocks,
            block_size=self.block_size, model_name=f.model_name, architecture=f.architecture,
            vocab_size=f.vocab_size, max_position_embeddings=f.max_position_embeddings,
            eos_token_ids=f.eos_token_ids, dtype=str(self.dtype).removeprefix("torch."),
            device=str(self.device), attention_backend=self.backend.name, pid=os.getpid(),
        )

