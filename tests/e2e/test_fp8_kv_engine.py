"""The whole engine with a quantized KV cache (--kv-cache-dtype fp8, and int8) on the CPU (real scheduler
and executor processes, a tiny random Qwen3): preemption by recompute and by swap, chunked prefill,
prefix-cache hits and forks each give the tokens of the same quantized engine run unpressured. Paging
stays bookkeeping (invariant 5): the bytes a token's K/V became do not depend on where or when they
were written."""
from __future__ import annotations

import random

import pytest

from scheduler_svc.entrypoints.llm import LLM
from scheduler_svc.frontend.sampling_params import SamplingParams
from support.tiny_checkpoints import tiny_checkpoint

NEW_TOKENS = 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module", params=["fp8", "int8"])
def kv_cache_dtype(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    return tiny_checkpoint("qwen3", tmp_path_factory)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    rng = random.Random(5)
    shared = [rng.randrange(256) for _ in range(24)]  # a prefix six blocks long
    fresh = [[rng.randrange(256) for _ in range(rng.randint(1, 60))] for _ in range(8)]
    return fresh + [shared + [rng.randrange(256) for _ in range(rng.randint(1, 9))] for _ in range(4)]


def generate(model: str, kv_cache_dtype: str, prompts, params=GREEDY, **engine_args):
    with LLM(model, kv_cache_dtype=kv_cache_dtype, block_size=4, **engine_args) as llm:
        outs = [r.outputs for r in llm.generate(prompts, params, use_tqdm=False)]
        return outs, llm.stats()


@pytest.fixture(scope="module")
def unpressured(model, kv_cache_dtype, prompts) -> list[list[int]]:
    outs, stats = generate(model, kv_cache_dtype, prompts, num_gpu_blocks=4096, enable_prefix_caching=False)
    assert stats.num_preemptions == 0 and stats.prefix_cache_hit_tokens == 0
    return [o[0].token_ids for o in outs]


def tokens(outs) -> list[list[int]]:
    return [o[0].token_ids for o in outs]


def test_preemption_by_recompute_gives_the_unpressured_tokens(model, kv_cache_dtype, prompts, unpressured):
    outs, stats = generate(model, kv_cache_dtype, prompts, num_gpu_blocks=24, enable_prefix_caching=False)
    assert stats.num_preemptions > 0 and stats.num_swap_outs == 0
    assert tokens(outs) == unpressured


def test_preemption_by_swap_gives_the_unpressured_tokens(model, kv_cache_dtype, prompts, unpressured):
    outs, stats = generate(model, kv_cache_dtype, prompts, num_gpu_blocks=24, num_host_blocks=256, enable_prefix_caching=False)
    assert stats.num_swap_outs > 0 and stats.num_swapped == 0
    assert tokens(outs) == unpressured


def test_chunked_prefill_mixed_with_decodes_gives_the_unpressured_tokens(model, kv_cache_dtype, prompts, unpressured):
    outs, stats = generate(model, kv_cache_dtype, prompts, max_num_batched_tokens=16, enable_prefix_caching=False)
    assert stats.num_partial_prefill_chunks > 0 and stats.num_mixed_steps > 0
    assert tokens(outs) == unpressured


def test_prefix_cache_hits_give_the_unpressured_tokens(model, kv_cache_dtype, prompts, unpressured):
    with LLM(model, kv_cache_dtype=kv_cache_dtype, block_size=4) as llm:
        first = llm.generate(prompts[8:9], GREEDY, use_tqdm=False)
        rest = llm.generate(prompts[:8] + prompts[9:], GREEDY, use_tqdm=False)
        stats = llm.stats()
    assert all(r.num_cached_tokens >= 24 for r in rest[8:]), [r.num_cached_tokens for r in rest]
    assert stats.prefix_cache_hit_tokens >= 3 * 24
    got = [r.outputs[0].token_ids for r in rest[:8] + first + rest[8:]]
    assert got == unpressured


def test_forked_samples_copy_quantized_blocks_on_write_and_give_the_unpressured_tokens(model, kv_cache_dtype, prompts, unpressured):
    # three greedy samples of each prompt: the later ones fork the first's blocks and copy the last one
    outs, stats = generate(model, kv_cache_dtype, prompts[:6], SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS,
                                                              ignore_eos=True, n=3), enable_prefix_caching=False)
    assert [[s.token_ids for s in o] for o in outs] == [[t] * 3 for t in unpressured[:6]]
    assert stats.free_kv_blocks == stats.total_kv_blocks
