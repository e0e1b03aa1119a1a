"""Filling a step's token masks (scheduler_svc/core/structured/mask_fill.py): llguidance's thread pool gives
exactly the masks that one thread does, on fresh grammars whose lexer states are built while the rows are
filled; a few rows are filled serially; the rows land in the message in the order of their sequences."""
from __future__ import annotations

import json

import llguidance
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask

from protos import engine_pb2
from scheduler_svc.core.structured import mask_fill
from scheduler_svc.core.structured.compiler import tokenizer_loader
from scheduler_svc.core.structured.grammars import grammar_of
from scheduler_svc.core.structured.mask_fill import PARALLEL_FROM_ROWS, MaskFiller
from support.structured_serving import EOS, VOCAB, allowed_tokens, masks_of

WORDS = st.text(alphabet="abcxyz019 ", min_size=1, max_size=6)


@pytest.fixture(scope="module")
def lltokenizer(embedded_model):
    return tokenizer_loader(embedded_model, VOCAB, (EOS,))()


def constraints() -> st.SearchStrategy[engine_pb2.Constraint]:
    """Small grammars of every kind, different each time: a fresh grammar builds its lexer states lazily."""
    schema = st.builds(lambda names, max_len, lo: {
        "type": "object", "additionalProperties": False, "required": names[:1],
        "properties": {name: {"type": "string", "maxLength": max_len} if i % 2 else
                       {"type": "integer", "minimum": lo} for i, name in enumerate(names)}},
        st.lists(st.text(alphabet="abcdef", min_size=1, max_size=5), min_size=1, max_size=3, unique=True),
        st.integers(1, 30), st.integers(-5, 5))
    return st.one_of(
        schema.map(lambda s: engine_pb2.Constraint(json_schema=json.dumps(s))),
        st.builds(lambda a, n: engine_pb2.Constraint(regex=f"[{a}]{{1,{n}}}( [0-9]+)?"),
                  st.sampled_from(["a-z", "a-f0-9", "xyz"]), st.integers(2, 40)),
        st.lists(WORDS, min_size=1, max_size=4, unique=True).map(
            lambda words: engine_pb2.Constraint(choice=engine_pb2.ChoiceList(choices=words))))


def walked_matchers(lltokenizer, constraint: engine_pb2.Constraint, num_rows: int, rng: np.random.Generator
                    ) -> list[llguidance.LLMatcher]:
    """num_rows copies of a freshly compiled grammar, each walked some random allowed tokens in."""
    template = llguidance.LLMatcher(lltokenizer, grammar_of(constraint), log_level=0)
    mask = allocate_token_bitmask(1, VOCAB)
    matchers = []
    for _ in range(num_rows):
        matcher = template.deep_copy()
        for _ in range(int(rng.integers(0, 12))):
            fill_next_token_bitmask(matcher, mask)
            if matcher.is_stopped():
                break
            assert matcher.consume_token(int(rng.choice(allowed_tokens(mask[0]))))
        matchers.append(matcher)
    return matchers


def filled(filler: MaskFiller, matchers: list[llguidance.LLMatcher], lexers: list[int] | None = None
           ) -> engine_pb2.TokenBitmasks:
    masks = engine_pb2.TokenBitmasks()
    filler.fill(matchers, [100 + i for i in range(len(matchers))], masks, lexers)
    return masks


def sent_words(masks: engine_pb2.TokenBitmasks) -> bytes:
    """Every sequence's mask, in order, as rank 0 reads them (a mask sent once for several counts for each)."""
    return b"".join(row.tobytes() for row in masks_of(masks).values())


def reference_words(matchers: list[llguidance.LLMatcher]) -> bytes:
    """The rows as llguidance.numpy's own one-row fill writes them."""
    mask = allocate_token_bitmask(len(matchers), VOCAB)
    for i, matcher in enumerate(matchers):
        fill_next_token_bitmask(matcher, mask, i)
    return mask.tobytes()


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(constraint=constraints(), num_rows=st.integers(1, 2 * PARALLEL_FROM_ROWS), seed=st.integers(0, 2**16),
       data=st.data())
def test_the_pool_and_the_loops_own_thread_fill_bit_for_bit_llguidances_masks(lltokenizer, constraint, num_rows,
                                                                               seed, data):
    # the same walk on fresh compiles: each fill meets lexer states its grammar has not built yet
    def walk() -> list[llguidance.LLMatcher]:
        return walked_matchers(lltokenizer, constraint, num_rows, np.random.default_rng(seed))

    expected = reference_words(walk())
    for threads in (1, 4):  # with 4, the rows go to the pool from PARALLEL_FROM_ROWS on
        masks = filled(MaskFiller(VOCAB, num_threads=threads), walk())
        assert sent_words(masks) == expected
        assert list(masks.seq_ids) == [100 + i for i in range(num_rows)] and masks.num_words == VOCAB // 32
    # the pool takes the rows grouped by lexer, yet each lands in its sequence's row
    lexers = data.draw(st.lists(st.integers(0, 3), min_size=num_rows, max_size=num_rows))
    assert sent_words(filled(MaskFiller(VOCAB, num_threads=4), walk(), lexers)) == expected
    assert all(len(allowed_tokens(row)) for row in masks_of(masks).values())  # every row allows something


