"""How fast is the weight-only FP8 GEMM (kernels/fp8_gemm.weight_only_fp8_gemm: the path of GPUs without FP8 tensor
cores, before sm_89) against bf16 on the same shapes? A study, not the engine.

On an A100 or A10 the engine keeps FP8 weights (half bf16's memory) and multiplies them weight-only: below
WEIGHT_ONLY_DEQUANTIZE_FROM tokens each W tile is read as bytes and widened to bf16 in the Triton kernel (half of
bf16's bytes, plus the decode's integer work), from there W is dequantized whole and torch multiplies. Timed per
Qwen3-8B product and M, block (128 x 128) and channel weights: bf16 (F.linear) and the weight-only GEMM, each a CUDA
graph of calls over copies of W larger than L2 (bench/fp8_gemm_table.cold_graph_us), with the error of max |y|
against float64 on the dequantized weights. It runs on any GPU: on Hopper it measures the kernel (sm_90 could run
the FP8 GEMMs instead); on an Ampere GPU it measures what the engine serves there.

    python bench/studies/fp8_weight_only.py --out fp8_weight_only.json
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from bench.fp8_gemm_table import QWEN3_8B_GEMMS  # noqa: E402

TOKENS = [1, 16, 64, 133, 255, 256, 4096]  # 255 and 256: either side of the switch to dequantize-then-multiply


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", default=",".join(map(str, TOKENS)))
    p.add_argument("--timing-ms", type=int, default=10)
    p.add_argument("--out", default=None)
    args = p.parse_args()

    import torch
    import torch.nn.functional as F

    from bench.fp8_gemm_table import cold_graph_us, study_gpu, weight_copies
    from kernels import fp8_gemm
    from kernels.fp8_quant import dequantize_rows, quantize_blocks_on_rows, quantize_rows_ref

    device, gen = study_gpu()
    results = []
    print(f"{torch.cuda.get_device_name()}, sm_{''.join(map(str, torch.cuda.get_device_capability()))}")
    print(f"{'gemm':>12} {'scheme':>7} {'M':>5} | us (W's TB/s): {'bf16':>14} {'weight-only':>14} | ratio | error")
    for name, n, k in QWEN3_8B_GEMMS:
        w16 = torch.randn(n, k, generator=gen, device=device, dtype=torch.bfloat16) / k**0.5
        for scheme, group in (("block", 128), ("channel", k)):
            wq, ws = quantize_blocks_on_rows(w16.float()) if scheme == "block" else quantize_rows_ref(w16.float(), k)
            w_plain = dequantize_rows(wq, ws, group).bfloat16()
            fp8_copies, plain_copies = weight_copies(wq), weight_copies(w_plain)
            for m in map(int, args.tokens.split(",")):
                x = torch.randn(m, k, generator=gen, device=device, dtype=torch.bfloat16)
                ref = x.double() @ dequantize_rows(wq, ws, group, torch.float64).T
                out = fp8_gemm.weight_only_fp8_gemm(x, wq, ws, group)
                error = ((out.double() - ref).abs().max() / ref.abs().max()).item()
                bf16_us = cold_graph_us(lambda w: F.linear(x, w), plain_copies, args.timing_ms)
                ours_us = cold_graph_us(lambda w: fp8_gemm.weight_only_fp8_gemm(x, w, ws, group), fp8_copies,
                                        args.timing_ms)
                row = {"gemm": name, "scheme": scheme, "n": n, "k": k, "m": m, "bf16_us": bf16_us,
                       "weight_only_us": ours_us, "error": error}
                results.append(row)
                tbs = [n * k * size / us / 1e6 for size, us in ((2, bf16_us), (1, ours_us))]
                print(f"{name:>12} {scheme:>7} {m:>5} | {bf16_us:8.1f} ({tbs[0]:.2f}) {ours_us:8.1f} ({tbs[1]:.2f}) | "
                      f"{bf16_us / ours_us:5.2f}x | {error:.1e}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": results}, f, indent=1)


if __name__ == "__main__":
    main()
