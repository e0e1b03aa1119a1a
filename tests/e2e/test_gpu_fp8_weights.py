"""On CUDA: an FP8 checkpoint (128 x 128 blocks, ragged: intermediate 320) and --quantization fp8 decode under
CUDA graphs to the tokens of the same engine run eagerly (ties judged by the top-5 rule: graph batches are
padded, and a GEMM may pick other tiles at another M), and to the tokens of the engine whose FP8 GEMMs quantize
their activations themselves (NANOSERVE_FP8_FUSED_QUANT=0) instead of the norms and SiLU-and-mul before them (and
whose products are then scaled by their own pass instead of by the kernel that reads them). FP8 experts:
test_gpu_fp8_experts.py."""
from __future__ import annotations

import pytest
import torch

from executor_svc.layers import fp8
from executor_svc.model_loader import load_model
from kernels.attention.torch_backend import TorchAttentionBackend
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
    write_fp8_checkpoints(str(root / "plain"), str(root / "fbgemm"), str(root / "fbgemm_dequantized"), "fbgemm")
    return str(root)


def test_an_fbgemm_checkpoint_quantizes_under_its_scale_bound_and_decodes_under_cuda_graphs_to_the_eager_tokens(
        checkpoints):
    """fbgemm_fp8's activation_scale_ub (1200): each FP8 layer quantizes its own input under it (no producer is fed),
    and the engine's decode graphs capture that path."""
    from kernels.fp8_quant import activation_max_scale

    path = f"{checkpoints}/fbgemm"
    loaded, _ = load_model(path, torch.bfloat16, torch.device("cuda"), TorchAttentionBackend())
    layers = [layer for _, layer in fp8.linear_layers(loaded) if layer.weight.dtype == torch.float8_e4m3fn]
    assert layers and all(layer.fp8_max_scale == activation_max_scale(1200.0) for layer in layers)
    assert not [m for m in loaded.modules() if getattr(m, "fp8_group", None) is not None]
    prompts = gpu_prompts()
    graphs, _ = generate(path, prompts, max_num_seqs=32)
    eager, _ = generate(path, prompts, enforce_eager=True)
    assert_greedy_matches(graphs, [o.token_ids for o in eager], max_flip_fraction=1.0)


@pytest.mark.parametrize("model, quantization", [("block", None), ("plain", "fp8")])
def test_fp8_weights_decode_under_cuda_graphs_to_the_eager_tokens(checkpoints, model, quantization):
    path, prompts = f"{checkpoints}/{model}", gpu_prompts()
    graphs, _ = generate(path, prompts, quantization=quantization, max_num_seqs=32)
    eager, _ = generate(path, prompts, quantization=quantization, enforce_eager=True)
    assert_greedy_matches(graphs, [o.token_ids for o in eager], max_flip_fraction=1.0)


@pytest.mark.parametrize("model, quantization, fed", [("block", None, 6), ("plain", "fp8", 8)])
def test_on_cuda_the_producers_before_fp8_layers_write_their_output_in_fp8(checkpoints, model, quantization, fed):
    loaded, _ = load_model(f"{checkpoints}/{model}", torch.bfloat16, torch.device("cuda"), TorchAttentionBackend(),
                           quantization=quantization)
    first, second = loaded.model.layers
    assert (first.input_layernorm.fp8_group, first.post_attention_layernorm.fp8_group, first.mlp.act_fn.fp8_group) \
        == ((128, 128, 128) if model == "block" else (256, 256, 320))
    producers = [m for m in loaded.modules() if getattr(m, "fp8_group", None) is not None]
    # the block checkpoint leaves layer 1's MLP plain: its qkv_proj and o_proj alone are fed (o_proj by attention)
    assert len(producers) == fed
    assert [layer.self_attn.attn.fp8_group for layer in (first, second)] == ([128, 128] if model == "block" else
                                                                             [512, 512])
    assert loaded.model.norm.fp8_group is None
    # channel scales: gate_up_proj may hand SiLU-and-mul its product unscaled (block scales apply inside the GEMM)
    unscaled = [getattr(layer.mlp.gate_up_proj, "fp8_unscaled_output", False) for layer in (first, second)]
    assert unscaled == ([False, False] if model == "block" else [True, True])
    # and qkv_proj the attention layer, whose fused prologue scales q, k and v as it reads them
    unscaled = [getattr(layer.self_attn.qkv_proj, "fp8_unscaled_output", False) for layer in (first, second)]
    assert unscaled == ([False, False] if model == "block" else [True, True])


@pytest.mark.parametrize("model, quantization", [("block", None), ("plain", "fp8")])
def test_fp8_activations_quantized_by_their_producers_give_the_tokens_of_the_separate_quantization(
        checkpoints, model, quantization, monkeypatch):
    path, prompts = f"{checkpoints}/{model}", gpu_prompts()
    fused, _ = generate(path, prompts, quantization=quantization, max_num_seqs=32)
    monkeypatch.setenv(fp8.FUSED_QUANT_ENV, "0")
    unfused, _ = generate(path, prompts, quantization=quantization, max_num_seqs=32)
    # the same bytes into every GEMM but for the order of the norm's sum of squares: a flip only at a near-tie
    assert_greedy_matches(fused, [o.token_ids for o in unfused])