def test_the_pool_gets_each_lexers_rows_as_one_run(lltokenizer, monkeypatch):
    # rows sharing a lexer take turns on its lock: interleaved, every pool thread would wait on the same one
    handed = []
    monkeypatch.setattr(mask_fill, "fill_next_token_bitmask_par", lambda pool, jobs, rows: handed.extend(jobs))
    matchers = walked_matchers(lltokenizer, engine_pb2.Constraint(regex="[a-z]{1,20}"), 9, np.random.default_rng(2))
    filled(MaskFiller(VOCAB, num_threads=3), matchers, [i % 3 for i in range(9)])
    assert [row for _, row in handed] == [0, 3, 6, 1, 4, 7, 2, 5, 8]
    assert [m for m, _ in handed] == [matchers[row] for _, row in handed]


def test_a_filler_reused_for_fewer_rows_sends_only_those_rows(lltokenizer):
    rng = np.random.default_rng(0)
    matchers = walked_matchers(lltokenizer, engine_pb2.Constraint(regex="[a-z]{1,20}"), 8, rng)
    filler = MaskFiller(VOCAB, num_threads=4)
    filled(filler, matchers)
    two = filled(filler, matchers[:2])  # the filler's rows 2..7 still hold the first fill
    assert list(two.seq_ids) == [100, 101] and sent_words(two) == reference_words(matchers[:2])
    assert two == filled(MaskFiller(VOCAB, num_threads=1), matchers[:2])


def test_sequences_at_one_point_of_a_grammar_send_their_mask_once(lltokenizer):
    template = llguidance.LLMatcher(lltokenizer, grammar_of(engine_pb2.Constraint(regex="[a-z]{1,20}")), log_level=0)
    other = walked_matchers(lltokenizer, engine_pb2.Constraint(regex="[0-9]{2,3}"), 1, np.random.default_rng(3))[0]
    matchers = [template.deep_copy() for _ in range(5)] + [other] + [template.deep_copy()]
    masks = filled(MaskFiller(VOCAB, num_threads=1), matchers)
    assert list(masks.rows) == [0, 0, 0, 0, 0, 1, 0] and len(masks.words) == 2 * (VOCAB // 32) * 4
    assert sent_words(masks) == reference_words(matchers)
    distinct = filled(MaskFiller(VOCAB, num_threads=1), [template.deep_copy(), other])
    assert not distinct.rows and len(distinct.words) == 2 * (VOCAB // 32) * 4  # nothing shared: no row list


@settings(max_examples=50, deadline=None)
@given(picks=st.lists(st.integers(0, 5), min_size=0, max_size=24), collide=st.booleans(), seed=st.integers(0, 99))
def test_distinct_rows_rebuild_every_row_and_keep_no_mask_twice(picks, collide, seed):
    pool = np.random.default_rng(seed).integers(-2**31, 2**31, size=(6, 7), dtype=np.int64).astype(np.int32)
    pool[5] = pool[4]
    pool[3, -1] ^= 1  # rows 2 and 3 differ in a single bit
    pool[2] = pool[3]
    pool[2, -1] ^= 1
    rows = pool[picks] if picks else np.zeros((0, 7), dtype=np.int32)
    hash_row = mask_fill.xxhash.xxh3_64_intdigest
    try:
        if collide:  # every row has one hash: equality alone must tell them apart
            mask_fill.xxhash.xxh3_64_intdigest = lambda row: 7
        keep, index = mask_fill.distinct_rows(rows)
    finally:
        mask_fill.xxhash.xxh3_64_intdigest = hash_row
    assert np.array_equal(rows[keep][index], rows)
    assert len({rows[i].tobytes() for i in keep}) == len(keep)
    assert keep == sorted(keep) and [int(index[i]) for i in keep] == list(range(len(keep)))


def test_few_rows_are_filled_without_the_pool_and_one_thread_never_makes_one(lltokenizer, monkeypatch):
    made, make = [], llguidance.LLExecutor
    monkeypatch.setattr(mask_fill.llguidance, "LLExecutor", lambda n: made.append(n) or make(n))
    matchers = walked_matchers(lltokenizer, engine_pb2.Constraint(regex="[0-9]{1,9}"), PARALLEL_FROM_ROWS,
                               np.random.default_rng(1))
    pooled, serial = MaskFiller(VOCAB, num_threads=3), MaskFiller(VOCAB, num_threads=1)
    filled(pooled, matchers[: PARALLEL_FROM_ROWS - 1])
    filled(serial, matchers)
    assert made == []
    filled(pooled, matchers)
    assert made == [3]


def test_the_default_pool_leaves_a_core_to_the_step_loop_and_is_bounded(monkeypatch):
    for cores, threads in ((1, 1), (2, 1), (4, 3), (16, mask_fill.MAX_DEFAULT_THREADS)):
        monkeypatch.setattr(mask_fill.os, "sched_getaffinity", lambda pid, n=cores: set(range(n)))
        assert mask_fill.default_fill_threads() == threads
        assert MaskFiller(VOCAB).num_threads == threads
