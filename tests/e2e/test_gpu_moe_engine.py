"""On CUDA: a random Qwen3-MoE checkpoint (production head shapes, 16 experts top-4, a dense layer mixed in)
decoded greedily with the decode CUDA graphs (the fused MoE kernels captured in them) equals the same run with
--enforce-eager, and both equal HF transformers in fp32 (ties judged by the top-5 rule)."""
from __future__ import annotations

import pytest
import torch

from support.gpu_engine import NEW_TOKENS, generate
from support.hf_reference import assert_greedy_matches, hf_greedy
from support.tiny_checkpoints import make_tiny_qwen3_moe

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)


@pytest.fixture(scope="module")
def gpu_qwen3_moe_dir(tmp_path_factory) -> str:
    return make_tiny_qwen3_moe(str(tmp_path_factory.mktemp("qwen3_moe_gpu")), hidden_size=256,
                               num_attention_heads=4, num_key_value_heads=2, head_dim=128, vocab_size=1024,
                               max_position_embeddings=2048, num_experts=16, num_experts_per_tok=4,
                               moe_intermediate_size=128)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_moe_cuda_graph_decoding_equals_eager_and_transformers(gpu_qwen3_moe_dir, gpu_prompts, dtype):
    graphs, _ = generate(gpu_qwen3_moe_dir, gpu_prompts, dtype=dtype, max_num_seqs=32)
    eager, stats = generate(gpu_qwen3_moe_dir, gpu_prompts, dtype=dtype, enforce_eager=True)
    assert stats.free_kv_blocks == stats.total_kv_blocks
    if dtype == "bfloat16":
        assert_bf16_runs_agree(graphs, [o.token_ids for o in eager])
        return
    assert_greedy_matches(graphs, [o.token_ids for o in eager])
    ref = hf_greedy(gpu_qwen3_moe_dir, gpu_prompts, NEW_TOKENS, device="cuda")
    assert_greedy_matches(graphs, ref)
    assert_greedy_matches(eager, ref)


def assert_bf16_runs_agree(ours, ref: list[list[int]]) -> None:
    """Graphs against eager in bf16. The two round differently (padded batches pick other GEMM tiles), and on a
    random model the router's top-4 of 16 is often a near-tie: a flipped expert is a step change in the hidden
    state, larger than the margins of a near-flat random head. So a divergence outside the top-5 rule is allowed
    in at most 1 sequence in 8, and only after the first 8 tokens agree; a broken graph diverges everywhere."""
    unexplained = []
    for i, (out, expected) in enumerate(zip(ours, ref)):
        assert len(out.token_ids) == len(expected)
        pos = next((p for p, (a, b) in enumerate(zip(out.token_ids, expected)) if a != b), None)
        if pos is not None and expected[pos] not in list(out.logprobs[pos].top_token_ids[:5]):
            assert pos >= 8, f"seq {i} diverges at token {pos}: {out.token_ids[:pos + 1]} vs {expected[:pos + 1]}"
            unexplained.append(i)
    assert len(unexplained) <= len(ref) // 8, f"sequences {unexplained} diverge outside the top-5 rule"

