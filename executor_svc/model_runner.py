"""The model runner: owns the weights, the KV pool and the sampler; launches a step's forward,
samples it (rank 0) and brings the sampled ids to the host. Plain Python and numpy in and out: the
executor loop (executor_svc/executor.py) converts from and to protobuf."""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass, replace

import numpy as np
import torch

from executor_svc.copy_costs import calibrate
from executor_svc.cuda_graphs import DecodeGraphs
from executor_svc.draft_model import DraftModel
from executor_svc.input_batch import (StepInputs, decode_graph_inputs, device_inputs, host_inputs,
                                      one_token_chunks_first, profiling_chunks, verification_rows)
from executor_svc.kv_cache import KVLayout, KVPool, num_host_blocks, num_kv_blocks
from executor_svc.kv_calibration import (CALIBRATION_TOKENS, calibration_chunks, calibration_source,
                                         checkpoint_kv_scales, kv_cache_scales, pool_amax)
from executor_svc.model_loader import load_model
from executor_svc.piecewise_graphs import PiecewiseGraphs, capture_or_fall_back
from executor_svc.pinned_staging import PinnedStaging
from executor_svc.sampler import Sampler, build_for_sequences
from executor_svc.sampling_row import plain_sampling_columns
from executor_svc.seq_mirror import MirroredSeq, ScheduledChunk, SequenceMirrors, draw_masks
from executor_svc.speculative_verify import draws_decide, drawable, verdict_from_draws, verify_chunks
from kernels.attention.registry import get_backend
from kernels.kv_quant import FP8_DTYPE, INT8_DTYPE, is_quantized
from kernels.kv_rotation import hadamard_matrix
from scheduler_svc.common.config import EngineConfig

log = logging.getLogger("nanoserve.executor")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
CALIBRATION_PREFILL_TOKENS = {"cuda": 2048, "cpu": 64}  # the timed forward of the preemption cost model


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


def resolve_kv_cache_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """--kv-cache-dtype: auto keeps the model's dtype; fp8 is float8_e4m3fn, int8 int8 (kernels/kv_quant.py)."""
    return {"fp8": FP8_DTYPE, "int8": INT8_DTYPE}.get(name, model_dtype)


@dataclass(slots=True)
class TokenLogprobs:
    sampled_logprob: float
    sampled_rank: int  # 1-based, in the raw distribution
    top_token_ids: list[int]  # the sequence's `logprobs` best
    top_logprobs: list[float]


@dataclass(slots=True)
class SampledToken:
    seq_id: int
    token_id: int
    logprobs: TokenLogprobs | None = None  # when the sequence asked for them
    accepted_token_ids: list[int] | tuple[int, ...] = ()  # speculative decoding: accepted proposals, before token_id


@dataclass
class PendingStep:
    """A sampled step whose ids are on their way to the host."""

    seqs: list[MirroredSeq]
    token_ids: torch.Tensor | None  # on the host (pinned on CUDA) once the event fires
    logprobs: tuple | None  # sampled logprob, rank, top ids, top logprobs
    event: "torch.cuda.Event | None"
    num_accepted: torch.Tensor | None = None  # speculative decoding: each sequence's accepted proposals, on the host
    proposals: list | None = None  # and the proposals they are the leading ones of
    void: list[bool] | None = None  # async verification: chunks that yield nothing (SequenceMirrors.settle)

    def done(self) -> bool:
        return self.event is None or self.event.query()


