"""n-gram proposals (prompt lookup): the tokens that followed the sequence's last n tokens where those n tokens
occurred before, in the prompt or the output. Editing, summarising and code repeat long runs of their input, so
the continuation of an earlier occurrence is often what the model writes next. Token ids only: no model."""
from __future__ import annotations

import numpy as np

SEARCH_WINDOW = 4096  # the most recent tokens searched for a match


def propose_ngram(token_ids: list[int], k: int, n_min: int, n_max: int) -> list[int]:
    """Up to k tokens: the continuation of the most recent earlier occurrence of the longest suffix of
    token_ids of n_min..n_max tokens that occurred before. Empty when none did."""
    length = len(token_ids)
    if k <= 0 or length < n_min + 1:
        return []
    n_max = min(n_max, length - 1)
    window = token_ids[-SEARCH_WINDOW:]  # bounds a step's cost on long sequences
    arr = np.asarray(window, dtype=np.int64)
    offset = length - len(arr)
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
    end = int(ends[np.flatnonzero(match == best)[-1]]) + offset
    return token_ids[end + 1: end + 1 + k]
