"""Which FP8 weight format a model is served in: read from the checkpoint's `quantization_config`, or
asked for with `--quantization fp8`. Stdlib only: the CLI checks it before any process starts, so a
checkpoint in a format nanoserve cannot load is refused at start-up with its quant_method named.

Formats (executor_svc/layers/fp8.py loads them, kernels/fp8_gemm.py multiplies them):

- block: the fine-grained FP8 of DeepSeek and Qwen3-*-FP8, `{"quant_method": "fp8", "weight_block_size":
  [128, 128]}`. Each Linear weight is float8_e4m3fn with a float32 `weight_scale_inv` per block of
  128 output rows x 128 input columns (ceil at the edges); W = weight * weight_scale_inv.
  compressed-tensors' FP8_BLOCK (llm-compressor) is the same with the scales named `weight_scale`.
- channel: float8_e4m3fn weights with a float32 `weight_scale` per output row or one per tensor (each served
  as a scale per row), activations quantized per token at run time. The checkpoints written so:
  compressed-tensors FP8 (llm-compressor's FP8_DYNAMIC, per row; its FP8 scheme, per tensor with static
  activation scales); `{"quant_method": "fp8"}` without weight_block_size (AutoFP8's and vLLM's per-tensor
  export, activation_scheme dynamic or static); `{"quant_method": "fbgemm_fp8"}` (Meta's Llama 3.1 FP8: per
  row, dynamic per-token activations whose scale is bounded: activation_scale_ub, 1200 unless given, caps each
  token's max before its scale is taken, and larger values saturate at +-448, as fbgemm's quantize_fp8_per_row
  does); NVIDIA ModelOpt's export
  (`hf_quant_config.json` {"quantization": {"quant_algo": "FP8", ...}}, or `quant_method "modelopt"` in config.json):
  FP8 a scale per tensor with a static input_scale, FP8_PER_CHANNEL_PER_TOKEN a scale per row.
  ModelOpt's FP8_PB_WO is the block format: 128 x 128 blocks, its weight_scale [N/128, 1, K/128, 1]. AMD Quark's
  (`quant_method "quark"`): global_quant_config's weight fp8_e4m3 per_tensor or per_channel, its static input scales
  not used.
  A checkpoint's static activation scales (`input_scale`, one per tensor) are read and not used: each
  token's activations are quantized with their own max, at least as fine as one calibrated scale. A checkpoint's
  KV cache scales (`k_scale`, `v_scale`) are an fp8 KV pool's under --kv-cache-scales checkpoint
  (scheduler_svc/common/checkpoint_kv_scales.py); the weight loader skips them.
- online: `--quantization fp8` on a bf16/fp32 checkpoint: each Linear weight quantized per output row at
  load, the same arithmetic as channel.

Modules the checkpoint lists as not converted (`modules_to_not_convert`, compressed-tensors' `ignore`, ModelOpt's
`exclude_modules` wildcards) keep their plain weights.
"""
from __future__ import annotations

import fnmatch
import json
import os
import re
from dataclasses import dataclass, field

QUANTIZATION_CHOICES = ("fp8",)  # --quantization
MODELOPT_CONFIG = "hf_quant_config.json"  # where NVIDIA ModelOpt's export states its quantization
FBGEMM_ACTIVATION_SCALE_UB = 1200.0  # fbgemm_fp8's bound where its config gives none (transformers' default)
STATIC_SCALES = ("input_scale",)  # a static activation scale per converted module, not used (module docstring)


@dataclass(frozen=True)
class WeightQuantization:
    scheme: str  # "block" or "channel"
    from_checkpoint: bool  # False: quantized at load (--quantization fp8)
    block: tuple[int, int] = (128, 128)  # block: (output rows, input columns) per scale
    scale_name: str = "weight_scale_inv"  # the checkpoint tensor beside each weight
    not_converted: tuple[str, ...] = field(default_factory=tuple)  # module names or "re:" patterns
    unused: tuple[str, ...] = ()  # checkpoint tensors (their last name) read and not used: static activation scales
    per_tensor: bool = False  # channel: the checkpoint has one scale per tensor (served on each of its rows)
    activation_scale_ub: float | None = None  # fbgemm_fp8: the most a token's max may count for in its scale

    def converts(self, module_name: str) -> bool:
        """Whether the checkpoint module `module_name` (e.g. model.layers.0.mlp.up_proj) holds FP8 weights."""
        for pattern in self.not_converted:
            if pattern.startswith("re:"):
                if re.fullmatch(pattern[3:], module_name):
                    return False
            elif f".{pattern}." in f".{module_name}.":  # whole dotted segments: layers.1 is not layers.10
                return False
        return True

    def describe(self) -> str:
        """The weight format as GetModelInfo reports it."""
        at_load = "" if self.from_checkpoint else ", quantized at load"
        if self.scheme == "block":
            return f"fp8_e4m3fn, {self.block[0]}x{self.block[1]} block scales{at_load}"
        bound = "" if self.activation_scale_ub is None else f", activation_scale_ub {self.activation_scale_ub:g}"
        return f"fp8_e4m3fn, {'per-tensor' if self.per_tensor else 'per-channel'} scales{bound}{at_load}"


