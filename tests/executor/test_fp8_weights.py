"""FP8 Linear weights at load (executor_svc/layers/fp8.py, scheduler_svc/common/weight_quantization.py):
which checkpoints are accepted, how the scales shard with their weights under tensor parallelism, and
what --quantization fp8 does to a plain checkpoint. On the CPU the weights are dequantized at load, so
a loaded layer's weight is directly comparable with the checkpoint's dequantized weight."""
from __future__ import annotations

import json
import logging
import os
from contextlib import contextmanager
from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from support.fp8_checkpoints import tiny_fp8_checkpoints
from torch import nn

from executor_svc.layers import fp8, linear, parallel
from executor_svc.model_loader import load_model
from kernels.attention.torch_backend import TorchAttentionBackend
from kernels.fp8_quant import dequantize_blocks, quantize_blocks_ref, quantize_weight_per_channel
from scheduler_svc.common.config import EngineConfig
from scheduler_svc.common.weight_quantization import WeightQuantization, weight_quantization

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> str:
    """A tiny Llama whose dimensions are not multiples of 128 (hidden 192, intermediate 320, k/v 96 rows),
    and its FP8 versions (block and channel) with their dequantized twins."""
    return tiny_fp8_checkpoints(str(tmp_path_factory.mktemp("fp8_weights")))


def load(path: str, **kwargs):
    return load_model(path, torch.float32, CPU, TorchAttentionBackend(), **kwargs)


@pytest.mark.parametrize("scheme", ["block", "channel", "tensor", "fbgemm", "compressed_block", "modelopt",
                                    "modelopt_channel", "modelopt_block", "quark"])
def test_an_fp8_checkpoint_loads_into_exactly_its_dequantized_weights_on_the_cpu(checkpoints, scheme, caplog):
    with caplog.at_level(logging.INFO, logger="nanoserve.executor"):
        model, facts = load(os.path.join(checkpoints, scheme))
    reference, _ = load(os.path.join(checkpoints, f"{scheme}_dequantized"))
    expected = dict(reference.named_parameters())
    for name, param in model.named_parameters():
        assert param.dtype == torch.float32 and torch.equal(param, expected[name]), name
    per_tensor = scheme in ("tensor", "modelopt", "quark")
    assert facts.weight_format == ("fp8_e4m3fn, per-tensor scales" if per_tensor else "fp8_e4m3fn, 128x128 block scales"
                                   if "block" in scheme else "fp8_e4m3fn, per-channel scales"
                                   + (", activation_scale_ub 1200" if scheme == "fbgemm" else ""))
    # the per-tensor checkpoints' static input_scale tensors are skipped, and the log says so
    said = "static scales (input_scale) are not used" in caplog.text
    assert said is per_tensor


def test_a_checkpoints_static_activation_scales_are_named_as_unused(tmp_path):
    def unused(config: dict) -> tuple[str, ...]:
        with open(tmp_path / "config.json", "w") as f:
            json.dump({"quantization_config": config}, f)
        return weight_quantization(str(tmp_path), None).unused

    fp8 = {"num_bits": 8, "type": "float"}
    groups = {"g": {"weights": {**fp8, "strategy": "tensor"},
                    "input_activations": {**fp8, "strategy": "tensor", "dynamic": False}}}
    assert unused({"quant_method": "compressed-tensors", "config_groups": groups}) == ("input_scale",)
    # KV cache scales are not the weight format's: the loader skips them by name (tests/executor/test_fp8_kv_pool.py)
    assert unused({"quant_method": "compressed-tensors", "config_groups": groups,
                   "kv_cache_scheme": {**fp8, "strategy": "tensor", "dynamic": False}}) == ("input_scale",)
    assert unused({"quant_method": "fp8", "activation_scheme": "static"}) == ("input_scale",)
    assert unused({"quant_method": "fp8", "activation_scheme": "dynamic"}) == ()
    assert unused({"quant_method": "fbgemm_fp8", "activation_scale_ub": 1200.0}) == ()


