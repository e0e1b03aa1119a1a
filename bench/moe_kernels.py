"""The fused MoE layer (kernels/fused_moe.py) at Qwen3-30B-A3B's layer shape: 128 experts, top-8 (renormalised),
hidden 2048, moe_intermediate 768, bf16. Run through bench/kernels.py (--moe, --moe-sweep).

Decode is scored against the bandwidth roofline: the bytes of every expert the step's tokens route to
(gate, up and down weights) plus the activations, over 4.26 TB/s; a 2k-token prefill against the bf16
tensor-core roofline, 2 * T * k * 3 * I * H FLOP over ~790 TFLOP/s. Decode is timed as the server runs
it, replayed in a CUDA graph; prefill eagerly. The eager per-expert torch loop (HF's algorithm, what the
CPU path runs) is timed beside it, and its output is the correctness check.

The sweep times each GEMM alone for every tile candidate at token counts from 1 to 16k, at the full shape
and at the expert slice -tp 2 leaves each rank (inter 384), and prints the best as rows for
kernels/fused_moe.MOE_TILES (and writes them as JSON for NANOSERVE_MOE_TILES). A row's two tiles share their
M tile (the pair with the least summed time among those that do), so that the pairs are grouped once a layer.
"""
from __future__ import annotations

HBM_TB_S, BF16_TFLOP_S = 4.26, 790.0
SHAPE = {"experts": 128, "hidden": 2048, "inter": 768, "top_k": 8}
SWEEP_SHAPES = [SHAPE, {**SHAPE, "inter": 384}]  # one rank's slice at -tp 2 too
TINY_SHAPE = {"experts": 8, "hidden": 64, "inter": 32, "top_k": 2}
LAYER_TOKENS = [1, 16, 64, 256, 2048]
SWEEP_TOKENS = [1, 16, 64, 128, 256, 512, 2048, 16384]
# (block_m, block_n, block_k, warps, stages[, group_m]), per M tile: a row's two GEMMs share it. Each fits sm_90's
# 227 KB of shared memory (compiled offline with bench/studies/kernel_sass.py's compile_sm90: gate/up holds two
# weight tiles a stage, down one). The 42a6317 sweep's winners are all here; the down GEMM, whose K (the expert's
# intermediate size, 768 or 384) is three to six 128-wide steps, gets wider N and K tiles and more warps; prefill
# tiles (M 64, 128) also come with group_m 8: the N tiles of 8 M tiles together, as a 16k-token step's gathered
# activations (64 MB, 200 MB as h) outgrow the L2 and M-fastest programs would read them once per N tile.
UP_CANDIDATES = [
    (16, 32, 128, 4, 4), (16, 64, 128, 4, 4), (16, 128, 128, 4, 3),
    (32, 64, 128, 4, 4), (32, 128, 128, 8, 3),
    (64, 64, 64, 4, 4), (64, 128, 64, 8, 4, 8),
    (128, 128, 64, 8, 3), (128, 128, 64, 8, 3, 8),
]
DOWN_CANDIDATES = [
    (16, 32, 128, 4, 4), (16, 64, 128, 4, 4), (16, 128, 128, 4, 3), (16, 128, 128, 8, 3), (16, 128, 256, 4, 3),
    (16, 256, 128, 8, 3), (16, 64, 256, 4, 3),
    (32, 128, 128, 4, 3), (32, 128, 128, 8, 4), (32, 128, 256, 8, 3), (32, 256, 128, 8, 3), (32, 64, 256, 4, 3),
    (64, 128, 64, 8, 4), (64, 128, 64, 8, 4, 8), (64, 128, 128, 8, 3),
    (128, 256, 64, 8, 3), (128, 256, 64, 8, 3, 8), (128, 128, 64, 8, 3, 8),
]


def _inputs(torch, device, shape: dict, num_tokens: int, seed: int):
    gen = torch.Generator(device=device).manual_seed(seed)
    e, h, i = shape["experts"], shape["hidden"], shape["inter"]
    dtype = torch.bfloat16

    def randn(*s, scale=1.0):
        return (torch.randn(*s, generator=gen, device=device) * scale).to(dtype)

    x = randn(num_tokens, h)
    router = randn(e, h, scale=h ** -0.5)
    return x, router, randn(e, 2 * i, h, scale=h ** -0.5), randn(e, h, i, scale=i ** -0.5)


