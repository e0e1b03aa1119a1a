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
- per-tensor (CPU): the weights quantized with one scale per checkpoint tensor (AutoFP8's format; the pieces of a
  fused q/k/v or gate/up layer each their own), activations per token, emulated;
- each of those with --kv-cache-dtype fp8 as well (where marked);
- --study (CPU): weights rounded through other formats (bf16, int8 per channel, e4m3 per 1 x 32 group) and
  e4m3 per channel on one layer kind at a time, activations untouched: what limits FP8 weights here.

Targets (issue 30): top-1 >= 97%, mean KL <= 0.02 nats.

    python bench/fp8_weights_accuracy.py                              # GPU: 64 prompts x 128 tokens
    python bench/fp8_weights_accuracy.py --device cpu --num-prompts 16 --new-tokens 32
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from bench.kv_fp8_accuracy import (add_accuracy_args, agreement, chat_prompts, greedy,  # noqa: E402
                                   greedy_match, prompts_per_forward, teacher_forced_logprobs, write_result)
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


def checkpoint_pieces(layer) -> list[int]:
    """The row counts of the checkpoint tensors a (fused) layer holds, in order: q, k, v; gate, up; or one."""
    if hasattr(layer, "num_kv_heads"):
        q, kv = layer.num_heads * layer.head_dim, layer.num_kv_heads * layer.head_dim
        return [q, kv, kv]
    return list(getattr(layer, "output_sizes", [layer.weight.shape[0]]))


@torch.no_grad()
def quantize_weights_per_tensor(runner: ModelRunner) -> None:
    """The weights as a per-tensor checkpoint (AutoFP8, compressed-tensors' FP8 scheme) ships them: e4m3 with one
    scale per checkpoint tensor (each piece of a fused layer its own)."""
    for _, layer in linear_layers(runner.model):
        for piece in layer.weight.data.split(checkpoint_pieces(layer)):
            q, scale = quantize_rows_ref(piece.float().reshape(1, -1), piece.numel())
            piece.copy_((q.float() * scale).view(piece.shape).to(piece.dtype))


@torch.no_grad()
def round_weights(runner: ModelRunner, fmt: str, only: str = "") -> None:
    """Emulated weight formats for the study (--study): each Linear weight (or only those whose name has
    `only`) rounded through `fmt` and back; activations untouched."""
    for name, layer in linear_layers(runner.model):
        if only not in name:
            continue
        w = layer.weight.data.float()
        if fmt == "e4m3-channel":
            q, scale = quantize_rows_ref(w, w.shape[1])
            w = q.float() * scale
        elif fmt == "e4m3-1x32":
            q, scale = quantize_rows_ref(w, 32)
            w = q.float() * scale.repeat_interleave(32, 1)[:, : w.shape[1]]
        elif fmt == "int8-channel":
            scale = w.abs().amax(1, keepdim=True) / 127
            w = (w / scale).round().clamp(-127, 127) * scale
        elif fmt == "bf16":
            w = w.bfloat16().float()
        layer.weight.data.copy_(w.to(layer.weight.dtype))


STUDY = {  # name -> (format, which layers): what limits FP8 weights on this model
    "bf16 weights (rounding floor)": ("bf16", ""),
    "int8 per-channel weights": ("int8-channel", ""),
    "e4m3 per 1x32 group weights": ("e4m3-1x32", ""),
    "e4m3 per-channel, qkv_proj only": ("e4m3-channel", "qkv_proj"),
    "e4m3 per-channel, o_proj only": ("e4m3-channel", "o_proj"),
    "e4m3 per-channel, gate_up only": ("e4m3-channel", "gate_up_proj"),
    "e4m3 per-channel, down_proj only": ("e4m3-channel", "down_proj"),
}

VARIANTS = {  # name -> (--quantization, --kv-cache-dtype, emulation applied to the runner, CPU only)
    "fp8 weights": ("fp8", "auto", None, False),
    "fp8 weights + fp8 KV": ("fp8", "fp8", None, False),
    "fp8 weights + per-token acts": ("fp8", "auto", lambda r: quantize_activations(r, None), True),
    "fp8 weights + acts + fp8 KV": ("fp8", "fp8", lambda r: quantize_activations(r, None), True),
    "128x128 blocks + 1x128 acts": (None, "auto", lambda r: (quantize_weights_in_blocks(r),
                                                             quantize_activations(r, 128)), True),
    "per-tensor + per-token acts": (None, "auto", lambda r: (quantize_weights_per_tensor(r),
                                                             quantize_activations(r, None)), True),
}
VARIANTS |= {name: (None, "auto", lambda r, f=fmt, o=only: round_weights(r, f, o), True)
             for name, (fmt, only) in STUDY.items()}
DEFAULT_VARIANTS = [v for v in VARIANTS if v not in STUDY]


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
            row |= greedy_match(runner, batches, trajectories, new_tokens)
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
    add_accuracy_args(p)
    p.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=DEFAULT_VARIANTS)
    p.add_argument("--study", action="store_true",
                   help="instead, emulated weight formats and one layer kind at a time (CPU): what limits FP8 here")
    p.add_argument("--out", default="bench/results/fp8_weights_accuracy.json")
    args = p.parse_args()
    batch = prompts_per_forward(args)
    result = measure(args.model or default_model_dir(), args.device, args.num_prompts, args.new_tokens, batch,
                     list(STUDY) if args.study else args.variants)
    print_table(result)
    write_result(result, args.out)


if __name__ == "__main__":
    main()
