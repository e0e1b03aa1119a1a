"""Does a head start pay: the next product's weights prefetched into L2 while the small kernel before it runs? A
study, not the engine.

At decode's batch each layer product of the 8B shape streams its weights at 2.1-3.25 TB/s (FP8) and 2.9-3.2 (bf16),
against 4.26 for a copy: every product starts cold (launch, the first loads' latency, a ragged last wave), and the
kernels between products (the norms, SiLU-and-mul, RoPE and the K/V store) move about a megabyte each and leave HBM
idle for their few microseconds. Here a prefetch kernel issues `cp.async.bulk.prefetch.L2` for the first `frac` of
every weight row (fire and forget: no shared memory, nothing waited for) just before the producer runs, so that each
of the product's programs finds the start of its rows in L2. If it pays, the producers themselves would issue it
(one launch less than here).

Per product of the Qwen3-8B shape and M, us a call of [producer -> product] against [prefetch -> producer ->
product], each a CUDA graph of calls over copies of W larger than L2, L2 flushed before each replay
(bench/fp8_gemm_table.cold_graph_us):
- fp8: the engine's decode path for channel weights: `rms_norm_quant` (SiLU-and-mul's `silu_and_mul_quant` before
  down_proj) writing FP8 per token, then `torch._scaled_mm` tensor-wise (kernels/fp8_gemm.unit_scaled_product);
- bf16: the plain norm (SiLU-and-mul) and F.linear.
The producer before o_proj is decode attention in the engine (HBM-bound itself); the norm stands in for it here.
"hot" is the same chain with one W replayed (in L2 after the first call where it fits): the floor a head start
approaches. "prefetch only" is [prefetch -> producer]: what the prefetch kernel adds on its own.

    python bench/studies/fp8_l2_head_start.py --out fp8_l2_head_start.json
    python bench/studies/fp8_l2_head_start.py --compile-check   # the prefetch kernel compiled for sm_90 offline
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from bench.fp8_gemm_table import QWEN3_8B_GEMMS  # noqa: E402

TOKENS = [64, 133, 256]
FRACTIONS = [0.125, 0.25, 0.5, 1.0]
_ROWS = 128  # weight rows a prefetch program covers


@triton.jit
def _prefetch_rows_kernel(w_ptr, n, row_bytes, nbytes, ROWS: tl.constexpr):
    """The first nbytes (a multiple of 16) of each of ROWS weight rows into L2: one bulk prefetch a row."""
    rows = tl.minimum(tl.program_id(0) * ROWS + tl.arange(0, ROWS), n - 1).to(tl.int64)
    tl.inline_asm_elementwise("cp.async.bulk.prefetch.L2.global [$1], $2; // $0", "=r,l,r",
                              [w_ptr + rows * row_bytes, tl.full([ROWS], 0, tl.int32) + nbytes],
                              dtype=tl.int32, is_pure=False, pack=1)


def prefetch_rows(w, frac: float) -> None:
    """w [N, K] (any dtype, rows contiguous): the first `frac` of each row prefetched into L2."""
    import torch

    raw = w.view(torch.uint8)
    row_bytes = raw.shape[1]
    nbytes = max(16, int(row_bytes * frac) // 16 * 16)
    _prefetch_rows_kernel[(triton.cdiv(raw.shape[0], _ROWS),)](raw, raw.shape[0], row_bytes, nbytes, ROWS=_ROWS,
                                                                num_warps=4)


def _chains(name: str, n: int, k: int, m: int, device):
    """(fp8 chain, bf16 chain, producer alone, fp8 W, bf16 W): chain(w, frac) runs [prefetch ->] producer -> product,
    producer_only(w, frac, fp8) the same without the product."""
    import torch
    import torch.nn.functional as F

    from kernels.fp8_fused_quant import rms_norm_quant, silu_and_mul_quant
    from kernels.fp8_gemm import unit_scaled_product
    from kernels.fp8_quant import quantize_rows_ref
    from kernels.fused_ops import rms_norm, silu_and_mul

    gen = torch.Generator(device=device).manual_seed(0)
    w16 = torch.randn(n, k, generator=gen, device=device, dtype=torch.bfloat16) / k**0.5
    wq, _ = quantize_rows_ref(w16, k)
    if name == "down_proj":  # SiLU-and-mul of gate_up's product
        x = torch.randn(m, 2 * k, generator=gen, device=device, dtype=torch.bfloat16)

        def fp8_producer():
            return silu_and_mul_quant(x, k).q

        def bf16_producer():
            return silu_and_mul(x)
    else:  # the norm after the residual add
        x = torch.randn(m, k, generator=gen, device=device, dtype=torch.bfloat16)
        residual = torch.randn(m, k, generator=gen, device=device, dtype=torch.bfloat16)
        norm_w = torch.rand(k, generator=gen, device=device, dtype=torch.bfloat16) + 0.5

        def fp8_producer():
            return rms_norm_quant(x, norm_w, 1e-6, k, residual=residual)[0].q

        def bf16_producer():
            return rms_norm(x, norm_w, 1e-6, residual)[0]

    def fp8_chain(w, frac):
        if frac:
            prefetch_rows(w, frac)
        return unit_scaled_product(fp8_producer(), w, torch.bfloat16)

    def bf16_chain(w, frac):
        if frac:
            prefetch_rows(w, frac)
        return F.linear(bf16_producer(), w)

    def producer_only(w, frac, fp8):
        if frac:
            prefetch_rows(w, frac)
        return fp8_producer() if fp8 else bf16_producer()

    return fp8_chain, bf16_chain, producer_only, wq, w16


def run(tokens: list[int], fractions: list[float], timing_ms: int) -> list[dict]:
    import torch

    from bench.fp8_gemm_table import cold_graph_us, weight_copies

    device = torch.device("cuda")
    rows = []
    print(f"{'product':>12} {'M':>4} {'dtype':>5} | us: {'none':>7} " + " ".join(f"{f'{f:g}':>7}" for f in fractions)
          + f" | {'hot':>7} | prefetch only at {fractions[-1]:g}: +us")
    for name, n, k in QWEN3_8B_GEMMS:
        for m in tokens:
            fp8_chain, bf16_chain, producer_only, wq, w16 = _chains(name, n, k, m, device)
            for dtype, chain, w in (("fp8", fp8_chain, wq), ("bf16", bf16_chain, w16)):
                copies = weight_copies(w)
                us = {f: cold_graph_us(lambda w, f=f: chain(w, f), copies, timing_ms) for f in [0.0, *fractions]}
                hot = cold_graph_us(lambda w: chain(w, 0.0), [w] * 8, timing_ms)
                alone = {f: cold_graph_us(lambda w, f=f: producer_only(w, f, dtype == "fp8"), copies, timing_ms)
                         for f in (0.0, fractions[-1])}
                row = {"product": name, "n": n, "k": k, "m": m, "dtype": dtype,
                       "weight_mb": w.numel() * w.element_size() / 2**20,
                       "us": {str(f): v for f, v in us.items()}, "hot_us": hot,
                       "prefetch_only_extra_us": alone[fractions[-1]] - alone[0.0]}
                rows.append(row)
                print(f"{name:>12} {m:>4} {dtype:>5} | us: {us[0.0]:7.1f} "
                      + " ".join(f"{us[f]:7.1f}" for f in fractions)
                      + f" | {hot:7.1f} | {row['prefetch_only_extra_us']:+.1f}", flush=True)
            del wq, w16
            torch.cuda.empty_cache()
    best = {}
    for r in rows:
        gain = r["us"]["0.0"] - min(r["us"].values())
        best.setdefault((r["dtype"], r["m"]), [0.0, 0.0])
        best[(r["dtype"], r["m"])][0] += r["us"]["0.0"]
        best[(r["dtype"], r["m"])][1] += gain
    print("\na layer's four products with their producers, us: as they run, and the best fraction's gain per product")
    for (dtype, m), (base, gain) in sorted(best.items()):
        print(f"  {dtype:>5} M = {m:>4}: {base:7.1f} -> {base - gain:7.1f} ({gain / base:.1%})")
    return rows


def compile_check() -> None:
    from bench.studies.kernel_sass import compile_sm90

    r = compile_sm90(_prefetch_rows_kernel, {"w_ptr": "*u8"}, {"ROWS": _ROWS}, 4, 1)
    prefetches = r["sass"].count("UBLKPF")
    print(f"prefetch kernel: {r['registers']} registers, {r['instructions']} instructions, {prefetches} UBLKPF")
    if prefetches == 0:
        sys.exit("the bulk prefetch was compiled away")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", default=",".join(map(str, TOKENS)))
    p.add_argument("--fractions", default=",".join(map(str, FRACTIONS)))
    p.add_argument("--timing-ms", type=int, default=10)
    p.add_argument("--out", default=None)
    p.add_argument("--compile-check", action="store_true")
    args = p.parse_args()
    if args.compile_check:
        compile_check()
        return
    import torch

    if not torch.cuda.is_available():
        sys.exit("the study needs a CUDA GPU")
    rows = run([int(t) for t in args.tokens.split(",")], [float(f) for f in args.fractions.split(",")],
               args.timing_ms)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
