"""Loading mixture-of-experts checkpoints: an MoE variant this code would compute differently is refused at
start-up with an error naming the config field; transformers' own stacked expert layout loads to the same model as
the per-expert tensors of hub checkpoints; a missing expert tensor fails the load; --quantization fp8 quantizes the
experts (FP8 MoE checkpoints: tests/e2e/test_fp8_weights_engine.py, tests/executor/test_fp8_weights.py)."""
import json
import logging
import os

import pytest
import torch
from safetensors.torch import load_file

from executor_svc.model_loader import load_model
from kernels.attention.torch_backend import TorchAttentionBackend
from support.tiny_checkpoints import drop_checkpoint_tensor, make_tiny_mixtral, make_tiny_qwen3_moe, tiny_checkpoint


def load(path: str):
    return load_model(path, torch.float32, torch.device("cpu"), TorchAttentionBackend())[0]


def with_config(path: str, **fields) -> str:
    config_path = os.path.join(path, "config.json")
    with open(config_path) as f:
        config = json.load(f)
    config.update(fields)
    with open(config_path, "w") as f:
        json.dump(config, f)
    return path


@pytest.mark.parametrize("maker, field, value", [
    (make_tiny_qwen3_moe, "shared_expert_intermediate_size", 64),  # Qwen2-MoE's shared expert
    (make_tiny_qwen3_moe, "n_group", 4),                           # DeepSeek's grouped top-k
    (make_tiny_qwen3_moe, "scoring_func", "sigmoid"),              # another router
    (make_tiny_qwen3_moe, "use_sliding_window", True),
    (make_tiny_mixtral, "routed_scaling_factor", 2.5),
    (make_tiny_mixtral, "sliding_window", 4096),
])
def test_an_unsupported_moe_variant_is_refused_naming_the_field(tmp_path, maker, field, value):
    path = with_config(maker(str(tmp_path / "m")), **{field: value})
    with pytest.raises(ValueError, match=field):
        load(path)


def test_transformers_stacked_expert_layout_loads_the_same_model(tmp_path, tmp_path_factory):
    """transformers 5 can save the experts as [E, 2I, H] gate_up_proj and [E, H, I] down_proj tensors."""
    path = tiny_checkpoint("qwen3_moe", tmp_path_factory)
    from transformers import AutoModelForCausalLM

    stacked = str(tmp_path / "stacked")
    AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).save_pretrained(stacked, save_original_format=False)
    names = load_file(os.path.join(stacked, "model.safetensors")).keys()
    assert "model.layers.0.mlp.experts.gate_up_proj" in names, sorted(names)[:12]
    ours, theirs = dict(load(path).named_parameters()), dict(load(stacked).named_parameters())
    assert ours.keys() == theirs.keys()
    for name, param in ours.items():
        assert torch.equal(param, theirs[name]), name


def test_a_checkpoint_missing_one_expert_tensor_fails_to_load(tmp_path):
    path = make_tiny_mixtral(str(tmp_path / "m"))
    drop_checkpoint_tensor(path, "model.layers.1.block_sparse_moe.experts.4.w3.weight")
    with pytest.raises(ValueError, match=r"layers\.1\.mlp\.experts\.w13"):
        load(path)


def test_quantization_fp8_quantizes_every_expert_per_output_row_and_says_so(tmp_path_factory, caplog):
    """--quantization fp8 on an MoE checkpoint (Mixtral's w1/w3/w2 names): on the CPU each expert's stacked gate/up
    and down rows are their per-row FP8 quantization, dequantized; the router and the norms stay as they were."""
    from kernels.fp8_quant import quantize_weight_per_channel

    path = tiny_checkpoint("mixtral", tmp_path_factory)
    plain = load(path)
    with caplog.at_level(logging.INFO, logger="nanoserve.executor"):
        model, facts = load_model(path, torch.float32, torch.device("cpu"), TorchAttentionBackend(),
                                  quantization="fp8")
    assert facts.weight_format == "fp8_e4m3fn, per-channel scales, quantized at load"
    assert "and 2 expert blocks" in caplog.text
    expected = dict(plain.named_parameters())
    for name, param in model.named_parameters():
        if name.endswith(("experts.w13", "experts.w2")):
            w = expected[name]
            q, scale = quantize_weight_per_channel(w.reshape(-1, w.shape[-1]))
            assert torch.equal(param, (q.float() * scale).view(w.shape)), name
            assert not torch.equal(param, w)
        elif not name.endswith("proj.weight"):
            assert torch.equal(param, expected[name]), name


def test_random_experts_for_a_block_checkpoints_config_are_quantized_in_blocks_per_expert(tmp_path):
    """load_format dummy (the benchmarks' random weights) on an MoE config with a block checkpoint's
    quantization_config: each expert's gate/up and down weights are its own 128 x 128 block quantization (a block
    never spans two experts), dequantized on the CPU; the router stays plain."""
    from kernels.fp8_quant import dequantize_blocks, quantize_blocks_ref

    path = make_tiny_qwen3_moe(str(tmp_path / "plain"))
    plain = load_model(path, torch.float32, torch.device("cpu"), TorchAttentionBackend(), load_format="dummy")[0]
    block = with_config(make_tiny_qwen3_moe(str(tmp_path / "block")), quantization_config={
        "quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]})
    model, facts = load_model(block, torch.float32, torch.device("cpu"), TorchAttentionBackend(), load_format="dummy")
    assert facts.weight_format == "fp8_e4m3fn, 128x128 block scales, quantized at load"
    expected = dict(plain.named_parameters())
    for name, param in model.named_parameters():
        if name.endswith(("experts.w13", "experts.w2")):
            want = torch.stack([dequantize_blocks(*quantize_blocks_ref(w, (128, 128)), (128, 128))
                                for w in expected[name]])
            assert torch.equal(param, want) and not torch.equal(param, expected[name]), name
        elif not name.endswith("proj.weight"):
            assert torch.equal(param, expected[name]), name

