"""A split decode step's merge writing o_proj's FP8 input with a scale per token (channel weights): how to find the
token's max. A study, not the engine.

kernels/attention/decode_common.merge_splits runs a program a token up to ROW_MERGE_MAX_SPLITS splits: it holds the
token's every head and quantizes the row from registers. Past that the merge writes bf16 and kernels/fp8_gemm.
quantize_rows quantizes it. (A program a head that left its max and counted itself in the token's counter, the last
of a token's 32 quantizing the row read back from L2, took 2.6-3.3x the plain merge on the H200 and is gone:
bench/RESULTS.md, 2026-12-05.) Timed at the Qwen3-8B shape's heads (32 query heads of 128) on synthetic partials, per
batch at the split count the Gluon kernel picks over an 8-bit pool (gluon_num_splits, contexts of 1,500) or --splits:
the plain merge, the merge a program a token (where the splits fit), and the plain merge followed by quantize_rows;
us a call, graph-replayed (triton.testing.do_bench_cudagraph). The FP8 bytes and scales are checked equal to
quantize_rows' of the output.

    python bench/studies/fp8_merge_output.py --out fp8_merge_output.json
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

BATCHES = [1, 8, 16, 64, 96, 140, 256]
HQ, HKV, D = 32, 8, 128


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", default=",".join(map(str, BATCHES)))
    p.add_argument("--splits", type=int, default=0, help="splits for every batch (0: gluon_num_splits')")
    p.add_argument("--out", default=None)
    args = p.parse_args()

    import torch
    import triton

    from kernels.attention import decode_common as dc
    from kernels.attention.gluon_decode import gluon_num_splits
    from kernels.fp8_gemm import quantize_rows
    from kernels.triton_runtime import num_sms

    row_max = dc.ROW_MERGE_MAX_SPLITS
    rows = []
    print(f"merge of split decode partials, {HQ} heads of {D}, us: plain | FP8 per token, a program a token | "
          "plain, then quantize_rows")
    for b in map(int, args.batches.split(",")):
        splits = args.splits or gluon_num_splits(b, HKV, 1500, num_sms(torch.device("cuda")))
        gen = torch.Generator(device="cuda").manual_seed(b)
        out = torch.empty(b, HQ, D, dtype=torch.bfloat16, device="cuda")
        part_acc, part_m, part_l = dc.split_partials(out, splits) if splits > 1 else (None, None, None)
        if splits == 1:
            print(f"B = {b:>4}: unsplit, no merge")
            continue
        part_acc.copy_(torch.randn(part_acc.shape, generator=gen, device="cuda"))
        part_m.copy_(4 * torch.randn(part_m.shape, generator=gen, device="cuda"))
        part_l.copy_(torch.rand(part_l.shape, generator=gen, device="cuda") + 0.5)
        partials = (part_acc, part_m, part_l)

        def merge(fp8: bool, max_splits: int = row_max):
            dc.ROW_MERGE_MAX_SPLITS = max_splits
            try:
                decode = dc.fp8_decode_output(out, HKV, splits, HQ * D) if fp8 else None
                dc.merge_splits(partials, out, splits, D, decode and decode.output)
                return decode
            finally:
                dc.ROW_MERGE_MAX_SPLITS = row_max

        merge(False)
        plain = out.clone()
        want_q, want_scale = quantize_rows(plain.view(b, -1), HQ * D)
        cases = {"plain": lambda: merge(False)}
        if triton.next_power_of_2(splits) <= max(row_max, 4):
            cases["row"] = lambda: merge(True, max(row_max, 4))
            got = cases["row"]()
            assert torch.equal(out, plain)
            assert torch.equal(got.quantized.scale, want_scale)
            assert torch.equal(got.quantized.q.view(torch.uint8), want_q.view(torch.uint8))
        cases["plain_then_quantize_rows"] = lambda: (merge(False), quantize_rows(out.view(b, -1), HQ * D))
        row = {"batch": b, "splits": splits, "us": {}}
        for name, fn in cases.items():
            fn()
            with torch.cuda.stream(torch.cuda.Stream()):
                row["us"][name] = triton.testing.do_bench_cudagraph(fn, rep=50) * 1e3
        rows.append(row)
        print(f"B = {b:>4}, {splits:>2} splits: " + " | ".join(f"{k} {v:6.1f}" for k, v in row["us"].items()),
              flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
