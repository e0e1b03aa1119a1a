"""The draft model of speculative decoding (--speculative-method draft): a smaller model with the target's
vocabulary, loaded by every executor beside the target, that proposes the tokens the target then verifies.

Its KV pool is its own but indexed by the target's block ids: a sequence's block table (the scheduler's, lookahead
slots included) places both models' K/V, so the scheduler stays the single writer of one allocation. Each step,
before the target's forward, propose() runs it for the chunks that carry num_draft (decodes whose every input is
known): first a catch-up over the tokens it has not seen (a new mirror's whole context, in eager forwards split at
the step's token budget; after a verdict its last proposal, if accepted, and the target's token, as one-token rows
in a decode CUDA graph on CUDA), whose last row gives d_1's distribution, then one one-token forward per further
proposal (in the decode graphs on CUDA, one per batch size).
Rank 0 draws d_j from q_j: the argmax for greedy rows, else by inverse CDF from q_j, the draft's distribution
after the row's temperature, min-p, top-k and top-p (speculative_verify.target_probs' form), with a seeded row's
uniform drawn from its seed; every rank gets the tokens. The tokens come to the host (one wait per step) and
become the chunks' proposals; q's rows go to rejection sampling (speculative_verify.verify_chunks).
"""
from __future__ import annotations

import logging

import numpy as np
import torch

from executor_svc.cuda_graphs import DecodeGraphs
from executor_svc.input_batch import (decode_graph_inputs, device_inputs, host_inputs, one_token_chunks_first,
                                      one_token_rows)
from executor_svc.kv_cache import KVLayout, KVPool
from executor_svc.model_loader import load_model
from executor_svc.pinned_staging import PinnedStaging
from executor_svc.sampler import SamplingBatch, tempered_and_filtered
from executor_svc.seq_mirror import ScheduledChunk
from executor_svc.speculative_verify import row_uniforms
from kernels.attention.registry import get_backend
from scheduler_svc.common.config import EngineConfig

log = logging.getLogger("nanoserve.executor")

# A seeded row's draft draws use mix_seed(seed, this + generated position): a stream of their own, apart from the
# acceptance test's uniforms at the same positions (which must not depend on the draw they judge).
DRAFT_SEED_STREAM = 1 << 40


