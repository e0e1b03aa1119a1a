"""End to end through the real scheduler and executor processes: greedy tokens equal HF transformers
(fp32, same weights), also when preemption, chunked prefill and prefix caching are forced."""
from __future__ import annotations

import dataclasses
import random

import pytest

from support.hf_reference import assert_greedy_matches, hf_greedy
from scheduler_svc.entrypoints.llm import LLM
from scheduler_svc.frontend.sampling_params import SamplingParams
from scheduler_svc.text.tokenizer import Tokenizer
from support.tiny_checkpoints import tiny_checkpoint

NEW_TOKENS = 24
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=5)

TOPICS = [
    "What is the capital of France?", "Write a haiku about the sea.", "Explain photosynthesis simply.",
    "List three prime numbers.", "Who wrote Hamlet?", "Translate 'good morning' into Spanish.",
    "Why is the sky blue?", "Give me a recipe for pancakes.", "What does a CPU do?",
    "Describe a cat in one sentence.", "How many legs does a spider have?", "What is 12 times 12?",
    "Name a famous painter.", "Summarize the plot of Cinderella.", "What is machine learning?", "Say hello.",
]


def smol_prompts(tokenizer: Tokenizer) -> list[list[int]]:
    """16 prompts of mixed lengths: chat-formatted questions, some with a long preamble."""
    rng = random.Random(7)
    prompts = []
    for i, topic in enumerate(TOPICS):
        preamble = " ".join(["Please answer carefully and think about every detail."] * rng.randint(0, 12))
        prompts.append(tokenizer.encode_chat([{"role": "user", "content": f"{preamble} {topic}".strip()}]))
    return prompts


@pytest.fixture(scope="module")
def smol_case(embedded_model):
    prompts = smol_prompts(Tokenizer(embedded_model))
    return prompts, hf_greedy(embedded_model, prompts, NEW_TOKENS)


def run_engine(model_dir: str, prompts: list[list[int]], **engine_args):
    with LLM(model_dir, **engine_args) as llm:
        results = llm.generate(prompts, GREEDY, use_tqdm=False)
        stats = llm.stats()
    return [r.outputs[0] for r in results], stats


def test_smollm2_greedy_batch_of_16_equals_transformers(embedded_model, smol_case):
    prompts, ref = smol_case
    assert len({len(p) for p in prompts}) >= 8, "prompts should have mixed lengths"
    outs, stats = run_engine(embedded_model, prompts)
    assert_greedy_matches(outs, ref)
    assert stats.num_running == 0 and stats.num_waiting == 0
    assert stats.free_kv_blocks == stats.total_kv_blocks


