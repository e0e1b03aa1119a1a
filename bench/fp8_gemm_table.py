"""The FP8 GEMM table of bench/kernels.py --fp8-gemm: each Linear GEMM of the Qwen3-8B shape at M = 1, 16,
64, 256 and 4,096 tokens, bf16 (F.linear) against the FP8 GEMMs of kernels/fp8_gemm.py: torch._scaled_mm
(row-wise, and tensor-wise on unit scales then scaled) and Triton with channel scales, Triton with 128 x 128
block scales (1 x 128 activation groups), each timed on pre-quantized activations (the GEMM alone), and the
engine's whole FP8 product (activation quantization + the GEMM kernels/fp8_gemm_dispatch.py picks), each a CUDA
graph of calls over copies of W larger than L2 (cold_graph_us). TFLOP/s count 2MNK; TB/s count the operands
read and the output written once (x, W, y, and the scales).

It ends with the dispatch table the measurement implies (the faster channel GEMM per shape and M), in the
form of kernels/fp8_gemm_dispatch.TABLE, and with the fused producers' table: the RMSNorm (with the residual add)
and SiLU-and-mul that write FP8 activations (kernels/fp8_fused_quant.py) against the plain kernel followed by
the quantization kernel, graph-replayed as decode runs them, for both scale layouts.

`--fp8-gemm-sweep` first times the Triton kernel's tiles (SWEEP_TILES) on every GEMM and M, each checked against
the default tiles' output, and takes the fastest per shape and M, and then the faster of it and `_scaled_mm`:
the rows of kernels/fp8_gemm_dispatch.TILES and TABLE, applied at once to the table that follows and written as
JSON for NANOSERVE_FP8_GEMM_TABLE (`--fp8-gemm-table-out`).
"""
from __future__ import annotations

import json
import sys

# (name, N, K) of Qwen3-8B: hidden 4096, 32 q and 8 KV heads of 128, intermediate 12288
QWEN3_8B_GEMMS = [("qkv_proj", 6144, 4096), ("o_proj", 4096, 4096), ("gate_up_proj", 24576, 4096),
                  ("down_proj", 4096, 12288)]
TOKENS = [1, 16, 64, 256, 4096]
L2_BYTES = 50 * 2**20  # the H200's L2


def study_gpu():
    """(the CUDA device, a generator on it seeded 0) for a study of the 8B shape's GEMMs; exits saying so where no GPU
    is."""
    import torch

    if not torch.cuda.is_available():
        sys.exit("the study needs a CUDA GPU")
    device = torch.device("cuda", torch.cuda.current_device())
    return device, torch.Generator(device=device).manual_seed(0)


