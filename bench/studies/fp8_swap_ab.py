"""Is cuBLASLt's FP8 GEMM faster with its operands swapped at decode's token counts? A study, not the engine.

The decode product y [M, N] = x [M, K] @ W^T with M = 1-256 tokens and N, K in the thousands: cuBLASLt's heuristics
tile the small M dimension badly at some M (on the H200, gate_up_proj took 74 us at M = 144 and 48 us at M = 256).
Its transpose y^T [N, M] = W [N, K] @ x^T puts the large N in the GEMM's row dimension and the tokens in its column
dimension, the orientation of the weight-streaming kernels CUTLASS ships for small batches ("swap AB"). Both run as
`torch._scaled_mm` with row-wise scales: W's per-channel scales become scale_a [N, 1], the tokens' scale_b [1, M];
_scaled_mm needs M a multiple of 16, so the tokens are padded to one. Timed per Qwen3-8B GEMM and M (do_bench, L2
flushed, median): the product as the engine runs it, the swapped product alone, and the swapped product with the
transpose back to [M, N] (the copy a consumer that needs rows would pay), each also with cuBLASLt's fast (unpromoted)
accumulation; the errors are of max |y|, against float64 on the same quantized operands.

    python bench/studies/fp8_swap_ab.py --out swap_ab.json
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from bench.fp8_gemm_table import QWEN3_8B_GEMMS  # noqa: E402

TOKENS = [1, 16, 64, 128, 132, 144, 160, 192, 224, 256]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", default=",".join(map(str, TOKENS)))
    p.add_argument("--out", default=None)
    args = p.parse_args()

    import torch
    import triton

    from kernels import fp8_gemm
    from kernels.fp8_quant import fp8_gemm_ref, quantize_rows_ref

    def time_us(fn):
        return triton.testing.do_bench(fn, warmup=5, rep=25, return_mode="median") * 1e3

    device = torch.device("cuda")
    gen = torch.Generator(device=device).manual_seed(3)
    rows = []
    print(f"{'gemm':>12} {'M':>5} {'plain':>7} {'swapped':>8} {'+T':>7} {'sw fast':>7} {'fast':>7} "
          f"{'err':>8} {'err sw':>8} {'err fast':>8}")
    for name, n, k in QWEN3_8B_GEMMS:
        w = torch.randn(n, k, generator=gen, device=device, dtype=torch.bfloat16) / k**0.5
        wq, ws = quantize_rows_ref(w, k)
        for m in map(int, args.tokens.split(",")):
            x = torch.randn(m, k, generator=gen, device=device, dtype=torch.bfloat16)
            a, a_s = fp8_gemm.quantize_rows(x, k)
            m16 = -(-m // 16) * 16
            a16 = torch.zeros(m16, k, dtype=a.dtype, device=device)
            a16[:m] = a
            s16 = torch.ones(1, m16, dtype=torch.float32, device=device)
            s16[0, :m] = a_s[:, 0]

            def plain(fast=False):
                return torch._scaled_mm(a, wq.t(), scale_a=a_s, scale_b=ws.view(1, -1), out_dtype=torch.bfloat16,
                                        use_fast_accum=fast)

            def swapped(fast=False):
                return torch._scaled_mm(wq, a16.t(), scale_a=ws, scale_b=s16, out_dtype=torch.bfloat16,
                                        use_fast_accum=fast)

            def swapped_rows():
                return swapped()[:, :m].t().contiguous()

            ref = fp8_gemm_ref(a, a_s, wq, ws, k)
            scale = ref.abs().max().item()
            err = {"plain": (plain().double() - ref).abs().max().item() / scale,
                   "swapped": (swapped_rows().double() - ref).abs().max().item() / scale,
                   "plain_fast": (plain(True).double() - ref).abs().max().item() / scale}
            us = {"plain": time_us(plain), "swapped": time_us(swapped), "swapped_rows": time_us(swapped_rows),
                  "swapped_fast": time_us(lambda: swapped(True)), "plain_fast": time_us(lambda: plain(True))}
            rows.append({"gemm": name, "m": m, "n": n, "k": k, "us": us, "err": err})
            print(f"{name:>12} {m:>5} {us['plain']:>7.1f} {us['swapped']:>8.1f} {us['swapped_rows']:>7.1f} "
                  f"{us['swapped_fast']:>7.1f} {us['plain_fast']:>7.1f} "
                  f"{err['plain']:>8.1e} {err['swapped']:>8.1e} {err['plain_fast']:>8.1e}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
