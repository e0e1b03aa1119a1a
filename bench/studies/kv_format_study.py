"""Which 8-bit K/V number format would meet issue 13's accuracy targets: each format fake-quantized (quantize,
then dequantize) on its way into a KV pool of the model's dtype, through the torch backend, so every later
read sees it; scored as bench/kv_fp8_accuracy.py scores the fp8 cache (teacher-forced top-1 and KL against
the same engine with an exact pool, the embedded SmolLM2 by default). A study, not a product path: the
engine's caches are fp8 (float8_e4m3fn, a scale per KV head) and int8 (a scale per KV head and channel,
1.5x headroom: this study's int8ch1.5/int8ch1.5), in `kernels/kv_quant.py`.

Formats, each per token and KV head (its own scale over the head_dim values):
  e4m3      float8_e4m3fn at scale absmax / 448 (3 mantissa bits: a value's error is relative, whatever the scale)
  int8      round(x / s) in [-127, 127], s = absmax / 127 (an error of at most s / 2, the same for every value)
  int8+H    int8 after a normalized Hadamard rotation of head_dim (spreads outlier channels), rotated back
  e4m3+H    e4m3 after the same rotation: the best e4m3 K the engine could store (its --kv-cache-rotation
            hadamard, with a scale per token instead of per KV head)
Static formats, their scales fixed from the engine's calibration forward (its texts, not the scored prompts):
  int8chH   int8 with a scale per layer, KV head and channel, the calibrated |max| times the headroom H
  int8headH the same with a scale per layer and KV head
  e4m3head  the engine's fp8 cache (calibrated-per-head, 16x headroom)

    python bench/studies/kv_format_study.py --num-prompts 64 --new-tokens 128     # the issue's size: ~10 min on 2 cores
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402

from bench import kv_fp8_accuracy as accuracy  # noqa: E402
from kernels.attention.torch_backend import TorchAttentionBackend  # noqa: E402
from kernels.kv_quant import FP8_DTYPE, FP8_MAX  # noqa: E402
from kernels.kv_rotation import hadamard_matrix  # noqa: E402
from scheduler_svc.common.model_paths import default_model_dir  # noqa: E402


def e4m3(x: torch.Tensor) -> torch.Tensor:
    s = (x.abs().amax(-1, keepdim=True) / FP8_MAX).clamp_min(1e-30)
    return (x / s).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE).float() * s


def int8(x: torch.Tensor) -> torch.Tensor:
    s = (x.abs().amax(-1, keepdim=True) / 127).clamp_min(1e-30)
    return (x / s).round().clamp(-127, 127) * s


def rotated(fmt):
    """fmt applied to x rotated by the normalized Hadamard matrix, rotated back after."""
    def rotated_format(x: torch.Tensor) -> torch.Tensor:
        h = hadamard_matrix(x.shape[-1], x.dtype, x.device)
        return fmt(x @ h) @ h.T
    return rotated_format


class StaticScales:
    """Scales fixed before serving, as an engine stores them: from the largest |K| (or |V|) its calibration
    forward (ModelRunner.calibration_amax's texts) stored per layer, KV head and, if per_channel, head_dim
    channel, times a headroom; values beyond are clamped. The store is called once per layer in order,
    so the call count modulo the layer count names the layer."""

    def __init__(self, num_layers: int):
        self.num_layers, self.calls, self.amax = num_layers, 0, {}

    def layer(self) -> int:
        self.calls += 1
        return (self.calls - 1) % self.num_layers

    def record(self, x: torch.Tensor) -> None:  # x [T, H_kv, D]
        layer, seen = self.layer(), x.abs().amax(0).float()
        self.amax[layer] = torch.maximum(self.amax.get(layer, seen), seen)

    def format(self, qmax: float, per_channel: bool, headroom: float, cast=None):
        def static_format(x: torch.Tensor) -> torch.Tensor:
            amax = self.amax[self.layer()]
            amax = amax if per_channel else amax.amax(-1, keepdim=True)
            s = (amax * headroom / qmax).clamp_min(1e-30)
            y = (x / s).clamp(-qmax, qmax)
            return (y.to(cast).float() if cast is not None else y.round()) * s
        return static_format


FORMATS = {"e4m3": e4m3, "int8": int8, "int8+H": rotated(int8), "e4m3+H": rotated(e4m3), "exact": None}
# Static scales (calibrated once, as the engine's are): int8 per layer, KV head and channel follows the KIVI
# observation that K's outliers sit in fixed channels, so one scale per channel fits every token, and it
# folds into q (q . k = sum_d (q_d s_d) k_d) or, for V, into the output. Name: format, granularity, headroom.
STATIC = {f"int8ch{h:g}": (127.0, True, h, None) for h in (1.0, 1.25, 1.5, 2.0, 3.0)}
STATIC |= {f"int8head{h:g}": (127.0, False, h, None) for h in (1.0, 1.5, 2.0)}
STATIC["e4m3head"] = (FP8_MAX, False, 16.0, FP8_DTYPE)  # the engine's fp8 cache (calibrated-per-head)
# (K, V) pairs: V alone barely moves top-1 (2026-12-01, 590fe90), so K is the question
PAIRS = [("e4m3", "e4m3"), ("e4m3+H", "e4m3"), ("int8", "e4m3"), ("int8+H", "e4m3"), ("int8", "int8"),
         ("e4m3", "exact"), ("int8", "exact"), ("e4m3head", "e4m3head"), ("int8ch1.5", "e4m3head"),
         ("int8ch1.5", "int8ch1.5")]


def fake_quantized_store(k_format, v_format):
    """TorchAttentionBackend.store_kvcache, K and V passed through their formats first (in float32)."""
    store = TorchAttentionBackend.store_kvcache

    def store_fake(self, key, value, k_cache, v_cache, slot_mapping, kv_scales=None):
        if k_format is not None:
            key = k_format(key.float()).to(key.dtype)
        if v_format is not None:
            value = v_format(value.float()).to(value.dtype)
        return store(self, key, value, k_cache, v_cache, slot_mapping, kv_scales)
    return store_fake


def calibrated(runner) -> tuple[StaticScales, StaticScales]:
    """K's and V's static scales from the engine's own calibration forward (its texts, not the scored prompts)."""
    k_scales, v_scales = StaticScales(len(runner.kv_pool.layers)), StaticScales(len(runner.kv_pool.layers))
    exact_store = TorchAttentionBackend.store_kvcache

    def store_recording(self, key, value, k_cache, v_cache, slot_mapping, kv_scales=None):
        k_scales.record(key)
        v_scales.record(value)
        return exact_store(self, key, value, k_cache, v_cache, slot_mapping, kv_scales)
    TorchAttentionBackend.store_kvcache = store_recording
    num_blocks = runner.kv_pool.num_blocks
    try:
        runner.calibration_amax()  # through a pool of its own, which unbinds the layers' views of ours
    finally:
        TorchAttentionBackend.store_kvcache = exact_store
        runner.kv_pool.allocate(num_blocks)
    k_scales.calls = v_scales.calls = 0
    return k_scales, v_scales


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="", help="checkpoint directory (default: the embedded SmolLM2)")
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--pairs", nargs="+", metavar="K/V", default=[f"{k}/{v}" for k, v in PAIRS],
                   help=f"K/V format pairs to score, of {sorted(FORMATS) + sorted(STATIC)}")
    p.add_argument("--out", default="bench/results/kv_format_study.json")
    args = p.parse_args()
    torch.set_num_threads(max(1, (os.cpu_count() or 2) - 1))
    model = args.model or default_model_dir()
    prompts = accuracy.chat_prompts(model, args.num_prompts)
    batches = [prompts[i:i + args.batch] for i in range(0, len(prompts), args.batch)]
    num_blocks = args.batch * -(-(max(len(q) for q in prompts) + args.new_tokens + 1) // 16)
    runner = accuracy.make_runner(model, "cpu", "auto", "static", num_blocks)  # the torch backend, exact pool
    trajectories = [accuracy.greedy(runner, b, args.new_tokens) for b in batches]
    reference = torch.cat([accuracy.teacher_forced_logprobs(runner, b, t) for b, t in zip(batches, trajectories)])
    rows, exact_store = [], TorchAttentionBackend.store_kvcache
    static = calibrated(runner) if any(name in STATIC for pair in args.pairs for name in pair.split("/")) else None
    for k_name, v_name in (pair.split("/") for pair in args.pairs):
        t0 = time.perf_counter()
        k_format = static[0].format(*STATIC[k_name]) if k_name in STATIC else FORMATS[k_name]
        v_format = static[1].format(*STATIC[v_name]) if v_name in STATIC else FORMATS[v_name]
        TorchAttentionBackend.store_kvcache = fake_quantized_store(k_format, v_format)
        try:
            test = torch.cat([accuracy.teacher_forced_logprobs(runner, b, t) for b, t in zip(batches, trajectories)])
        finally:
            TorchAttentionBackend.store_kvcache = exact_store
        rows.append({"k": k_name, "v": v_name, **accuracy.agreement(reference, test),
                     "seconds": time.perf_counter() - t0})
    print(f"\nK/V formats fake-quantized into an exact pool: {os.path.basename(model)}, {args.num_prompts} prompts x "
          f"{args.new_tokens} tokens, teacher-forced (targets: top-1 >= {accuracy.TOP1_TARGET:.0%}, mean KL <= "
          f"{accuracy.MEAN_KL_TARGET})")
    print(f"{'K':>7} {'V':>6} {'top-1':>7} {'ties ok':>7} {'mean KL':>9} {'p99 KL':>8}")
    for r in rows:
        print(f"{r['k']:>7} {r['v']:>6} {r['top1']:>7.2%} {r['top1_near_ties_excused']:>7.2%} {r['mean_kl']:>9.5f} "
              f"{r['p99_kl']:>8.4f}")
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"args": vars(args), "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