def weight_copies(w) -> list:
    """w and enough clones of it that a call through each in turn finds its copy long gone from L2 (decode reads
    each layer's weights once a step)."""
    copies = max(2, -(-4 * L2_BYTES // (w.numel() * w.element_size())))
    return [w] + [w.clone() for _ in range(copies - 1)]


def cold_graph_us(fn, weights: list, timing_ms: int = 10) -> float:
    """Microseconds a call of fn(w) as decode runs it: one call per copy of the weight captured in one CUDA graph
    (no launch gaps between a product's kernels), its replays timed by do_bench (which also flushes L2 before each),
    the median over the number of calls."""
    import torch
    import triton

    calls = [lambda w=w: fn(w) for w in weights]
    for call in calls:  # compiles, allocates the split-K counters, warms cuBLASLt: all before capture
        call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    ms = triton.testing.do_bench(graph.replay, warmup=timing_ms // 4 or 1, rep=timing_ms, return_mode="median")
    del graph
    return ms * 1e3 / len(calls)


def block_checkpoint_weight(w):
    """w as a fine-grained FP8 checkpoint holds it (128 x 128 blocks) and the loader lays it out: (fp8 w, the block
    scales repeated over their rows, how many aligned rows share them: kernels/fp8_quant.rows_sharing_scales)."""
    from kernels.fp8_quant import quantize_blocks_on_rows, rows_sharing_scales

    wq, scale = quantize_blocks_on_rows(w)
    return wq, scale, rows_sharing_scales(scale)


def fp8_gemm_rows(device) -> list[dict]:
    import torch
    import torch.nn.functional as F

    from kernels import fp8_gemm
    from kernels.fp8_gemm_dispatch import choose_gemm
    from kernels.fp8_quant import quantize_rows_ref

    gen = torch.Generator(device=device).manual_seed(0)
    rows = []
    for name, n, k in QWEN3_8B_GEMMS:
        w = torch.randn(n, k, generator=gen, device=device, dtype=torch.bfloat16) / k**0.5
        w_ch, s_ch = quantize_rows_ref(w, k)
        w_bl, s_bl, shared = block_checkpoint_weight(w)
        w16s, chs, bls = weight_copies(w), weight_copies(w_ch), weight_copies(w_bl)
        for m in TOKENS:
            x = torch.randn(m, k, generator=gen, device=device, dtype=torch.bfloat16)
            a_ch, as_ch = fp8_gemm.quantize_rows(x, k)
            a_bl, as_bl = fp8_gemm.quantize_rows(x, 128)
            us = {
                "bf16": cold_graph_us(lambda w: F.linear(x, w), w16s),
                "scaled_mm": cold_graph_us(lambda w: fp8_gemm.scaled_mm_fp8_gemm(a_ch, as_ch, w, s_ch, torch.bfloat16),
                                           chs),
                "unit_scaled_mm": cold_graph_us(
                    lambda w: fp8_gemm.unit_scaled_mm_fp8_gemm(a_ch, as_ch, w, s_ch, torch.bfloat16), chs),
                "triton_channel": cold_graph_us(
                    lambda w: fp8_gemm.triton_fp8_gemm(a_ch, as_ch, w, s_ch, k, torch.bfloat16), chs),
                "triton_block": cold_graph_us(
                    lambda w: fp8_gemm.triton_fp8_gemm(a_bl, as_bl, w, s_bl, 128, torch.bfloat16,
                                                       rows_sharing_scales=shared), bls),
                "act_quant": cold_graph_us(lambda w: fp8_gemm.quantize_rows(x, k), [None]),
                "engine_channel": cold_graph_us(lambda w: fp8_gemm.fp8_linear(x, w, s_ch, k), chs),
                "engine_block": cold_graph_us(lambda w: fp8_gemm.fp8_linear(x, w, s_bl, 128, rows_sharing_scales=shared),
                                              bls),
            }
            flops = 2 * m * n * k
            bf16_bytes = 2 * (m * k + n * k + m * n)
            fp8_bytes = m * k + n * k + 2 * m * n + 4 * (m + n)
            row = {"gemm": name, "m": m, "n": n, "k": k, "us": us,
                   "tflops": {key: flops / t / 1e6 for key, t in us.items() if key != "act_quant"},
                   "tb_per_s": {key: (bf16_bytes if key == "bf16" else fp8_bytes) / t / 1e6
                                for key, t in us.items() if key != "act_quant"},
                   "channel_backend": choose_gemm("channel", m, n, k)[0]}
            rows.append(row)
        del w16s, chs, bls
        torch.cuda.empty_cache()
    return rows


def print_fp8_gemm_table(rows: list[dict]) -> None:
    print("\nFP8 GEMMs of the Qwen3-8B shape: us (TFLOP/s | TB/s), each a CUDA graph of calls over copies of W "
          "larger than L2; speedup = bf16 / engine FP8 product")
    keys = ["bf16", "scaled_mm", "unit_scaled_mm", "triton_channel", "triton_block", "engine_channel", "engine_block"]
    print(f"{'gemm':>12} {'M':>5} " + " ".join(f"{k:>24}" for k in keys) + f" {'quant us':>8} {'x ch':>5} {'x bl':>5}")
    for r in rows:
        cells = " ".join(f"{r['us'][k]:>7.1f} ({r['tflops'][k]:>5.0f}|{r['tb_per_s'][k]:>4.2f})".rjust(24) for k in keys)
        print(f"{r['gemm']:>12} {r['m']:>5} {cells} {r['us']['act_quant']:>8.1f} "
              f"{r['us']['bf16'] / r['us']['engine_channel']:>5.2f} {r['us']['bf16'] / r['us']['engine_block']:>5.2f}")
    print("\nthe fastest channel GEMM per shape (kernels/fp8_gemm_dispatch.TABLE):")
    table: dict = {}
    for r in rows:
        best = min(("scaled_mm", "unit_scaled_mm", "triton_channel"), key=r["us"].get).removesuffix("_channel")
        table.setdefault((r["n"], r["k"]), []).append((r["m"], best))
    for shape, entries in table.items():
        print(f"    {shape}: {entries},")


# The Triton kernel's tiles tried per M, (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages[, SPLIT_K]): at small M
# narrow N tiles, deep pipelines and split K (more programs and more bytes in flight for a weight-bound product), at
# large M wide ones. Block weights need BLOCK_K = 128 (one scale a K tile). Each list serves M up to its key; its
# first tiles are the kernel's own rule there.
SWEEP_TILES = {
    "channel": {
        16: [(16, 64, 128, 4, 4), (16, 16, 128, 2, 6), (16, 32, 128, 4, 6), (16, 32, 256, 4, 4), (16, 64, 256, 4, 4),
            (16, 128, 128, 4, 4), (16, 64, 128, 4, 4, 2), (16, 64, 128, 4, 4, 4), (16, 64, 128, 4, 4, 8),
            (16, 128, 128, 4, 4, 4), (16, 32, 128, 4, 4, 4)],
        64: [(64, 64, 128, 4, 4), (64, 32, 128, 4, 4), (64, 64, 256, 4, 3), (64, 128, 128, 4, 4), (32, 64, 128, 4, 4),
             (64, 64, 128, 4, 4, 2), (64, 128, 128, 4, 4, 4), (32, 64, 128, 4, 4, 4)],
        128: [(128, 128, 128, 8, 3), (64, 128, 128, 4, 4), (64, 64, 128, 4, 4), (128, 64, 128, 4, 4),
              (64, 256, 128, 4, 3), (64, 128, 128, 4, 4, 2), (128, 128, 128, 8, 3, 2), (64, 64, 128, 4, 4, 4)],
        256: [(128, 128, 128, 8, 3), (64, 128, 128, 4, 4), (128, 64, 128, 4, 4), (128, 256, 128, 8, 3),
              (64, 256, 128, 4, 3), (128, 128, 256, 8, 3), (128, 128, 128, 8, 3, 2), (128, 128, 128, 8, 3, 4),
              (64, 128, 128, 4, 4, 2)],
        4096: [(128, 128, 128, 8, 3), (128, 256, 128, 8, 3), (128, 128, 256, 8, 3)],
    },
    "block": {
        16: [(16, 64, 128, 4, 4), (16, 32, 128, 4, 6), (16, 128, 128, 4, 4), (16, 16, 128, 2, 6),
             (16, 64, 128, 4, 4, 2), (16, 64, 128, 4, 4, 4), (16, 128, 128, 4, 4, 4)],
        64: [(64, 64, 128, 4, 4), (64, 32, 128, 4, 4), (64, 128, 128, 4, 4), (32, 64, 128, 4, 4),
             (64, 64, 128, 4, 4, 2), (64, 128, 128, 4, 4, 4)],
        128: [(128, 128, 128, 8, 3), (64, 128, 128, 4, 3), (64, 64, 128, 4, 4), (64, 128, 128, 4, 4, 2),
              (128, 128, 128, 8, 3, 2)],
        256: [(128, 128, 128, 8, 3), (64, 128, 128, 4, 3), (64, 64, 128, 4, 4), (128, 64, 128, 4, 4),
              (128, 128, 128, 8, 3, 2), (64, 128, 128, 4, 4, 2)],
        4096: [(128, 128, 128, 8, 3), (64, 128, 128, 4, 3), (128, 256, 128, 8, 3)],
    },
}


# the products whose one reader applies the tensor-wise GEMM's scales as it reads them (SiLU-and-mul, the norms after
# o_proj and down_proj, at tensor-parallel size 1; kernels/fp8_quant.UnscaledProduct): the sweep times that GEMM
# without its scale pass there, as the engine runs it
SCALED_BY_READER = {"o_proj", "gate_up_proj", "down_proj"}


# decode batches fall evenly over 1-256 on nano-vLLM's workload (outputs uniform in [100, 1024]); from 129 to 256 in
# steps of 16-32, since cuBLASLt's FP8 GEMM is slower at some of those M than at 256 (gate_up_proj on the H200: 74 us
# at 144, 48 at 256) and the dispatch then pads (choose_backends)
SWEEP_TOKENS = [1, 16, 64, 128, 144, 160, 192, 224, 256, 4096]


def _sweep_tiles(scheme: str, m: int) -> list:
    return SWEEP_TILES[scheme][min((t for t in SWEEP_TILES[scheme] if t >= m), default=max(SWEEP_TILES[scheme]))]


def fp8_gemm_sweep(device, tokens: list[int] | None = None) -> dict:
    """Each Triton tile of SWEEP_TILES on each Qwen3-8B GEMM and M (scheme, channel or block), and _scaled_mm's two
    GEMMs: microseconds (cold_graph_us: graph-replayed as decode runs them, W cold in L2), the fastest tiles and
    backend per shape and M. A tile whose output is
    off the default tiles' by more than 1% of max |y| is dropped (and reported). tokens: the Ms, else SWEEP_TOKENS."""
    import torch

    from kernels import fp8_gemm
    from kernels.fp8_quant import block_scales_of, quantize_rows_ref

    gen = torch.Generator(device=device).manual_seed(1)
    rows, tiles = [], {}
    for name, n, k in QWEN3_8B_GEMMS:
        w = torch.randn(n, k, generator=gen, device=device, dtype=torch.bfloat16) / k**0.5
        for scheme, group in (("channel", k), ("block", 128)):
            wq, ws, shared = block_checkpoint_weight(w) if scheme == "block" else (*quantize_rows_ref(w, k), 1)
            wqs = weight_copies(wq)
            for m in tokens or SWEEP_TOKENS:
                x = torch.randn(m, k, generator=gen, device=device, dtype=torch.bfloat16)
                a, a_s = fp8_gemm.quantize_rows(x, group)
                ref = None
                timed = {}
                for cfg in _sweep_tiles(scheme, m):
                    out = fp8_gemm.triton_fp8_gemm(a, a_s, wq, ws, group, torch.bfloat16, tiles=cfg,
                                                   rows_sharing_scales=shared)
                    ref = out.float() if ref is None else ref
                    err = (out.float() - ref).abs().max().item() / ref.abs().max().item()
                    if err > 1e-2:
                        print(f"  {name} {scheme} M={m} tiles {cfg}: off by {err:.2e} of max |y|, dropped")
                        continue
                    timed[cfg] = cold_graph_us(lambda w: fp8_gemm.triton_fp8_gemm(
                        a, a_s, w, ws, group, torch.bfloat16, tiles=cfg, rows_sharing_scales=shared), wqs)
                best = min(timed, key=timed.get)
                row = {"gemm": name, "scheme": scheme, "m": m, "n": n, "k": k,
                       "us": {",".join(map(str, c)): t for c, t in timed.items()}, "best": list(best),
                       "best_us": timed[best], "default_us": timed.get(_sweep_tiles(scheme, m)[0])}
                tiles.setdefault(f"{scheme} {n}x{k}", []).append([m, list(best)])
                if scheme == "block":  # torch's block recipe on the checkpoint's whole blocks, its activations'
                    blocks = block_scales_of(ws, 128, shared)  # scales M-major as the engine's producers write them
                    a_mm, as_mm = fp8_gemm.quantize_rows(x, 128, m_major=True)
                    row["block_scaled_mm_us"] = cold_graph_us(
                        lambda w: fp8_gemm.block_scaled_mm_fp8_gemm(a_mm, as_mm, w, blocks, torch.bfloat16), wqs)
                if scheme == "channel":
                    row["scaled_mm_us"] = cold_graph_us(
                        lambda w: fp8_gemm.scaled_mm_fp8_gemm(a, a_s, w, ws, torch.bfloat16), wqs)
                    if name in SCALED_BY_READER:  # the engine leaves the scales to the reader: the product alone
                        row["unit_scaled_mm_us"] = cold_graph_us(
                            lambda w: fp8_gemm.unit_scaled_product(a, w, torch.bfloat16), wqs)
                    else:
                        row["unit_scaled_mm_us"] = cold_graph_us(
                            lambda w: fp8_gemm.unit_scaled_mm_fp8_gemm(a, a_s, w, ws, torch.bfloat16), wqs)
                rows.append(row)
            del wqs
            torch.cuda.empty_cache()
    return {"rows": rows, "table": {"backends": choose_backends(rows), "tiles": tiles,
                                    "block_backends": choose_backends(rows, "block")}}


PAD_GAIN = 0.95  # padding to more rows must beat the product on M rows by 5%: beyond do_bench's noise, and an
# activation tensor without spare rows (kernels/fp8_quant.empty_quantized) pays a copy


def choose_backends(rows: list[dict], scheme: str = "channel") -> dict:
    """Per shape of `scheme` and swept M, the fastest of: [M, "triton"]; [M, B] or [M, B, P] for each cuBLASLt GEMM B
    (channel: _scaled_mm's "scaled_mm", row-wise, and "unit_scaled_mm", tensor-wise then scaled; block: torch's
    block recipe, "block_scaled_mm"), P where B measured faster on P rows (a swept M up to 2M) than on M, by
    PAD_GAIN: the product then runs on P rows."""
    cublas = ("scaled_mm", "unit_scaled_mm") if scheme == "channel" else ("block_scaled_mm",)
    timed: dict[str, dict[str, dict[int, float]]] = {}
    for r in rows:
        if r["scheme"] == scheme:
            shape = timed.setdefault(f"{r['n']}x{r['k']}", {})
            shape.setdefault("triton", {})[r["m"]] = r["best_us"]
            for backend in cublas:
                if f"{backend}_us" in r:
                    shape.setdefault(backend, {})[r["m"]] = r[f"{backend}_us"]
    backends = {}
    for shape, by_backend in timed.items():
        entries = []
        for m in sorted(by_backend["triton"]):
            choices = [(by_backend["triton"][m], [m, "triton"])]
            for backend in cublas:
                by_m = by_backend.get(backend, {})
                if m not in by_m:
                    continue
                pad = min((p for p in by_m if m < p <= 2 * m), key=by_m.get, default=m)
                if by_m[pad] > PAD_GAIN * by_m[m]:
                    pad = m
                choices.append((by_m[pad], [m, backend] + ([pad] if pad != m else [])))
            entries.append(min(choices, key=lambda c: c[0])[1])
        backends[shape] = entries
    return backends


def print_fp8_gemm_sweep(sweep: dict) -> None:
    print("\nFP8 GEMM tile sweep (us, graph-replayed over copies of W, L2 cold): the default tiles, the fastest, "
          "_scaled_mm row-wise (block weights: torch's block recipe) and tensor-wise on unit scales (then scaled, but for "
          f"{', '.join(sorted(SCALED_BY_READER))}, whose readers scale them)")
    print(f"{'gemm':>12} {'scheme':>7} {'M':>5} {'default':>8} {'best':>8} {'tiles':>24} {'scaled_mm':>9} "
          f"{'unit':>9}")
    for r in sweep["rows"]:
        default = f"{r['default_us']:.1f}" if r["default_us"] is not None else "-"
        scaled = f"{r['scaled_mm_us']:.1f}" if "scaled_mm_us" in r else ""
        unit = f"{r['unit_scaled_mm_us']:.1f}" if "unit_scaled_mm_us" in r else ""
        if "block_scaled_mm_us" in r:  # the block recipe, in the row-wise column
            scaled = f"{r['block_scaled_mm_us']:.1f}"
        print(f"{r['gemm']:>12} {r['scheme']:>7} {r['m']:>5} {default:>8} {r['best_us']:>8.1f} "
              f"{str(tuple(r['best'])):>24} {scaled:>9} {unit:>9}")
    print("\nkernels/fp8_gemm_dispatch.TABLE (channel backends), BLOCK_TABLE and TILES, as measured:")
    for part in ("backends", "block_backends"):
        for key, entries in sweep["table"].get(part, {}).items():
            n, k = key.split("x")
            print(f"    {'block ' if part == 'block_backends' else ''}({n}, {k}): {[tuple(e) for e in entries]},")
    for key, entries in sweep["table"]["tiles"].items():
        scheme, shape = key.split()
        n, k = shape.split("x")
        print(f"    (\"{scheme}\", {n}, {k}): {[(m, tuple(t)) for m, t in entries]},")


def merge_tables(base: dict, new: dict) -> dict:
    """An earlier sweep's table with a newer one's rows joined in, per shape, in increasing M; where both measured
    an M, the newer row wins. Both are {"backends": {key: [[M, value, ...], ...]}, "tiles": {...}}."""
    merged = {}
    for part in ("backends", "tiles", "block_backends"):
        merged[part] = {}
        for key in base.get(part, {}).keys() | new.get(part, {}).keys():
            rows = {int(m): rest for m, *rest in base.get(part, {}).get(key, [])}
            rows.update({int(m): rest for m, *rest in new.get(part, {}).get(key, [])})
            merged[part][key] = [[m, *rows[m]] for m in sorted(rows)]
    return merged


def apply_and_write_sweep(sweep: dict, path: str | None, base_path: str | None = None) -> None:
    """Put the sweep's rows (joined to those of the JSON at `base_path`, if given) into kernels/fp8_gemm_dispatch
    (this process) and, with `path`, write them as the JSON that NANOSERVE_FP8_GEMM_TABLE reads."""
    from kernels import fp8_gemm_dispatch

    table = sweep["table"]
    if base_path:
        with open(base_path) as f:
            table = merge_tables(json.load(f), table)
    fp8_gemm_dispatch.apply_table(table)
    if path:
        with open(path, "w") as f:
            json.dump(table, f, indent=2)


# the producers of a Qwen3-8B layer's FP8 GEMM inputs: hidden 4096 (the norms), intermediate 12288 (SiLU-and-mul)
PRODUCER_SHAPES = {"hidden": 4096, "intermediate": 12288}


def fused_producer_rows(time_us, device) -> list[dict]:
    """Per M and scale layout: the fused RMSNorm + residual add and SiLU-and-mul that write FP8, against the plain
    kernel then the quantization kernel; time_us(fn) graph-replays fn (no launch overhead, as in decode)."""
    import torch

    from kernels import fp8_fused_quant, fp8_gemm, fused_ops

    gen = torch.Generator(device=device).manual_seed(2)
    hidden, inter = PRODUCER_SHAPES["hidden"], PRODUCER_SHAPES["intermediate"]
    weight = torch.randn(hidden, generator=gen, device=device, dtype=torch.bfloat16)
    rows = []
    for m in TOKENS:
        x, residual = (torch.randn(m, hidden, generator=gen, device=device, dtype=torch.bfloat16) for _ in range(2))
        gate_up = torch.randn(m, 2 * inter, generator=gen, device=device, dtype=torch.bfloat16)
        for layout, norm_group, act_group in (("channel", hidden, inter), ("block", 128, 128)):
            us = {
                "norm_plain": time_us(lambda: fused_ops.rms_norm(x, weight, 1e-6, residual)),
                "norm_then_quant": time_us(lambda: fp8_gemm.quantize_rows(
                    fused_ops.rms_norm(x, weight, 1e-6, residual)[0], norm_group)),
                "norm_fused": time_us(lambda: fp8_fused_quant.rms_norm_quant(x, weight, 1e-6, norm_group, residual)),
                "silu_plain": time_us(lambda: fused_ops.silu_and_mul(gate_up)),
                "silu_then_quant": time_us(lambda: fp8_gemm.quantize_rows(fused_ops.silu_and_mul(gate_up), act_group)),
                "silu_fused": time_us(lambda: fp8_fused_quant.silu_and_mul_quant(gate_up, act_group)),
            }
            rows.append({"m": m, "layout": layout, "us": us})
    return rows


def print_fused_producer_table(rows: list[dict]) -> None:
    print(f"\nFP8 activations written by their producers (graph-replayed us; hidden {PRODUCER_SHAPES['hidden']}, "
          f"intermediate {PRODUCER_SHAPES['intermediate']}): plain kernel, plain + quantization, fused")
    print(f"{'M':>5} {'layout':>8} {'norm':>7} {'+quant':>7} {'fused':>7} {'saved':>6} "
          f"{'silu':>7} {'+quant':>7} {'fused':>7} {'saved':>6}")
    for r in rows:
        u = r["us"]
        print(f"{r['m']:>5} {r['layout']:>8} {u['norm_plain']:>7.1f} {u['norm_then_quant']:>7.1f} "
              f"{u['norm_fused']:>7.1f} "
              f"{u['norm_then_quant'] - u['norm_fused']:>6.1f} {u['silu_plain']:>7.1f} {u['silu_then_quant']:>7.1f} "
              f"{u['silu_fused']:>7.1f} {u['silu_then_quant'] - u['silu_fused']:>6.1f}")