def weight_quantization(model_dir: str, quantization: str | None) -> WeightQuantization | None:
    """The format the weights of `model_dir` are served in, or None for plain weights.

    Raises ValueError for a quantization_config nanoserve does not load (naming its quant_method)."""
    if quantization is not None and quantization not in QUANTIZATION_CHOICES:
        raise ValueError(f"--quantization must be one of {QUANTIZATION_CHOICES}, got {quantization!r}")
    path = os.path.join(model_dir, "config.json")
    raw = {}
    if os.path.exists(path):
        with open(path) as f:
            raw = json.load(f).get("quantization_config") or {}
    modelopt = os.path.join(model_dir, MODELOPT_CONFIG)
    if not raw and os.path.exists(modelopt):
        with open(modelopt) as f:
            raw = {"quant_method": "modelopt", **(json.load(f).get("quantization") or {})}
    if raw:
        return _from_checkpoint(raw, model_dir)
    if quantization == "fp8":
        return WeightQuantization(scheme="channel", from_checkpoint=False, scale_name="weight_scale")
    return None


def _from_checkpoint(raw: dict, model_dir: str) -> WeightQuantization:
    method = str(raw.get("quant_method", "<missing>"))

    def refuse(why: str) -> ValueError:
        return ValueError(f"{model_dir}: quantization_config quant_method {method!r}: {why}. nanoserve loads "
                          "FP8 checkpoints only: quant_method 'fp8' (with or without weight_block_size), "
                          "'fbgemm_fp8', 'compressed-tensors' FP8 with channel, tensor or block weight scales, or "
                          "'modelopt' FP8, FP8_PER_CHANNEL_PER_TOKEN or FP8_PB_WO, or 'quark' FP8 per tensor or "
                          "channel")

    if method == "fp8":
        block, activations = raw.get("weight_block_size"), raw.get("activation_scheme", "dynamic")
        not_converted = tuple(raw.get("modules_to_not_convert") or ())
        if activations not in ("dynamic", "static"):
            raise refuse(f"activation_scheme {activations!r} is not supported, only 'dynamic' or 'static'")
        if block is None:  # a float32 weight_scale per tensor (AutoFP8, vLLM's export)
            return WeightQuantization(scheme="channel", from_checkpoint=True, scale_name="weight_scale",
                                      not_converted=not_converted, per_tensor=True,
                                      unused=STATIC_SCALES if activations == "static" else ())
        if len(block) != 2:
            raise refuse(f"weight_block_size {block!r} is not [rows, columns]")
        if activations != "dynamic":
            raise refuse("activation_scheme 'static' with weight_block_size is not supported, only 'dynamic'")
        return WeightQuantization(scheme="block", from_checkpoint=True, block=(int(block[0]), int(block[1])),
                                  scale_name="weight_scale_inv", not_converted=not_converted)
    if method == "fbgemm_fp8":  # a float32 weight_scale [N, 1] per row; activations per token at run time
        bound = raw.get("activation_scale_ub", FBGEMM_ACTIVATION_SCALE_UB)
        if isinstance(bound, bool) or not isinstance(bound, (int, float)) or not 0 < bound < float("inf"):
            raise refuse(f"activation_scale_ub {bound!r} is not a positive number")
        return WeightQuantization(scheme="channel", from_checkpoint=True, scale_name="weight_scale",
                                  not_converted=tuple(raw.get("modules_to_not_convert") or ()),
                                  activation_scale_ub=float(bound))
    if method == "compressed-tensors":
        groups = list((raw.get("config_groups") or {}).values())
        if len(groups) != 1:
            raise refuse(f"{len(groups)} config_groups; one is supported")
        weights, acts = groups[0].get("weights") or {}, groups[0].get("input_activations")
        if weights.get("type") != "float" or weights.get("num_bits") != 8:
            raise refuse(f"weights of type {weights.get('type')!r} with {weights.get('num_bits')} bits; "
                         "only 8-bit float")
        if weights.get("strategy") not in ("channel", "tensor", "block"):
            raise refuse(f"weight strategy {weights.get('strategy')!r}; only channel, tensor or block")
        static = acts is not None and not acts.get("dynamic", False)
        if weights.get("strategy") == "block":  # llm-compressor's FP8_BLOCK: a weight_scale per block
            block = weights.get("block_structure") or []
            if len(block) != 2:
                raise refuse(f"block_structure {block!r} is not [rows, columns]")
            if static:
                raise refuse("static activation scales with block weights; only dynamic ones")
            return WeightQuantization(scheme="block", from_checkpoint=True, block=(int(block[0]), int(block[1])),
                                      scale_name="weight_scale", not_converted=tuple(raw.get("ignore") or ()))
        if static and acts.get("strategy") != "tensor":
            raise refuse(f"static activation scales per {acts.get('strategy')!r}; only per tensor (or dynamic)")
        return WeightQuantization(scheme="channel", from_checkpoint=True, scale_name="weight_scale",
                                  not_converted=tuple(raw.get("ignore") or ()),
                                  unused=STATIC_SCALES if static else (),
                                  per_tensor=weights.get("strategy") == "tensor")
    if method == "modelopt":  # NVIDIA ModelOpt: its quant_algo names the format
        algo = str(raw.get("quant_algo", "<missing>")).upper()
        excluded = tuple(_wildcards(raw.get("exclude_modules") or raw.get("ignore") or ()))
        if algo == "FP8":  # a weight_scale per tensor, a static input_scale (not used)
            return WeightQuantization(scheme="channel", from_checkpoint=True, scale_name="weight_scale",
                                      not_converted=excluded, per_tensor=True, unused=STATIC_SCALES)
        if algo == "FP8_PER_CHANNEL_PER_TOKEN":
            return WeightQuantization(scheme="channel", from_checkpoint=True, scale_name="weight_scale",
                                      not_converted=excluded)
        if algo == "FP8_PB_WO":  # 128 x 128 blocks; the loader flattens the scales' [N/128, 1, K/128, 1]
            return WeightQuantization(scheme="block", from_checkpoint=True, block=(128, 128), scale_name="weight_scale",
                                      not_converted=excluded)
        raise refuse(f"quant_algo {algo!r} is not supported, only FP8, FP8_PER_CHANNEL_PER_TOKEN or FP8_PB_WO")
    if method == "quark":  # AMD Quark: one global config (per-layer overrides are refused)
        global_config = raw.get("global_quant_config") or {}
        weight, inputs = global_config.get("weight") or {}, global_config.get("input_tensors")
        if raw.get("layer_quant_config") or raw.get("layer_type_quant_config"):
            raise refuse("per-layer quant configs (layer_quant_config) are not supported, only a global one")
        if weight.get("dtype") != "fp8_e4m3" or weight.get("qscheme") not in ("per_tensor", "per_channel"):
            raise refuse(f"weights {weight.get('dtype')!r} {weight.get('qscheme')!r}; only fp8_e4m3 per_tensor or "
                         "per_channel")
        static = inputs is not None and not inputs.get("is_dynamic", False)
        if static and inputs.get("qscheme") != "per_tensor":
            raise refuse(f"static input scales {inputs.get('qscheme')!r}; only per_tensor (or dynamic)")
        return WeightQuantization(scheme="channel", from_checkpoint=True, scale_name="weight_scale",
                                  not_converted=tuple(_wildcards(raw.get("exclude") or ())),
                                  per_tensor=weight["qscheme"] == "per_tensor",
                                  unused=STATIC_SCALES if static else ())
    raise refuse("this quantization method is not supported")


def _wildcards(patterns) -> list[str]:
    """ModelOpt's exclude_modules (fnmatch wildcards: `model.layers.1.mlp*`) as WeightQuantization.not_converted
    entries: a pattern with a wildcard becomes a "re:" one, a plain name stays a dotted name."""
    return [f"re:{fnmatch.translate(p)}" if any(c in p for c in "*?[") else p for p in patterns]
