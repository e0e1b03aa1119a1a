"""On CUDA, steps with a prefill chunk in piecewise graphs (executor_svc/piecewise_graphs.py): the layers between
attention calls replayed, attention eager. A mixed step gives the eager forward's hidden states and K/V, its padding
rows store nothing, and the engine's greedy tokens equal those of the engine without them."""
from __future__ import annotations

import pytest
import torch

from support.gpu_engine import generate
from support.hf_reference import assert_greedy_matches

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)


@pytest.fixture(scope="module")
def runner(gpu_qwen3_dir):
    from executor_svc.model_runner import ModelRunner
    from scheduler_svc.common.config import EngineConfig

    return ModelRunner(EngineConfig(model=gpu_qwen3_dir, device="cuda", dtype="float32", num_gpu_blocks=256,
                                    max_num_seqs=16, cuda_graph_max_tokens=512))


def mixed_step(num_decodes: int, prompt_len: int, seed: int):
    """num_decodes sequences decoding at ragged contexts, then one prompt's whole chunk: fresh random ids."""
    from executor_svc.seq_mirror import MirroredSeq, ScheduledChunk
    from protos import engine_pb2

    g = torch.Generator().manual_seed(seed)
    options = engine_pb2.SamplingOptions(temperature=0.0)
    chunks = []
    for i in range(num_decodes):
        n = int(torch.randint(5, 60, (1,), generator=g))
        ids = torch.randint(0, 1024, (n,), generator=g).tolist()
        seq = MirroredSeq(i, ids, n - 1, list(range(4 * i, 4 * i + 4)), n - 1, options)
        chunks.append(ScheduledChunk(seq, n - 1, n))
    ids = torch.randint(0, 1024, (prompt_len,), generator=g).tolist()
    first = 4 * num_decodes
    seq = MirroredSeq(100, ids, prompt_len, list(range(first, first + -(-prompt_len // 16))), 0, options)
    chunks.append(ScheduledChunk(seq, 0, prompt_len))
    return chunks


@pytest.mark.parametrize("num_decodes,prompt_len", [(5, 37), (0, 16), (11, 200), (3, 497)])
def test_a_mixed_step_in_piecewise_graphs_equals_the_eager_forward(runner, num_decodes, prompt_len):
    from executor_svc.input_batch import one_token_chunks_first

    assert runner.piecewise is not None
    cache = runner.kv_pool.cache
    with torch.inference_mode():
        inputs = runner.prepare_inputs(one_token_chunks_first(mixed_step(num_decodes, prompt_len, seed=prompt_len)))
        t = inputs.input_ids.shape[0]
        tb = runner.piecewise.bucket(t)
        assert tb is not None and tb >= t
        cache.normal_()  # stale K/V everywhere: the step's own slots are rewritten, the padding's must not be
        before = cache.clone()
        eager = runner.model(inputs.input_ids, inputs.positions, inputs.meta).clone()
        eager_cache = cache.clone()
        cache.copy_(before)
        graphed = runner._forward(inputs).clone()
        torch.cuda.synchronize()
    assert graphed.shape == eager.shape
    scale = eager.abs().max().item()
    assert scale > 0
    assert (graphed - eager).abs().max().item() <= 1e-4 * scale
    # the same K/V stored, at the step's slots and nowhere else (padding rows have slot -1)
    assert torch.allclose(cache, eager_cache, rtol=1e-5, atol=1e-5)
    per_slot = (cache != before).reshape(2, cache.shape[1], cache.shape[2] * cache.shape[3], -1)
    written = set(per_slot.any(dim=3).any(dim=1).any(dim=0).nonzero().flatten().tolist())
    assert written == set(inputs.meta.slot_mapping.tolist())


def test_piecewise_buckets_replay_after_one_another(runner):
    """Every bucket shares one memory pool: a smaller bucket replayed after a larger one, then the larger again,
    still gives the eager forward's hidden states (no bucket's replay corrupts another's inputs)."""
    from executor_svc.input_batch import one_token_chunks_first

    with torch.inference_mode():
        steps = [runner.prepare_inputs(one_token_chunks_first(mixed_step(d, n, seed=7 * n)))
                 for d, n in ((2, 300), (4, 20), (2, 300))]
        results = []
        for inputs in steps:
            graphed = runner._forward(inputs).clone()
            eager = runner.model(inputs.input_ids, inputs.positions, inputs.meta)
            results.append((graphed, eager))
        torch.cuda.synchronize()
    for graphed, eager in results:
        assert (graphed - eager).abs().max().item() <= 1e-4 * eager.abs().max().item()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_engine_with_piecewise_graphs_gives_the_same_greedy_tokens(gpu_qwen3_dir, gpu_prompts, dtype):
    """Chunked prefill beside decodes (a small token budget makes most steps mixed)."""
    piecewise, stats = generate(gpu_qwen3_dir, gpu_prompts, dtype=dtype, max_num_seqs=32,
                                max_num_batched_tokens=192)
    plain, _ = generate(gpu_qwen3_dir, gpu_prompts, dtype=dtype, max_num_seqs=32, max_num_batched_tokens=192,
                        cuda_graph_max_tokens=0)
    flips = 0.0 if dtype == "float32" else 1.0
    assert_greedy_matches(piecewise, [o.token_ids for o in plain], max_flip_fraction=flips)
