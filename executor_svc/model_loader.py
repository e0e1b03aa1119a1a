"""Build a supported model from an HF checkpoint directory and stream its safetensors into it.

Each parameter loads its own shard through its `weight_loader`; checkpoint tensors that we
fuse (q/k/v -> qkv_proj, gate/up -> gate_up_proj) go to the fused parameter with a shard id.
"""
import contextlib
import json
import logging
import os
import time
from dataclasses import dataclass, replace

import torch
from safetensors import safe_open
from torch import nn
from transformers import AutoConfig

from executor_svc.layers import fp8
from executor_svc.models import MODEL_REGISTRY
from executor_svc.models.llama import head_dim_of
from kernels.attention.base import AttentionBackend
from scheduler_svc.common.checkpoint_kv_scales import is_kv_scale
from scheduler_svc.common.model_paths import checkpoint_files
from scheduler_svc.common.weight_quantization import weight_quantization

log = logging.getLogger("nanoserve.executor")
PROGRESS_EVERY_S = 10.0  # a large checkpoint's load says how far it is at most this often
FP8_TYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


@dataclass
class ModelFacts:
    architecture: str
    model_name: str
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    vocab_size: int
    max_position_embeddings: int
    eos_token_ids: list[int]
    torch_dtype: str  # the checkpoint's dtype name, e.g. "bfloat16"
    weight_format: str = ""  # how the Linear weights are served: the dtype, or an FP8 format


def read_model_facts(model_dir: str) -> ModelFacts:
    return _facts(model_dir, AutoConfig.from_pretrained(model_dir))


def _facts(model_dir: str, config) -> ModelFacts:
    with open(os.path.join(model_dir, "config.json")) as f:
        raw = json.load(f)
    eos = _as_list(config.eos_token_id)
    gen_path = os.path.join(model_dir, "generation_config.json")
    if os.path.exists(gen_path):
        with open(gen_path) as f:
            eos += _as_list(json.load(f).get("eos_token_id"))
    return ModelFacts(
        architecture=(config.architectures or ["<none>"])[0],
        model_name=os.path.basename(os.path.normpath(model_dir)),
        num_layers=config.num_hidden_layers,
        num_heads=config.num_attention_heads,
        num_kv_heads=getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
        head_dim=head_dim_of(config),
        hidden_size=config.hidden_size,
        vocab_size=config.vocab_size,
        max_position_embeddings=config.max_position_embeddings,
        eos_token_ids=list(dict.fromkeys(eos)),  # union, first-seen order
        torch_dtype=str(raw.get("dtype") or raw.get("torch_dtype") or "float32"),
    )


def load_model(
    model_dir: str, dtype: torch.dtype, device: torch.device, backend: AttentionBackend, load_format: str = "auto",
    quantization: str | None = None,
) -> tuple[nn.Module, ModelFacts]:
    """The model on `device` in `dtype`, weights loaded (this rank's shard), attention on `backend`.

    load_format "dummy" draws random weights from config.json alone (benchmarks, no checkpoint).
    FP8 checkpoints, and `quantization` "fp8" for plain ones, give FP8 Linear weights (layers/fp8.py)."""
    quant = weight_quantization(model_dir, quantization)  # refuses an unsupported quant_method first
    if quant is not None and quant.from_checkpoint and load_format == "dummy":
        # random weights, quantized at load in the checkpoint's format (a block checkpoint's square blocks, or per row)
        quant = replace(quant, from_checkpoint=False, not_converted=(), unused=())
    config = AutoConfig.from_pretrained(model_dir)
    facts = _facts(model_dir, config)
    model_cls = MODEL_REGISTRY.get(facts.architecture)
    if model_cls is None:
        raise ValueError(
            f"architecture {facts.architecture!r} in {model_dir} is not supported; supported: {sorted(MODEL_REGISTRY)}"
        )
    with _default_dtype(dtype), torch.device(device):
        model = model_cls(config)
    if quant is not None and quant.from_checkpoint:
        fp8.prepare_checkpoint_layers(model, quant)
    if load_format == "dummy":
        init_dummy_weights(model)
    else:
        load_weights(model, model_dir, unused=quant.unused if quant is not None else ())
    model.requires_grad_(False)
    facts.weight_format = str(dtype).removeprefix("torch.")
    if quant is not None:
        fp8.finish_loading(model, quant, dtype, device)
        facts.weight_format = quant.describe()
    for attn in model.attention_layers():
        attn.backend = backend
    return model, facts


def _check_fp8_dtype(tensor: torch.Tensor, param: nn.Parameter) -> None:
    """Refuse a checkpoint tensor that is FP8 where its parameter is not, or not where it is: either would be cast
    and read wrongly scaled."""
    if tensor.dtype in FP8_TYPES and param.dtype != tensor.dtype:
        raise ValueError(f"a {str(tensor.dtype).removeprefix('torch.')} tensor for a "
                         f"{str(param.dtype).removeprefix('torch.')} parameter: config.json's quantization_config "
                         "does not make this module FP8 (none is given, or modules_to_not_convert lists it), so its "
                         "bytes would be read unscaled")
    if param.dtype in FP8_TYPES and tensor.dtype != param.dtype:
        raise ValueError(f"a {str(tensor.dtype).removeprefix('torch.')} weight where the checkpoint's "
                         "quantization_config makes the module FP8 (float8_e4m3fn); a module left plain must be "
                         "listed in modules_to_not_convert (compressed-tensors: ignore)")