def test_fbgemms_activation_scale_bound_is_read_with_transformers_default_and_a_bad_one_is_refused(tmp_path):
    def bound(config: dict) -> float | None:
        with open(tmp_path / "config.json", "w") as f:
            json.dump({"quantization_config": config}, f)
        return weight_quantization(str(tmp_path), None).activation_scale_ub

    assert bound({"quant_method": "fbgemm_fp8", "activation_scale_ub": 600}) == 600.0
    assert bound({"quant_method": "fbgemm_fp8"}) == 1200.0  # FbgemmFp8Config's default
    assert bound({"quant_method": "compressed-tensors", "config_groups": {"g": {
        "weights": {"num_bits": 8, "type": "float", "strategy": "channel"}}}}) is None
    for bad in (0, -1.0, "1200", None, True, float("inf")):
        with pytest.raises(ValueError, match="activation_scale_ub .* is not a positive number"):
            bound({"quant_method": "fbgemm_fp8", "activation_scale_ub": bad})


BAD_TENSORS = {  # (scheme, tensor, replacement, what the error says)
    "a block grid of the wrong shape": ("block", "model.layers.0.self_attn.k_proj.weight_scale_inv",
                                        lambda t: torch.ones(3, 3), r"shape \[3, 3\] for a 96 x 192 weight.*\[1, 2\]"),
    "a scale per row of the wrong length": ("channel", "model.layers.0.mlp.up_proj.weight_scale",
                                            lambda t: t[:-1], r"shape \[319, 1\] for a 320 x 192 weight"),
    "a NaN scale": ("block", "model.layers.0.mlp.down_proj.weight_scale_inv",
                    lambda t: t.clone().fill_(float("nan")), "not finite and non-negative"),
    "a negative scale": ("channel", "model.layers.0.self_attn.o_proj.weight_scale", lambda t: -t, "non-negative"),
    "a plain weight where the config says FP8": ("block", "model.layers.0.self_attn.q_proj.weight",
                                                 lambda t: t.float(), "a float32 weight .* modules_to_not_convert"),
    "FP8 bytes where the config keeps the module plain": (
        "block", "model.layers.1.mlp.down_proj.weight", lambda t: t.to(torch.float8_e4m3fn),
        "a float8_e4m3fn tensor for a float32 parameter: .*read unscaled"),
}


@pytest.mark.parametrize("case", sorted(BAD_TENSORS))
def test_a_checkpoint_tensor_that_does_not_fit_its_fp8_format_is_refused_naming_it(checkpoints, tmp_path, case):
    """Each of these loaded silently before (a plain weight cast to FP8, a scale grid read past or short of its
    weight, NaN scales): wrong weights, or NaN, at the first token."""
    import glob
    import shutil

    from safetensors.torch import load_file, save_file

    scheme, name, replace_with, said = BAD_TENSORS[case]
    model_dir = str(tmp_path / "ckpt")
    shutil.copytree(os.path.join(checkpoints, scheme), model_dir)
    (path,) = glob.glob(os.path.join(model_dir, "*.safetensors"))
    tensors = load_file(path)
    tensors[name] = replace_with(tensors[name])
    save_file(tensors, path)
    with pytest.raises(ValueError, match=rf"checkpoint tensor '{name}' in .*: .*{said}"):
        load(model_dir)


@pytest.mark.parametrize("scheme, layer", [("block", "model.layers.0.mlp.down_proj"),
                                           ("channel", "model.layers.0.self_attn.qkv_proj")])
def test_fp8_weights_holding_nan_bytes_are_refused_as_a_corrupted_file(checkpoints, tmp_path, scheme, layer):
    """One byte 0x7F (e4m3's NaN, which no quantizer writes) in an FP8 weight: the load fails naming the layer,
    rather than every token of the first step coming out NaN."""
    import glob
    import shutil

    from safetensors.torch import load_file, save_file

    model_dir = tmp_path / scheme
    shutil.copytree(os.path.join(checkpoints, scheme), model_dir)
    (path,) = glob.glob(str(model_dir / "*.safetensors"))
    tensors = load_file(path)
    name = layer.replace("qkv_proj", "v_proj") + ".weight"
    tensors[name].view(torch.uint8)[3, 5] = 0x7F
    save_file(tensors, path)
    with pytest.raises(ValueError, match=rf"{layer}: its FP8 weight holds 1 NaN values .* corrupted"):
        load(str(model_dir))


