"""Filling a step's token masks: llguidance computes the rows on its own thread pool, outside the GIL, and
they are packed straight into the TokenBitmasks message that carries them.

A mask is ceil(V / 32) int32 words (151,936 tokens: 19 KB a row, 2.4 MB for 128 rows), so the copies count as
much as the fill on rank 0's critical path (DESIGN.md "Structured output"): the rows are written into one
reused array and copied once into the message, which the caller builds in its envelope (a protobuf
constructor given a message copies it whole). Identical rows go once (TokenBitmasks.rows): sequences at one
point of a grammar (inside a free string, at a key) have one mask, and every copy after this one (the
serialization, the socket, rank 0's parse and upload) moves each byte. A few rows, or all of them with one
thread, are filled in this thread, straight into the array: handing them to the pool costs more than it
saves, and llguidance.numpy's per-row wrapper checks the array again for every row (a third of a warm row's
time).
"""
from __future__ import annotations

import os

import llguidance
import numpy as np
import xxhash
from llguidance.numpy import fill_next_token_bitmask_par

from protos import engine_pb2

MAX_DEFAULT_THREADS = 8  # the step loop, the executors and the front ends share the machine
PARALLEL_FROM_ROWS = 8  # fewer rows are filled in this thread (a warm row takes 5-10 us, the hand-off ~10 us)


def distinct_rows(rows: np.ndarray) -> tuple[list[int], np.ndarray]:
    """(the first row of each distinct mask, in order; for each row, the index of its mask in that list).
    Rows are grouped by hash, and a row joins a group only if its bytes equal the group's first row's, so a
    hash collision costs a mask sent twice, never a wrong one. About 1 us a row and 2 us a repeat (151,936
    tokens), against some 20 us of copies saved for each repeat (this side's packing and serializing, rank
    0's parse and upload)."""
    first: dict[int, list[tuple[int, bytes]]] = {}  # hash -> (index into keep, bytes) of its distinct masks
    keep: list[int] = []
    index = np.empty(len(rows), dtype=np.uint32)
    for i, row in enumerate(rows):
        h = xxhash.xxh3_64_intdigest(row)
        same = first.get(h)
        if same is None:
            first[h] = [(len(keep), b"")]  # its bytes are taken only if another row has its hash
        else:
            data = row.tobytes()
            for g, (j, kept) in enumerate(same):
                if not kept:
                    kept = rows[keep[j]].tobytes()
                    same[g] = (j, kept)
                if kept == data:
                    index[i] = j
                    break
            else:
                same.append((len(keep), data))
                index[i] = len(keep)
                keep.append(i)
            continue
        index[i] = len(keep)
        keep.append(i)
    return keep, index


def default_fill_threads() -> int:
    """One per core this process may run on, less one for the step loop itself, at most MAX_DEFAULT_THREADS."""
    return max(1, min(MAX_DEFAULT_THREADS, len(os.sched_getaffinity(0)) - 1))


class MaskFiller:
    def __init__(self, vocab_size: int, num_threads: int = 0) -> None:
        self.num_words = (vocab_size + 31) // 32  # a mask covers every logit
        self.num_threads = num_threads or default_fill_threads()
        self._pool: llguidance.LLExecutor | None = None  # made on the first parallel fill
        self._bitmask = np.zeros((0, self.num_words), dtype=np.int32)  # grown to the most rows a step masked

    def fill(self, matchers: list[llguidance.LLMatcher], seq_ids: list[int], into: engine_pb2.TokenBitmasks,
             lexers: list[int] | None = None) -> None:
        """Each matcher's allowed next tokens, row i for matchers[i], written into `into` (a fresh message).
        lexers: which lexer each matcher shares (its grammar's CompiledGrammar.initial_states index)."""
        n = len(matchers)
        if n > len(self._bitmask):
            self._bitmask = np.zeros((max(n, 2 * len(self._bitmask)), self.num_words), dtype=np.int32)
        rows = self._bitmask[:n]  # C-contiguous: a slice of whole rows
        if self.num_threads > 1 and n >= PARALLEL_FROM_ROWS:
            if self._pool is None:
                self._pool = llguidance.LLExecutor(self.num_threads)
            jobs = list(zip(matchers, range(n)))
            if lexers is not None:
                # rows sharing a lexer take turns on its lock, so give each pool thread a run of one lexer's
                # rows: the pool splits the list into contiguous runs (rayon), and interleaved rows would put
                # every thread on the same lexer at once
                jobs = [jobs[i] for i in sorted(range(n), key=lexers.__getitem__)]
            fill_next_token_bitmask_par(self._pool, jobs, rows)
        else:
            address, row_bytes = rows.ctypes.data, rows.shape[1] * rows.itemsize
            for i, matcher in enumerate(matchers):  # what fill_next_token_bitmask does, the checks done once above
                matcher.unsafe_compute_mask_ptr(address + i * row_bytes, row_bytes)
        into.seq_ids.extend(seq_ids)
        into.num_words = self.num_words
        keep, index = distinct_rows(rows)
        if len(keep) < n:
            into.rows.extend(index.tolist())
            rows = rows[keep]
        into.words = rows.astype("<i4", copy=False).tobytes()
