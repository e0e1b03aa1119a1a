"""Which of torch's FP8 GEMM paths streams the 8B shape's weights fastest at decode's token counts? A study, not the
engine.

The engine runs its channel-scaled FP8 products as `torch._scaled_mm` with row-wise scales (per token x per output
channel, applied in the GEMM's epilogue). torch serves each scaling recipe with a different kernel: row-wise with
its own CUTLASS kernel or cuBLASLt's outer-vector scaling, tensor-wise (one float per operand) with cuBLASLt's plain
FP8 GEMM, the 1 x 128 / 128 x 128 block recipe with cuBLASLt's block scaling. If the tensor-wise GEMM were much
faster, the engine could run it with unit scales and leave the per-token and per-channel factors to the kernel that
reads the product next (exact: only where bf16's rounding happens moves). Timed per Qwen3-8B product and M: bf16
(F.linear), row-wise at M rows and at 256, tensor-wise at M rows (unit scales, bf16 product), and the block recipe
(cuBLASLt's, and the engine's Triton block GEMM on the same operands); each a CUDA graph of calls over copies of W
larger than L2 (bench/fp8_gemm_table.cold_graph_us). The errors are of max |y| against float64 on the same quantized
operands (tensor-wise: its product scaled afterwards in fp32). It then names the kernels each path launched at M =
132 (torch.profiler). `--fast-accum` also times the row-wise and tensor-wise recipes with fast (unpromoted)
accumulation (torch refuses it with block scales), which CUTLASS's and vLLM's FP8 GEMMs use: whether it pays at
prefill's M, and what it costs in error.

    python bench/studies/fp8_scaling_modes.py --out fp8_scaling_modes.json
    python bench/studies/fp8_scaling_modes.py --tokens 512,1024,2048,4096 --fast-accum
    python bench/studies/fp8_scaling_modes.py --tokens 4096,16384 --fast-accum --error-rows 512  # prefill's M
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from bench.fp8_gemm_table import QWEN3_8B_GEMMS  # noqa: E402

TOKENS = [64, 128, 132, 144, 192, 256]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", default=",".join(map(str, TOKENS)))
    p.add_argument("--timing-ms", type=int, default=10)
    p.add_argument("--fast-accum", action="store_true", help="also time the cuBLASLt recipes with fast accumulation")
    p.add_argument("--error-rows", type=int, default=None,
                   help="errors over the first R rows only (the float64 reference at prefill's M takes minutes)")
    p.add_argument("--out", default=None)
    args = p.parse_args()

    import torch
    import torch.nn.functional as F

    from bench.fp8_gemm_table import cold_graph_us, study_gpu, weight_copies
    from kernels import fp8_gemm
    from kernels.fp8_quant import dequantize_rows, quantize_rows_ref, rows_in_place

    device, gen = study_gpu()
    one = torch.ones((), dtype=torch.float32, device=device)
    results, kernels = [], {}
    print(f"{'gemm':>12} {'M':>4} | us (W's TB/s): {'bf16':>13} {'rowwise M':>13} {'rowwise 256':>13} "
          f"{'tensorwise':>13} {'block':>13} {'triton block':>13} | errors: rowwise, tensorwise, block, triton block")
    for name, n, k in QWEN3_8B_GEMMS:
        w16 = torch.randn(n, k, generator=gen, device=device, dtype=torch.bfloat16) / k**0.5
        wq, ws = quantize_rows_ref(w16, k)
        w64 = dequantize_rows(wq, ws, k, torch.float64)
        wqs, w16s = weight_copies(wq), weight_copies(w16)
        # 128 x 128 block scales of the same weights (the block recipe's operand): one float per block
        wb = wq.float() * ws
        blocks = wb.reshape(n // 128, 128, k // 128, 128).abs().amax(dim=(1, 3)).clamp(min=1e-12) / 448.0
        wbq = (wb / blocks.repeat_interleave(128, 0).repeat_interleave(128, 1)).to(torch.float8_e4m3fn)
        wbqs = weight_copies(wbq)
        block_rows = blocks.repeat_interleave(128, 0).contiguous()  # the loader's layout: a block's scale on its rows
        for m in map(int, args.tokens.split(",")):
            x = torch.randn(m, k, generator=gen, device=device, dtype=torch.bfloat16)
            x *= torch.rand(m, 1, generator=gen, device=device, dtype=torch.bfloat16) + 0.1
            a, a_s = fp8_gemm.quantize_rows(x, k)  # a 256-row buffer, as the engine's activations
            a16 = rows_in_place(a, -(-m // 16) * 16)  # _scaled_mm's tensor-wise path wants rows in 16s
            er = min(m, args.error_rows or m)  # the rows whose error is measured
            ref = dequantize_rows(a, a_s, k, torch.float64)[:er] @ w64.T
            scale = ref.abs().max().item()
            # the block recipe: activations per token and 128 columns (outer-dim-major scales)
            xb = dequantize_rows(a, a_s, k, torch.float32)
            a_blk = xb.reshape(m, k // 128, 128).abs().amax(-1).clamp(min=1e-12) / 448.0
            ab = (xb / a_blk.repeat_interleave(128, 1)).to(torch.float8_e4m3fn)
            a_blk_t = a_blk.t().contiguous().t()
            ref_b = (ab[:er].double() * a_blk[:er].double().repeat_interleave(128, 1)) @ (
                wbq.double() * blocks.double().repeat_interleave(128, 0).repeat_interleave(128, 1)).T

            def rowwise(w, rows=m, fast=False):
                return fp8_gemm.scaled_mm_fp8_gemm(a, a_s, w, ws, torch.bfloat16, rows=rows, fast_accum=fast)

            def tensorwise(w, fast=False):
                return torch._scaled_mm(a16, w.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16,
                                        use_fast_accum=fast)

            def block(w):  # scale_b [K / 128, N / 128], K-major (a transposed view), as cuBLASLt wants
                return F.scaled_mm(ab, w.t(), a_blk_t, F.ScalingType.BlockWise1x128, blocks.t(),
                                   F.ScalingType.BlockWise128x128, output_dtype=torch.bfloat16)

            def triton_block(w):  # the engine's block GEMM: one weight scale per tile and K group
                return fp8_gemm.triton_fp8_gemm(ab, a_blk, w, block_rows, 128, torch.bfloat16,
                                                rows_sharing_scales=128)

            row = {"gemm": name, "m": m, "n": n, "k": k, "us": {}, "err": {}}
            recipes = [("bf16", lambda w: F.linear(x, w), w16s), ("rowwise", rowwise, wqs),
                       ("rowwise_256", lambda w: rowwise(w, 256), wqs), ("tensorwise", tensorwise, wqs),
                       ("block", block, wbqs), ("triton_block", triton_block, wbqs)]
            if args.fast_accum:
                recipes += [("rowwise_fast", lambda w: rowwise(w, fast=True), wqs),
                            ("tensorwise_fast", lambda w: tensorwise(w, True), wqs)]
            for label, fn, ws_list in recipes:
                try:
                    row["us"][label] = cold_graph_us(fn, ws_list, args.timing_ms)
                    out = fn(ws_list[0])[:er].double()
                    if label.startswith("tensorwise"):
                        out = out * a_s[:er].double() * ws.view(1, -1).double()
                    if label != "bf16":
                        r = ref_b if label.startswith(("block", "triton_block")) else ref
                        row["err"][label] = (out - r).abs().max().item() / scale
                except Exception as e:  # noqa: BLE001  a recipe this torch cannot run is a result
                    row["us"][label] = None
                    row["err"][label] = f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
            results.append(row)

            def cell(label):
                us = row["us"][label]
                nbytes = n * k * (2 if label == "bf16" else 1)
                return f"{us:>6.1f} ({nbytes / us / 1e6:.2f})" if us else f"{'-':>13}"

            errs = ", ".join(f"{row['err'][lb]:.1e}" if isinstance(row["err"][lb], float) else "fails"
                             for lb in ("rowwise", "tensorwise", "block", "triton_block"))
            print(f"{name:>12} {m:>4} | {cell('bf16'):>29} {cell('rowwise'):>13} {cell('rowwise_256'):>13} "
                  f"{cell('tensorwise'):>13} {cell('block'):>13} {cell('triton_block'):>13} | {errs}", flush=True)
            if args.fast_accum:
                errs = ", ".join(f"{row['err'][lb]:.1e}" if isinstance(row["err"][lb], float) else "fails"
                                 for lb in ("rowwise_fast", "tensorwise_fast"))
                print(f"{'fast accumulation':>47} {cell('rowwise_fast'):>13} {'':>13} {cell('tensorwise_fast'):>13} "
                      f"{'':>13} {'':>13} | {errs}", flush=True)
            if m == 132 and name == "gate_up_proj":
                for label, fn, ws_list in (("rowwise", rowwise, wqs), ("rowwise_256", lambda w: rowwise(w, 256), wqs),
                                           ("tensorwise", tensorwise, wqs), ("block", block, wbqs)):
                    try:
                        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                            fn(ws_list[0])
                            torch.cuda.synchronize()
                        kernels[label] = sorted({e.name for e in prof.events() if e.device_type.name == "CUDA"})
                    except Exception as e:  # noqa: BLE001
                        kernels[label] = [f"{type(e).__name__}"]
        del wqs, w16s, wbqs
        torch.cuda.empty_cache()
    for err_row in results:
        for label, e in err_row["err"].items():
            if isinstance(e, str):
                print(f"{label} failed at {err_row['gemm']} M = {err_row['m']}: {e}")
                break
    print("\nkernels launched at gate_up_proj, M = 132:")
    for label, names in kernels.items():
        print(f"  {label}: {'; '.join(nm[:140] for nm in names)}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(device), "torch": torch.__version__,
                       "rows": results, "kernels": kernels}, f, indent=1)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
