"""Are prefill's products faster cut into row chunks? A study, not the engine.

At prefill's 16,384 tokens (bench/throughput.py's chunk) cuBLASLt's FP8 GEMMs measured 1,070-1,300 TFLOP/s on
gate_up_proj against 1,400-1,500 at 4,096 tokens, in one sample over cold copies of W (bench/RESULTS.md, 2026-12-05,
the H100). This times each Qwen3-8B product at M
tokens whole against the same product as M / C calls of C rows each, written into row slices of one output (torch's
`out=`, no copy), for bf16 (F.linear), FP8 row-wise (per-token x per-channel scales) and FP8 tensor-wise on unit scales,
all with fast accumulation as the engine runs them; us a product (triton.testing.do_bench, median), TFLOP/s, and the
chunked output checked equal to the whole one's within bf16's rounding. On the H100 (2026-12-05) the whole product was
as fast as any chunking.

    python bench/studies/fp8_prefill_row_chunks.py --tokens 16384 --chunks 2048,4096,8192 --out row_chunks.json
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from bench.fp8_gemm_table import QWEN3_8B_GEMMS  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", default="16384")
    p.add_argument("--chunks", default="2048,4096,8192")
    p.add_argument("--out", default=None)
    args = p.parse_args()

    import torch
    import triton

    from kernels.fp8_gemm import quantize_rows
    from kernels.fp8_quant import quantize_rows_ref

    gen = torch.Generator(device="cuda").manual_seed(0)
    one = torch.ones((), dtype=torch.float32, device="cuda")
    chunks = [int(c) for c in args.chunks.split(",")]
    rows = []
    print(f"{'product':>12} {'M':>6} {'recipe':>10} | us (TFLOP/s): whole, then chunks of "
          + ", ".join(map(str, chunks)))
    for name, n, k in QWEN3_8B_GEMMS:
        w16 = torch.randn(n, k, generator=gen, device="cuda", dtype=torch.bfloat16) / k**0.5
        wq, ws = quantize_rows_ref(w16, k)
        for m in map(int, args.tokens.split(",")):
            x = torch.randn(m, k, generator=gen, device="cuda", dtype=torch.bfloat16)
            a, a_s = quantize_rows(x, k)
            a, a_s = a[:m], a_s[:m]

            def bf16(i, j, out):
                return torch.matmul(x[i:j], w16.t(), out=out[i:j])

            def rowwise(i, j, out):
                return torch._scaled_mm(a[i:j], wq.t(), scale_a=a_s[i:j], scale_b=ws.view(1, -1),
                                        out_dtype=torch.bfloat16, use_fast_accum=True, out=out[i:j])

            def tensorwise(i, j, out):
                return torch._scaled_mm(a[i:j], wq.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16,
                                        use_fast_accum=True, out=out[i:j])

            for label, fn in (("bf16", bf16), ("rowwise", rowwise), ("tensorwise", tensorwise)):
                out = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
                fn(0, m, out)
                whole = out.clone()
                row = {"gemm": name, "m": m, "n": n, "k": k, "recipe": label, "us": {}}
                for c in [m] + [c for c in chunks if c < m]:
                    def call(c=c):
                        for i in range(0, m, c):
                            fn(i, min(m, i + c), out)
                    call()
                    err = (out.float() - whole.float()).abs().max().item() / whole.float().abs().max().item()
                    assert err < 1e-2, (name, label, c, err)
                    row["us"][str(c)] = triton.testing.do_bench(call, warmup=5, rep=40, return_mode="median") * 1e3
                rows.append(row)
                flops = 2 * m * n * k
                print(f"{name:>12} {m:>6} {label:>10} | " + ", ".join(
                    f"{us:8.0f} ({flops / us / 1e6:5.0f})" for us in row["us"].values()), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
