"""The most an fp8 KV cache can gain on the throughput workload; a model of bytes, not a timing.

An fp8 pool changes only the bytes decode attention reads: the weights, the prefill and every small
kernel stay as they are. So a bf16 run of T seconds, whose decode attention read K bytes at an achieved
bandwidth B16, can at best become T - K / B16 + (K / 2) / B8, with B8 the fp8 kernel's bandwidth over
its own bytes (at most a plain copy's, 4.26 TB/s on the H200). The KV bytes come from the workload's own
lengths (nano-vLLM's draws: every decode step of a sequence reads its prompt and the tokens generated so
far, in every layer, K and V); the bandwidths from bench/kernels.py --ragged (the throughput run's batches).

    python bench/studies/fp8_ceiling.py --model-shape qwen3-8b --bf16-seconds 14.14
    python bench/studies/fp8_ceiling.py --bf16-seconds 5.33 --fp8-tb-per-s 2.64   # what the fp8 kernel gives today
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from bench.nanovllm_workload import MODEL_SHAPES, workload  # noqa: E402

COPY_TB_PER_S = 4.26  # H200 device-to-device copy (BRIEF): no kernel reads faster


def decode_kv_bytes(shape: dict, num_seqs: int, max_len: int, seed: int, bytes_per_value: int) -> int:
    """K and V bytes that decode attention reads over the run (the first output token comes from prefill)."""
    prompts, max_tokens = workload(num_seqs, max_len, max_len, seed)
    context_reads = sum(len(p) + t for p, n in zip(prompts, max_tokens) for t in range(1, n))
    per_token = 2 * shape["num_hidden_layers"] * shape["num_key_value_heads"] * shape["head_dim"] * bytes_per_value
    return context_reads * per_token


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-shape", choices=sorted(MODEL_SHAPES), default="qwen3-0.6b")
    p.add_argument("--bf16-seconds", type=float, required=True, help="the measured bf16 run (bench/throughput.py)")
    p.add_argument("--bf16-tb-per-s", type=float, nargs="+", default=[3.6, 3.9, 4.26],
                   help="decode attention's achieved bandwidth in the bf16 run (--ragged: 3.6-4.0 TB/s)")
    p.add_argument("--fp8-tb-per-s", type=float, default=COPY_TB_PER_S,
                   help="the fp8 kernel's bandwidth over fp8 bytes (default: a copy's, the ceiling)")
    p.add_argument("--num-seqs", type=int, default=256)
    p.add_argument("--max-len", type=int, default=1024)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    shape = MODEL_SHAPES[args.model_shape]
    kv16 = decode_kv_bytes(shape, args.num_seqs, args.max_len, args.seed, 2)
    _, max_tokens = workload(args.num_seqs, args.max_len, args.max_len, args.seed)
    tokens = sum(max_tokens)
    print(f"{args.model_shape}: decode attention reads {kv16 / 1e12:.2f} TB in bf16, {kv16 / 2e12:.2f} TB in fp8; "
          f"bf16 run {args.bf16_seconds:.2f} s = {tokens / args.bf16_seconds:,.0f} tok/s")
    print(f"{'bf16 attn TB/s':>14} {'bf16 attn s':>11} {'fp8 attn s':>10} {'fp8 run s':>9} {'tok/s':>8} {'x bf16':>6}")
    rows = []
    for b16 in args.bf16_tb_per_s:
        t16 = kv16 / b16 / 1e12
        t8 = kv16 / 2 / args.fp8_tb_per_s / 1e12
        run = args.bf16_seconds - t16 + t8
        rows.append({"bf16_tb_per_s": b16, "bf16_attention_s": t16, "fp8_attention_s": t8, "fp8_run_s": run,
                     "fp8_tok_per_s": tokens / run, "ratio": args.bf16_seconds / run})
        print(f"{b16:>14.2f} {t16:>11.2f} {t8:>10.2f} {run:>9.2f} {tokens / run:>8,.0f} {args.bf16_seconds / run:>5.2f}x")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"model_shape": args.model_shape, "kv_bytes_bf16": kv16, "output_tokens": tokens,
                       "bf16_seconds": args.bf16_seconds, "fp8_tb_per_s": args.fp8_tb_per_s, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
