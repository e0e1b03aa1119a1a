"""The piecewise CUDA graphs (executor_svc/piecewise_graphs.py) on the CPU: the token buckets a step with a prefill
chunk replays and the padding that costs, the cut they rest on (Attention.cut, Attention.attend): a forward whose
attention goes through the cut gives the same hidden states and K/V; and what a failed capture does. The graphs
themselves need CUDA: tests/executor/test_gpu_piecewise_graphs.py."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from executor_svc.piecewise_graphs import bucket_for, capture_or_fall_back, token_buckets
from support.tiny_checkpoints import make_tiny_qwen3


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
    from scheduler_svc.common.config import EngineConfig

    with pytest.raises(ValueError, match="--cuda-graph-max-tokens must be >= 0, got -1"):
        EngineConfig(cuda_graph_max_tokens=-1)
    assert EngineConfig(cuda_graph_max_tokens=0).cuda_graph_max_tokens == 0


def test_a_forward_cut_at_each_attention_gives_the_same_hidden_states_and_kv(tmp_path):
    """What the graphs replay around: each layer's part before attention (q/k norm, RoPE, the K/V store) runs, the
    cut receives q, and what it returns is what the rest of the layer reads. A cut that attends eagerly (as a replay
    does between its segments) gives the plain forward's hidden states and K/V, on a mixed step of decodes and a
    prefill chunk; a cut is called once per layer, in layer order."""
    from executor_svc.input_batch import one_token_chunks_first
    from executor_svc.model_runner import ModelRunner
    from executor_svc.seq_mirror import MirroredSeq, ScheduledChunk
    from protos import engine_pb2
    from scheduler_svc.common.config import EngineConfig

    model = make_tiny_qwen3(str(tmp_path / "qwen3"))
    runner = ModelRunner(EngineConfig(model=model, device="cpu", dtype="float32", block_size=16, num_gpu_blocks=32,
                                      max_num_seqs=4, attention_backend="torch"))
    g = torch.Generator().manual_seed(3)
    options = engine_pb2.SamplingOptions(temperature=0.0)
    chunks = []
    for i, n in enumerate((9, 30)):  # two decodes at ragged contexts
        seq = MirroredSeq(i, torch.randint(0, 100, (n,), generator=g).tolist(), n - 1, [2 * i, 2 * i + 1], n - 1,
                          options)
        chunks.append(ScheduledChunk(seq, n - 1, n))
    prompt = MirroredSeq(9, torch.randint(0, 100, (21,), generator=g).tolist(), 21, [4, 5], 0, options)
    chunks.append(ScheduledChunk(prompt, 0, 21))
    layers = runner.model.attention_layers()
    cache = runner.kv_pool.cache
    with torch.inference_mode():
        inputs = runner.prepare_inputs(one_token_chunks_first(chunks))
        cache.copy_(torch.randn(cache.shape, generator=g))  # stale K/V, never zeros
        before = cache.clone()
        plain = runner.model(inputs.input_ids, inputs.positions, inputs.meta)
        plain_cache = cache.clone()
        cache.copy_(before)
        seen = []

        def cut(layer, q):
            seen.append(layer)
            assert q.shape == (inputs.input_ids.shape[0], layer.num_heads, layer.head_dim)
            return layer.attend(q.clone(), inputs.meta)

        for layer in layers:
            layer.cut = cut
        try:
            through_cut = runner.model(inputs.input_ids, inputs.positions, inputs.meta)
            cut_cache = cache.clone()
            for layer in layers:  # what the cut returns is what the layer reads on
                layer.cut = lambda layer, q: torch.zeros(q.shape[0], layer.num_heads * layer.head_dim)
            zeroed = runner.model(inputs.input_ids, inputs.positions, inputs.meta)
        finally:
            for layer in layers:
                layer.cut = None
    assert seen == layers
    assert not torch.equal(plain_cache, before)  # the step stored K/V
    torch.testing.assert_close(cut_cache, plain_cache, rtol=0, atol=0)
    torch.testing.assert_close(through_cut, plain, rtol=0, atol=0)
    assert not torch.allclose(zeroed, plain)


class _FailingCapture:
    """Stands in for PiecewiseGraphs whose capture raises (a unit test of the policy alone: capture needs CUDA)."""

    def capture(self) -> None:
        raise RuntimeError("operation not permitted when stream is capturing")


class _Capturing:
    captured = False

    def capture(self) -> None:
        self.captured = True


def test_capture_failure_falls_back_on_one_gpu_and_ends_start_up_under_tensor_parallel(caplog):
    graphs = _Capturing()
    assert capture_or_fall_back(graphs, rank=0, world_size=2) is graphs and graphs.captured
    with caplog.at_level("WARNING", logger="nanoserve.executor"):
        assert capture_or_fall_back(_FailingCapture(), rank=0, world_size=1) is None
    assert "run eagerly" in caplog.text
    with pytest.raises(RuntimeError, match=r"rank 1: .*--cuda-graph-max-tokens 0") as raised:
        capture_or_fall_back(_FailingCapture(), rank=1, world_size=2)
    assert "stream is capturing" in str(raised.value.__cause__)
