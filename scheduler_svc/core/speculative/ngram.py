"""n-gram proposals (prompt lookup): the tokens that followed the sequence's last n tokens where those n tokens
occurred before, in the prompt or the output. Editing, summarising and code repeat long runs of their input, so
the continuation of an earlier occurrence is often what the model writes next. Token ids only: no model."""
from __future__ import annotations

import numpy as np

SEARCH_WINDOW = 4096  # the most recent tokens searched for a match


def propose_ngram(token_ids: list[int], k: int, n_min: int, n_max: int) -> list[int]:
    """Up to k tokens: the continuation of the most recent earlier occurrence of the longest suffix of
    token_ids of n_min..n_max tokens that occurred before. Empty when none did. The reference search, over an
    array: the engine uses NgramIndex, which finds the same."""
    arr = np.asarray(token_ids[-SEARCH_WINDOW:], dtype=np.int64)  # bounds the search on long sequences
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


class NgramIndex:
    """The most recent end of every n-gram (n_min..n_max tokens) of a sequence's known tokens, kept as they are
    appended: a proposal is then a few dictionary lookups, where a search over an array costs a dozen numpy calls
    (~15-40 us) per sequence and step. Ends are indexed up to the second-to-last known token: the last one's own
    n-grams are the suffix being looked up, not an earlier occurrence. Every SEARCH_WINDOW tokens the ends that fell
    out of the window go, so a long sequence holds at most two windows' n-grams."""

    __slots__ = ("ends", "indexed", "pruned_at", "n_min", "n_max")

    def __init__(self, n_min: int, n_max: int) -> None:
        self.ends: dict[tuple[int, ...], int] = {}
        self.indexed = 0  # ends 0 .. indexed - 1 are in
        self.pruned_at = 0  # indexed when the ends before the window were last dropped
        self.n_min, self.n_max = n_min, n_max

    def _extend(self, known: list[int]) -> None:
        if len(known) - 1 < self.indexed:  # not the list it indexed: start again
            self.ends.clear()
            self.indexed = self.pruned_at = 0
        if len(known) - 1 - self.pruned_at >= SEARCH_WINDOW:
            # an end before this can never lie in the window again (propose's `lowest` only grows): drop it, where
            # it would only be overwritten by a later occurrence of its n-gram
            lowest = len(known) - SEARCH_WINDOW
            self.ends = {key: end for key, end in self.ends.items() if end >= lowest}
            self.pruned_at = len(known) - 1
        ends = self.ends
        # ends before the search window never count: a long prompt is indexed from its last SEARCH_WINDOW tokens
        for end in range(max(self.indexed, len(known) - 1 - SEARCH_WINDOW), len(known) - 1):
            for n in range(self.n_min, min(self.n_max, end + 1) + 1):
                ends[tuple(known[end - n + 1: end + 1])] = end
        self.indexed = max(self.indexed, len(known) - 1)

    def propose(self, known: list[int], tokens: list[int], k: int) -> list[int]:
        """propose_ngram(tokens, k, n_min, n_max), where tokens starts with known (the sequence's tokens, which only
        grow) and goes on with assumed ones (steps in flight), searched directly."""
        self._extend(known)
        length = len(tokens)
        if k <= 0 or length < self.n_min + 1:
            return []
        lowest = length - SEARCH_WINDOW  # the first position of the window an occurrence must lie in
        for n in range(min(self.n_max, length - 1), self.n_min - 1, -1):
            key = tuple(tokens[length - n:])
            end = -1
            for e in range(length - 2, max(len(known) - 1, n - 1) - 1, -1):  # ends among the assumed tokens
                if tuple(tokens[e - n + 1: e + 1]) == key:
                    end = e
                    break
            if end < 0:
                end = self.ends.get(key, -1)
            if end >= 0 and end - n + 1 >= lowest:
                return tokens[end + 1: end + 1 + k]
        return []


def ngram_proposer(n_min: int, n_max: int):
    """A Proposer (speculator.py) keeping each sequence's n-gram index (Sequence.proposer_cache)."""
    def propose(seq, tokens: list[int], k: int) -> list[int]:
        index = seq.proposer_cache
        if not isinstance(index, NgramIndex):
            index = seq.proposer_cache = NgramIndex(n_min, n_max)
        return index.propose(seq.token_ids, tokens, k)
    return propose
