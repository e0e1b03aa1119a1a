"""A quantized KV pool's scales (fp8 or int8), chosen once at start-up (--kv-cache-scales):

- static (fp8 only): 1.0 everywhere; K and V are stored as they come, clamped to +-448.
- calibrated: per layer, for K and for V, the largest |value| seen in a calibration forward maps to
  448 / 16 (fp8) or 127 / 1.5 (int8), leaving headroom for larger values later
  (kernels/kv_quant.scales_from_amax); beyond that values are clamped.
- calibrated-per-head: the same per KV head (fp8's default).
- calibrated-per-channel: the same per KV head and channel (int8's default).
- checkpoint (fp8 only): the checkpoint's own calibrated k_scale and v_scale per layer (one per tensor, repeated over
  the KV heads, or one per KV head, this rank's taken), as its exporter computed them (max |x| / 448, no headroom:
  larger values clamp); scheduler_svc/common/checkpoint_kv_scales.py names them.
An fp8 pool keeps a scale per head ([2, L, H_kv]; per channel takes each head's largest); an int8 pool a
scale per head and channel ([2, L, H_kv, D]; per head or per layer repeats the one over the others).

The calibration forward (ModelRunner.calibration_amax) runs the model over a few short texts when the
checkpoint has a tokenizer (tokenizer.json), else over random token ids like the profiling forward,
through a temporary pool of the model's dtype whose contents give the amax; it is released before
the real pool is allocated.
Each tensor-parallel rank calibrates its own KV heads. bench/kv_fp8_accuracy.py measures the methods.
"""
from __future__ import annotations

import logging
import os
import torch

from executor_svc.input_batch import profiling_chunks
from executor_svc.kv_cache import KVLayout, KVPool
from executor_svc.sampling_row import GREEDY_ROW
from executor_svc.seq_mirror import MirroredSeq, ScheduledChunk
from kernels.kv_quant import is_int8, scales_from_amax

log = logging.getLogger("nanoserve.executor")

CALIBRATION_TOKENS = 512  # at most, whatever the step budget: the scales depend on the checkpoint alone
# Varied text (prose, dialogue, code, numbers, lists, another language); none of it is in the
# accuracy benchmark's prompts.
CALIBRATION_TEXTS = (
    "The river had frozen early that year, and the children of the village spent every afternoon "
    "skating between the reeds while their parents argued about whether the ice would hold.",
    "User: Can you explain how a refrigerator keeps food cold?\nAssistant: A refrigerator moves heat "
    "from inside the box to the room. A compressor squeezes a refrigerant gas, which then condenses.",
    "def merge_sorted(a, b):\n    out, i, j = [], 0, 0\n    while i < len(a) and j < len(b):\n"
    "        if a[i] <= b[j]:\n            out.append(a[i]); i += 1\n        else:\n"
    "            out.append(b[j]); j += 1\n    return out + a[i:] + b[j:]\n",
    "Quarterly revenue rose 14.2% to $3.87 billion, while operating costs fell from 2,310 to 2,145 "
    "million; the board approved a dividend of 0.42 per share, payable on 2025-03-15.",
    "Ingredients: 2 cups flour, 1 tsp baking soda, 3 eggs, 250 ml milk.\n1. Preheat the oven.\n"
    "2. Whisk the eggs and milk.\n3. Fold in the flour until smooth.\n4. Bake for 25 minutes.",
    "La bibliothèque municipale ouvre ses portes à neuf heures. Les lecteurs peuvent emprunter "
    "jusqu'à cinq livres pendant trois semaines, et la salle d'étude reste calme toute la journée.",
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nSummarise the "
    "causes of the French Revolution in two sentences.<|im_end|>\n<|im_start|>assistant\n",
    "Photosynthesis converts light energy into chemical energy. In the thylakoid membranes, water "
    "is split, oxygen is released, and ATP and NADPH carry the energy to the Calvin cycle.",
)


