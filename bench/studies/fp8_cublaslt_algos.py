"""Does a cuBLASLt algorithm other than its heuristic's first choice (the one torch._scaled_mm runs) stream the 8B
shape's FP8 weights faster at decode's token counts? Split-K variants included. A study, not the engine.

At batch 133 the 8B shape's FP8 layer products run at about 2.7 TB/s, bf16's at 3.15 (DESIGN 12), and products at
bf16's bandwidth would take the shape from 1.25x to about 1.3x of bf16. cuBLASLt runs a single wave of 96-128
programs at these M; torch asks its heuristic for one algorithm and offers no other. `kernels/cublaslt.Fp8Matmul`
lists the heuristic's candidates (up to --count) and their split-K variants (--splits, every reduction scheme an
algorithm supports); each is timed as decode runs it (a CUDA graph of calls over copies of W larger than L2:
bench/fp8_gemm_table.cold_graph_us), first briefly, then the best few again at full length, beside torch's call of
the same recipe and the engine's Triton kernel: tensor-wise on unit scales (the bare product, the engine's decode
GEMM), row-wise ("outer": per token x per channel) and the block recipe (1 x 128 activations, 128 x 128 weights).
Every candidate's output is checked against float64 on the same quantized operands; one off by more than --max-error
of max |y| is reported and not ranked. The table gives, per product, M and recipe: Triton's and torch's times, the
heuristic's first through this binding (which should match torch's), the best candidate, its speed-up over torch and
what it is (tile, stages, split-K). --table-out writes the winners as the dispatch's CUBLASLT_ALGOS, and the block
products' choice between cuBLASLt and Triton as its BLOCK_TABLE rows (block_backends), for NANOSERVE_FP8_GEMM_TABLE.

    python bench/studies/fp8_cublaslt_algos.py --out fp8_cublaslt_algos.json
    python bench/studies/fp8_cublaslt_algos.py --tokens 128,144 --recipes tensor --count 64
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from bench.fp8_gemm_table import QWEN3_8B_GEMMS  # noqa: E402

TOKENS = [16, 32, 64, 96, 128, 144, 160, 192, 224, 256]
RECIPES = ("tensor", "outer", "block")
TABLE_RECIPES = ("tensor", "block")  # the engine's decode products (row-wise runs prefill's)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", default=",".join(map(str, TOKENS)))
    p.add_argument("--recipes", default=",".join(TABLE_RECIPES), help=f"of {', '.join(RECIPES)}")
    p.add_argument("--gemms", default=",".join(name for name, _, _ in QWEN3_8B_GEMMS))
    p.add_argument("--count", type=int, default=16, help="heuristic candidates asked for")
    p.add_argument("--splits", default="2,4,8", help="split-K counts tried ('' for none)")
    p.add_argument("--split-top", type=int, default=4, help="on the heuristic's first this many candidates (0: all)")
    p.add_argument("--screen-ms", type=int, default=3, help="each candidate's first timing")
    p.add_argument("--timing-ms", type=int, default=10, help="the best few's (and torch's) timing")
    p.add_argument("--finalists", type=int, default=4)
    p.add_argument("--max-error", type=float, default=2e-2, help="of max |y|, against float64")
    p.add_argument("--out", default=None)
    p.add_argument("--table-out", default=None,
                   help="write the winners as NANOSERVE_FP8_GEMM_TABLE's cublaslt_algos")
    p.add_argument("--margin", type=float, default=1.03, help="how much faster than torch a winner must be")
    args = p.parse_args()

    import torch
    import torch.nn.functional as F

    from bench.fp8_gemm_table import cold_graph_us, weight_copies
    from kernels import fp8_gemm
    from kernels.cublaslt import Fp8Matmul
    from kernels.fp8_quant import block_recipe_rows, dequantize_rows, quantize_rows_ref

    if not torch.cuda.is_available():
        sys.exit("the study needs a CUDA GPU")
    device = torch.device("cuda", torch.cuda.current_device())
    one = fp8_gemm.unit_scale(device)  # the tensor recipe's scales, as the engine passes them
    gen = torch.Generator(device=device).manual_seed(0)
    splits = tuple(int(s) for s in args.splits.split(",") if s)
    recipes = args.recipes.split(",")
    rows = []
    print(f"{'gemm':>12} {'M':>4} {'recipe':>6} | us: {'triton':>6} {'torch':>6} {'lt first':>8} {'lt best':>7} "
          f"{'x torch':>7} {'TB/s':>5} | {'tried':>5} {'bad':>3} | best")
    for name, n, k in QWEN3_8B_GEMMS:
        if name not in args.gemms.split(","):
            continue
        w16 = torch.randn(n, k, generator=gen, device=device, dtype=torch.bfloat16) / k**0.5
        wq, ws = quantize_rows_ref(w16, k)
        ws_vec = ws.view(-1).contiguous()
        w64 = dequantize_rows(wq, ws, k, torch.float64)
        # the same weights as a block checkpoint holds them: one float per 128 x 128 block
        wf = wq.float() * ws
        blocks = wf.reshape(n // 128, 128, k // 128, 128).abs().amax(dim=(1, 3)).clamp(min=1e-12) / 448.0
        wbq = (wf / blocks.repeat_interleave(128, 0).repeat_interleave(128, 1)).to(torch.float8_e4m3fn)
        wb64 = wbq.double() * blocks.double().repeat_interleave(128, 0).repeat_interleave(128, 1)
        block_rows = blocks.repeat_interleave(128, 0).contiguous()  # the loader's layout: a block's scale on its rows
        copies = {"tensor": weight_copies(wq)}
        copies["outer"] = copies["tensor"]
        if "block" in recipes:
            copies["block"] = weight_copies(wbq)
        for m in map(int, args.tokens.split(",")):
            x = torch.randn(m, k, generator=gen, device=device, dtype=torch.bfloat16)
            x *= torch.rand(m, 1, generator=gen, device=device, dtype=torch.bfloat16) + 0.1
            a, a_s = fp8_gemm.quantize_rows(x, k)  # a 256-row buffer, as the engine's activations
            ref = dequantize_rows(a, a_s, k, torch.float64) @ w64.T
            m4 = block_recipe_rows(m)  # the rows the engine runs the block recipe on
            xb = dequantize_rows(a, a_s, k, torch.float32)
            a_blk = xb.reshape(m, k // 128, 128).abs().amax(-1).clamp(min=1e-12) / 448.0
            ab = torch.zeros(m4, k, dtype=torch.float8_e4m3fn, device=device)
            ab[:m] = (xb / a_blk.repeat_interleave(128, 1)).to(torch.float8_e4m3fn)
            a_blk4 = torch.ones(m4, k // 128, device=device)
            a_blk4[:m] = a_blk
            a_blk_mmajor = a_blk4.t().contiguous()  # [K / 128, M]
            ref_b = (ab[:m].double() * a_blk.double().repeat_interleave(128, 1)) @ wb64.T
            a_rows = a_s.view(-1)[:m].contiguous()
            torch_calls = {
                "tensor": lambda w: fp8_gemm.unit_scaled_product(a, w, torch.bfloat16),  # on M rows, as the engine
                "outer": lambda w: fp8_gemm.scaled_mm_fp8_gemm(a, a_s, w, ws, torch.bfloat16),
                "block": lambda w: F.scaled_mm(ab, w.t(), a_blk_mmajor.t(), F.ScalingType.BlockWise1x128, blocks.t(),
                                               F.ScalingType.BlockWise128x128, output_dtype=torch.bfloat16),
            }
            # the engine's Triton kernel on the same operands (its tiles), which the dispatch weighs them against
            triton_calls = {
                "tensor": lambda w: fp8_gemm.triton_fp8_gemm(a, a_s, w, ws, k, torch.bfloat16),
                "block": lambda w: fp8_gemm.triton_fp8_gemm(ab[:m], a_blk, w, block_rows, 128, torch.bfloat16,
                                                            rows_sharing_scales=128),
            }
            triton_calls["outer"] = triton_calls["tensor"]
            for recipe in recipes:
                rows_run = m4 if recipe == "block" else m
                plan = Fp8Matmul(n, k, rows_run, torch.bfloat16, recipe, device=device, x_stride=k)
                operand = ab if recipe == "block" else a
                scales = {"tensor": (one, one), "outer": (a_rows, ws_vec), "block": (a_blk_mmajor, blocks)}[recipe]

                def lt(w, algo, plan=plan, operand=operand, scales=scales):
                    return plan(operand, w, algo, x_scale=scales[0], w_scale=scales[1])

                def error(out, recipe=recipe):
                    out = out[:m].double()
                    if recipe == "tensor":
                        out = out * a_s[:m].double() * ws.view(1, -1).double()
                    r = ref_b if recipe == "block" else ref
                    return (out - r).abs().max().item() / r.abs().max().item()

                row = {"gemm": name, "n": n, "k": k, "m": m, "recipe": recipe, "candidates": [],
                       "triton_us": cold_graph_us(triton_calls[recipe], copies[recipe], args.timing_ms)}
                try:
                    row["torch_us"] = cold_graph_us(torch_calls[recipe], copies[recipe], args.timing_ms)
                    row["torch_error"] = error(torch_calls[recipe](copies[recipe][0]))
                except Exception as e:  # noqa: BLE001  a recipe this torch cannot run is a result
                    row["torch_us"], row["torch_error"] = None, f"{type(e).__name__}: {str(e)[:160]}"
                try:
                    candidates = plan.candidates(args.count, splits, args.split_top)
                except RuntimeError as e:
                    row["error"] = str(e)
                    rows.append(row)
                    print(f"{name:>12} {m:>4} {recipe:>6} | {e}")
                    continue
                for algo in candidates:  # waves: the heuristic's estimate (0 for a split-K variant built here)
                    entry = {"config": algo.config, "table_entry": algo.entry(), "workspace": algo.workspace,
                             "waves": algo.waves}
                    try:
                        entry["error"] = error(lt(copies[recipe][0], algo))
                        if entry["error"] <= args.max_error:
                            entry["screen_us"] = cold_graph_us(lambda w, algo=algo: lt(w, algo), copies[recipe],
                                                               args.screen_ms)
                    except RuntimeError as e:
                        entry["error"] = str(e)
                    row["candidates"].append((algo, entry))
                ranked = sorted((c for c in row["candidates"] if "screen_us" in c[1]), key=lambda c: c[1]["screen_us"])
                finalists = ranked[: args.finalists]
                first = row["candidates"][0] if row["candidates"] else None
                if first is not None and first not in finalists and "screen_us" in first[1]:
                    finalists.append(first)
                for algo, entry in finalists:
                    entry["us"] = cold_graph_us(lambda w, algo=algo: lt(w, algo), copies[recipe], args.timing_ms)
                best = min(finalists, key=lambda c: c[1]["us"]) if finalists else None
                bad = sum(1 for _, e in row["candidates"] if not isinstance(e.get("error"), float)
                          or e["error"] > args.max_error)
                row["candidates"] = [e for _, e in row["candidates"]]
                rows.append(row)
                torch_us = row["torch_us"]
                first_us = first[1].get("us") if first is not None else None
                best_us = best[1]["us"] if best else None
                row["best"] = best[1] if best else None
                print(f"{name:>12} {m:>4} {recipe:>6} | {_us(row['triton_us']):>10} {_us(torch_us):>6} "
                      f"{_us(first_us):>8} {_us(best_us):>7} "
                      f"{(torch_us / best_us if torch_us and best_us else 0):>7.2f} "
                      f"{(n * k / best_us / 1e6 if best_us else 0):>5.2f} | {len(candidates):>5} {bad:>3} | "
                      f"{best[0] if best else '-'}", flush=True)
        del copies
        torch.cuda.empty_cache()
    if args.table_out:
        table = cublaslt_table(rows, args.margin)
        with open(args.table_out, "w") as f:
            json.dump({"cublaslt_algos": table, "block_backends": block_backends(rows, args.margin)}, f, indent=1)
        print(f"wrote {args.table_out}: {sum(c is not None for r in table.values() for _, c in r)} products "
              f"on another algorithm")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(device), "torch": torch.__version__, "rows": rows}, f,
                      indent=1)
        print(f"wrote {args.out}")


def cublaslt_table(rows: list[dict], margin: float) -> dict:
    """kernels/fp8_gemm_dispatch.CUBLASLT_ALGOS' rows for the engine's cuBLASLt recipes: per product, recipe and
    measured M (an M between two takes the larger's row), the best candidate's configuration where it beat torch's
    call by `margin`, else None (torch's)."""
    table: dict[str, list] = {}
    for row in sorted(rows, key=lambda r: r["m"]):
        winner = _winner(row, margin)
        table.setdefault(f"{row['recipe']} {row['n']}x{row['k']}", []).append(
            [row["m"], winner["table_entry"] if winner else None])
    return table


def _winner(row: dict, margin: float) -> dict | None:
    """The best candidate where it beat torch's call by `margin` (the table names it), else None."""
    best, torch_us = row.get("best"), row.get("torch_us")
    return best if best is not None and (torch_us is None or torch_us >= margin * best["us"]) else None


def block_backends(rows: list[dict], margin: float) -> dict:
    """BLOCK_TABLE's rows for the measured block products: at each measured M the block recipe on cuBLASLt (on the
    algorithm cublaslt_table names, else torch's) where it beat the Triton kernel, else Triton; past the last,
    cuBLASLt (prefill's M, where it won by 1.6-1.7x: bench/RESULTS.md, 2026-12-05)."""
    from kernels.fp8_gemm_dispatch import ANY_M

    table: dict[str, list] = {}
    for row in sorted((r for r in rows if r["recipe"] == "block"), key=lambda r: r["m"]):
        winner = _winner(row, margin)
        us = winner["us"] if winner else row.get("torch_us")
        cublaslt = us is not None and us < row["triton_us"]
        table.setdefault(f"{row['n']}x{row['k']}", []).append([row["m"], "block_scaled_mm" if cublaslt else "triton"])
    for shape_rows in table.values():
        shape_rows.append([ANY_M, "block_scaled_mm"])
    return table


def _us(us) -> str:
    return f"{us:.1f}" if us else "-"


if __name__ == "__main__":
    main()
