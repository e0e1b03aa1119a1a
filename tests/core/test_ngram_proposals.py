"""n-gram proposals (prompt lookup): the continuation of the latest earlier occurrence of the longest suffix
that occurred before."""
from __future__ import annotations

from unittest import mock

from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler_svc.core.speculative import ngram
from scheduler_svc.core.speculative.ngram import ngram_proposer, propose_ngram


def test_the_continuation_of_the_longest_earlier_match_is_proposed():
    tokens = [1, 2, 3, 4, 5, 9, 3, 4, 7, 1, 2, 3, 4]
    # "1 2 3 4" occurred at the start, followed by 5 9 3; "3 4" alone last occurred before 7
    assert propose_ngram(tokens, 3, 1, 4) == [5, 9, 3]
    assert propose_ngram(tokens, 3, 1, 2) == [7, 1, 2]
    assert propose_ngram(tokens, 10, 1, 4) == [5, 9, 3, 4, 7, 1, 2, 3, 4]  # up to the end of what is known


def test_nothing_is_proposed_without_a_match_of_the_shortest_length():
    assert propose_ngram([1, 2, 3, 4], 3, 1, 3) == []
    assert propose_ngram([1, 2, 9, 2], 3, 2, 3) == []  # "2" occurred, "9 2" did not
    assert propose_ngram([1, 2, 9, 2], 3, 1, 3) == [9, 2]
    assert propose_ngram([5], 3, 1, 3) == [] and propose_ngram([5, 5], 0, 1, 3) == []


@settings(max_examples=300, deadline=None)
@given(tokens=st.lists(st.integers(0, 4), min_size=1, max_size=60), k=st.integers(1, 6), n_min=st.integers(1, 3),
       extra=st.integers(0, 3))
def test_a_proposal_continues_an_earlier_occurrence_of_the_longest_matching_suffix(tokens, k, n_min, extra):
    n_max = n_min + extra
    proposal = propose_ngram(tokens, k, n_min, n_max)
    matches = {}  # suffix length -> the latest earlier end position where that suffix occurred
    for n in range(n_min, min(n_max, len(tokens) - 1) + 1):
        ends = [e for e in range(n - 1, len(tokens) - 1) if tokens[e - n + 1: e + 1] == tokens[-n:]]
        if ends:
            matches[n] = ends[-1]
    if not matches:
        assert proposal == []
        return
    longest = max(matches)
    # the longest match wins, its latest occurrence, and nothing shorter that occurred later
    end = max(e for n, e in matches.items() if n == longest)
    assert proposal == tokens[end + 1: end + 1 + k]
    assert 1 <= len(proposal) <= k


class GrowingSeq:
    """What the engine's proposer reads of a sequence: its known tokens and its per-sequence cache."""

    def __init__(self) -> None:
        self.token_ids: list[int] = []
        self.proposer_cache = None


@settings(max_examples=300, deadline=None)
@given(tokens=st.lists(st.integers(0, 4), min_size=1, max_size=60), cuts=st.lists(st.integers(0, 60), max_size=4),
       tail=st.lists(st.integers(0, 4), max_size=8), k=st.integers(0, 6), n_min=st.integers(1, 3),
       extra=st.integers(0, 3))
def test_the_engines_index_proposes_what_the_reference_search_does_as_tokens_are_appended(tokens, cuts, tail, k,
                                                                                           n_min, extra):
    """The index grows with the sequence (asked at several lengths on the way) and searches assumed tokens (steps
    in flight) after the known ones directly."""
    propose = ngram_proposer(n_min, n_min + extra)
    seq = GrowingSeq()
    for cut in sorted(cuts) + [len(tokens)]:
        seq.token_ids = tokens[:cut]
        assumed = seq.token_ids + tail
        assert propose(seq, assumed, k) == propose_ngram(assumed, k, n_min, n_min + extra)


@settings(max_examples=200, deadline=None)
@given(tokens=st.lists(st.integers(0, 3), min_size=40, max_size=120), step=st.integers(1, 9),
       tail=st.lists(st.integers(0, 3), max_size=4), k=st.integers(1, 4), n_min=st.integers(1, 2),
       extra=st.integers(0, 2))
def test_a_long_sequences_index_stays_within_two_windows_and_proposes_what_the_reference_does(tokens, step, tail, k,
                                                                                              n_min, extra):
    """With a window of 8 tokens and sequences of up to 120: past the window the index forgets what can no longer
    match, so its size stays bounded, and it still proposes exactly what the reference search over the window
    does."""
    n_max = n_min + extra
    with mock.patch.object(ngram, "SEARCH_WINDOW", 8):
        propose = ngram_proposer(n_min, n_max)
        seq = GrowingSeq()
        for cut in list(range(step, len(tokens), step)) + [len(tokens)]:
            seq.token_ids = tokens[:cut]
            assumed = seq.token_ids + tail
            assert propose(seq, assumed, k) == propose_ngram(assumed, k, n_min, n_max)
            index = seq.proposer_cache
            assert all(end >= cut - 1 - 2 * 8 for end in index.ends.values())
            assert len(index.ends) <= 2 * 8 * (n_max - n_min + 1)