def layer_table(bench, tiny: bool) -> list[dict]:
    """The layer at decode batch 1, 16, 64, 256 (graph replay) and a 2k-token prefill."""
    from kernels import fused_moe as fm
    from kernels import moe_reference

    torch = bench.torch
    shape = TINY_SHAPE if tiny else SHAPE
    e, h, i, k = shape["experts"], shape["hidden"], shape["inter"], shape["top_k"]
    tokens = [1, 3] if tiny else LAYER_TOKENS
    cuda = bench.device.type == "cuda"
    print(f"\nfused MoE layer: {e} experts top-{k}, hidden {h}, inter {i}, bf16 "
          f"(roofline {HBM_TB_S} TB/s, {BF16_TFLOP_S:.0f} TFLOP/s)")
    print(f"{'T':>6} {'experts':>7} {'tiles (up; down)':>34} {'us':>8} {'TB/s':>6} {'TFLOP/s':>8} {'% roof':>6}"
          f" {'torch us':>9} {'x torch':>7} {'rel err':>8} {'group us':>8} {'apart us':>8}")
    rows = []
    for num_tokens in tokens:
        x, router, w13, w2 = _inputs(torch, bench.device, shape, num_tokens, seed=num_tokens)
        logits = x @ router.t()
        run = lambda: fm.fused_moe(x, logits, w13, w2, k, True)  # noqa: E731
        _, ids = fm.route(logits, k, True)
        hit = int(ids.unique().numel())
        nbytes = hit * 3 * i * h * 2 + 2 * num_tokens * h * 2 + e * h * 2
        flops = 2 * num_tokens * k * 3 * i * h
        us = bench.time_us(run, graph=cuda and num_tokens <= 256)
        ref_fn = lambda: moe_reference.fused_moe_ref(x, logits, w13, w2, k, True)  # noqa: E731
        ref = ref_fn().float()
        err = ((run().float() - ref).norm() / ref.norm()).item()
        torch_us = bench.time_us(ref_fn)
        roof_us = max(nbytes / HBM_TB_S / 1e6, flops / BF16_TFLOP_S / 1e6)
        up, down = fm.tiles_for(num_tokens, e, h, i, k)
        group_us, apart_us = (
            bench.time_us(lambda: grouping(fm, logits, k, up.block_m, fused), graph=cuda)  # noqa: B023
            for fused in (True, False))
        row = {"tokens": num_tokens, "experts_hit": hit, "bytes": nbytes, "flops": flops, "us": us,
               "tb_per_s": nbytes / us / 1e6, "tflop_per_s": flops / us / 1e6, "roofline_fraction": roof_us / us,
               "torch_us": torch_us, "speedup_vs_torch": torch_us / us, "rel_err_vs_torch": err,
               "tiles": [list(vars(up).values()), list(vars(down).values())],
               "route_and_group_us": group_us, "route_and_group_apart_us": apart_us}
        rows.append(row)
        tiles = f"{tuple(row['tiles'][0])}; {tuple(row['tiles'][1])}"
        print(f"{num_tokens:>6} {hit:>7} {tiles:>34} {us:>8.1f} {row['tb_per_s']:>6.2f} {row['tflop_per_s']:>8.1f}"
              f" {100 * row['roofline_fraction']:>5.0f}% {torch_us:>9.1f} {row['speedup_vs_torch']:>7.1f} {err:>8.1e}"
              f" {group_us:>8.1f} {apart_us:>8.1f}")
    print("group us: routing and grouping as fused_moe runs them (route_and_group); apart us: the same as four "
          "launches after route (the counts' fill, a count, a plan and a scatter kernel), as at 42a6317 less its "
          "fill of the padding ids")
    return rows


def grouping(fm, logits, top_k: int, block_m: int, fused: bool):
    """Routing and grouping as the layer runs them (fused), or with a kernel per step (apart)."""
    if fused:
        return fm.route_and_group(logits, top_k, True, block_m)
    _, ids = fm.route(logits, top_k, True)
    threshold, fm.SINGLE_PROGRAM_PAIRS = fm.SINGLE_PROGRAM_PAIRS, -1
    try:
        return fm.group_by_expert(ids, logits.shape[1], block_m)
    finally:
        fm.SINGLE_PROGRAM_PAIRS = threshold


