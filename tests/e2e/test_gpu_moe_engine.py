"""On CUDA: a random Qwen3-MoE checkpoint (a dense layer mixed in) decodes through the fused MoE kernels inside
the decode CUDA graphs to the same greedy tokens as HF transformers in fp32 (ties judged by the top-5 rule), and
bf16 with graphs agrees with bf16 eager."""
from __future__ import annotations

import pytest
import torch

from support.gpu_engine import generate, gpu_prompts
from support.hf_reference import assert_greedy_matches, hf_greedy
from support.tiny_checkpoints import make_tiny_qwen3_moe

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory) -> str:
    # production head shapes; 16 experts top-4 with a 128-wide intermediate, the middle layer dense
    return make_tiny_qwen3_moe(str(tmp_path_factory.mktemp("moe_gpu") / "qwen3_moe"), hidden_size=256,
                               num_attention_heads=4, num_key_value_heads=2, head_dim=128, vocab_size=1024,
                               max_position_embeddings=2048, num_experts=16, num_experts_per_tok=4,
                               moe_intermediate_size=128)


def test_moe_decoding_in_cuda_graphs_equals_transformers_fp32(moe_dir):
    prompts = gpu_prompts()[:12]
    outs, _ = generate(moe_dir, prompts, dtype="float32", attention_backend="triton", max_num_seqs=16)
    assert_greedy_matches(outs, hf_greedy(moe_dir, prompts, len(outs[0].token_ids)))


def test_moe_bf16_graphs_agree_with_bf16_eager(moe_dir):
    prompts = gpu_prompts()[:12]
    graphs, _ = generate(moe_dir, prompts, dtype="bfloat16", attention_backend="triton", max_num_seqs=16)
    eager, _ = generate(moe_dir, prompts, dtype="bfloat16", attention_backend="triton", enforce_eager=True)
    assert_greedy_matches(graphs, [o.token_ids for o in eager], max_flip_fraction=1.0)
