"""Tiny FP8 checkpoints made from a plain tiny checkpoint, each beside a plain checkpoint of its dequantized
weights (what HF transformers runs as the reference).

- block: the fine-grained format of Qwen3-*-FP8 and DeepSeek (quant_method "fp8", 128 x 128 blocks of
  float32 `weight_scale_inv`), with `modules_to_not_convert` naming one layer's MLP;
- channel: compressed-tensors FP8_DYNAMIC (a `weight_scale` per output row, dynamic per-token activations);
- tensor: AutoFP8's per-tensor format (quant_method "fp8" without weight_block_size: a scalar `weight_scale` per
  module, and a static `input_scale` per module, activation_scheme "static");
- fbgemm: Meta's fbgemm_fp8 (a `weight_scale` [N, 1] per output row, activation_scale_ub);
- compressed_block: compressed-tensors FP8_BLOCK (128 x 128 blocks of `weight_scale`, activations per token and
  128 columns).

Before quantizing, every weight block is multiplied by its own factor in [0.5, 2], so the scales differ
block to block and a scale applied to the wrong block changes the output.
"""
from __future__ import annotations

import glob
import json
import os
import shutil

import torch
from safetensors.torch import load_file, save_file

from kernels.fp8_quant import dequantize_blocks, quantize_blocks_ref, quantize_rows_ref

BLOCK = (128, 128)
NOT_CONVERTED = "model.layers.1.mlp"  # its gate, up and down projections stay plain
SCHEMES = ("block", "channel", "tensor", "fbgemm", "compressed_block", "modelopt", "modelopt_channel", "modelopt_block",
           "quark")
MODELOPT_ALGOS = {"modelopt": "FP8", "modelopt_channel": "FP8_PER_CHANNEL_PER_TOKEN", "modelopt_block": "FP8_PB_WO"}


def _converted(name: str, not_converted: tuple[str, ...]) -> bool:
    return name.endswith("_proj.weight") and not any(f".{m}." in f".{name}" for m in not_converted)