def tile_sweep(bench, tiny: bool, inters: list[int] | None = None) -> dict:
    """Each GEMM alone, every candidate tile, at token counts from 1 to 16k: the best pair per count, for each
    shape of SWEEP_SHAPES (or those of these intermediate sizes). The rows go into this process's MOE_TILES (the
    layer table then runs on them) and, as apply_tiles' JSON, into the result's "tiles"."""
    from kernels import fused_moe as fm

    shapes = [TINY_SHAPE] if tiny else [s for s in SWEEP_SHAPES if not inters or s["inter"] in inters]
    sweeps, tiles = [], {}
    for shape in shapes:
        sweeps.append(shape_sweep(bench, tiny, shape))
        key = (shape["experts"], shape["hidden"], shape["inter"], shape["top_k"])
        tiles.update(fm.tiles_json(key, [(r["tokens"], fm.MoeTile(*r["up"][0]), fm.MoeTile(*r["down"][0]))
                                         for r in sweeps[-1]["rows"]]))
    fm.apply_tiles(tiles)
    return {"shapes": sweeps, "tiles": tiles}


def best_pair(results: dict) -> tuple[tuple, tuple]:
    """((us, tile) for gate/up, (us, tile) for down) with one M tile, least summed time."""
    pairs = []
    for block_m in {t.block_m for _, t in results["up"]}:
        up = min((r for r in results["up"] if r[1].block_m == block_m), key=lambda r: r[0])
        down = [r for r in results["down"] if r[1].block_m == block_m]
        if down:
            pairs.append((up, min(down, key=lambda r: r[0])))
    return min(pairs, key=lambda p: p[0][0] + p[1][0])


def shape_sweep(bench, tiny: bool, shape: dict) -> dict:
    import triton

    from kernels import fused_moe as fm

    torch = bench.torch
    e, h, i, k = shape["experts"], shape["hidden"], shape["inter"], shape["top_k"]
    tokens = [1, 5] if tiny else SWEEP_TOKENS
    tiny_tile = [fm.MoeTile(16, 16, 16, 1, 1)]
    candidates = {"up": tiny_tile if tiny else [fm.MoeTile(*c) for c in UP_CANDIDATES],
                  "down": tiny_tile if tiny else [fm.MoeTile(*c) for c in DOWN_CANDIDATES]}
    x_all, router_w, w13, w2 = _inputs(torch, bench.device, shape, max(tokens), seed=99)

    def timed(fn) -> float:
        if bench.device.type != "cuda":
            return bench.time_us(fn)
        return triton.testing.do_bench(fn, warmup=5, rep=10, return_mode="median") * 1e3

    best, table = {}, []
    print(f"\nMoE tile sweep, {e} experts top-{k}, hidden {h}, inter {i} ({len(candidates['up'])} gate/up and "
          f"{len(candidates['down'])} down candidates): best us per token count, both with one M tile")
    print(f"{'T':>6} {'gate/up tile':>24} {'us':>8} {'down tile':>24} {'us':>8} {'best down, any M tile':>24}"
          f" {'us':>8}")
    for num_tokens in tokens:
        x = x_all[:num_tokens].contiguous()
        weights, ids = fm.route(x @ router_w.t(), k, True)
        h_act = torch.randn(num_tokens * k, i, device=bench.device).to(torch.bfloat16)
        groups_by_m = {}
        results = {"up": [], "down": []}
        for kind, tiles in candidates.items():
            for tile in tiles:
                if tile.block_m not in groups_by_m:
                    groups_by_m[tile.block_m] = fm.group_by_expert(ids, e, tile.block_m)
                groups = groups_by_m[tile.block_m]
                fn = ((lambda: fm.gate_up_silu(x, w13, groups, k, tile)) if kind == "up"  # noqa: B023
                      else (lambda: fm.down_weighted(h_act, w2, weights.view(-1), groups, tile)))  # noqa: B023
                try:
                    results[kind].append((timed(fn), tile))
                except Exception as exc:  # a tile over the shared-memory or register limit
                    results[kind].append((float("inf"), tile))
                    print(f"  skipped {kind} {tile}: {type(exc).__name__}")
        (up_us, up_tile), (down_us, down_tile) = best_pair(results)
        any_us, any_down = min(results["down"], key=lambda r: r[0])
        best[num_tokens] = (up_tile, down_tile)
        table.append({"tokens": num_tokens, "up": [list(vars(up_tile).values()), up_us],
                      "down": [list(vars(down_tile).values()), down_us],
                      "all_up": [[list(vars(t).values()), us] for us, t in results["up"]],
                      "all_down": [[list(vars(t).values()), us] for us, t in results["down"]]})
        print(f"{num_tokens:>6} {str(tuple(vars(up_tile).values())):>24} {up_us:>8.1f} "
              f"{str(tuple(vars(down_tile).values())):>24} {down_us:>8.1f} "
              f"{str(tuple(vars(any_down).values())):>24} {any_us:>8.1f}")
    print(f"\nMOE_TILES[({e}, {h}, {i}, {k})] = [")
    for num_tokens, (up_tile, down_tile) in best.items():
        print(f"    ({num_tokens}, MoeTile{tuple(vars(up_tile).values())}, MoeTile{tuple(vars(down_tile).values())}),")
    print("]")
    return {"shape": shape, "rows": table}


