"""Do FP8 activations make FP8 experts pay? The fused MoE block with FP8 activations
(kernels/fused_moe_fp8_activations.py, w8a8: x and h quantized per token and 128 columns, FP8 x FP8 dots) against
the engine's weight-only FP8 experts (kernels/fused_moe.py, each FP8 weight tile widened to bf16 in registers) and
bf16. On the H200 (bench/RESULTS.md, 2026-12-04) the weight-only layer reads its experts at 2.0-2.6 TB/s where bf16's
read at 3.7-4.0, and prefill pays for the widening (the 30B-A3B shape: decode 1.10x, prefill 0.80x of bf16).

    python bench/studies/fp8_moe_activations.py                    # H200: the layer against bf16 and weight-only FP8
    python bench/studies/fp8_moe_activations.py --interpret-check  # CPU: the kernels in Triton's interpreter
    python bench/studies/fp8_moe_activations.py --compile-check    # CPU: each tile compiled for sm_90, offline

The study times, per token count, the fused MoE layer at Qwen3-30B-A3B's shape (128 experts, top-8, hidden 2048,
inter 768) as CUDA-graph replays: bf16, weight-only FP8 and FP8 activations (the x quantization included), each with
row weight scales, per row and 128 columns, and a 128 x 128 block checkpoint's, and prints each one's error against
float64 on the same quantized weights (FP8 activations add their own quantization error; weight-only FP8 adds none).
"""
from __future__ import annotations

import argparse
from dataclasses import replace
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path = [str(HERE.parent.parent)] + [p for p in sys.path if Path(p or ".").resolve() != HERE]
from bench.studies import triton_mode_from_argv  # noqa: E402

triton_mode_from_argv(sys.argv)  # before any kernel is decorated

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from kernels import fused_moe as fm  # noqa: E402
from kernels.fp8_quant import dequantize_rows, quantize_rows_ref  # noqa: E402
from kernels.moe_reference import block_quantized_experts, fp8_activations_ref64, untied_tokens  # noqa: E402
from kernels.fused_moe_fp8_activations import (GROUP, _down_fp8_kernel, _fp8_tiles,  # noqa: E402
                                               _gate_up_fp8_kernel, fused_moe_fp8_activations)
from kernels.triton_runtime import INTERPRET  # noqa: E402

SHAPE = {"experts": 128, "hidden": 2048, "inter": 768, "top_k": 8}
TOKENS = [1, 16, 64, 128, 256, 2048]


# ---------------------------------------------------------------------------------------------
# references
# ---------------------------------------------------------------------------------------------


def fp8_experts(w13: torch.Tensor, w2: torch.Tensor, group: int | str | None) -> tuple:
    """(fp8 w13, fp8 w2, Fp8Experts, dequantized w13 and w2 in float64): scales per row and `group` columns, per row
    (None), or a 128 x 128 block checkpoint's ("blocks": one scale per N tile and K group in the w8a8 kernels)."""
    if group == "blocks":
        (q13, s13, d13), (q2, s2, d2) = (block_quantized_experts(w) for w in (w13, w2))
        return q13, q2, fm.Fp8Experts(s13, s2, GROUP, GROUP), d13, d2
    out = []
    for w in (w13, w2):
        g = group or w.shape[-1]
        q, scale = quantize_rows_ref(w.reshape(-1, w.shape[-1]).float(), g)
        out.append((q.view(w.shape), scale.view(*w.shape[:2], -1), g,
                    dequantize_rows(q, scale, g, torch.float64).view(w.shape)))
    (q13, s13, g13, d13), (q2, s2, g2, d2) = out
    return q13, q2, fm.Fp8Experts(s13, s2, g13, g2), d13, d2


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double().cpu() - b).norm() / b.norm()).item()


def case(num_tokens: int, shape: dict, dtype: torch.dtype, device, seed: int):
    gen = torch.Generator().manual_seed(seed)
    e, h, i = shape["experts"], shape["hidden"], shape["inter"]
    x = torch.randn(num_tokens, h, generator=gen)
    x *= torch.rand(num_tokens, 1, generator=gen) + 0.1  # tokens of unequal scale
    logits = 2 * torch.randn(num_tokens, e, generator=gen)
    w13 = torch.randn(e, 2 * i, h, generator=gen) / h**0.5
    w2 = torch.randn(e, h, i, generator=gen) / i**0.5
    return [t.to(device=device, dtype=dtype) for t in (x, logits, w13, w2)]


