"""Accuracy of FP8 Linear weights (--quantization fp8: a scale per output channel, activations per token)
on real weights (the embedded SmolLM2 by default), with the method of bench/kv_fp8_accuracy.py.

The reference is the engine with plain weights and a KV cache of the model's dtype (bf16 on the GPU, fp32
on the CPU). Its greedy trajectory of N chat prompts x T tokens is teacher-forced through each variant:
top-1 agreement (and with near-tie flips excused), KL(ref || variant) per token (mean, p99), and the
greedy exact-match length. Variants:

- fp8 weights: --quantization fp8. On the GPU the FP8 GEMMs (activations quantized per token); on the CPU
  the weights are dequantized at load and the activations stay fp32 (weight error only);
- fp8 weights + per-token activations (CPU): the GPU's numerics emulated: every Linear input quantized
  per token to e4m3 and back before the product;
- 128x128 blocks (CPU): the weights quantized per 128 x 128 block as an FP8 checkpoint ships them,
  activations per token and 128 columns, emulated;
- each of those with --kv-cache-dtype fp8 as well (where marked).

Targets (issue 30): top-1 >= 97%, mean KL <= 0.02 nats.

    python bench/fp8_weights_accuracy.py                              # GPU: 64 prompts x 128 tokens
    python bench/fp8_weights_accuracy.py --device cpu --num-prompts 16 --new-tokens 32
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from bench.kv_fp8_accuracy import agreement, chat_prompts, exact_match, greedy, teacher_forced_logprobs  # noqa: E402
from executor_svc.layers.fp8 import linear_layers  # noqa: E402
from executor_svc.model_runner import ModelRunner  # noqa: E402
from kernels.fp8_quant import dequantize_blocks, quantize_blocks_ref, quantize_rows_ref  # noqa: E402
from scheduler_svc.common.config import EngineConfig  # noqa: E402
from scheduler_svc.common.model_paths import default_model_dir  # noqa: E402

TOP1_TARGET, MEAN_KL_TARGET = 0.97, 0.02


def make_runner(model_dir: str, device: str, num_blocks: int, quantization: str | None = None,
                kv_cache_dtype: str = "auto") -> ModelRunner:
    return ModelRunner(EngineConfig(model=model_dir, device=device, quantization=quantization,
                                    kv_cache_dtype=kv_cache_dtype, num_gpu_blocks=num_blocks, enforce_eager=True,
                                    max_num_seqs=256))


def quantize_activations(runner: ModelRunner, group: int | None) -> None:
    """Emulate the FP8 GEMM's activations: each Linear input quantized per token (and `group` columns) and back."""
    def hook(_module, args):
        x = args[0]
        rows = x.reshape(-1, x.shape[-1])
        q, scale = quantize_rows_ref(rows, group or rows.shape[1])
        g = group or rows.shape[1]
        deq = q.float() * scale.repeat_interleave(g, 1)[:, : rows.shape[1]]
        return (deq.to(x.dtype).view(x.shape),) + tuple(args[1:])

    for _, layer in linear_layers(runner.model):
        layer.register_forward_pre_hook(hook)


@torch.no_grad()
def quantize_weights_in_blocks(runner: ModelRunner, block=(128, 128)) -> None:
    for _, layer in linear_layers(runner.model):
        q, scale = quantize_blocks_ref(layer.weight.data, block)
        layer.weight.data.copy_(dequantize_blocks(q, scale, block))


VARIANTS = {  # name -> (--quantization, --kv-cache-dtype, emulation applied to the runner, CPU only)
    "fp8 weights": ("fp8", "auto", None, False),
    "fp8 weights + fp8 KV": ("fp8", "fp8", None, False),
    "fp8 weights + per-token acts": ("fp8", "auto", lambda r: quantize_activations(r, None), True),
    "fp8 weights + acts + fp8 KV": ("fp8", "fp8", lambda r: quantize_activations(r, None), True),
    "128x128 blocks + 1x128 acts": (None, "auto", lambda r: (quantize_weights_in_blocks(r),
                                                             quantize_activations(r, 128)), True),
}


def measure(model_dir: str, device: str, num_prompts: int, new_tokens: int, batch: int, variants: list[str],
            exact_match_len: bool = True) -> dict:
    prompts = chat_prompts(model_dir, num_prompts)
    batches = [prompts[i:i + batch] for i in range(0, len(prompts), batch)]
    num_blocks = batch * -(-(max(len(p) for p in prompts) + new_tokens + 1) // 16)
    ref_runner = make_runner(model_dir, device, num_blocks)
    ref_dtype = str(ref_runner.dtype).removeprefix("torch.")
    trajectories = [greedy(ref_runner, b, new_tokens) for b in batches]
    ref = torch.cat([teacher_forced_logprobs(ref_runner, b, t) for b, t in zip(batches, trajectories)])
    del ref_runner
    rows = []
    for name in variants:
        quantization, kv_dtype, emulate, cpu_only = VARIANTS[name]
        if cpu_only and device != "cpu":
            continue
        t0 = time.perf_counter()
        runner = make_runner(model_dir, device, num_blocks, quantization, kv_dtype)
        if emulate is not None:
            emulate(runner)
        test = torch.cat([teacher_forced_logprobs(runner, b, t) for b, t in zip(batches, trajectories)])
        row = {"variant": name, "weight_format": runner.facts.weight_format, **agreement(ref, test)}
        if exact_match_len:
            outs = [o for b in batches for o in greedy(runner, b, new_tokens)]
            row |= exact_match([t for ts in trajectories for t in ts], outs)
        row["seconds"] = time.perf_counter() - t0
        rows.append(row)
        del runner
    return {"model": os.path.basename(model_dir), "device": device, "reference": f"plain {ref_dtype} weights and KV",
            "num_prompts": num_prompts, "new_tokens": new_tokens, "rows": rows}


def print_table(result: dict) -> None:
    print(f"\nFP8 weights vs {result['reference']}: {result['model']} on {result['device']}, {result['num_prompts']} "
          f"prompts x {result['new_tokens']} tokens (targets: top-1 >= {TOP1_TARGET:.0%}, mean KL <= {MEAN_KL_TARGET})")
    print(f"{'variant':>30} {'top-1':>7} {'ties ok':>7} {'miss gap':>8} {'mean KL':>9} {'p99 KL':>9} {'match len':>9} "
          f"{'full':>5} {'s':>6}")
    for r in result["rows"]:
        print(f"{r['variant']:>30} {r['top1']:>7.2%} {r['top1_near_ties_excused']:>7.2%} {r['miss_ref_gap_median']:>8.3f} "
              f"{r['mean_kl']:>9.5f} {r['p99_kl']:>9.5f} {r.get('mean_match_len', float('nan')):>9.1f} "
              f"{r.get('full_match', float('nan')):>5.0%} {r['seconds']:>6.1f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="", help="checkpoint directory (default: the embedded SmolLM2)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cuda", "cpu"])
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--batch", type=int, default=None, help="prompts per forward (default: all on GPU, 4 on CPU)")
    p.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    p.add_argument("--out", default="bench/results/fp8_weights_accuracy.json")
    args = p.parse_args()
    if args.device == "cpu":
        torch.set_num_threads(max(1, (os.cpu_count() or 2) - 1))
    batch = args.batch or (args.num_prompts if args.device == "cuda" else 4)
    result = measure(args.model or default_model_dir(), args.device, args.num_prompts, args.new_tokens, batch,
                     args.variants)
    print_table(result)
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
