"""On CUDA: n-gram speculative decoding under the decode CUDA graphs (verification rows replayed by the decode
graphs, async verification planned ahead of its verdict) gives the greedy tokens of the plain engine, and
verifies proposals and accepts some: the model is a random Qwen3 with production head shapes and a vocabulary of
24 tokens, whose greedy continuations fall into loops that n-gram proposals catch."""
from __future__ import annotations

import random

import pytest
import torch

from scheduler_svc.frontend.sampling_params import SamplingParams
from support.gpu_engine import generate
from support.hf_reference import assert_greedy_matches
from support.tiny_checkpoints import make_tiny_qwen3

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

VOCAB = 24
NEW_TOKENS = 64
GREEDY_LOGPROBS = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=5)
# logprobs turn speculation off for a request, so the speculative run asks for tokens only
GREEDY_TOKENS = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def looping_qwen3_dir(tmp_path_factory) -> str:
    return make_tiny_qwen3(str(tmp_path_factory.mktemp("qwen3_loops")), hidden_size=256, num_attention_heads=4,
                           num_key_value_heads=2, head_dim=128, vocab_size=VOCAB, max_position_embeddings=2048)


def repeating_prompts() -> list[list[int]]:
    rng = random.Random(5)
    prompts = []
    for _ in range(12):
        segment = [rng.randrange(VOCAB) for _ in range(rng.randint(4, 24))]
        prompts.append([rng.randrange(VOCAB) for _ in range(rng.randint(1, 40))] + segment * rng.randint(2, 6))
    return prompts


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_ngram_speculation_under_cuda_graphs_gives_the_plain_engines_greedy_tokens(looping_qwen3_dir, dtype):
    prompts = repeating_prompts()
    plain, _ = generate(looping_qwen3_dir, prompts, GREEDY_LOGPROBS, dtype=dtype, attention_backend="triton",
                        max_num_seqs=32)
    speculative, stats = generate(looping_qwen3_dir, prompts, GREEDY_TOKENS, dtype=dtype, attention_backend="triton",
                                  max_num_seqs=32, speculative_method="ngram", num_speculative_tokens=4,
                                  speculative_max_batch_size=32)
    assert stats.num_speculative_steps > 0 and stats.num_accepted_tokens > 0
    assert stats.free_kv_blocks == stats.total_kv_blocks
    # a flip is allowed only where the speculative token is among the plain engine's top 5 (a near-tie that
    # another batch composition rounds the other way); fp32 leaves few of those
    flips = 0.25 if dtype == "float32" else 1.0
    assert_greedy_matches(plain, [o.token_ids for o in speculative], max_flip_fraction=flips)
