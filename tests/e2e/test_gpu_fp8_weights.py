"""On CUDA: an FP8 checkpoint (128 x 128 blocks, ragged: intermediate 320) and --quantization fp8 decode under
CUDA graphs to the tokens of the same engine run eagerly (ties judged by the top-5 rule: graph batches are
padded, and a GEMM may pick other tiles at another M)."""
from __future__ import annotations

import pytest
import torch

from support.fp8_checkpoints import write_fp8_checkpoints
from support.gpu_engine import generate, gpu_prompts
from support.hf_reference import assert_greedy_matches
from support.tiny_checkpoints import make_tiny_qwen3

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> str:
    root = tmp_path_factory.mktemp("fp8_gpu")
    make_tiny_qwen3(str(root / "plain"), hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=128,
                    intermediate_size=320, vocab_size=1024, max_position_embeddings=2048)
    write_fp8_checkpoints(str(root / "plain"), str(root / "block"), str(root / "dequantized"), "block")
    return str(root)


@pytest.mark.parametrize("model, quantization", [("block", None), ("plain", "fp8")])
def test_fp8_weights_decode_under_cuda_graphs_to_the_eager_tokens(checkpoints, model, quantization):
    path, prompts = f"{checkpoints}/{model}", gpu_prompts()
    graphs, _ = generate(path, prompts, quantization=quantization, max_num_seqs=32)
    eager, _ = generate(path, prompts, quantization=quantization, enforce_eager=True)
    assert_greedy_matches(graphs, [o.token_ids for o in eager], max_flip_fraction=1.0)