def test_smollm2_equals_transformers_when_kv_pool_forces_preemption(embedded_model, smol_case):
    prompts, ref = smol_case
    longest_blocks = -(-max(len(p) + NEW_TOKENS for p in prompts) // 16)
    outs, stats = run_engine(embedded_model, prompts, num_gpu_blocks=longest_blocks + 8)
    assert stats.num_preemptions > 0, "the pool was meant to be too small for the batch"
    assert_greedy_matches(outs, ref)
    assert stats.free_kv_blocks == stats.total_kv_blocks


def test_smollm2_equals_transformers_when_preempted_sequences_swap_to_host(embedded_model, smol_case):
    prompts, ref = smol_case
    longest_blocks = -(-max(len(p) + NEW_TOKENS for p in prompts) // 16)
    outs, stats = run_engine(embedded_model, prompts, num_gpu_blocks=longest_blocks + 8, num_host_blocks=256)
    assert stats.num_swap_outs > 0, "the pool was meant to be too small for the batch"
    assert_greedy_matches(outs, ref)
    assert stats.free_kv_blocks == stats.total_kv_blocks and stats.num_swapped == 0


def test_smollm2_equals_transformers_with_chunked_prefill_mixed_with_decodes(embedded_model, smol_case):
    prompts, ref = smol_case
    outs, stats = run_engine(embedded_model, prompts, max_num_batched_tokens=48)
    assert stats.num_partial_prefill_chunks > 0, "prompts longer than the budget must be chunked"
    assert stats.num_mixed_steps > 0, "prefill chunks must share steps with decodes"
    assert_greedy_matches(outs, ref)


def test_smollm2_equals_transformers_with_shared_prefix_cache_hits(embedded_model):
    tokenizer = Tokenizer(embedded_model)
    system = "You are a meticulous assistant who double-checks every fact. " * 12
    prompts = [tokenizer.encode_chat([{"role": "system", "content": system}, {"role": "user", "content": t}])
               for t in TOPICS[:8]]
    ref = hf_greedy(embedded_model, prompts, NEW_TOKENS)
    with LLM(embedded_model) as llm:
        first = llm.generate(prompts[:1], GREEDY, use_tqdm=False)
        rest = llm.generate(prompts[1:], GREEDY, use_tqdm=False)
        stats = llm.stats()
    assert stats.prefix_cache_hit_tokens > 0
    common = next(i for i, toks in enumerate(zip(*prompts)) if len(set(toks)) > 1)
    assert common >= 128, "the shared system prompt should span several blocks"
    # every later prompt hits every full block of the shared prefix that the first one computed
    assert all(r.num_cached_tokens == common // 16 * 16 for r in rest), ([r.num_cached_tokens for r in rest], common)
    assert_greedy_matches([r.outputs[0] for r in first + rest], ref)


@pytest.mark.parametrize("kind", ["qwen2", "qwen3", "llama"])
def test_tiny_random_checkpoint_greedy_equals_transformers(kind, tmp_path_factory):
    path = tiny_checkpoint(kind, tmp_path_factory)
    rng = random.Random(3)
    prompts = [[rng.randrange(256) for _ in range(rng.randint(1, 90))] for _ in range(16)]
    ref = hf_greedy(path, prompts, NEW_TOKENS)
    outs, _ = run_engine(path, prompts)
    assert_greedy_matches(outs, ref)
    # forced cases on the tiny model too: preemption, chunked prefill, and both at once
    outs, stats = run_engine(path, prompts, num_gpu_blocks=12, max_num_batched_tokens=32)
    assert stats.num_preemptions > 0 and stats.num_partial_prefill_chunks > 0
    assert_greedy_matches(outs, ref)


@pytest.mark.parametrize("mode, policy", [("auto", "least-progress"), ("recompute", "priority")])
def test_smollm2_equals_transformers_under_a_preemption_mode_and_policy(embedded_model, smol_case, mode, policy):
    prompts, ref = smol_case[0][:8], smol_case[1][:8]
    longest_blocks = -(-max(len(p) + NEW_TOKENS for p in prompts) // 16)
    priorities = [i % 2 for i in range(len(prompts))]  # the priority policy then has lower ones to preempt
    with LLM(embedded_model, num_gpu_blocks=longest_blocks + 4, num_host_blocks=64, preemption_mode=mode,
             preemption_policy=policy) as llm:
        results = llm.generate(prompts, GREEDY, use_tqdm=False, priority=priorities)
        stats = llm.stats()
    assert stats.num_preemptions > 0, "the pool was meant to be too small for the batch"
    assert stats.num_swap_outs + stats.num_recompute_preemptions == stats.num_preemptions
    assert mode != "recompute" or stats.num_recomputed_tokens > 0 and stats.num_swap_outs == 0
    assert stats.prefill_tokens_per_s > 0  # calibrated at start-up (auto), or measured from the steps run
    assert_greedy_matches([r.outputs[0] for r in results], ref)
    assert stats.free_kv_blocks == stats.total_kv_blocks and stats.num_swapped == 0


def test_max_concurrency_keeps_that_many_prompts_in_the_engine_and_changes_no_token(tmp_path_factory):
    """LLM.generate(max_concurrency=c) sends the next prompt as one ends (a closed loop of c clients): at c = 1
    each prompt runs alone, so the steps add up to every prompt's own; a prompt of n = 2 holds its slot until both
    of its outputs end; the tokens are HF's."""
    path = tiny_checkpoint("qwen3", tmp_path_factory)
    rng = random.Random(5)
    prompts = [[rng.randrange(256) for _ in range(rng.randint(4, 40))] for _ in range(4)]
    ref = hf_greedy(path, prompts, NEW_TOKENS)
    params = [GREEDY, GREEDY, dataclasses.replace(GREEDY, n=2), GREEDY]
    with LLM(path) as llm:
        with pytest.raises(ValueError, match="max_concurrency"):
            llm.generate(prompts, GREEDY, use_tqdm=False, max_concurrency=0)
        before = llm.stats().num_steps
        alone = llm.generate(prompts, params, use_tqdm=False, max_concurrency=1)
        steps_alone = llm.stats().num_steps - before
        before = llm.stats().num_steps
        together = llm.generate(prompts, params, use_tqdm=False)
        steps_together = llm.stats().num_steps - before
    # each prompt alone: a prefill step, then a decode step per further token (its n = 2 outputs decode together)
    assert steps_alone >= len(prompts) * NEW_TOKENS > 2 * steps_together
    for results in (alone, together):
        assert_greedy_matches([r.outputs[0] for r in results], ref)
        assert results[2].outputs[1].token_ids == results[2].outputs[0].token_ids  # greedy: both outputs alike
    assert [r.finished_at for r in alone] == sorted(r.finished_at for r in alone)
