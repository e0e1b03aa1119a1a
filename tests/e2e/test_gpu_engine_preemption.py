"""On CUDA under memory pressure: chunked prefill, preemption by recompute and by swap, and prefix-cache hits
give the torch reference backend's greedy tokens (ties judged by the top-5 rule)."""
from __future__ import annotations

import pytest
import torch

from support.gpu_engine import generate
from support.hf_reference import assert_greedy_matches

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)


def test_cuda_engine_with_chunked_prefill_preemption_and_prefix_hits(gpu_qwen3_dir, gpu_prompts):
    shared = gpu_prompts[0][:200]
    tricky = [shared + p[:50] for p in gpu_prompts[:8]] + gpu_prompts[8:]
    ref2, _ = generate(gpu_qwen3_dir, tricky, dtype="float32", attention_backend="torch", enforce_eager=True)
    outs, stats = generate(gpu_qwen3_dir, tricky, dtype="float32", attention_backend="triton", max_num_seqs=32,
                           num_gpu_blocks=60, max_num_batched_tokens=128)
    assert stats.num_preemptions > 0 and stats.num_partial_prefill_chunks > 0
    assert_greedy_matches(outs, [o.token_ids for o in ref2])


def test_cuda_engine_swapping_preempted_sequences_to_host_equals_the_reference(gpu_qwen3_dir, gpu_prompts):
    ref, _ = generate(gpu_qwen3_dir, gpu_prompts, dtype="float32", attention_backend="torch", enforce_eager=True)
    outs, stats = generate(gpu_qwen3_dir, gpu_prompts, dtype="float32", attention_backend="triton", max_num_seqs=32,
                           num_gpu_blocks=60, num_host_blocks=400, preemption_mode="swap")  # (auto may recompute)
    assert stats.num_swap_outs > 0
    assert_greedy_matches(outs, [o.token_ids for o in ref])