@torch.no_grad()
def init_dummy_weights(model: nn.Module, seed: int = 0) -> None:
    """Random weights at a scale that keeps activations finite: norms near 1, matrices ~N(0, 1/fan_in)."""
    gen = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            param.fill_(1.0)
        elif param.dim() == 1:
            param.zero_()
        else:
            noise = torch.randn(param.shape, generator=gen, device=param.device, dtype=torch.float32)
            param.copy_(noise / param.shape[-1] ** 0.5)


def load_weights(model: nn.Module, model_dir: str, unused: tuple[str, ...] = ()) -> None:
    """Stream every tensor of the checkpoint's files (model_paths.checkpoint_files) into its parameter; fail if any
    parameter stays unloaded. Tensors whose last name is in `unused` (an FP8 checkpoint's static activation scales)
    are skipped, and so are KV cache scales (scheduler_svc/common/checkpoint_kv_scales.py: an fp8 pool reads them
    itself under --kv-cache-scales checkpoint). The log shows progress: a line every PROGRESS_EVERY_S seconds, and
    one at the end."""
    files = checkpoint_files(model_dir)
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {model_dir}")
    params = dict(model.named_parameters())
    packed = model.packed_modules_mapping
    loaded: dict[str, set] = {name: set() for name in params}
    kv_scales = 0
    total_gb, done_gb, start = sum(os.path.getsize(p) for p in files) / 1e9, 0.0, time.monotonic()
    last_said = start
    for number, path in enumerate(files, 1):
        with safe_open(path, framework="pt", device="cpu") as f:
            for ckpt_name in f.keys():
                if ckpt_name.endswith("rotary_emb.inv_freq"):
                    continue  # recomputed from the config
                if ckpt_name.rpartition(".")[2] in unused:
                    continue
                if is_kv_scale(ckpt_name):
                    kv_scales += 1
                    continue
                if ckpt_name == "lm_head.weight" and model.tie_word_embeddings:
                    continue  # the LM head is embed_tokens' weight
                name, shard_id = model.checkpoint_param(ckpt_name) or _our_name(ckpt_name, packed)
                if name not in params:
                    model_name = type(model).__name__
                    raise ValueError(f"checkpoint tensor {ckpt_name!r} has no parameter {name!r} in {model_name}")
                param = params[name]
                tensor = f.get_tensor(ckpt_name)
                try:
                    _check_fp8_dtype(tensor, param)
                    if shard_id is None:
                        param.weight_loader(param, tensor)
                    else:
                        param.weight_loader(param, tensor, shard_id)
                except ValueError as exc:  # a loader's refusal, named by the tensor it refused
                    raise ValueError(f"checkpoint tensor {ckpt_name!r} in {path}: {exc}") from exc
                loaded[name].add(shard_id)
        done_gb += os.path.getsize(path) / 1e9
        now = time.monotonic()
        if now - last_said >= PROGRESS_EVERY_S or number == len(files):
            log.info("weights %s: %d of %d files, %.1f of %.1f GB, %.0f s", "loaded" if number == len(files) else
                     "loading", number, len(files), done_gb, total_gb, now - start)
            last_said = now

    if kv_scales:
        log.info("the checkpoint's %d KV cache scales (k_scale, v_scale) are read by an fp8 KV pool under "
                 "--kv-cache-scales checkpoint, and not otherwise", kv_scales)
    expected_shards = {}
    for fused, shard_id in packed.values():
        expected_shards.setdefault(fused, set()).add(shard_id)
    missing = []
    for name, got in loaded.items():
        module_name = name.split(".")[-2] if "." in name else ""
        # a parameter that stacks many checkpoint tensors (the experts) lists the sets that complete it
        complete = getattr(params[name], "expected_shards", None) or [expected_shards.get(module_name, {None})]
        if got not in complete:
            missing.append(name)
    if missing:
        raise ValueError(f"{len(missing)} parameters not (fully) loaded from {model_dir}: {missing[:8]}")


def _our_name(ckpt_name: str, packed: dict) -> tuple[str, object]:
    """Map a checkpoint tensor name to (our parameter name, shard id or None)."""
    parts = ckpt_name.split(".")
    for i, part in enumerate(parts):
        if part in packed:
            fused, shard_id = packed[part]
            return ".".join(parts[:i] + [fused] + parts[i + 1 :]), shard_id
    return ckpt_name, None


def _as_list(ids) -> list[int]:
    if ids is None:
        return []
    return [int(ids)] if isinstance(ids, int) else [int(i) for i in ids]


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype):
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)