class DraftModel:
    def __init__(self, config: EngineConfig, target_vocab_size: int, dtype: torch.dtype, device: torch.device,
                 rank: int, world_size: int, staging: PinnedStaging) -> None:
        self.config = config
        self.rank, self.world_size = rank, world_size
        self.device, self.dtype = device, dtype
        self.staging = staging
        self.block_size = config.block_size
        # a pool of the draft's own dtype: the target's KV quantization is not the draft's
        self.backend = get_backend(config.attention_backend, device, config.block_size, kv_cache_dtype=dtype)
        self.model, self.facts = load_model(config.draft_model, dtype, device, self.backend, config.load_format)
        f = self.facts
        if f.vocab_size != target_vocab_size:
            raise ValueError(f"--draft-model vocab_size {f.vocab_size} differs from the target's {target_vocab_size}")
        self.layout = KVLayout(f.num_layers, self.block_size, f.num_kv_heads // world_size, f.head_dim, dtype, device)
        self.kv_pool = KVPool(self.layout, self.model.attention_layers(), staging)
        self.graphs: DecodeGraphs | None = None

    @property
    def bytes_per_block(self) -> int:
        return self.layout.bytes_per_block

    def allocate(self, num_blocks: int, max_model_len: int) -> None:
        """Its pool, as many blocks as the target's (the same ids); then its decode graphs on CUDA."""
        self.kv_pool.allocate(num_blocks)
        cfg = self.config
        if self.device.type == "cuda" and not cfg.enforce_eager and self.backend.capabilities.cuda_graph_safe:
            # the draft's one-token steps run at most the speculating sequences, a catch-up after a verdict two rows
            # each; several loads per step, each with a host buffer of its own (propose() waits for all of them
            # before the next step)
            self.graphs = DecodeGraphs(self.model, 2 * min(cfg.max_num_seqs, cfg.speculative_max_batch_size),
                                       min(max_model_len, self.facts.max_position_embeddings), self.block_size,
                                       self.facts.hidden_size, self.dtype, self.device,
                                       vocab_size=self.facts.vocab_size if self.world_size == 1 else None,
                                       host_buffers=cfg.num_speculative_tokens + 1)
            self.graphs.capture()
        log.info("draft model %s: %d layers, %d KV blocks of its own on the target's block ids, %s",
                 self.facts.model_name, self.facts.num_layers, num_blocks,
                 "decode CUDA graphs" if self.graphs is not None else "eager")

    # ------------------------------------------------------------------ a step's proposals

    @torch.inference_mode()
    def propose(self, chunks: list[ScheduledChunk], generators: dict, rng: np.random.Generator) -> None:
        """Fill each chunk with num_draft its proposal (host token ids) and, on rank 0 where some row samples,
        draft_probs (float64 [num_draft, V]: q_1..q_k, the distributions they were drawn from; greedy rows are
        verified against the target's argmax alone, so an all-greedy step computes none)."""
        drafting = [c for c in chunks if c.num_draft]
        k_max = max(c.num_draft for c in drafting)
        vocab = self.facts.vocab_size
        rows = [c.seq.sampling_row for c in drafting]
        batch = uniforms = None
        samples = self.rank == 0 and not all(r.greedy for r in rows)
        if samples:
            batch = self._sampling_batch(rows, rng, 0)
            generated = [len(c.seq.token_ids) - c.seq.num_prompt_tokens + DRAFT_SEED_STREAM for c in drafting]
            uniforms = row_uniforms([r for r in rows for _ in range(k_max)],
                                    [g + j for g in generated for j in range(k_max)], self.device,
                                    generators)[:, 0].view(len(rows), k_max)
        drafts = torch.zeros(len(drafting), k_max, dtype=torch.int64, device=self.device)
        probs: list[torch.Tensor] = []  # per step j, [active rows, V] on rank 0
        active = torch.arange(len(drafting), device=self.device)
        logits = self._catch_up(drafting)
        for j in range(k_max):
            live = [i for i, c in enumerate(drafting) if c.num_draft > j]  # a short proposal's rows stop early
            if j > 0:
                if len(live) < active.numel():
                    active = self._index(live, f"draft_live{j}")
                    if samples:
                        batch = self._sampling_batch([rows[i] for i in live], rng, j)
                logits = self._one_token_step([drafting[i] for i in live], j, drafts[active, j - 1])
            if self.rank == 0 and not samples:
                token = logits.argmax(dim=-1)
            elif samples:
                q = tempered_and_filtered(logits.float(), batch).softmax(dim=-1).double()
                cdf = q.cumsum(dim=-1)
                drawn = torch.searchsorted(cdf, uniforms[active, j:j + 1] * cdf[:, -1:], right=True).squeeze(1)
                token = torch.where(batch.greedy, logits.argmax(dim=-1), drawn.clamp_(max=vocab - 1))
                probs.append(q)
            else:
                token = torch.empty(len(live), dtype=torch.int64, device=self.device)
            if self.world_size > 1:
                import torch.distributed as dist

                dist.broadcast(token, src=0)
            drafts[active, j] = token
        host = drafts.tolist()  # the verification's inputs: the host builds them (the one wait of a draft step)
        for i, c in enumerate(drafting):
            c.proposal = host[i][: c.num_draft]
        if samples:
            per_chunk: list[list[torch.Tensor]] = [[] for _ in drafting]
            for j, q in enumerate(probs):
                live = [i for i, c in enumerate(drafting) if c.num_draft > j]
                for n, i in enumerate(live):
                    per_chunk[i].append(q[n])
            for i, c in enumerate(drafting):
                c.draft_probs = torch.stack(per_chunk[i])

    def _index(self, values, group: str) -> torch.Tensor:
        """int64 indices on the device through the pinned staging (a copy from pageable memory would wait for the
        whole stream)."""
        return self.staging.upload({"index": np.asarray(values, dtype=np.int64)}, group)["index"]

    def _sampling_batch(self, rows: list, rng: np.random.Generator, step: int) -> SamplingBatch:
        """The rows' temperatures and filters on the device (an upload group per draft step: none waits)."""
        empty: list[list[int]] = [[] for _ in rows]
        return SamplingBatch.build(rows, empty, empty, self.facts.vocab_size, self.device,
                                   lambda arrays: self.staging.upload(arrays, f"draft_options{step}"), rng)

    def _catch_up(self, drafting: list[ScheduledChunk]) -> torch.Tensor | None:
        """The draft's forward over each chunk's tokens it has not computed, up to its input (the sequence's last
        token); the logits of each chunk's last token, in chunk order (rank 0; None elsewhere). After a verdict
        that is a token or two a sequence: one-token rows in a decode graph. Else (a new mirror's context) eager
        forwards of at most max_num_batched_tokens."""
        spans = [(c.seq.draft_computed, c.start + 1) for c in drafting]
        for c, (lo, hi) in zip(drafting, spans):
            if lo > c.start:
                raise RuntimeError(f"seq {c.seq.seq_id}: the draft computed {lo} tokens, past its input at {c.start}")
            c.seq.draft_computed = hi
        num_rows = sum(hi - lo for lo, hi in spans)
        if self.graphs is not None and num_rows <= self.graphs.capacity:
            return self._catch_up_in_graph(drafting, spans)
        return self._catch_up_eagerly(drafting, spans)

    def _catch_up_in_graph(self, drafting: list[ScheduledChunk], spans: list[tuple[int, int]]) -> torch.Tensor | None:
        """Each token to catch up on a one-token row over its sequence's block table (every row's K/V is stored
        before any row attends, as in a verification)."""
        ids, last = [], []
        for c, (lo, hi) in zip(drafting, spans):
            ids += c.seq.token_ids[lo:hi]
            last.append(len(ids) - 1)
        host = one_token_rows(ids, [lo for lo, _ in spans], [hi for _, hi in spans],
                              [c.seq.block_array for c in drafting], self.block_size, [], [])
        bucket = self.graphs.bucket(len(ids), host.max_seqlen_k)
        if bucket is None:
            return self._catch_up_eagerly(drafting, spans)
        decode_graph_inputs(host, self.graphs, bucket, None)
        hidden = self.graphs.run(bucket, len(ids))
        rows = self._index(last, "draft_last_rows")
        return self.graphs.logits[rows] if self.graphs.samples else self.model.compute_logits(hidden[rows])

    def _catch_up_eagerly(self, drafting: list[ScheduledChunk], spans: list[tuple[int, int]]) -> torch.Tensor | None:
        """Varlen forwards of at most max_num_batched_tokens, a chunk split across them where it must."""
        budget = self.config.max_num_batched_tokens
        pieces: list[list[ScheduledChunk]] = [[]]
        room = budget
        for c, (lo, hi) in zip(drafting, spans):
            while lo < hi:
                n = min(hi - lo, room)
                pieces[-1].append(ScheduledChunk(c.seq, lo, lo + n))
                lo += n
                room -= n
                if room == 0:
                    pieces.append([])
                    room = budget
        order = {id(c.seq): i for i, c in enumerate(drafting)}
        rows: list[torch.Tensor] = []
        where: list[int] = []
        for n, piece in enumerate(p for p in pieces if p):
            host = host_inputs(one_token_chunks_first(piece), self.block_size, {})
            inputs = device_inputs(host, self.staging, self.block_size, None, group=f"draft_catch_up{n}")
            hidden = self.model(inputs.input_ids, inputs.positions, inputs.meta)
            logits = self.model.compute_logits(hidden[inputs.logits_indices])
            where += [order[id(c.seq)] for c in host.sampling_chunks]
            if logits is not None:
                rows.append(logits)
        if self.rank != 0:
            return None
        logits = torch.cat(rows)
        return logits[self._index(np.argsort(where), "draft_order")]

    def _one_token_step(self, chunks: list[ScheduledChunk], j: int, tokens: torch.Tensor) -> torch.Tensor | None:
        """The draft's forward of proposal j (tokens, on the device) at position start + j of each chunk; its
        logits (rank 0; None elsewhere)."""
        n = len(chunks)
        host = one_token_rows([0] * n, [c.start + j for c in chunks], [c.start + j + 1 for c in chunks],
                              [c.seq.block_array for c in chunks], self.block_size, list(range(n)), list(range(n)))
        bucket = self.graphs.bucket(n, host.max_seqlen_k) if self.graphs is not None else None
        if bucket is None:
            inputs = device_inputs(host, self.staging, self.block_size, tokens, group=f"draft{j}")
            return self.model.compute_logits(self.model(inputs.input_ids, inputs.positions, inputs.meta))
        self.graphs.prev_tokens[:n].copy_(tokens)  # gathered inside the graph, as a decode's pending inputs
        decode_graph_inputs(host, self.graphs, bucket, None)
        hidden = self.graphs.run(bucket, n)
        return self.graphs.logits[:n] if self.graphs.samples else self.model.compute_logits(hidden)

