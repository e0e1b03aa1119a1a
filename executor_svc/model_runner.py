"""The model runner: owns the weights and the paged KV pool, turns a step's chunks into tensors,
runs the forward and samples (rank 0)."""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import numpy as np
import torch

from executor_svc.cuda_graphs import DecodeGraphs
from executor_svc.host_kv_pool import HostKVPool, num_host_blocks
from executor_svc.pinned_staging import PinnedStaging
from executor_svc.model_loader import ModelFacts, load_model
from executor_svc.sampler import Sampler, build_for_sequences, plain_sampling_columns
from executor_svc.seq_mirror import MirroredSeq, ScheduledChunk
from kernels.attention.base import AttentionMetadata, get_backend
from protos import engine_pb2
from scheduler_svc.common.config import EngineConfig

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
    logits_indices: torch.Tensor | None  # int64 [S]: the last token of each chunk that samples; None: every row
    sampling_chunks: list[ScheduledChunk]  # aligned with logits_indices
    logits: torch.Tensor | None = None  # [S, vocab] once launched (rank 0)
    sampled: torch.Tensor | None = None  # [S] token ids when the decode graph sampled them


@dataclass
class HostInputs:
    """A step's inputs as host arrays, before they go to the device."""

    # input_ids, positions, slot_mapping, cu_seqlens_q, seqlens_k, block_tables, logits_indices;
    # decode_order over the leading one-token chunks; fill_at/fill_from for inputs the last step sampled
    arrays: dict[str, np.ndarray]
    sampling_chunks: list[ScheduledChunk]
    max_seqlen_q: int
    max_seqlen_k: int
    num_decodes: int  # leading chunks of one token


@dataclass
class PendingStep:
    """A sampled step whose ids are on their way to the host."""

    seqs: list[MirroredSeq]
    token_ids: torch.Tensor | None  # on the host (pinned on CUDA) once the event fires
    logprobs: tuple | None  # sampled logprob, rank, top ids, top logprobs
    event: "torch.cuda.Event | None"

    def done(self) -> bool:
        return self.event is None or self.event.query()