def kv_cache_scales(method: str, layout: KVLayout, amax: torch.Tensor | None) -> torch.Tensor:
    """The scales (K, V) of a quantized pool for --kv-cache-scales `method` (resolved: not auto), logged:
    [2, L, H_kv] for fp8, [2, L, H_kv, D] for int8. amax is the calibration forward's [2, L, H_kv, D]
    (ModelRunner.calibration_amax), None for static scales."""
    shape = (2, layout.num_layers, layout.num_kv_heads, layout.head_dim)
    if method == "static":
        amax = None
    elif method == "calibrated":  # one scale per layer: the largest over its heads and channels
        amax = amax.amax(dim=(2, 3), keepdim=True).expand(shape)
    elif method == "calibrated-per-head":
        amax = amax.amax(dim=3, keepdim=True).expand(shape)
    if not is_int8(layout.dtype):  # fp8 kernels take a scale per head: a channel's is its head's largest
        amax = None if amax is None else amax.amax(dim=3)
        shape = shape[:3]
    scales = torch.ones(shape) if amax is None else scales_from_amax(amax, layout.dtype)
    log.info("KV cache %s, %s scales (per layer, largest over heads): K [%s] V [%s]",
             str(layout.dtype).removeprefix("torch."), method, _per_layer(scales[0]), _per_layer(scales[1]))
    log.debug("KV cache scales per layer and KV head: %s", scales.tolist())
    return scales


def checkpoint_kv_scales(model_dir: str, layout: KVLayout, rank: int = 0, world_size: int = 1) -> torch.Tensor:
    """The fp8 pool's scales [2, L, H_kv] (this rank's KV heads) from the checkpoint's k_scale and v_scale tensors,
    logged as kv_cache_scales logs its own. A tensor holds one scale, or one per KV head of the whole model."""
    from contextlib import ExitStack

    from safetensors import safe_open

    from scheduler_svc.common.checkpoint_kv_scales import checkpoint_kv_scale_names

    names = checkpoint_kv_scale_names(model_dir)
    heads = layout.num_kv_heads
    scales = torch.empty(2, layout.num_layers, heads)
    with ExitStack() as stack:  # each file opened once
        files = {path: stack.enter_context(safe_open(path, framework="pt", device="cpu"))
                 for parts in names.values() for path, _ in parts.values()}
        values = {(layer, part): files[path].get_tensor(name).float().flatten()
                  for layer in range(layout.num_layers) for part, (path, name) in names[layer].items()}
    for layer in range(layout.num_layers):
        for i, part in enumerate("kv"):
            path, name = names[layer][part]
            value = values[(layer, part)]
            if value.numel() == heads * world_size:
                value = value[rank * heads:(rank + 1) * heads]
            elif value.numel() != 1:
                raise ValueError(f"KV cache scale {name} in {path} holds {value.numel()} values: one, or one per KV "
                                 f"head ({heads * world_size}), was expected")
            if not bool(torch.isfinite(value).all() and (value > 0).all()):
                raise ValueError(f"KV cache scale {name} in {path} is not a positive finite number: {value.tolist()}")
            scales[i, layer] = value
    log.info("KV cache %s, checkpoint scales (per layer, largest over heads): K [%s] V [%s]",
             str(layout.dtype).removeprefix("torch."), _per_layer(scales[0]), _per_layer(scales[1]))
    return scales


def pool_amax(pool: KVPool) -> torch.Tensor:
    """The largest |K| and |V| a pool holds per layer, KV head and channel, [2, L, H_kv, D] float32 on the host."""
    return pool.cache.abs().amax(dim=(2, 3)).float().cpu()


def calibration_chunks(model_dir: str, vocab_size: int, block_size: int, max_tokens: int,
                       seed: int) -> tuple[list[ScheduledChunk], int]:
    """Fresh prefill chunks of at most max_tokens in all, on blocks 0.. in order: the calibration texts
    when the checkpoint has a tokenizer, else random ids. Returns the chunks and the blocks they use."""
    path = _tokenizer_file(model_dir)
    if path is None:
        return profiling_chunks(max_tokens, len(CALIBRATION_TEXTS), block_size, vocab_size,
                                torch.Generator().manual_seed(seed))
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(path)
    chunks, next_block, left = [], 0, max_tokens
    for i, text in enumerate(CALIBRATION_TEXTS):
        ids = [t for t in tokenizer.encode(text).ids if t < vocab_size][:left]
        if not ids:
            break
        num_blocks = -(-len(ids) // block_size)
        seq = MirroredSeq(i, ids, len(ids), list(range(next_block, next_block + num_blocks)), 0, GREEDY_ROW)
        chunks.append(ScheduledChunk(seq, 0, len(ids)))
        next_block += num_blocks
        left -= len(ids)
    return chunks, next_block


def calibration_source(model_dir: str) -> str:
    return "text" if _tokenizer_file(model_dir) else "random token ids"


def _tokenizer_file(model_dir: str) -> str | None:
    path = os.path.join(model_dir, "tokenizer.json")
    return path if os.path.exists(path) else None


def _per_layer(scales: torch.Tensor) -> str:
    return " ".join(f"{x:.3g}" for x in scales.flatten(1).amax(dim=1).tolist())