def fp8_layer_table(bench) -> list[dict]:
    """The layer with FP8 experts (weight-only, kernels/fused_moe.Fp8Experts) against bf16 at decode sizes, graph
    replayed, on the same tiles: row scales (--quantization fp8) and 128-column block scales (Qwen3-30B-A3B-FP8);
    TB/s of the experts the tokens route to (FP8: half the bytes)."""
    from kernels import fused_moe as fm
    from kernels.fp8_quant import quantize_rows_ref

    torch = bench.torch
    e, h, i, k = SHAPE["experts"], SHAPE["hidden"], SHAPE["inter"], SHAPE["top_k"]
    print(f"\nfused MoE layer with FP8 experts (weight-only): {e} experts top-{k}, hidden {h}, inter {i}; us, and the "
          f"routed experts' weight TB/s")
    print(f"{'T':>5} {'experts':>7} {'bf16':>12} {'fp8 row':>12} {'fp8 block':>12} {'row x bf16':>10} "
          f"{'block x bf16':>12} {'rel err':>8}")
    rows = []
    for num_tokens in (1, 16, 64, 128, 256):
        x, router, w13, w2 = _inputs(torch, bench.device, SHAPE, num_tokens, seed=num_tokens)
        logits = x @ router.t()
        _, ids = fm.route(logits, k, True)
        hit = int(ids.unique().numel())
        weight_bytes = hit * 3 * i * h
        variants = {"bf16": (lambda: fm.fused_moe(x, logits, w13, w2, k, True), 2 * weight_bytes)}
        ref = variants["bf16"][0]().float()
        errs = []
        for name, group in (("row", None), ("block", 128)):
            quantized = []
            for w in (w13, w2):
                g = group or w.shape[-1]
                q, scale = quantize_rows_ref(w.reshape(-1, w.shape[-1]), g)
                quantized.append((q.view(w.shape), scale.view(*w.shape[:2], -1), g))
            (q13, s13, g13), (q2, s2, g2) = quantized
            fp8 = fm.Fp8Experts(s13, s2, g13, g2)
            variants[f"fp8 {name}"] = (
                lambda q13=q13, q2=q2, fp8=fp8: fm.fused_moe(x, logits, q13, q2, k, True, fp8=fp8), weight_bytes)
            out = variants[f"fp8 {name}"][0]().float()
            errs.append(((out - ref).norm() / ref.norm()).item())
        us = {name: bench.time_us(fn, graph=True) for name, (fn, _) in variants.items()}
        tb = {name: nbytes / us[name] / 1e6 for name, (_, nbytes) in variants.items()}
        rows.append({"tokens": num_tokens, "experts_hit": hit, "us": us, "tb_per_s": tb,
                     "row_speedup": us["bf16"] / us["fp8 row"], "block_speedup": us["bf16"] / us["fp8 block"],
                     "rel_err_vs_bf16": max(errs)})
        cell = lambda n: f"{us[n]:>6.1f} {tb[n]:>4.2f}"  # noqa: E731
        print(f"{num_tokens:>5} {hit:>7} {cell('bf16'):>12} {cell('fp8 row'):>12} {cell('fp8 block'):>12} "
              f"{us['bf16'] / us['fp8 row']:>10.2f} {us['bf16'] / us['fp8 block']:>12.2f} {max(errs):>8.1e}")
    print("rel err: FP8 against bf16, the weights' quantization")
    return rows