def slot_mapping(block_tables: np.ndarray, row: np.ndarray, positions: np.ndarray, block_size: int) -> np.ndarray:
    """Where each token's K/V goes in the pool: block_id * block_size + offset in the block."""
    return block_tables[row, positions // block_size].astype(np.int64) * block_size + positions % block_size


def one_token_chunks_first(chunks: list[ScheduledChunk]) -> list[ScheduledChunk]:
    """A mixed step's decode-like chunks (one new token) ahead of the rest, so attention can run them
    in a decode kernel; results are keyed by sequence, so the order is free."""
    ones = [c for c in chunks if c.end - c.start == 1]
    if not ones or len(ones) == len(chunks):
        return chunks
    return ones + [c for c in chunks if c.end - c.start != 1]


class ModelRunner:
    def __init__(self, config: EngineConfig, rank: int = 0, world_size: int = 1) -> None:
        self.config = config
        self.rank = rank
        self.world_size = world_size
        self.device = resolve_device(config.device, rank)
        self.dtype = resolve_dtype(config.dtype, self.device)
        self.block_size = config.block_size
        torch.manual_seed(config.seed)
        if self.device.type == "cpu":
            # the scheduler and front end need a core too; a torch thread that waits for a descheduled
            # peer at every op costs far more than the second thread gains on these memory-bound steps
            torch.set_num_threads(config.cpu_threads or max(1, (os.cpu_count() or 2) - 1))
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        self.backend = get_backend(config.attention_backend, self.device, config.block_size)
        self.model, self.facts = load_model(config.model, self.dtype, self.device, self.backend, config.load_format)
        self.sampler = Sampler()
        self._noise_rng = np.random.default_rng(config.seed)  # the noise seeds of unseeded sampling rows
        self.staging = PinnedStaging(self.device)
        self._pinned_sampled: dict[int, torch.Tensor] = {}
        self.prev_sampled: torch.Tensor | None = None  # the last sampled step's ids, on the device
        self.prev_rows: dict[int, int] = {}  # seq_id -> row in prev_sampled
        self.num_blocks = self._size_kv_pool()
        self._allocate_kv_pool(self.num_blocks)
        self.num_host_blocks = num_host_blocks(config.num_host_blocks, config.swap_space_gb, self._bytes_per_block())
        self.host_pool = HostKVPool(self.kv_cache, self.num_host_blocks) if self.num_host_blocks else None
        self.graphs: DecodeGraphs | None = None
        # the torch reference backend syncs the host inside store_kvcache, so it cannot be captured
        if self.device.type == "cuda" and not config.enforce_eager and self.backend.name != "torch":
            self.graphs = DecodeGraphs(self.model, config.max_num_seqs, self.max_model_len, self.block_size,
                                       self.facts.hidden_size, self.dtype, self.device,
                                       vocab_size=self.facts.vocab_size if world_size == 1 else None)
            self.graphs.capture()
        if self.device.type == "cuda" and self.rank == 0:
            from kernels import sampling

            sampling.warm_up(config.max_num_seqs, self.facts.vocab_size, self.dtype, self.device)

    # ------------------------------------------------------------------ KV pool

    @property
    def max_model_len(self) -> int:
        limit = self.facts.max_position_embeddings
        return min(self.config.max_model_len or limit, limit)

    @property
    def num_kv_heads_local(self) -> int:
        return self.facts.num_kv_heads // self.world_size  # the layers check divisibility

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
        lengths = [num_tokens // num_seqs] * num_seqs
        lengths[-1] += num_tokens - sum(lengths)
        chunks, next_block = [], 0
        for i, n in enumerate(lengths):
            nb = -(-n // self.block_size)
            ids = torch.randint(0, self.facts.vocab_size, (n,)).tolist()
            seq = MirroredSeq(i, ids, n, list(range(next_block, next_block + nb)), 0, engine_pb2.SamplingOptions())
            chunks.append(ScheduledChunk(seq, 0, n))
            next_block += nb
        self._allocate_kv_pool(next_block)
        inputs = self.prepare_inputs(chunks)
        hidden = self.model(inputs.input_ids, inputs.positions, inputs.meta)
        self.model.compute_logits(hidden[inputs.logits_indices])
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device)
        del hidden, inputs
        self._release_kv_pool()
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

    def _release_kv_pool(self) -> None:
        self.kv_cache = None
        for attn in self.model.attention_layers():
            attn.k_cache = attn.v_cache = torch.tensor([])

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
        dev = self.staging.upload({"src": np.fromiter((c.src_block_id for c in copies), np.int64),
                                   "dst": np.fromiter((c.dst_block_id for c in copies), np.int64)}, "copies")
        src, dst = dev["src"], dev["dst"]
        self.kv_cache[:, :, dst] = self.kv_cache[:, :, src]

    def swap_out(self, copies) -> None:
        """Preemption by swap: KV pool blocks to host blocks. Run first in a plan: its sources may be
        the destinations of the plan's swap-ins and copies."""
        if copies:
            self._host_pool("swap_out").swap_out(self.kv_cache, copies)

    def swap_in(self, copies) -> None:
        """A swapped sequence resumes: host blocks back to KV pool blocks, after swap_out."""
        if copies:
            self._host_pool("swap_in").swap_in(self.kv_cache, copies)

    def _host_pool(self, what: str) -> HostKVPool:
        if self.host_pool is None:
            raise RuntimeError(f"the plan asks for {what}, but this executor has no host pool "
                               "(--swap-space-gb 0 and no --num-host-blocks)")
        return self.host_pool

    # ------------------------------------------------------------------ inputs

    def host_inputs(self, chunks: list[ScheduledChunk]) -> HostInputs:
        """Flatten the step's chunks into host arrays; one python pass, the rest vectorised."""
        bs = self.block_size
        ids: list[int] = []
        starts, ends, tables, sampling, logits_idx = [], [], [], [], []
        fill_at, fill_from = [], []  # inputs whose token the previous step sampled, still on the device
        for c in chunks:
            seq = c.seq
            if len(seq.block_table) * bs < c.end:
                raise RuntimeError(f"seq {seq.seq_id}: {len(seq.block_table)} blocks cannot hold {c.end} tokens")
            ids.extend(seq.token_ids[c.start:c.end])
            if c.needs_pending_token:
                if c.end != len(seq.token_ids) + 1 or seq.seq_id not in self.prev_rows:
                    raise RuntimeError(f"seq {seq.seq_id}: input {c.end - 1} was not sampled by the previous step")
                fill_at.append(len(ids))
                fill_from.append(self.prev_rows[seq.seq_id])
                ids.append(0)
            starts.append(c.start)
            ends.append(c.end)
            tables.append(seq.block_array)
            if c.samples:
                logits_idx.append(len(ids) - 1)
                sampling.append(c)
        k_lens = np.asarray(ends, dtype=np.int64)
        q_lens = k_lens - np.asarray(starts, dtype=np.int64)
        cu_q = np.zeros(len(chunks) + 1, dtype=np.int64)
        np.cumsum(q_lens, out=cu_q[1:])
        # token t of sequence i sits at position starts[i] + (t - cu_q[i])
        row = np.repeat(np.arange(len(chunks)), q_lens)
        positions = k_lens[row] - q_lens[row] + np.arange(len(ids)) - cu_q[row]
        block_tables = self._block_tables(tables, -(-k_lens // bs))
        arrays = {
            "input_ids": np.asarray(ids, dtype=np.int64), "positions": positions,
            "slot_mapping": slot_mapping(block_tables, row, positions, bs),
            "cu_seqlens_q": cu_q.astype(np.int32), "seqlens_k": k_lens.astype(np.int32),
            "block_tables": block_tables, "logits_indices": np.asarray(logits_idx, dtype=np.int64),
        }
        num_decodes = len(chunks) if (q_lens == 1).all() else int(np.argmax(q_lens != 1))  # leading one-token chunks
        if num_decodes:  # the decode kernel takes the longest contexts first
            arrays["decode_order"] = np.argsort(-k_lens[:num_decodes], kind="stable").astype(np.int32)
        if fill_at:
            arrays["fill_at"] = np.asarray(fill_at, dtype=np.int64)
            arrays["fill_from"] = np.asarray(fill_from, dtype=np.int64)
        return HostInputs(arrays, sampling, int(q_lens.max()), int(k_lens.max()), num_decodes)

    def prepare_inputs(self, chunks: list[ScheduledChunk]) -> StepInputs:
        """The step's inputs on the device, in one copy."""
        host = self.host_inputs(chunks)
        dev = self.staging.upload(host.arrays)
        meta = AttentionMetadata(
            slot_mapping=dev["slot_mapping"], cu_seqlens_q=dev["cu_seqlens_q"], seqlens_k=dev["seqlens_k"],
            block_tables=dev["block_tables"], max_seqlen_q=host.max_seqlen_q, max_seqlen_k=host.max_seqlen_k,
            block_size=self.block_size, decode_order=dev.get("decode_order"), num_decodes=host.num_decodes,
        )
        input_ids = dev["input_ids"]
        if "fill_at" in dev:
            input_ids[dev["fill_at"]] = self.prev_sampled[dev["fill_from"]]
        return StepInputs(input_ids=input_ids, positions=dev["positions"], meta=meta,
                          logits_indices=dev["logits_indices"], sampling_chunks=host.sampling_chunks)

    def _load_decode_graph(self, chunks: list[ScheduledChunk], bucket: int, graph_samples: bool) -> StepInputs:
        """Stage a decode step straight into the graph's static inputs (one copy, no per-input copies)."""
        host = self.host_inputs(chunks)
        a = host.arrays
        gather = np.arange(self.graphs.capacity, self.graphs.capacity + len(chunks))  # the host's own ids
        if "fill_at" in a:
            gather[a["fill_at"]] = a["fill_from"]  # decode: token i is row i
        rows = {"tokens": a["input_ids"], "gather": gather, "positions": a["positions"],
                "slot_mapping": a["slot_mapping"], "seqlens_k": a["seqlens_k"], "decode_order": a["decode_order"]}
        if graph_samples:
            rows.update(plain_sampling_columns([c.seq.sampling_row for c in chunks], self._noise_rng))
        self.graphs.load(bucket, rows, a["block_tables"])
        input_ids, positions, meta = self.graphs.step_inputs(bucket, len(chunks))
        return StepInputs(input_ids=input_ids, positions=positions, meta=meta, logits_indices=None,
                          sampling_chunks=host.sampling_chunks)

    @staticmethod
    def _block_tables(tables: list[np.ndarray], num_blocks: np.ndarray) -> np.ndarray:
        """Each sequence's blocks in use this step, padded with 0 to the longest."""
        out = np.zeros((len(tables), int(num_blocks.max())), dtype=np.int32)
        for i, (table, n) in enumerate(zip(tables, num_blocks.tolist())):
            out[i, :n] = table[:n]
        return out

    # ------------------------------------------------------------------ step

    @torch.inference_mode()
    def launch(self, chunks: list[ScheduledChunk]) -> StepInputs | None:
        """Prepare the step and enqueue its forward and logits; returns before the device finishes."""
        if not chunks:
            return None
        self.staging.next_step()  # alternate pinned buffers: the previous step's copies may be in flight
        bucket = None
        # a decode graph's logits are one row per chunk: a one-token prefill chunk that does not end its
        # prompt (so does not sample) sends the step down the eager path
        if self.graphs is not None and all(c.end - c.start == 1 and c.samples for c in chunks):
            bucket = self.graphs.bucket(len(chunks), max(c.end for c in chunks))
        if bucket is None:
            inputs = self.prepare_inputs(one_token_chunks_first(chunks))
            hidden = self.model(inputs.input_ids, inputs.positions, inputs.meta)
        else:
            # a decode graph samples in place when every row samples plainly (temperature alone)
            graph_samples = self.graphs.samples and all(c.seq.sampling_row.plain for c in chunks)
            inputs = self._load_decode_graph(chunks, bucket, graph_samples)
            hidden = self.graphs.run(bucket, len(chunks))
            if self.graphs.samples:
                inputs.logits = self.graphs.logits[: len(chunks)]
            if graph_samples:
                inputs.sampled = self.graphs.sampled[: len(chunks)]
        if inputs.sampling_chunks and inputs.logits is None:
            rows = hidden if inputs.logits_indices is None else hidden[inputs.logits_indices]
            inputs.logits = self.model.compute_logits(rows)
        return inputs

    @torch.inference_mode()
    def sample(self, inputs: StepInputs | None) -> PendingStep:
        """Sample the launched step (rank 0; other ranks receive the ids) and start copying them to the host.

        Call after the previous step's tokens were appended to the mirrors, so penalties and seeds see them."""
        chunks = inputs.sampling_chunks if inputs is not None else []
        if not chunks:
            return PendingStep([], None, None, None)
        seqs = [c.seq for c in chunks]
        lp = None
        if inputs.sampled is not None:  # sampled inside the decode graph
            token_ids = inputs.sampled
        elif self.rank == 0:
            batch = build_for_sequences([s.sampling_row for s in seqs], [s.token_ids for s in seqs],
                                        [s.num_prompt_tokens for s in seqs], self.facts.vocab_size, self.device,
                                        lambda arrays: self.staging.upload(arrays, "sampling"), self._noise_rng)
            out = self.sampler(inputs.logits, batch)
            token_ids = out.token_ids
            if batch.max_logprobs > 0 and out.top_token_ids is not None:
                lp = (out.sampled_logprobs, out.sampled_ranks, out.top_token_ids, out.top_logprobs)
        else:
            token_ids = torch.empty(len(chunks), dtype=torch.int64, device=self.device)
        if self.world_size > 1:
            import torch.distributed as dist

            dist.broadcast(token_ids, src=0)  # every rank feeds them to its next step
        # the next step reads these on the device for inputs it does not know yet
        if self.graphs is not None and inputs.sampled is None:
            self.graphs.prev_tokens[: len(chunks)].copy_(token_ids)  # where a decode graph gathers them
        self.prev_sampled = token_ids
        self.prev_rows = {s.seq_id: i for i, s in enumerate(seqs)}
        event = None
        if self.device.type == "cuda":
            host = self._pinned_tokens(len(chunks))
            host.copy_(token_ids, non_blocking=True)
            if lp is not None:
                lp = tuple(t.to("cpu", non_blocking=True) for t in lp)
            event = torch.cuda.Event()
            event.record()
        else:
            host = token_ids
        return PendingStep(seqs, host, lp, event)

    def finalize(self, pending: PendingStep) -> list[engine_pb2.SampledToken]:
        """Wait for a sampled step's ids on the host and turn them into the reply."""
        if not pending.seqs:
            return []
        if pending.event is not None:
            pending.event.synchronize()
        token_ids = pending.token_ids.tolist()
        lp = None
        if pending.logprobs is not None:
            lp = [t.tolist() for t in pending.logprobs]
        results = []
        for i, seq in enumerate(pending.seqs):
            sampled = engine_pb2.SampledToken(seq_id=seq.seq_id, token_id=token_ids[i])
            n = seq.sampling.logprobs
            if lp is not None and n > 0:
                sampled.logprobs.CopyFrom(engine_pb2.TokenLogprobs(
                    sampled_logprob=lp[0][i], sampled_rank=lp[1][i],
                    top_token_ids=lp[2][i][:n], top_logprobs=lp[3][i][:n]))
            results.append(sampled)
        return results

    def _pinned_tokens(self, n: int) -> torch.Tensor:
        buf = self._pinned_sampled.get(self.staging.parity)
        if buf is None or buf.numel() < n:
            buf = torch.empty(max(n, self.config.max_num_seqs), dtype=torch.int64).pin_memory()
            self._pinned_sampled[self.staging.parity] = buf
        return buf[:n]

    def handshake(self) -> engine_pb2.ExecutorHandshake:
        f: ModelFacts = self.facts
        return engine_pb2.ExecutorHandshake(
            rank=self.rank, world_size=self.world_size, num_blocks=self.num_blocks,
            block_size=self.block_size, model_name=f.model_name, architecture=f.architecture,
            vocab_size=f.vocab_size, max_position_embeddings=f.max_position_embeddings,
            eos_token_ids=f.eos_token_ids, dtype=str(self.dtype).removeprefix("torch."),
            device=str(self.device), attention_backend=self.backend.name, pid=os.getpid(),
            num_host_blocks=self.num_host_blocks,
        )