def test_fp8_tensors_under_a_config_without_quantization_config_are_refused(checkpoints, tmp_path):
    import shutil

    model_dir = tmp_path / "stripped"
    shutil.copytree(os.path.join(checkpoints, "channel"), model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    del config["quantization_config"]
    (model_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"'model\.layers\.0\..*\.weight' .*a float8_e4m3fn tensor for a float32"):
        load(str(model_dir))


def test_modelopts_hf_quant_config_names_the_format_and_an_unsupported_one_is_refused(checkpoints, tmp_path):
    """NVIDIA ModelOpt states its quantization in hf_quant_config.json, not config.json: its quant_algo chooses the
    format, its exclude_modules wildcards keep modules plain, and an algorithm nanoserve does not load (NVFP4) is
    refused at start-up by name."""
    import shutil

    quant = weight_quantization(os.path.join(checkpoints, "modelopt_block"), None)
    assert (quant.scheme, quant.block, quant.scale_name) == ("block", (128, 128), "weight_scale")
    assert not quant.converts("model.layers.1.mlp.down_proj") and quant.converts("model.layers.0.mlp.down_proj")
    assert quant.converts("model.layers.10.mlp.down_proj")  # the wildcard is layer 1's alone
    model_dir = tmp_path / "nvfp4"
    shutil.copytree(os.path.join(checkpoints, "modelopt"), model_dir)
    (model_dir / "hf_quant_config.json").write_text(json.dumps({"quantization": {"quant_algo": "NVFP4"}}))
    with pytest.raises(ValueError, match="'modelopt': quant_algo 'NVFP4' is not supported"):
        EngineConfig(model=str(model_dir))


def test_modules_the_checkpoint_does_not_convert_keep_their_plain_weights(checkpoints):
    quant = weight_quantization(os.path.join(checkpoints, "block"), None)
    assert not quant.converts("model.layers.1.mlp.down_proj") and not quant.converts("lm_head")
    assert quant.converts("model.layers.0.mlp.down_proj") and quant.converts("model.layers.10.mlp.down_proj")
    channel = weight_quantization(os.path.join(checkpoints, "channel"), None)
    assert not channel.converts("model.layers.1.mlp.up_proj") and channel.converts("model.layers.0.mlp.up_proj")


@pytest.mark.parametrize("config, named", [
    ({"quant_method": "awq", "bits": 4, "group_size": 128}, "'awq'"),
    ({"quant_method": "gptq", "bits": 4}, "'gptq'"),
    ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "'bitsandbytes'"),
    ({"quant_method": "fp8", "activation_scheme": "calibrated"}, "'calibrated'"),
    ({"quant_method": "fp8", "weight_block_size": [128, 128], "activation_scheme": "static"}, "'static'"),
    ({"quant_method": "fp8", "weight_block_size": [128], "activation_scheme": "dynamic"}, r"\[128\]"),
    ({"quant_method": "compressed-tensors", "config_groups": {"g": {
        "weights": {"num_bits": 8, "type": "float", "strategy": "channel"},
        "input_activations": {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": False}}}}, "'token'"),
    ({"quant_method": "modelopt", "quant_algo": "NVFP4"}, "quant_algo 'NVFP4'"),  # config.json's modelopt form
    ({"quant_method": "quark", "global_quant_config": {"weight": {"dtype": "int4", "qscheme": "per_group"}}},
     "'int4' 'per_group'"),
    ({"quant_method": "quark", "global_quant_config": {"weight": {"dtype": "fp8_e4m3", "qscheme": "per_tensor"}},
      "layer_quant_config": {"*down_proj": {}}}, "layer_quant_config"),
])
def test_an_unsupported_quantization_config_is_refused_at_start_up_naming_it(checkpoints, tmp_path, config, named):
    with open(os.path.join(checkpoints, "plain", "config.json")) as f:
        raw = json.load(f)
    with open(tmp_path / "config.json", "w") as f:
        json.dump({**raw, "quantization_config": config}, f)
    with pytest.raises(ValueError, match=named):
        EngineConfig(model=str(tmp_path))  # the CLI's check, before any process starts
    with pytest.raises(ValueError, match=named):
        load(str(tmp_path))  # and the executor's, for roles started on their own


def test_quantization_fp8_quantizes_a_plain_checkpoint_per_output_channel_and_says_so(checkpoints, caplog):
    plain, _ = load(os.path.join(checkpoints, "plain"))
    with caplog.at_level(logging.INFO, logger="nanoserve.executor"):
        model, facts = load(os.path.join(checkpoints, "plain"), quantization="fp8")
    assert facts.weight_format == "fp8_e4m3fn, per-channel scales, quantized at load"
    assert "8 linear layers" in caplog.text  # 2 layers x (qkv_proj, o_proj, gate_up_proj, down_proj)
    expected = dict(plain.named_parameters())
    for name, param in model.named_parameters():
        if name.endswith("proj.weight"):
            q, scale = quantize_weight_per_channel(expected[name])
            assert torch.equal(param, q.float() * scale), name
            assert not torch.equal(param, expected[name])
        else:
            assert torch.equal(param, expected[name]), name


@pytest.mark.parametrize("scheme", ["block", "channel"])
def test_random_weights_for_an_fp8_checkpoints_config_are_quantized_in_its_format(checkpoints, scheme):
    """load_format dummy (the benchmarks' random weights) on an FP8 checkpoint's config: the random weights quantized
    at load as that checkpoint holds its weights (128 x 128 blocks, or a scale per output row), so that a benchmark
    runs the format's own kernels."""
    plain, _ = load(os.path.join(checkpoints, "plain"), load_format="dummy")
    model, facts = load(os.path.join(checkpoints, scheme), load_format="dummy")
    assert facts.weight_format == {"block": "fp8_e4m3fn, 128x128 block scales, quantized at load",
                                   "channel": "fp8_e4m3fn, per-channel scales, quantized at load"}[scheme]
    expected = dict(plain.named_parameters())
    for name, param in model.named_parameters():
        if name.endswith("proj.weight"):
            if scheme == "block":
                q, blocks = quantize_blocks_ref(expected[name], (128, 128))
                want = dequantize_blocks(q, blocks, (128, 128))
            else:
                q, scale = quantize_weight_per_channel(expected[name])
                want = q.float() * scale
            assert torch.equal(param, want) and not torch.equal(param, expected[name]), name
        else:
            assert torch.equal(param, expected[name]), name


@contextmanager
def as_rank(rank: int, size: int):
    with mock.patch.multiple(parallel, tp_rank=lambda: rank, tp_size=lambda: size), \
         mock.patch.multiple(linear, tp_rank=lambda: rank, tp_size=lambda: size), \
         mock.patch.multiple(fp8, tp_rank=lambda: rank, tp_size=lambda: size):
        yield


@settings(max_examples=25, deadline=None)
@given(tp=st.sampled_from([2, 3, 4]), block=st.sampled_from([(16, 32), (32, 16), (128, 128), (64, 48)]),
       head_dim=st.sampled_from([8, 24, 40]), inter_per_rank=st.integers(5, 40), hidden=st.integers(20, 150),
       seed=st.integers(0, 2**16))
def test_block_scales_shard_with_their_weights_whatever_the_split(tp, block, head_dim, inter_per_rank, hidden, seed):
    """Column-parallel (fused q/k/v and gate/up: each piece with its own blocks) and row-parallel layers on
    every rank hold exactly their slice of the dequantized weight, also where a shard boundary falls
    inside a scale block."""
    gen = torch.Generator().manual_seed(seed)
    heads, kv_heads, inter = 2 * tp, tp, inter_per_rank * tp
    pieces = {  # checkpoint tensors: (name, fused layer, shard id, [rows, cols])
        "q": ("qkv", "q", heads * head_dim, hidden), "k": ("qkv", "k", kv_heads * head_dim, hidden),
        "v": ("qkv", "v", kv_heads * head_dim, hidden), "gate": ("gate_up", 0, inter, hidden),
        "up": ("gate_up", 1, inter, hidden), "down": ("down", None, hidden, inter),
    }
    ckpt = {}
    for name, (_, _, rows, cols) in pieces.items():
        w = torch.randn(rows, cols, generator=gen) * 2.0 ** torch.randint(-6, 6, (rows, 1), generator=gen)
        ckpt[name] = quantize_blocks_ref(w, block)
    quant = WeightQuantization("block", from_checkpoint=True, block=block)
    for rank in range(tp):
        with as_rank(rank, tp):
            layers = nn.ModuleDict({
                "qkv": linear.QKVParallelLinear(hidden, head_dim, heads, kv_heads),
                "gate_up": linear.MergedColumnParallelLinear(hidden, [inter, inter]),
                "down": linear.RowParallelLinear(inter, hidden),
            })
            for layer in layers.values():
                fp8._add_fp8_parameters(layer, quant)
            for name, (fused, shard_id, _, _) in pieces.items():
                layer, (q, scale_inv) = layers[fused], ckpt[name]
                extra = () if shard_id is None else (shard_id,)
                layer.weight.weight_loader(layer.weight, q, *extra)
                layer.weight_scale_inv.weight_loader(layer.weight_scale_inv, scale_inv, *extra)
            fp8.finish_loading(layers, quant, torch.float32, CPU)
        full = {name: dequantize_blocks(q, s, block) for name, (q, s) in ckpt.items()}
        rows = lambda t: t.chunk(tp, 0)[rank]  # noqa: E731
        assert torch.equal(layers["qkv"].weight, torch.cat([rows(full["q"]), rows(full["k"]), rows(full["v"])]))
        assert torch.equal(layers["gate_up"].weight, torch.cat([rows(full["gate"]), rows(full["up"])]))
        assert torch.equal(layers["down"].weight, full["down"].chunk(tp, 1)[rank])


@settings(max_examples=25, deadline=None)
@given(tp=st.sampled_from([1, 2, 3, 4]), scheme=st.sampled_from(["block", "channel"]),
       block=st.sampled_from([(16, 32), (32, 16), (128, 128), (64, 48)]), inter_per_rank=st.integers(5, 40),
       hidden=st.integers(20, 150), seed=st.integers(0, 2**16))
def test_expert_scales_shard_with_their_weights_whatever_the_split(tp, scheme, block, inter_per_rank, hidden, seed):
    """Stacked FP8 experts (an FP8 MoE checkpoint's per-expert gate/up/down tensors and scales) on every rank hold
    exactly their slice of each expert's dequantized weights: gate/up rows split across ranks (inside a block too),
    down_proj's columns split (its K groups shrinking to fit the rank's slice)."""
    from executor_svc.layers import fused_moe
    from kernels.fp8_quant import quantize_rows_ref

    gen = torch.Generator().manual_seed(seed)
    num_experts, inter = 3, inter_per_rank * tp
    ckpt, full = {}, {}
    for e in range(num_experts):
        for part, shape in (("gate", (inter, hidden)), ("up", (inter, hidden)), ("down", (hidden, inter))):
            w = torch.randn(*shape, generator=gen) * 2.0 ** torch.randint(-6, 6, (shape[0], 1), generator=gen)
            q, s = quantize_blocks_ref(w, block) if scheme == "block" else quantize_rows_ref(w, shape[1])
            ckpt[e, part] = q, s
            full[e, part] = dequantize_blocks(q, s, block) if scheme == "block" else q.float() * s
    quant = WeightQuantization(scheme, from_checkpoint=True, block=block,
                               scale_name="weight_scale_inv" if scheme == "block" else "weight_scale")
    for rank in range(tp):
        with as_rank(rank, tp), mock.patch.object(fused_moe, "tp_rank", lambda: rank):
            experts = fused_moe.StackedExperts(num_experts, hidden, inter_per_rank)
            fp8._add_fp8_expert_parameters(experts, quant)
            for (e, part), (q, s) in ckpt.items():
                attr = "w2" if part == "down" else "w13"
                getattr(experts, attr).weight_loader(getattr(experts, attr), q, (e, part))
                scale = getattr(experts, f"{attr}_{quant.scale_name}")
                scale.weight_loader(scale, s, (e, part))
            assert fp8._finish_experts("experts", experts, quant, torch.float32, CPU, False) == 1
        rows = lambda t: t.chunk(tp, 0)[rank]  # noqa: E731
        for e in range(num_experts):
            assert torch.equal(experts.w13[e], torch.cat([rows(full[e, "gate"]), rows(full[e, "up"])]))
            assert torch.equal(experts.w2[e], full[e, "down"].chunk(tp, 1)[rank])


@pytest.mark.parametrize("not_converted, layer", [
    ("model.layers.0.mlp.experts.3.up_proj", "model.layers.0.mlp.experts"),  # one expert's projection of a block
    ("model.layers.2.self_attn.k_proj", "model.layers.2.self_attn.qkv_proj"),  # one piece of a fused layer
])
def test_a_checkpoint_that_converts_part_of_a_layer_is_refused_naming_it(tmp_path, not_converted, layer):
    from support.fp8_checkpoints import tiny_fp8_moe_checkpoints

    path = os.path.join(tiny_fp8_moe_checkpoints(str(tmp_path)), "block")
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"]["modules_to_not_convert"].append(not_converted)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    with pytest.raises(ValueError, match=f"{layer}: the checkpoint converts only some of the modules it loads"):
        load(path)


@pytest.mark.parametrize("asked, group_k13, group_k2, expected", [
    ("", 128, 128, "fp8"),  # a block checkpoint (Qwen3-*-FP8, DeepSeek): w8a8 by default
    ("", 2048, 768, "fp8"),  # --quantization fp8: a scale per row
    ("", 64, 64, "bf16"),  # groups the FP8-activation kernels cannot scale: weight-only, not refused
    ("bf16", 128, 128, "bf16"),
    ("fp8", 64, 64, "NANOSERVE_FP8_MOE_ACTIVATIONS=fp8: layers.0.mlp.experts's expert scales come in groups of 64"),
    ("int8", 128, 128, "expected 'fp8' \\(FP8 activations\\) or 'bf16'"),
])
def test_fp8_experts_multiply_fp8_activations_by_default_where_their_scales_allow(monkeypatch, asked, group_k13,
                                                                                   group_k2, expected):
    from kernels.fused_moe import Fp8Experts

    num_experts, hidden, inter = 4, 2048, 768
    scales = Fp8Experts(torch.ones(num_experts, 2 * inter, -(-hidden // group_k13)),
                        torch.ones(num_experts, hidden, -(-inter // group_k2)), group_k13, group_k2)
    monkeypatch.setenv(fp8.MOE_ACTIVATIONS_ENV, asked)
    if expected in ("fp8", "bf16"):
        assert fp8.moe_activations("layers.0.mlp.experts", scales) == expected
    else:
        with pytest.raises(ValueError, match=expected):
            fp8.moe_activations("layers.0.mlp.experts", scales)


def test_fp8_experts_stay_weight_only_where_the_checkpoint_bounds_its_activations_scales(monkeypatch):
    """fbgemm_fp8's activation_scale_ub: the FP8-activation experts would not apply it, the weight-only ones quantize
    no activations; asking for FP8 activations is refused, naming why."""
    from kernels.fused_moe import Fp8Experts

    scales = Fp8Experts(torch.ones(4, 1536, 1), torch.ones(4, 2048, 1), 2048, 768)  # a scale per row: w8a8 allowed
    monkeypatch.setenv(fp8.MOE_ACTIVATIONS_ENV, "")
    assert fp8.moe_activations("layers.0.mlp.experts", scales) == "fp8"
    assert fp8.moe_activations("layers.0.mlp.experts", scales, bounded=True) == "bf16"
    monkeypatch.setenv(fp8.MOE_ACTIVATIONS_ENV, "fp8")
    with pytest.raises(ValueError, match="bounds its activations' scales"):
        fp8.moe_activations("layers.0.mlp.experts", scales, bounded=True)


def test_fp8_weights_stay_fp8_on_gpus_and_take_the_weight_only_gemm_before_fp8_tensor_cores(checkpoints, monkeypatch,
                                                                                             caplog):
    """runs_fp8_gemms: Ada and Hopper (sm_89, sm_90) keep FP8 weights for the FP8 GEMMs; runs_weight_only_fp8_gemms: an
    A100 or A10 (sm_80, sm_86), whose torch._scaled_mm and Triton FP8 dots do not run, keeps them for the weight-only
    GEMM (NANOSERVE_FP8_WEIGHT_ONLY=0: dequantized at load as on the CPU). The loader follows the predicates (here
    forced for a CPU load: the layers keep their FP8 weights and scales, and the log says which GEMMs run them; the
    weight-only products themselves: tests/kernels/test_fp8_gemm.py, under the interpreter)."""
    for capability, fp8_gemms in (((8, 0), False), ((8, 6), False), ((8, 9), True), ((9, 0), True)):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None, c=capability: c)
        assert fp8.runs_fp8_gemms(torch.device("cuda")) == fp8_gemms, capability
        assert fp8.runs_weight_only_fp8_gemms(torch.device("cuda")) == (not fp8_gemms), capability
        monkeypatch.setenv(fp8.WEIGHT_ONLY_ENV, "0")
        assert not fp8.runs_weight_only_fp8_gemms(torch.device("cuda"))
        monkeypatch.delenv(fp8.WEIGHT_ONLY_ENV)
    assert not fp8.runs_fp8_gemms(CPU) and not fp8.runs_weight_only_fp8_gemms(CPU)
    for predicate, said in (("runs_fp8_gemms", "FP8 GEMMs"), ("runs_weight_only_fp8_gemms", "weight-only FP8 GEMMs")):
        with monkeypatch.context() as patched:
            patched.setattr(fp8, predicate, lambda device: True)
            patched.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
            caplog.clear()
            with caplog.at_level(logging.INFO, logger="nanoserve.executor"):
                model, _ = load(os.path.join(checkpoints, "block"))
        layer = model.model.layers[0].self_attn.qkv_proj
        assert layer.weight.dtype == torch.float8_e4m3fn and layer.weight_scale.dtype == torch.float32
        assert layer.fp8_weight_only == (predicate == "runs_weight_only_fp8_gemms") and said in caplog.text


def test_the_norm_before_fp8_experts_that_multiply_fp8_activations_writes_both_forms(tmp_path, monkeypatch):
    """quantize_in_producers on a Qwen3-MoE with --quantization fp8, loaded as a GPU with FP8 tensor cores would load
    it (runs_fp8_gemms forced on for a CPU load): the post-attention norm of each sparse layer writes FP8 per token
    and 128 columns for its experts and its plain output for the router; the dense layer's feeds its gate_up_proj;
    with weight-only experts (NANOSERVE_FP8_MOE_ACTIVATIONS=bf16) the norm stays plain."""
    from support.tiny_checkpoints import make_tiny_qwen3_moe

    path = make_tiny_qwen3_moe(str(tmp_path / "moe"))
    monkeypatch.setattr(fp8, "runs_fp8_gemms", lambda device: True)
    model, _ = load(path, quantization="fp8")
    sparse, dense = [model.model.layers[i] for i in (0, 2)], model.model.layers[1]
    for layer in sparse:
        norm = layer.post_attention_layernorm
        assert layer.mlp.experts.fp8.activations == "fp8" and (norm.fp8_group, norm.fp8_keeps_plain) == (128, True)
    assert not dense.post_attention_layernorm.fp8_keeps_plain and dense.post_attention_layernorm.fp8_group is not None
    monkeypatch.setenv(fp8.MOE_ACTIVATIONS_ENV, "bf16")
    model, _ = load(path, quantization="fp8")
    assert all(model.model.layers[i].post_attention_layernorm.fp8_group is None for i in (0, 2))


def test_an_fbgemm_checkpoints_layers_quantize_their_own_inputs_under_its_activation_scale_bound(checkpoints,
                                                                                                 monkeypatch, caplog):
    """Loaded as a GPU with FP8 tensor cores would load it (runs_fp8_gemms forced on for a CPU load): each FP8 layer
    of an fbgemm_fp8 checkpoint takes the bound as fp8_max_scale, which its GEMM's quantize_rows applies
    (tests/kernels/test_fp8_gemm.py), and so no producer quantizes for it; the log says the bound. A checkpoint
    without one feeds its layers from their producers as before."""
    from kernels.fp8_quant import activation_max_scale

    monkeypatch.setattr(fp8, "runs_fp8_gemms", lambda device: True)
    with caplog.at_level(logging.INFO, logger="nanoserve.executor"):
        model, _ = load(os.path.join(checkpoints, "fbgemm"))
    layers = [layer for _, layer in fp8.linear_layers(model) if layer.weight.dtype == torch.float8_e4m3fn]
    assert layers and all(layer.fp8_max_scale == activation_max_scale(1200.0) for layer in layers)
    block = model.model.layers[0]
    assert block.input_layernorm.fp8_group is None and block.mlp.act_fn.fp8_group is None
    assert "counts for at most 1200 in its scale" in caplog.text
    model, _ = load(os.path.join(checkpoints, "channel"))
    block = model.model.layers[0]
    assert not any(hasattr(layer, "fp8_max_scale") for _, layer in fp8.linear_layers(model))
    assert block.input_layernorm.fp8_group is not None and block.mlp.act_fn.fp8_group is not None


def test_experts_on_a_gpu_without_fp8_tensor_cores_keep_fp8_as_bytes_and_stay_weight_only(tmp_path, monkeypatch,
                                                                                            caplog):
    """A Qwen3-MoE with --quantization fp8 loaded as an A100 would load it (the weight-only GEMMs forced for a CPU
    load): the experts keep their FP8 weights, read as bytes (Fp8Experts.weight_bytes) and multiplied weight-only, and
    no producer quantizes; asking for FP8 activations there is refused. The kernels: tests/kernels/test_fused_moe.py."""
    from support.tiny_checkpoints import make_tiny_qwen3_moe

    path = make_tiny_qwen3_moe(str(tmp_path / "moe"))
    monkeypatch.setattr(fp8, "runs_weight_only_fp8_gemms", lambda device: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    with caplog.at_level(logging.INFO, logger="nanoserve.executor"):
        model, _ = load(path, quantization="fp8")
    for i in (0, 2):
        experts = model.model.layers[i].mlp.experts
        assert experts.w13.dtype == torch.float8_e4m3fn and experts.fp8.weight_bytes
        assert experts.fp8.activations == "bf16" and model.model.layers[i].post_attention_layernorm.fp8_group is None
    assert model.model.layers[1].mlp.gate_up_proj.fp8_weight_only  # the dense layer's Linear layers too
    assert "weight-only FP8 GEMMs" in caplog.text and "2 expert blocks" in caplog.text
    monkeypatch.setenv(fp8.MOE_ACTIVATIONS_ENV, "fp8")
    with pytest.raises(ValueError, match="FP8 activations need FP8 tensor cores"):
        load(path, quantization="fp8")