# ---------------------------------------------------------------------------------------------
# --interpret-check and --compile-check
# ---------------------------------------------------------------------------------------------


def interpret_check() -> None:
    """Ragged shapes (hidden 200: a partial last group; inter 160: a partial h group and N tile), an expert with no
    token, both weight scalings; fp32 activations (the interpreter rounds bf16 wrongly). FP8 activations against the
    float64 block on the same quantized x and h (up to the rounding of a value at a quantization boundary), and
    against the unquantized block (their own error)."""
    assert INTERPRET, "TRITON_INTERPRET=1 must be set before the kernels are decorated"
    shape = {"experts": 4, "hidden": 200, "inter": 160, "top_k": 2}
    for group in (GROUP, None):
        x, logits, w13, w2 = case(13, shape, torch.float32, "cpu", seed=1)
        logits[:, 3] = -1e4  # expert 3 gets no token
        q13, q2, scales, d13, d2 = fp8_experts(w13, w2, group)
        out = fused_moe_fp8_activations(x, logits, q13, q2, 2, True, fp8=scales)
        emulated = fp8_activations_ref64(x, logits, d13, d2, 2, quantize_activations=True)
        exact = fp8_activations_ref64(x, logits, d13, d2, 2, quantize_activations=False)
        err, own = rel(out, emulated), rel(out, exact)
        print(f"weights {'per 128 columns' if group else 'per row'}: against the emulated quantization {err:.1e}, "
              f"against unquantized activations {own:.1e}")
        assert err < 2e-3, err  # the same bytes, but for a rare value rounded across a quantization step
        assert 1e-3 < own < 8e-2, own  # FP8 activations cost something, not everything
    print("interpret check passed")


