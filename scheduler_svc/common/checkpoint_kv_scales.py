"""The KV cache scales an FP8 checkpoint carries: a calibrated scale for K and one for V per attention layer, found
by tensor name without torch, so that `--kv-cache-scales checkpoint` is refused at start-up where a checkpoint lacks
them. An fp8 KV pool then serves them (executor_svc/kv_calibration.py reads their values); under any other method
the weight loader skips them (executor_svc/model_loader.load_weights).

Each is float32, one per tensor or one per KV head, with the fp8 pool's own meaning: a value is stored as
x / scale, clamped to e4m3's +-448 (calibrated so, scale = max |x| / 448). The names exporters give them:
- `model.layers.N.self_attn.k_scale` and `.v_scale`: compressed-tensors' kv_cache_scheme (llm-compressor), Quark;
- `model.layers.N.self_attn.k_proj.k_scale` and `.v_proj.v_scale`: NVIDIA ModelOpt;
- `model.layers.N.self_attn.k_proj.output_scale` and `.v_proj.output_scale`: AutoFP8's and older exports;
- `model.layers.N.self_attn.kv_scale`: one scale for both K and V (an older single-scale export).
"""
from __future__ import annotations

import json
import os
import re
import struct

from scheduler_svc.common.model_paths import checkpoint_files

_KV_SCALE = re.compile(r"(?:.*\.)?layers\.(\d+)\.self_attn\."
                       r"(k_scale|v_scale|kv_scale|k_proj\.k_scale|v_proj\.v_scale|k_proj\.output_scale|"
                       r"v_proj\.output_scale)")


def is_kv_scale(name: str) -> bool:
    """Whether checkpoint tensor `name` is a KV cache scale (one of the module docstring's names)."""
    return _KV_SCALE.fullmatch(name) is not None


def kv_scale_names(model_dir: str) -> dict[int, dict[str, tuple[str, str]]]:
    """{layer: {"k": (file, tensor name), "v": (file, tensor name)}} for the KV cache scales the checkpoint in model_dir
    holds (a layer's one kv_scale names both; a layer may lack either)."""
    found: dict[int, dict[str, tuple[str, str]]] = {}
    for path, name in checkpoint_tensor_names(model_dir):
        match = _KV_SCALE.fullmatch(name)
        if match is None:
            continue
        layer, kind = int(match.group(1)), match.group(2)
        for part in ("k", "v") if kind == "kv_scale" else (kind[0],):
            found.setdefault(layer, {})[part] = (path, name)
    return found


def checkpoint_kv_scale_names(model_dir: str) -> dict[int, dict[str, tuple[str, str]]]:
    """kv_scale_names for `--kv-cache-scales checkpoint`: every layer of config.json's num_hidden_layers with both
    a K and a V scale, else ValueError saying which are missing."""
    path = os.path.join(model_dir, "config.json")
    if not os.path.exists(path):
        raise ValueError(f"--kv-cache-scales checkpoint: {model_dir} has no config.json")
    with open(path) as f:
        config = json.load(f)
    num_layers = int((config.get("text_config") or config)["num_hidden_layers"])
    names = kv_scale_names(model_dir)
    missing = [f"{layer}.{part}" for layer in range(num_layers) for part in "kv" if part not in names.get(layer, {})]
    if missing:
        shown = ", ".join(missing[:6]) + (f" and {len(missing) - 6} more" if len(missing) > 6 else "")
        raise ValueError(f"--kv-cache-scales checkpoint: {model_dir} lacks KV cache scales for {len(missing)} of "
                         f"{2 * num_layers} layer K/V pairs (layer.k or .v: {shown}); it needs a k_scale and a "
                         "v_scale per attention layer (e.g. an llm-compressor checkpoint with a kv_cache_scheme). "
                         "Use --kv-cache-scales calibrated-per-head to calibrate them at start-up instead")
    return names


def checkpoint_tensor_names(model_dir: str) -> list[tuple[str, str]]:
    """(file, tensor name) for every tensor in the checkpoint's weight files (model_paths.checkpoint_files), read from
    their JSON headers (no tensor data)."""
    names = []
    for path in checkpoint_files(model_dir):
        with open(path, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(length))
        names.extend((path, name) for name in header if name != "__metadata__")
    return names