def _block_factors(w: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    gn, gk = -(-w.shape[0] // BLOCK[0]), -(-w.shape[1] // BLOCK[1])
    f = 2.0 ** (2 * torch.rand(gn, gk, generator=gen) - 1)
    return f.repeat_interleave(BLOCK[0], 0)[: w.shape[0]].repeat_interleave(BLOCK[1], 1)[:, : w.shape[1]]


def write_fp8_checkpoints(plain_dir: str, fp8_dir: str, dequantized_dir: str, scheme: str = "block",
                          not_converted: tuple[str, ...] = (NOT_CONVERTED,)) -> None:
    """From plain_dir (safetensors, fp32), write the FP8 checkpoint to fp8_dir and its dequantized weights
    as a plain checkpoint to dequantized_dir. The modules named in not_converted (dotted segments) stay plain."""
    (path,) = glob.glob(os.path.join(plain_dir, "*.safetensors"))
    tensors = load_file(path)
    gen = torch.Generator().manual_seed(11)
    fp8, plain = {}, {}
    for name, w in tensors.items():
        if not _converted(name, not_converted):
            fp8[name] = plain[name] = w
            continue
        w = w * _block_factors(w, gen)
        module = name.removesuffix(".weight")
        if scheme in ("block", "compressed_block", "modelopt_block"):
            q, scale = quantize_blocks_ref(w, BLOCK)
            plain[name] = dequantize_blocks(q, scale, BLOCK)
            if scheme == "modelopt_block":  # ModelOpt's FP8_PB_WO: [N/128, 1, K/128, 1]
                scale = scale[:, None, :, None]
            fp8[module + (".weight_scale_inv" if scheme == "block" else ".weight_scale")] = scale
        elif scheme in ("tensor", "modelopt", "quark"):
            q, scale = quantize_rows_ref(w.reshape(1, -1), w.numel())
            q, scale = q.reshape(w.shape), scale.reshape(())  # AutoFP8, ModelOpt and Quark write 0-dim scales
            fp8[module + ".weight_scale"] = scale
            fp8[module + ".input_scale"] = torch.rand((), generator=gen) + 0.01  # static: read, not used
            plain[name] = q.float() * scale
        else:
            q, scale = quantize_rows_ref(w, w.shape[1])
            plain[name] = q.float() * scale
            fp8[module + ".weight_scale"] = scale.view(-1) if scheme == "modelopt_channel" else scale  # ModelOpt: [N]
        fp8[name] = q
    for out_dir, out in ((fp8_dir, fp8), (dequantized_dir, plain)):
        shutil.copytree(plain_dir, out_dir, dirs_exist_ok=True)
        save_file(out, os.path.join(out_dir, os.path.basename(path)))
    if scheme in MODELOPT_ALGOS:  # ModelOpt states its quantization beside config.json, with wildcard exclusions
        quantization = {"quant_algo": MODELOPT_ALGOS[scheme], "kv_cache_quant_algo": None,
                        "exclude_modules": ["lm_head", *(f"{m}*" for m in not_converted)]}
        with open(os.path.join(fp8_dir, "hf_quant_config.json"), "w") as f:
            json.dump({"producer": {"name": "modelopt", "version": "0.37.0"}, "quantization": quantization}, f)
        return
    with open(os.path.join(fp8_dir, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = _quantization_config(scheme, not_converted)
    with open(os.path.join(fp8_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=2)


def tiny_fp8_checkpoints(root: str) -> str:
    """Under root: a tiny Llama whose dimensions are not multiples of 128 (hidden 192, intermediate 320, k/v
    96 rows) in `plain`, its FP8 versions in each of SCHEMES (ModelOpt's three with their hf_quant_config.json), and
    their dequantized twins in `<scheme>_dequantized`. Returns root."""
    from support.tiny_checkpoints import make_tiny_llama

    make_tiny_llama(os.path.join(root, "plain"), hidden_size=192, intermediate_size=320, num_attention_heads=4,
                    num_key_value_heads=2)
    return _write_schemes(root, SCHEMES)


def tiny_fp8_moe_checkpoints(root: str) -> str:
    """Under root: a tiny Qwen3-MoE (8 experts top-3; hidden 192 and moe_intermediate 160, so each expert's
    projections have ragged blocks; layer 1 dense and not converted) in `plain`, its FP8 versions with per-expert
    FP8 tensors and scales (as Qwen3-30B-A3B-FP8 stores them) in `block`, `channel`, `tensor` (a scale per expert
    projection, as AutoFP8's Mixtral-FP8 stores them) and `modelopt` (the same, ModelOpt's), and their dequantized
    twins.
    Returns root."""
    from support.tiny_checkpoints import make_tiny_qwen3_moe

    make_tiny_qwen3_moe(os.path.join(root, "plain"), hidden_size=192, moe_intermediate_size=160)
    return _write_schemes(root, ("block", "channel", "tensor", "modelopt"))


def _write_schemes(root: str, schemes: tuple[str, ...] = ("block", "channel")) -> str:
    """root/plain's FP8 versions in root/<scheme> for each of `schemes`, with their dequantized twins. Returns
    root."""
    for scheme in schemes:
        write_fp8_checkpoints(os.path.join(root, "plain"), os.path.join(root, scheme),
                              os.path.join(root, f"{scheme}_dequantized"), scheme)
    return root


def _quantization_config(scheme: str, not_converted: tuple[str, ...]) -> dict:
    if scheme == "block":
        return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                "weight_block_size": list(BLOCK), "modules_to_not_convert": ["lm_head", *not_converted]}
    if scheme == "tensor":
        return {"quant_method": "fp8", "activation_scheme": "static", "modules_to_not_convert": ["lm_head",
                                                                                              *not_converted]}
    if scheme == "fbgemm":
        return {"quant_method": "fbgemm_fp8", "activation_scale_ub": 1200.0,
                "modules_to_not_convert": ["lm_head", *not_converted]}
    if scheme == "quark":
        fp8 = {"dtype": "fp8_e4m3", "qscheme": "per_tensor", "is_dynamic": False,
               "observer_cls": "PerTensorMinMaxObserver"}
        return {"quant_method": "quark", "global_quant_config": {"weight": fp8, "input_tensors": fp8,
                                                                 "output_tensors": None, "bias": None},
                "layer_quant_config": {}, "exclude": ["lm_head", *(f"{m}.*" for m in not_converted)],
                "export": {"kv_cache_group": [], "pack_method": "reorder"}}
    fp8_group = {"targets": ["Linear"],
                 "weights": {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True,
                             "dynamic": False},
                 "input_activations": {"num_bits": 8, "type": "float", "strategy": "token", "symmetric": True,
                                       "dynamic": True}}
    if scheme == "compressed_block":
        fp8_group["weights"].update(strategy="block", block_structure=list(BLOCK))
        fp8_group["input_activations"].update(strategy="group", group_size=BLOCK[1])
    return {"quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
            "config_groups": {"group_0": fp8_group},
            "ignore": ["lm_head", *(f"re:(.*\\.)?{m}\\..*" for m in not_converted)]}