def compile_check() -> bool:
    """Each token count's tiles (tiles_for, made fit by _fp8_tiles) for both kernels and weight scalings, compiled
    for sm_90 by Triton's own ptxas: shared memory within the SM's."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler.compiler import ASTSource

    e, h, i, k = SHAPE["experts"], SHAPE["hidden"], SHAPE["inter"], SHAPE["top_k"]
    ok = True
    for num_tokens in TOKENS:
        up, down = _fp8_tiles(*fm.tiles_for(num_tokens, e, h, i, k))
        for fn, tile in ((_gate_up_fp8_kernel, up), (_down_fp8_kernel, down)):
            for grouped, per_tile in ((True, False), (True, True), (False, False)):  # block scales per row or tile
                const = dict(BLOCK_M=tile.block_m, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k, GROUP_M=tile.group_m,
                             W_GROUPED=grouped, W_PER_TILE=per_tile, UPCAST=False)
                if fn is _gate_up_fp8_kernel:
                    const.update(TOP_K=k, OUT_DTYPE=tl.bfloat16)
                sig, attrs = {}, {}
                for n, name in enumerate(fn.arg_names):
                    if name in const:
                        sig[name] = "constexpr"
                        continue
                    if name.endswith("_ptr"):
                        sig[name] = {"xq_ptr": "*fp8e4nv", "w_ptr": "*fp8e4nv", "hq_ptr": "*fp8e4nv",
                                     "sorted_pairs_ptr": "*i32", "block_expert_ptr": "*i32", "num_padded_ptr": "*i32",
                                     "out_ptr": "*bf16"}.get(name, "*fp32")
                    else:
                        sig[name] = "i32"
                    if sig[name].startswith("*") or name in ("hidden", "inter") or name.startswith("stride"):
                        attrs[(n,)] = [["tt.divisibility", 16]]
                started = time.perf_counter()
                try:
                    kernel = triton.compile(ASTSource(fn, sig, constexprs=const, attrs=attrs),
                                            target=GPUTarget("cuda", 90, 32),
                                            options={"num_warps": tile.num_warps, "num_stages": tile.num_stages})
                except Exception as err:  # noqa: BLE001  a tile that cannot compile is a finding
                    ok = False
                    print(f"T={num_tokens} {fn.__name__} {tile} grouped={grouped} per_tile={per_tile}: FAILED "
                          f"{str(err).splitlines()[0]}")
                    continue
                fits = kernel.metadata.shared <= 227 * 1024
                ok &= fits
                print(f"T={num_tokens:>5} {fn.__name__:>20} {tuple(vars(tile).values())} grouped={grouped!s:>5} "
                      f"per_tile={per_tile!s:>5}: "
                      f"{kernel.metadata.shared / 1024:.0f} KB shared, {time.perf_counter() - started:.1f} s"
                      + ("" if fits else "  TOO MUCH SHARED MEMORY"))
    return ok


# ---------------------------------------------------------------------------------------------
# the study (CUDA)
# ---------------------------------------------------------------------------------------------


def graph_us(fn, reps: int = 20) -> float:
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    return triton.testing.do_bench(graph.replay, rep=50, return_mode="median") * 1e3 / reps


SCHEMES = {None: "row", GROUP: "group", "blocks": "blocks"}  # per row; per row and 128 columns; 128 x 128 blocks


def study() -> None:
    e, h, i, k = SHAPE["experts"], SHAPE["hidden"], SHAPE["inter"], SHAPE["top_k"]
    print(f"fused MoE layer, {e} experts top-{k}, hidden {h}, inter {i}, bf16: us (graph-replayed) and error against "
          "float64 on the quantized weights (unquantized activations), 16 rows without a router tie")
    print(f"{'T':>5} {'scales':>7} {'bf16':>8} {'w8a16':>8} {'w8a8':>8} {'w8a8 x bf16':>11} {'w8a8 x w8a16':>12} "
          f"{'err w8a16':>9} {'err w8a8':>9} {'w8a8 K128':>9}")
    for num_tokens in TOKENS:
        x, logits, w13, w2 = case(num_tokens, SHAPE, torch.bfloat16, "cuda", seed=num_tokens)
        bf16_us = graph_us(lambda: fm.fused_moe(x, logits, w13, w2, k, True))  # noqa: B023
        for group in (None, GROUP, "blocks"):
            q13, q2, scales, d13, d2 = fp8_experts(w13, w2, group)
            q13, q2 = q13.cuda(), q2.cuda()
            scales = fm.Fp8Experts(scales.w13_scale.cuda(), scales.w2_scale.cuda(), scales.group_k13, scales.group_k2)
            w8a16 = lambda: fm.fused_moe(x, logits, q13, q2, k, True, fp8=scales)  # noqa: B023, E731
            w8a8 = lambda: fused_moe_fp8_activations(x, logits, q13, q2, k, True, fp8=scales)  # noqa: B023, E731
            rows = untied_tokens(logits, k, 16)
            ref = fp8_activations_ref64(x[rows].cpu(), logits[rows].cpu(), d13.cpu(), d2.cpu(), k,
                                        quantize_activations=False)
            err16, err8 = rel(w8a16()[rows], ref), rel(w8a8()[rows], ref)
            us16, us8 = graph_us(w8a16), graph_us(w8a8)
            # the fitted tiles with K tiles of 128 FP8 columns (the bf16 tiles' bytes a stage; fewer scale steps)
            up, down = _fp8_tiles(*fm.tiles_for(num_tokens, e, h, i, k))
            deep = (replace(up, block_k=GROUP), replace(down, block_k=GROUP))
            us8_deep = graph_us(lambda: fused_moe_fp8_activations(x, logits, q13, q2, k, True,  # noqa: B023
                                                                  tiles=deep, fp8=scales))  # noqa: B023
            print(f"{num_tokens:>5} {SCHEMES[group]:>7} {bf16_us:>8.1f} {us16:>8.1f} {us8:>8.1f} "
                  f"{bf16_us / us8:>11.2f} {us16 / us8:>12.2f} {err16:>9.1e} {err8:>9.1e} {us8_deep:>9.1f}", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--interpret-check", action="store_true", help="the kernels in Triton's CPU interpreter")
    mode.add_argument("--compile-check", action="store_true", help="each token count's tiles compiled for sm_90")
    args = p.parse_args()
    if args.interpret_check:
        return interpret_check()
    if args.compile_check:
        sys.exit(0 if compile_check() else 1)
    if not torch.cuda.is_available():
        sys.exit("the study needs a CUDA GPU: --interpret-check and --compile-check run on the CPU")
    study()


if __name__ == "__main__":
    main()
