"""The token buckets of the piecewise CUDA graphs (executor_svc/piecewise_graphs.py): which graphs a step with a
prefill chunk replays, and how much padding that costs. The graphs themselves need CUDA:
tests/executor/test_gpu_piecewise_graphs.py."""
from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from executor_svc.piecewise_graphs import bucket_for, token_buckets


@given(st.integers(1, 16384), st.integers(1, 16384))
def test_a_step_replays_the_smallest_bucket_that_holds_it(max_tokens, num_tokens):
    buckets = token_buckets(max_tokens)
    assert buckets == sorted(set(buckets)) and buckets[-1] == max_tokens and buckets[0] <= 16
    chosen = bucket_for(buckets, num_tokens)
    if num_tokens > max_tokens:
        assert chosen is None  # runs eagerly
        return
    assert chosen in buckets and chosen >= num_tokens
    assert all(b < num_tokens for b in buckets if b < chosen)
    # padding: at most 16 rows, or the step's own size below 256 tokens, or 255 rows above
    assert chosen - num_tokens <= max(15, num_tokens - 1 if num_tokens <= 256 else 255)


def test_no_buckets_when_piecewise_graphs_are_off():
    assert token_buckets(0) == []
    assert bucket_for(token_buckets(0), 1) is None


def test_a_negative_token_limit_is_refused():
    import pytest

    from scheduler_svc.common.config import EngineConfig

    with pytest.raises(ValueError, match="--cuda-graph-max-tokens must be >= 0, got -1"):
        EngineConfig(cuda_graph_max_tokens=-1)
    assert EngineConfig(cuda_graph_max_tokens=0).cuda_graph_max_tokens == 0