class ModelRunner:
    def __init__(self, config: EngineConfig, rank: int = 0, world_size: int = 1) -> None:
        self.config = config
        self.rank = rank
        self.world_size = world_size
        self.device = resolve_device(config.device, rank)
        self.dtype = resolve_dtype(config.dtype, self.device)
        self.kv_cache_dtype = resolve_kv_cache_dtype(config.kv_cache_dtype, self.dtype)
        self.block_size = config.block_size
        torch.manual_seed(config.seed)
        if self.device.type == "cpu":
            # the scheduler and front end need a core too; a torch thread that waits for a descheduled
            # peer at every op costs far more than the second thread gains on these memory-bound steps
            torch.set_num_threads(config.cpu_threads or max(1, (os.cpu_count() or 2) - 1))
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        self.backend = get_backend(config.attention_backend, self.device, config.block_size,
                                   kv_cache_dtype=self.kv_cache_dtype)
        self.model, self.facts = load_model(config.model, self.dtype, self.device, self.backend, config.load_format,
                                              config.quantization)
        self.draft: DraftModel | None = None  # speculative method draft: the proposer, loaded before the pool is sized
        self.sampler = Sampler()
        self._noise_rng = np.random.default_rng(config.seed)  # the noise seeds of unseeded sampling rows
        self.staging = PinnedStaging(self.device)
        self._pinned_sampled: dict[int, torch.Tensor] = {}
        self.prev_sampled: torch.Tensor | None = None  # the last sampled step's ids, on the device
        self.prev_rows: dict[int, int] = {}  # seq_id -> row in prev_sampled
        # steps launched since the last one with proposals: a chunk can be void, or its guess fail, only while a
        # step with proposals may still be in flight before it (speculative decoding, DESIGN.md section 14)
        self._steps_since_proposals = 1 << 30
        f = self.facts
        layout = KVLayout(f.num_layers, self.block_size, f.num_kv_heads // world_size,  # the layers check divisibility
                          f.head_dim, self.kv_cache_dtype, self.device)
        self.kv_pool = KVPool(layout, self.model.attention_layers(), self.staging)
        if config.speculative_method == "draft":
            self.draft = DraftModel(config, self.facts.vocab_size, self.dtype, self.device, rank, world_size,
                                    self.staging)
        if is_quantized(layout.dtype):  # before sizing: the profiling forward runs on the quantized pool too
            if config.kv_cache_rotation == "hadamard":  # before calibrating: the scales are of the rotated K
                self.kv_pool.set_rotation(hadamard_matrix(layout.head_dim, self.dtype, self.device))
            method = config.kv_scales_method()
            if method == "checkpoint":
                self.kv_pool.set_scales(checkpoint_kv_scales(config.model, layout, rank, world_size))
            else:
                amax = None if method == "static" else self.calibration_amax()
                self.kv_pool.set_scales(kv_cache_scales(method, layout, amax))
        self.kv_pool.allocate(num_kv_blocks(config, layout, self._peak_forward,
                                            self.draft.bytes_per_block if self.draft is not None else 0))
        if self.draft is not None:
            self.draft.allocate(self.kv_pool.num_blocks, self.max_model_len)
        host_blocks = num_host_blocks(config.num_host_blocks, config.host_pool_gb(self.device.type),
                                      layout.bytes_per_block)
        if host_blocks:
            self.kv_pool.allocate_host(host_blocks)
        self.graphs: DecodeGraphs | None = None
        if self.device.type == "cuda" and not config.enforce_eager and self.backend.capabilities.cuda_graph_safe:
            self.graphs = DecodeGraphs(self.model, config.max_num_seqs, self.max_model_len, self.block_size,
                                       self.facts.hidden_size, self.dtype, self.device,
                                       vocab_size=self.facts.vocab_size if world_size == 1 else None)
            self.graphs.capture()
        self.piecewise: PiecewiseGraphs | None = None  # steps with a prefill chunk, attention eager between graphs
        max_piecewise = min(config.cuda_graph_max_tokens, config.max_num_batched_tokens)
        if self.graphs is not None and max_piecewise > 0:
            self.piecewise = capture_or_fall_back(
                PiecewiseGraphs(self.model, max_piecewise, self.block_size, self.facts.hidden_size, self.dtype,
                                self.device), rank, world_size)
        # every rank runs the timed forward, or none does (tensor-parallel layers talk to each other); after the graphs
        # are captured, so that it runs as a recomputed prefill will (in the piecewise graphs when a bucket holds it)
        timed = self.device.type == "cuda" or config.resolved_preemption_mode(self.device.type) == "auto"
        num_tokens = min(CALIBRATION_PREFILL_TOKENS[self.device.type], config.max_num_batched_tokens,
                         self.max_model_len, self.kv_pool.num_blocks // 2 * self.block_size)
        self.calibration = calibrate(self.kv_pool, self._prefill_on_free_blocks if timed and num_tokens > 0 else None,
                                     num_tokens, rank)
        self.fused_masked_draw = False  # masked decode rows drawn by the graph's kernel (DecodeGraphs.redraw_masked)
        if self.device.type == "cuda" and self.rank == 0:
            from kernels import sampling

            self.fused_masked_draw = sampling.warm_up(config.max_num_seqs, self.facts.vocab_size, self.dtype,
                                                      self.device)

    @property
    def max_model_len(self) -> int:
        limit = self.facts.max_position_embeddings
        return min(self.config.max_model_len or limit, limit)

    def _peak_forward(self) -> None:
        """The step that peaks memory, for sizing the KV pool on a GPU: a forward at
        max_num_batched_tokens over a pool just large enough, released after."""
        cfg = self.config
        chunks, num_blocks = profiling_chunks(cfg.max_num_batched_tokens, cfg.max_num_seqs, self.block_size,
                                              self.facts.vocab_size)
        self.kv_pool.allocate(num_blocks)
        inputs = self.prepare_inputs(chunks)
        hidden = self.model(inputs.input_ids, inputs.positions, inputs.meta)
        self.model.compute_logits(hidden[inputs.logits_indices])
        self.kv_pool.release()

    @torch.inference_mode()
    def calibration_amax(self) -> torch.Tensor:
        """The largest |K| and |V| per layer, KV head and channel, [2, L, H_kv, D], over one forward of the
        calibration tokens (executor_svc/kv_calibration.py) through a temporary pool of the model's dtype."""
        cfg = self.config
        # not bounded by the step budget: the scales must not depend on it, and the pool is not allocated yet
        chunks, num_blocks = calibration_chunks(cfg.model, self.facts.vocab_size, self.block_size,
                                                CALIBRATION_TOKENS, cfg.seed)
        pool = KVPool(replace(self.kv_pool.layout, dtype=self.dtype), self.kv_pool.layers, self.staging)
        pool.allocate(num_blocks)
        try:
            inputs = self.prepare_inputs(chunks)
            self.model(inputs.input_ids, inputs.positions, inputs.meta)
            amax = pool_amax(pool)  # unused slots hold zeros
        finally:
            pool.release()
        log.info("KV cache scales calibrated on %d tokens of %d sequences (%s)", sum(c.end for c in chunks),
                 len(chunks), calibration_source(cfg.model))
        return amax

    @torch.inference_mode()
    def _prefill_on_free_blocks(self, num_tokens: int) -> None:
        """A prefill of one sequence of num_tokens random tokens on the pool's first blocks (all free at
        start-up), zeroed again after, as the pool starts; through _forward, as a step's prefill runs."""
        chunks, num_blocks = profiling_chunks(num_tokens, 1, self.block_size, self.facts.vocab_size)
        inputs = self.prepare_inputs(chunks)
        hidden = self._forward(inputs)
        self.model.compute_logits(hidden[inputs.logits_indices])
        self.kv_pool.cache[:, :, :num_blocks].zero_()

    def prepare_inputs(self, chunks: list[ScheduledChunk]) -> StepInputs:
        """The step's inputs on the device, in one copy."""
        host = host_inputs(chunks, self.block_size, self.prev_rows)
        return device_inputs(host, self.staging, self.block_size, self.prev_sampled)

    # ------------------------------------------------------------------ step

    @torch.inference_mode()
    def launch(self, chunks: list[ScheduledChunk]) -> StepInputs | None:
        """Prepare the step and enqueue its forward and logits; returns before the device finishes."""
        if not chunks:
            return None
        self.staging.next_step()  # alternate pinned buffers: the previous step's copies may be in flight
        self._steps_since_proposals += 1
        if self.draft is not None and any(c.num_draft for c in chunks):  # the draft's proposals, verified below
            self.draft.propose(chunks, self.sampler._generators, self._noise_rng)
        if any(c.proposal for c in chunks):
            self._steps_since_proposals = 0
            rows = verification_rows(chunks, self.block_size, self.prev_rows)
            if rows is not None:
                return self._launch_rows(rows)
        bucket = None
        # a decode graph's logits are one row per chunk: a one-token prefill chunk that does not end its
        # prompt (so does not sample) sends the step down the eager path
        if self.graphs is not None and all(c.end - c.start == 1 and c.samples for c in chunks):
            bucket = self.graphs.bucket(len(chunks), max(c.end for c in chunks))
        if bucket is None:
            inputs = self.prepare_inputs(one_token_chunks_first(chunks))
            hidden = self._forward(inputs)
        else:
            # a decode graph samples in place when every row samples plainly (temperature alone); otherwise the
            # graph gives the logits and the sampler runs after it. Token masks (structured output, perhaps still
            # to come) do not send a plain step to the sampler: sample() draws again from the graph's logits and
            # rows, with the masks, in one kernel (the eager sampler's per-step host work sat on rank 0's path
            # from the late masks to the next step)
            graph_samples = self.graphs.samples and all(
                c.seq.sampling_row.plain and (self.fused_masked_draw or (c.token_mask is None and not c.late_mask))
                for c in chunks)
            columns = plain_sampling_columns([c.seq.sampling_row for c in chunks], self._noise_rng) \
                if graph_samples else None
            host = host_inputs(chunks, self.block_size, self.prev_rows)
            inputs = decode_graph_inputs(host, self.graphs, bucket, columns)
            hidden = self.graphs.run(bucket, len(chunks))
            if self.graphs.samples:
                inputs.logits = self.graphs.logits[: len(chunks)]
            if graph_samples:
                inputs.sampled = self.graphs.sampled[: len(chunks)]
                if any(c.token_mask is not None or c.late_mask for c in chunks):
                    inputs.redraw_masked_in = bucket
        if inputs.sampling_chunks and inputs.logits is None:
            rows = hidden if inputs.logits_indices is None else hidden[inputs.logits_indices]
            inputs.logits = self.model.compute_logits(rows)
        if inputs.verifies:  # proposals beside a prefill chunk (the varlen path): greedy rows need only their argmax
            inputs.verify_from_draws = draws_decide(inputs.sampling_chunks, inputs.sampled is not None)
        return inputs

    def _forward(self, inputs: StepInputs) -> torch.Tensor:
        """The hidden states of a step no decode graph runs: in piecewise graphs when a token bucket holds it (the
        layers graphed, attention eager), else eagerly. A piecewise step's are a static buffer's, valid until the
        next step's forward."""
        tb = self.piecewise.bucket(inputs.input_ids.shape[0]) if self.piecewise is not None else None
        if tb is None:
            return self.model(inputs.input_ids, inputs.positions, inputs.meta)
        return self.piecewise.run(tb, inputs.input_ids, inputs.positions, inputs.meta)

    def _launch_rows(self, rows) -> StepInputs:
        """A step of decodes and verifications, as one-token rows (input_batch.verification_rows): in a decode
        graph when one is large enough, else eagerly; one logits row per row."""
        bucket = self.graphs.bucket(len(rows.arrays["seqlens_k"]), rows.max_seqlen_k) if self.graphs else None
        chunks = rows.sampling_chunks
        plain = drawable(chunks)  # the graph's draws will decide
        if bucket is None:
            inputs = device_inputs(rows, self.staging, self.block_size, self.prev_sampled)
            inputs.logits = self.model.compute_logits(self._forward(inputs))
        else:  # plain rows: the graph's own draw of each row decides (verdict_from_draws); otherwise it is not used
            columns = None
            if plain and self.graphs.samples:
                row_options = [c.seq.sampling_row for c in chunks for _ in range(1 + len(c.proposal))]
                columns = plain_sampling_columns(row_options, self._noise_rng)
            inputs = decode_graph_inputs(rows, self.graphs, bucket, columns)
            hidden = self.graphs.run(bucket, rows.num_decodes)
            inputs.logits = self.graphs.logits[: rows.num_decodes] if self.graphs.samples \
                else self.model.compute_logits(hidden)
            if columns is not None:
                inputs.sampled = self.graphs.sampled[: rows.num_decodes]
        inputs.verifies = True
        inputs.verify_from_draws = draws_decide(chunks, inputs.sampled is not None)
        return inputs

    @torch.inference_mode()
    def sample(self, inputs: StepInputs | None) -> PendingStep:
        """Sample the launched step (rank 0; other ranks receive the ids) and start copying them to the host.

        Call after the previous step's tokens were appended to the mirrors, so penalties and seeds see them."""
        chunks = inputs.sampling_chunks if inputs is not None else []
        if not chunks:
            return PendingStep([], None, None, None)
        seqs = [c.seq for c in chunks]
        lp = void = None
        # chained verification (DESIGN.md): the step before is in; a plain step far from any with proposals (a
        # large batch, where speculation pauses) skips the walk over its chunks. Steps in flight: at most
        # max_steps_in_flight, one more while constrained sequences run
        if self.config.speculative_method is not None and \
                self._steps_since_proposals <= self.config.max_steps_in_flight + 2:
            SequenceMirrors.settle(chunks)
            void = _void_of(chunks)
        if inputs.verifies:
            return self._verify(inputs, chunks, void)
        if inputs.sampled is not None:  # sampled inside the decode graph
            token_ids = inputs.sampled
            if inputs.redraw_masked_in is not None:
                self._redraw_masked(inputs.redraw_masked_in, chunks)
        elif self.rank == 0:
            batch = build_for_sequences([s.sampling_row for s in seqs], [s.token_ids for s in seqs],
                                        [s.num_prompt_tokens for s in seqs], self.facts.vocab_size, self.device,
                                        lambda arrays: self.staging.upload(arrays, "sampling"), self._noise_rng,
                                        [c.token_mask for c in chunks])
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
        return PendingStep(seqs, host, lp, event, void=void)

    def _sample_plain(self, logits: torch.Tensor, chunks: list[ScheduledChunk]):
        """The ordinary sampler over these chunks' logits rows (one each)."""
        seqs = [c.seq for c in chunks]
        batch = build_for_sequences([s.sampling_row for s in seqs], [s.token_ids for s in seqs],
                                    [s.num_prompt_tokens for s in seqs], self.facts.vocab_size, self.device,
                                    lambda arrays: self.staging.upload(arrays, "sampling"), self._noise_rng,
                                    [c.token_mask for c in chunks])
        out = self.sampler(logits, batch)
        if not (batch.max_logprobs > 0 and out.top_token_ids is not None):
            out.top_token_ids = None
        return out

    def _verify(self, inputs: StepInputs, chunks: list[ScheduledChunk], void: list[bool] | None) -> PendingStep:
        """A step with proposals (speculative decoding): verify them (rank 0), send every rank the verdict, and
        start copying it to the host."""
        seqs = [c.seq for c in chunks]
        lp = None
        if self.rank == 0 and inputs.verify_from_draws:  # one draw per row decides (the graph's, or the argmax)
            draws = inputs.sampled if inputs.sampled is not None else inputs.logits.argmax(dim=-1)
            both = verdict_from_draws(draws, chunks, self.staging.upload).both  # [tokens; accepted counts]
        elif self.rank == 0:
            verdict = verify_chunks(inputs.logits, chunks, self.facts.vocab_size, self.staging.upload,
                                    self._sample_plain, self.sampler._generators, self._noise_rng)
            both = torch.stack([verdict.token_ids, verdict.num_accepted])
            lp = verdict.logprobs
        else:
            both = torch.empty(2, len(chunks), dtype=torch.int64, device=self.device)
        if self.world_size > 1:
            import torch.distributed as dist

            dist.broadcast(both, src=0)
        token_ids = both[0]
        if self.graphs is not None:
            self.graphs.prev_tokens[: len(chunks)].copy_(token_ids)
        self.prev_sampled = token_ids
        self.prev_rows = {s.seq_id: i for i, s in enumerate(seqs)}
        event = None
        if self.device.type == "cuda":
            both = both.to("cpu", non_blocking=True)
            if lp is not None:
                lp = tuple(t.to("cpu", non_blocking=True) for t in lp)
            event = torch.cuda.Event()
            event.record()
        return PendingStep(seqs, both[0], lp, event, num_accepted=both[1], proposals=[c.proposal for c in chunks],
                           void=void)

    def _redraw_masked(self, bucket: int, chunks: list[ScheduledChunk]) -> None:
        """Draw the graph's step again over its logits, temperatures and noise seeds with the rows' token masks
        (a late row dropped since has none: it draws free, and the scheduler discards its token)."""
        masks = draw_masks(chunks)
        if masks is None:
            return
        dev = self.staging.upload({"mask_rows": masks[0], "mask_words": masks[1]}, "sampling")
        self.graphs.redraw_masked(bucket, len(chunks), dev["mask_rows"], dev["mask_words"])

    def finalize(self, pending: PendingStep) -> list[SampledToken]:
        """Wait for a sampled step's ids on the host: one SampledToken per sampling sequence."""
        if not pending.seqs:
            return []
        if pending.event is not None:
            pending.event.synchronize()
        token_ids = pending.token_ids.tolist()
        num_accepted = pending.num_accepted.tolist() if pending.num_accepted is not None else None
        lp = None
        if pending.logprobs is not None:
            lp = [t.tolist() for t in pending.logprobs]
        results = []
        for i, seq in enumerate(pending.seqs):
            if pending.void is not None and pending.void[i]:
                results.append(SampledToken(seq.seq_id, -1))  # appends nothing; not sent to the scheduler
                continue
            sampled = SampledToken(seq.seq_id, token_ids[i])
            if num_accepted is not None and num_accepted[i]:
                sampled.accepted_token_ids = pending.proposals[i][: num_accepted[i]]
            n = seq.sampling_row.logprobs
            if lp is not None and n > 0:
                sampled.logprobs = TokenLogprobs(lp[0][i], lp[1][i], lp[2][i][:n], lp[3][i][:n])
            results.append(sampled)
        return results

    def _pinned_tokens(self, n: int) -> torch.Tensor:
        buf = self._pinned_sampled.get(self.staging.parity)
        if buf is None or buf.numel() < n:
            buf = torch.empty(max(n, self.config.max_num_seqs), dtype=torch.int64).pin_memory()
            self._pinned_sampled[self.staging.parity] = buf
        return buf[:n]


def _void_of(chunks: list[ScheduledChunk]) -> list[bool] | None:
    """Which chunks are void (SequenceMirrors.settle); None when none is."""
    void = [c.void for c in chunks]
    return void if any(void) else None
