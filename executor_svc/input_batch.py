"""A step's chunks as tensors: input ids, positions, the slot mapping, block tables and cumulative
sequence lengths, built as host arrays in one Python pass and sent to the device in one copy (or
staged straight into a decode graph's static inputs).

The slot where a token's K/V goes is computed here, in slot_mapping(), and written by the attention
layer (executor_svc/layers/attention.py).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from executor_svc.cuda_graphs import DecodeGraphs
from executor_svc.pinned_staging import PinnedStaging
from executor_svc.sampling_row import GREEDY_ROW
from executor_svc.seq_mirror import MirroredSeq, ScheduledChunk
from kernels.attention.base import AttentionMetadata


@dataclass
class StepInputs:
    input_ids: torch.Tensor  # int64 [T]
    positions: torch.Tensor  # int64 [T]
    meta: AttentionMetadata
    logits_indices: torch.Tensor | None  # int64 [S]: the last token of each chunk that samples; None: every row
    sampling_chunks: list[ScheduledChunk]  # aligned with logits_indices (a chunk with proposals has 1 + K rows)
    logits: torch.Tensor | None = None  # [S, vocab] once launched (rank 0)
    sampled: torch.Tensor | None = None  # [S] token ids when the decode graph sampled them
    # the graph bucket whose in-graph draw ignored this step's token masks: sample() draws again with them
    redraw_masked_in: int | None = None
    verifies: bool = False  # some chunk carries proposals: sample() verifies them (executor_svc/speculative_verify.py)
    verify_from_draws: bool = False  # and one draw per row decides: sampled (or argmax) ids (verdict_from_draws)


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
    verifies: bool = False  # some chunk carries proposals, each scored in its own logits row


def slot_mapping(block_tables: np.ndarray, row: np.ndarray, positions: np.ndarray, block_size: int) -> np.ndarray:
    """Where each token's K/V goes in the pool: block_id * block_size + offset in the block.

    Token t belongs to sequence row[t] and sits at positions[t] of its context."""
    return block_tables[row, positions // block_size].astype(np.int64) * block_size + positions % block_size


def one_token_chunks_first(chunks: list[ScheduledChunk]) -> list[ScheduledChunk]:
    """A mixed step's decode-like chunks (one new token) ahead of the rest, so attention can run them
    in a decode kernel; results are keyed by sequence, so the order is free."""
    ones = [c for c in chunks if c.end - c.start == 1]
    if not ones or len(ones) == len(chunks):
        return chunks
    return ones + [c for c in chunks if c.end - c.start != 1]


def host_inputs(chunks: list[ScheduledChunk], block_size: int, prev_rows: dict[int, int]) -> HostInputs:
    """Flatten the step's chunks into host arrays; one python pass, the rest vectorised.

    prev_rows: seq_id -> row of the previous step's sampled ids, for inputs still on the device."""
    bs = block_size
    ids: list[int] = []
    starts, ends, tables, sampling, logits_idx = [], [], [], [], []
    fill_at, fill_from = [], []  # inputs whose token the previous step sampled, still on the device
    verifies = False
    for c in chunks:
        seq, k = c.seq, len(c.proposal)
        if len(seq.block_table) * bs < c.end:
            raise RuntimeError(f"seq {seq.seq_id}: {len(seq.block_table)} blocks cannot hold {c.end} tokens")
        ids.extend(seq.token_ids[c.start:c.end - k])
        if c.needs_pending_token:  # (after a verification in flight, beyond its proposals: DESIGN.md)
            if c.end - k - 1 < len(seq.token_ids) or seq.seq_id not in prev_rows:
                raise RuntimeError(f"seq {seq.seq_id}: input {c.end - 1} was not sampled by the previous step")
            fill_at.append(len(ids))
            fill_from.append(prev_rows[seq.seq_id])
            ids.append(0)
        if k:  # proposals: the target scores each of them, and the position after the last
            ids.extend(c.proposal)
            logits_idx.extend(range(len(ids) - 1 - k, len(ids) - 1))
            verifies = True
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
    block_tables = _block_tables(tables, -(-k_lens // bs))
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
    return HostInputs(arrays, sampling, int(q_lens.max()), int(k_lens.max()), num_decodes, verifies)


def verification_rows(chunks: list[ScheduledChunk], block_size: int, prev_rows: dict[int, int]) -> HostInputs | None:
    """A step of decodes and verifications (speculative decoding) as one-token rows: a verifying chunk's last
    token and each of its proposals become rows of their own over its block table, each seeing the context up to
    its position. Attention then runs them all as decodes (the one-token kernel, and on CUDA the decode graphs,
    with B (K + 1) rows), since every row's K/V is stored before any row attends. One logits row per row, in
    chunk order, as verification reads them. None when some chunk is neither (a prefill chunk): host_inputs."""
    bs = block_size
    ids: list[int] = []
    starts, ends, tables = [], [], []
    fill_at, fill_from = [], []
    for c in chunks:
        seq = c.seq
        if c.end - c.start != len(c.proposal) + 1 or not c.samples:
            return None
        if len(seq.block_table) * bs < c.end:
            raise RuntimeError(f"seq {seq.seq_id}: {len(seq.block_table)} blocks cannot hold {c.end} tokens")
        if c.needs_pending_token:  # an input the previous step sampled (a decode, or one verifying after a guess)
            if c.start < len(seq.token_ids) or seq.seq_id not in prev_rows:
                raise RuntimeError(f"seq {seq.seq_id}: input {c.end - 1} was not sampled by the previous step")
            fill_at.append(len(ids))
            fill_from.append(prev_rows[seq.seq_id])
            ids.append(0)
        else:
            ids.append(seq.token_ids[c.start])
        ids.extend(c.proposal)
        starts.append(c.start)
        ends.append(c.end)
        tables.append(seq.block_array)
    host = one_token_rows(ids, starts, ends, tables, bs, fill_at, fill_from)
    host.sampling_chunks, host.verifies = list(chunks), True
    return host


def one_token_rows(ids: list[int], starts: list[int], ends: list[int], tables: list[np.ndarray], block_size: int,
                   fill_at: list[int], fill_from: list[int]) -> HostInputs:
    """Rows of one token each, in runs: run i holds positions starts[i]..ends[i] - 1 over block table tables[i], each
    row seeing the context up to its position, with a logits row each; fill_at/fill_from: rows whose input is on the
    device (a step's ids before). Attention runs them as decodes."""
    bs = block_size
    num_rows = len(ids)
    first = np.asarray(starts, dtype=np.int64)
    last = np.asarray(ends, dtype=np.int64)
    # each row's run; row r of run i sits at position starts[i] + (r - its run's first row)
    chunk = np.repeat(np.arange(len(tables)), last - first)
    first_row = np.cumsum(last - first) - (last - first)
    pos = first[chunk] + np.arange(num_rows) - first_row[chunk]
    k_lens = pos + 1
    chunk_tables = _block_tables(tables, -(-last // bs))  # a row reads its run's table up to its own length
    block_tables = chunk_tables[chunk]
    arrays = {
        "input_ids": np.asarray(ids, dtype=np.int64), "positions": pos,
        "slot_mapping": slot_mapping(chunk_tables, chunk, pos, bs),
        "cu_seqlens_q": np.arange(num_rows + 1, dtype=np.int32), "seqlens_k": k_lens.astype(np.int32),
        "block_tables": block_tables, "logits_indices": np.arange(num_rows, dtype=np.int64),
        "decode_order": np.argsort(-k_lens, kind="stable").astype(np.int32),
    }
    if fill_at:
        arrays["fill_at"] = np.asarray(fill_at, dtype=np.int64)
        arrays["fill_from"] = np.asarray(fill_from, dtype=np.int64)
    return HostInputs(arrays, [], 1, int(k_lens.max()), num_rows)


def _block_tables(tables: list[np.ndarray], num_blocks: np.ndarray) -> np.ndarray:
    """Each sequence's blocks in use this step, padded with 0 to the longest."""
    out = np.zeros((len(tables), int(num_blocks.max())), dtype=np.int32)
    for i, (table, n) in enumerate(zip(tables, num_blocks.tolist())):
        out[i, :n] = table[:n]
    return out


def device_inputs(host: HostInputs, staging: PinnedStaging, block_size: int,
                  prev_sampled: torch.Tensor | None, group: str = "inputs") -> StepInputs:
    """The step's inputs on the device, in one copy; prev_sampled: the previous step's ids, on the device.
    group: the staging buffer (a forward of its own in the same step needs another: the draft model's)."""
    dev = staging.upload(host.arrays, group)
    meta = AttentionMetadata(
        slot_mapping=dev["slot_mapping"], cu_seqlens_q=dev["cu_seqlens_q"], seqlens_k=dev["seqlens_k"],
        block_tables=dev["block_tables"], max_seqlen_q=host.max_seqlen_q, max_seqlen_k=host.max_seqlen_k,
        block_size=block_size, decode_order=dev.get("decode_order"), num_decodes=host.num_decodes,
    )
    input_ids = dev["input_ids"]
    if "fill_at" in dev:
        input_ids[dev["fill_at"]] = prev_sampled[dev["fill_from"]]
    return StepInputs(input_ids=input_ids, positions=dev["positions"], meta=meta,
                      logits_indices=dev["logits_indices"], sampling_chunks=host.sampling_chunks,
                      verifies=host.verifies)


def decode_graph_inputs(host: HostInputs, graphs: DecodeGraphs, bucket: int,
                        sampling_columns: dict[str, np.ndarray] | None) -> StepInputs:
    """Stage a decode step straight into the graph's static inputs (one copy, no per-input copies).

    sampling_columns: temperature and noise seeds when the graph samples the step itself."""
    a = host.arrays
    num_seqs = len(a["seqlens_k"])
    gather = np.arange(graphs.capacity, graphs.capacity + num_seqs)  # the host's own ids
    if "fill_at" in a:
        gather[a["fill_at"]] = a["fill_from"]  # decode: token i is row i
    rows = {"tokens": a["input_ids"], "gather": gather, "positions": a["positions"],
            "slot_mapping": a["slot_mapping"], "seqlens_k": a["seqlens_k"], "decode_order": a["decode_order"]}
    if sampling_columns is not None:
        rows.update(sampling_columns)
    graphs.load(bucket, rows, a["block_tables"])
    input_ids, positions, meta = graphs.step_inputs(bucket, num_seqs)
    return StepInputs(input_ids=input_ids, positions=positions, meta=meta, logits_indices=None,
                      sampling_chunks=host.sampling_chunks)


def profiling_chunks(num_tokens: int, max_num_seqs: int, block_size: int, vocab_size: int,
                     generator: torch.Generator | None = None) -> tuple[list[ScheduledChunk], int]:
    """The largest step the scheduler may plan: num_tokens of prefill over up to max_num_seqs fresh
    sequences of random tokens (drawn from `generator`), on blocks 0.. in order. Returns the chunks
    and the blocks they use."""
    num_seqs = max(1, min(max_num_seqs, num_tokens))
    lengths = [num_tokens // num_seqs] * num_seqs
    lengths[-1] += num_tokens - sum(lengths)
    chunks, next_block = [], 0
    for i, n in enumerate(lengths):
        nb = -(-n // block_size)
        ids = torch.randint(0, vocab_size, (n,), generator=generator).tolist()
        seq = MirroredSeq(i, ids, n, list(range(next_block, next_block + nb)), 0, GREEDY_ROW)
        chunks.append(ScheduledChunk(seq, 0, n))
        next_block += nb
    return chunks, next_block
