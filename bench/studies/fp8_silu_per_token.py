"""SiLU-and-mul writing FP8 with a scale per token (the input of a channel-scaled down_proj): how to split the row.
A study, not the engine.

A token's scale is the max over its whole row (12,288 columns on the Qwen3-8B shape), so the engine
(kernels/fp8_fused_quant.silu_and_mul_quant) runs two kernels: programs of PER_TOKEN_CHUNK columns write SiLU-and-mul
in bf16 with each chunk's max, then programs of the same chunks quantize by the max of their token's chunks. The
alternative timed here: one kernel, a program a token (`one_kernel` below): the row computed chunk by chunk twice,
first for its max, then quantized (its second read hits L2), or held in registers at once (CHUNK >= the row),
writing nothing but the FP8 row. (A third, one kernel whose programs of a token wait for each other's maxes, was
1.7-2x slower than the pair at decode's M on the H200: bench/RESULTS.md, 2026-12-05, d1de785.) Timed per M
(graph-replayed, triton.testing.do_bench_cudagraph, us): the plain bf16 SiLU-and-mul, the engine's pair at chunks of
512-4,096 columns, and the one kernel a token at chunks of 2,048-16,384; the rows' bytes and scales are checked equal
to the engine's.

    python bench/studies/fp8_silu_per_token.py --out fp8_silu_per_token.json
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from kernels.attention.triton_kv_store import fp8_scale, quantize_fp8  # noqa: E402
from kernels.fp8_fused_quant import _MIN_SCALE, _silu_and_mul_tile  # noqa: E402

TOKENS = [1, 16, 64, 133, 256, 4096, 16384]
INTER = 12288  # Qwen3-8B's intermediate size


@triton.jit
def _one_kernel(x_ptr, q_ptr, scale_ptr, row_scale_ptr, col_scale_ptr, inter, x_stride,
                CHUNK: tl.constexpr, ONE_PASS: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, CHUNK)
    row_scale = tl.load(row_scale_ptr + row)
    if ONE_PASS:
        mask = offs < inter
        y = _silu_and_mul_tile(x_ptr, row * x_stride, inter, offs, mask, row_scale, col_scale_ptr, True)
        scale = fp8_scale(tl.max(tl.abs(y), axis=0), _MIN_SCALE)
        tl.store(q_ptr + row * inter + offs, quantize_fp8(y, scale).to(q_ptr.dtype.element_ty), mask=mask)
    else:
        amax = tl.zeros([CHUNK], dtype=tl.float32)
        for start in range(0, inter, CHUNK):
            cols = start + offs
            y = _silu_and_mul_tile(x_ptr, row * x_stride, inter, cols, cols < inter, row_scale, col_scale_ptr, True)
            amax = tl.maximum(amax, tl.abs(y))
        scale = fp8_scale(tl.max(amax, axis=0), _MIN_SCALE)
        for start in range(0, inter, CHUNK):
            cols = start + offs
            mask = cols < inter
            y = _silu_and_mul_tile(x_ptr, row * x_stride, inter, cols, mask, row_scale, col_scale_ptr, True)
            tl.store(q_ptr + row * inter + cols, quantize_fp8(y, scale).to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(scale_ptr + row, scale)


def one_kernel(x, row_scale, col_scale, chunk: int):
    import torch

    m, inter = x.shape[0], x.shape[1] // 2
    q = torch.empty(m, inter, dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty(m, 1, dtype=torch.float32, device=x.device)
    _one_kernel[(m,)](x, q, scale, row_scale, col_scale, inter, x.stride(0), CHUNK=chunk, ONE_PASS=inter <= chunk,
                      num_warps=min(16, chunk // 256))
    return q, scale


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", default=",".join(map(str, TOKENS)))
    p.add_argument("--out", default=None)
    args = p.parse_args()

    import torch

    from kernels import fp8_fused_quant as fq
    from kernels import fused_ops as fo

    engine_chunk = fq.PER_TOKEN_CHUNK
    rows = []
    print(f"SiLU-and-mul -> FP8 per token, intermediate {INTER}, us: plain bf16 | the engine's two kernels at "
          "chunks of 512 / 1,024 / 2,048 / 4,096 | one kernel a token at chunks of 2,048 / 4,096 / 16,384")
    for m in map(int, args.tokens.split(",")):
        gen = torch.Generator(device="cuda").manual_seed(m)
        x = torch.randn(m, 2 * INTER, generator=gen, device="cuda", dtype=torch.bfloat16)
        row_scale = torch.rand(m, 1, generator=gen, device="cuda") + 0.5
        col_scale = torch.rand(2 * INTER, 1, generator=gen, device="cuda") + 0.5
        scales = (row_scale, col_scale)

        def engine(chunk):
            fq.PER_TOKEN_CHUNK = chunk
            try:
                return fq.silu_and_mul_quant(x, INTER, scales=scales)
            finally:
                fq.PER_TOKEN_CHUNK = engine_chunk

        ref = engine(engine_chunk)
        cases = {"plain": lambda: fo.silu_and_mul(x)}
        for chunk in (512, 1024, 2048, 4096):
            cases[f"two_kernels_{chunk}"] = lambda c=chunk: engine(c)
        for chunk in (2048, 4096, 16384):
            q, s = one_kernel(x, row_scale, col_scale, chunk)
            assert torch.equal(q.view(torch.uint8), ref.q.view(torch.uint8)) and torch.equal(s, ref.scale), chunk
            cases[f"one_kernel_{chunk}"] = lambda c=chunk: one_kernel(x, row_scale, col_scale, c)
        row = {"m": m, "us": {}}
        for name, fn in cases.items():
            print(f"M = {m}: {name}", file=sys.stderr, flush=True)  # which case, should one fail
            fn()
            with torch.cuda.stream(torch.cuda.Stream()):
                row["us"][name] = triton.testing.do_bench_cudagraph(fn, rep=50) * 1e3
        rows.append(row)
        print(f"M = {m:>5}: " + " ".join(f"{v:7.1f}" for v in row["us"].values()), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "intermediate": INTER, "rows": rows}, f, indent=1)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
