"""On CUDA, FP8 experts (the fused MoE kernels read FP8): a Qwen3-MoE checkpoint whose experts alone are FP8 blocks
(moe_intermediate 192: ragged), its experts kept weight-only (NANOSERVE_FP8_MOE_ACTIVATIONS=bf16: each FP8 weight
tile widened to fp32, exact), equals HF transformers on its dequantized weights in fp32, under CUDA graphs and
eagerly; --quantization fp8 on it decodes under graphs to the eager tokens, its experts weight-only or multiplying
FP8 activations (the default, which rounds x and h to e4m3 and so cannot equal HF). Apart from
test_gpu_fp8_weights.py so that `run_on_gpu.sh tests-par` gives each file its own time; HF's reference runs on the
GPU."""
from __future__ import annotations

import pytest
import torch

from executor_svc.layers import fp8
from executor_svc.model_loader import load_model
from kernels.attention.torch_backend import TorchAttentionBackend
from support.fp8_checkpoints import write_fp8_checkpoints
from support.gpu_engine import NEW_TOKENS, generate, gpu_prompts
from support.hf_reference import assert_greedy_matches, hf_greedy
from support.tiny_checkpoints import make_tiny_qwen3_moe

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)


@pytest.fixture(scope="module")
def moe_checkpoints(tmp_path_factory) -> str:
    root = tmp_path_factory.mktemp("fp8_moe_gpu")
    make_tiny_qwen3_moe(str(root / "plain"), hidden_size=256, num_attention_heads=4, num_key_value_heads=2,
                        head_dim=128, vocab_size=1024, max_position_embeddings=2048, num_experts=16,
                        num_experts_per_tok=4, moe_intermediate_size=192)
    # attention and the dense layer's MLP stay plain: only the experts are FP8, which the MoE kernels read without
    # quantizing activations, so the fp32 engine can equal transformers on the dequantized weights
    write_fp8_checkpoints(str(root / "plain"), str(root / "experts"), str(root / "experts_dequantized"), "block",
                          not_converted=("self_attn", "model.layers.1.mlp"))
    return str(root)


def test_fp8_experts_decode_to_transformers_on_their_dequantized_weights_under_graphs_and_eagerly(moe_checkpoints,
                                                                                                 monkeypatch):
    monkeypatch.setenv(fp8.MOE_ACTIVATIONS_ENV, "bf16")  # weight-only: exact, so HF's tokens
    prompts = gpu_prompts()
    loaded, _ = load_model(f"{moe_checkpoints}/experts", torch.float32, torch.device("cuda"),
                           TorchAttentionBackend())
    fp8_experts = [m.experts for m in loaded.modules() if hasattr(m, "experts")]
    assert len(fp8_experts) == 2 and all(e.w13.dtype == torch.float8_e4m3fn and e.fp8 is not None
                                         and e.fp8.activations == "bf16" for e in fp8_experts)
    del loaded
    graphs, _ = generate(f"{moe_checkpoints}/experts", prompts, dtype="float32", max_num_seqs=32)
    eager, _ = generate(f"{moe_checkpoints}/experts", prompts, dtype="float32", enforce_eager=True)
    ref = hf_greedy(f"{moe_checkpoints}/experts_dequantized", prompts, NEW_TOKENS, device="cuda")
    assert_greedy_matches(graphs, ref)
    assert_greedy_matches(eager, ref)


@pytest.mark.parametrize("moe_activations", ["bf16", "fp8"])  # weight-only experts; FP8 activations too
def test_quantization_fp8_on_an_moe_decodes_under_cuda_graphs_to_the_eager_tokens(moe_checkpoints, moe_activations,
                                                                                  monkeypatch):
    monkeypatch.setenv(fp8.MOE_ACTIVATIONS_ENV, moe_activations)
    path, prompts = f"{moe_checkpoints}/plain", gpu_prompts()
    graphs, _ = generate(path, prompts, quantization="fp8", dtype="float32", max_num_seqs=32)
    eager, _ = generate(path, prompts, quantization="fp8", dtype="float32", enforce_eager=True)
    assert_greedy_matches(graphs, [o.token_ids for o in eager], max_flip_fraction=1.0)
