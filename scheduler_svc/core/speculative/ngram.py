"""n-gram proposals (prompt lookup): the tokens that followed the sequence's last n tokens where those n tokens
occurred before, in the prompt or the output. Editing, summarising and code repeat long runs of their input, so
the continuation of an earlier occurrence is often what the model writes next. Token ids only: no model."""
from __future__ import annotations

import numpy as np

SEARCH_WINDOW = 4096  # the most recent tokens searched for a match


def propose_ngram(token_ids: list[int], k: int, n_min: int, n_max: int) -> list[int]:
    """Up to k tokens: the continuation of the most recent earlier occurrence of the longest suffix of
    token_ids of n_min..n_max tokens that occurred before. Empty when none did."""
    return propose_in_window(np.asarray(token_ids[-SEARCH_WINDOW:], dtype=np.int64), k, n_min, n_max)


class TokenArray:
    """A sequence's tokens as a numpy array, grown as they are appended: converting a list of thousands of ids
    at every step cost more than the search (~100 us for 1,000 tokens)."""

    __slots__ = ("buf", "size")

    def __init__(self) -> None:
        self.buf = np.empty(256, dtype=np.int64)
        self.size = 0

    def window(self, known: list[int], tokens: list[int]) -> np.ndarray:
        """The last SEARCH_WINDOW of tokens, whose first len(known) are known (the sequence's, which only grow)
        and the rest assumed (steps in flight)."""
        n = len(known)
        if n < self.size:  # not the list it mirrored: start again
            self.size = 0
        if n > len(self.buf):
            grown = np.empty(max(n, 2 * len(self.buf)), dtype=np.int64)
            grown[: self.size] = self.buf[: self.size]
            self.buf = grown
        if n > self.size:
            self.buf[self.size: n] = known[self.size: n]
            self.size = n
        tail = tokens[n:]
        if not tail:
            return self.buf[max(0, n - SEARCH_WINDOW): n]
        keep = max(0, SEARCH_WINDOW - len(tail))
        return np.concatenate([self.buf[max(0, n - keep): n], np.asarray(tail[-SEARCH_WINDOW:], dtype=np.int64)])


def ngram_proposer(n_min: int, n_max: int):
    """A Proposer (speculator.py) keeping each sequence's tokens as an array (Sequence.proposer_cache)."""
    def propose(seq, tokens: list[int], k: int) -> list[int]:
        if k <= 0 or len(tokens) < n_min + 1:
            return []
        cache = seq.proposer_cache
        if not isinstance(cache, TokenArray):
            cache = seq.proposer_cache = TokenArray()
        return propose_in_window(cache.window(seq.token_ids, tokens), k, n_min, n_max)
    return propose


def propose_in_window(arr: np.ndarray, k: int, n_min: int, n_max: int) -> list[int]:
    """propose_ngram over the window's tokens, an int64 array."""
    length = len(arr)
    if k <= 0 or length < n_min + 1:
        return []
    n_max = min(n_max, length - 1)
    last = arr[-1]
    # candidate ends: earlier positions holding the last token (not the last position itself)
    ends = np.flatnonzero(arr[:-1] == last)
    if ends.size == 0:
        return []
    # how far each candidate's match runs backwards, up to n_max tokens
    match = np.ones(ends.size, dtype=np.int64)
    alive = np.ones(ends.size, dtype=bool)
    for back in range(1, n_max):
        prev = ends - back
        ok = alive & (prev >= 0)
        ok[ok] &= arr[prev[ok]] == arr[-1 - back]
        match += ok
        alive = ok
        if not alive.any():
            break
    best = int(match.max())
    if best < n_min:
        return []
    # the most recent occurrence among the longest matches
    end = int(ends[np.flatnonzero(match == best)[-1]])
    return arr[end + 1: end + 1 + k].tolist()
