"""Which FP8 GEMM runs a Linear layer's product, per weight format, shape and token count, and with which tiles
the Triton kernel runs it: the one dispatch table of kernels/fp8_gemm.py.

- block weights (a scale per 128 x 128 block): the Triton kernel ("triton"), which applies the scales per K group,
  or torch's block recipe on cuBLASLt ("block_scaled_mm": its scales must be whole 128 x 128 blocks, N and K
  multiples of 128), per BLOCK_TABLE;
- channel weights (a scale per output row, activations per token): `torch._scaled_mm`'s row-wise GEMM
  ("scaled_mm"), its tensor-wise GEMM on unit scales with the scales applied after ("unit_scaled_mm"), or the
  Triton kernel ("triton"), whichever bench/kernels.py --fp8-gemm-sweep measured fastest at that shape and M.

TABLE maps (N, K) of a channel weight to [(largest M, backend[, rows]), ...] in increasing M (an M between two rows
takes the larger row's); a shape not in it, or an M beyond its last row, takes DEFAULT_UP_TO's backend up to its M
and DEFAULT above. `rows`, on a row of either _scaled_mm backend, runs the product on that many rows
(kernels/fp8_gemm._padded_rows): cuBLASLt's heuristics pick slow kernels at some M, and a product on more rows can be
the faster one. TILES maps (scheme, N, K) to [(largest M, (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages[,
SPLIT_K])), ...] the same way; a shape or M not in it takes kernels/fp8_gemm's rule. bench/kernels.py --fp8-gemm
--fp8-gemm-sweep measures every backend (and the Triton kernel's tiles) on the Qwen3-8B shape's GEMMs, each as a CUDA
graph of calls over copies of W larger than L2, and prints the rows to put here. The rows below are those it printed
on the H200 (bench/RESULTS.md, 2026-12-04, 302c3a7): Triton's kernel (split-K among its tiles) at the smallest M,
the tensor-wise GEMM through most of decode's M, the row-wise one at prefill's (and on gate_up_proj from 161).

BLOCK_TABLE maps (N, K) of a block weight the same way; a shape not in it takes BLOCK_DEFAULT's rows. Both come from
bench/studies/fp8_scaling_modes.py on the H200 (2026-12-05, df68ff7): from 132 tokens on cuBLASLt's block kernels beat
the Triton kernel on all four Qwen3-8B products (1.1-1.6x at 132-256, gate_up_proj fastest on 256 rows; 1.6-1.7x at
4,096), at 96-128 on qkv_proj and gate_up_proj, while at 64 Triton wins or ties on all four.

FAST_ACCUM_FROM is the token count from which the cuBLASLt backends accumulate with the tensor cores' own (fast,
unpromoted) accumulation over all of K, as CUTLASS's and vLLM's FP8 GEMMs do; below it they promote to fp32
(the Triton kernel always promotes, per K tile). It is 1, every product, since the H200 measured it (bench/RESULTS.md,
2026-12-05): 1.303x bf16 on the Qwen3-8B shape against 1.264x promoted; at K = 4,096-12,288 an error of 0.57-0.62% of
max |y| against float64 (promoted: 0.22-0.28%; bf16's own rounding of the output is up to 0.4%); and on SmolLM2's
real weights against bf16, 92.32% top-1 and 0.0249 mean KL, promoted 92.53% and 0.0255.

CUBLASLT_ALGOS maps (recipe, N, K) to [(largest M, configuration or None), ...]: for the row-wise product ("outer",
scaled_mm's), the tensor-wise one ("tensor", unit_scaled_mm's) or the block recipe ("block", block_scaled_mm's), the
cuBLASLt algorithm (kernels/cublaslt.Algorithm.entry) that runs it in place of the one cuBLASLt's heuristic gives
torch; None, a shape not in it or an M past its last row keeps torch's call. bench/studies/fp8_cublaslt_algos.py
--table-out writes them. Empty until measured in the engine.

NANOSERVE_FP8_GEMM_TABLE names a JSON file that the sweep wrote (`--fp8-gemm-table-out`); its rows then replace
these, so that a sweep's choice can be measured in the engine before it is copied here.
"""
from __future__ import annotations

import json
import os

BACKENDS = ("scaled_mm", "unit_scaled_mm", "triton")
BLOCK_BACKENDS = ("triton", "block_scaled_mm")
# a shape the table lacks: cuBLASLt's plain (tensor-wise) FP8 GEMM up to decode's M, its row-wise one above, the faster
# on each of the Qwen3-8B shape's products at those M (bench/RESULTS.md, 2026-12-04)
DEFAULT = "scaled_mm"
DEFAULT_UP_TO = ("unit_scaled_mm", 256)
TABLE_ENV = "NANOSERVE_FP8_GEMM_TABLE"
Tiles = tuple[int, ...]  # BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages[, SPLIT_K (1 when absent)]

TABLE: dict[tuple[int, int], list[tuple]] = {  # the sweep's rows, runs of one choice merged
    (6144, 4096): [(16, "triton"), (192, "unit_scaled_mm"), (4096, "scaled_mm")],
    (4096, 4096): [(256, "unit_scaled_mm"), (4096, "scaled_mm")],
    (24576, 4096): [(64, "triton"), (160, "unit_scaled_mm"), (224, "scaled_mm", 256), (4096, "scaled_mm")],
    (4096, 12288): [(1, "triton"), (16, "unit_scaled_mm", 32), (256, "unit_scaled_mm"), (4096, "scaled_mm")],
}
ANY_M = 1 << 62
FAST_ACCUM_FROM = 1  # every product (the docstring says why)
# the block recipe's activation scales written M-major by their producers (kernels/fp8_quant.empty_quantized), read in
# place; NANOSERVE_FP8_M_MAJOR=0 writes them row-major and copies them before each block product, to compare
M_MAJOR_SCALES = os.environ.get("NANOSERVE_FP8_M_MAJOR", "1") != "0"
BLOCK_DEFAULT: list[tuple] = [(64, "triton"), (ANY_M, "block_scaled_mm")]  # a block shape BLOCK_TABLE lacks
BLOCK_TABLE: dict[tuple[int, int], list[tuple]] = {
    (6144, 4096): [(64, "triton"), (ANY_M, "block_scaled_mm")],
    (4096, 4096): [(128, "triton"), (ANY_M, "block_scaled_mm")],
    (24576, 4096): [(64, "triton"), (128, "block_scaled_mm"), (256, "block_scaled_mm", 256),
                    (ANY_M, "block_scaled_mm")],
    (4096, 12288): [(128, "triton"), (ANY_M, "block_scaled_mm")],
}
CUBLASLT_RECIPES = ("outer", "tensor", "block")
CUBLASLT_ALGOS: dict[tuple[str, int, int], list[tuple[int, dict | None]]] = {}
TILES: dict[tuple[str, int, int], list[tuple[int, Tiles]]] = {
    ("channel", 6144, 4096): [
        (1, (16, 16, 128, 2, 6)), (16, (16, 16, 128, 2, 6)), (32, (32, 64, 128, 4, 4, 4)),
        (64, (64, 64, 128, 4, 4, 2)), (96, (64, 64, 128, 4, 4)), (128, (64, 64, 128, 4, 4)),
        (144, (128, 128, 256, 8, 3)), (160, (64, 128, 128, 4, 4)), (192, (64, 128, 128, 4, 4)),
        (224, (64, 128, 128, 4, 4)), (256, (128, 128, 256, 8, 3)), (4096, (128, 128, 256, 8, 3)),
    ],
    ("block", 6144, 4096): [
        (1, (16, 64, 128, 4, 4, 4)), (16, (16, 64, 128, 4, 4, 4)), (32, (64, 64, 128, 4, 4, 2)),
        (64, (64, 64, 128, 4, 4, 2)), (96, (64, 128, 128, 4, 3)), (128, (64, 128, 128, 4, 4, 2)),
        (144, (64, 64, 128, 4, 4)), (160, (64, 64, 128, 4, 4)), (192, (64, 64, 128, 4, 4)),
        (224, (64, 64, 128, 4, 4)), (256, (64, 64, 128, 4, 4)), (4096, (64, 128, 128, 4, 3)),
    ],
    ("channel", 4096, 4096): [
        (1, (16, 16, 128, 2, 6)), (16, (16, 16, 128, 2, 6)), (32, (32, 64, 128, 4, 4, 4)),
        (64, (64, 64, 128, 4, 4, 2)), (96, (64, 64, 128, 4, 4)), (128, (64, 64, 128, 4, 4)),
        (144, (64, 128, 128, 4, 4)), (160, (64, 128, 128, 4, 4)), (192, (64, 128, 128, 4, 4)),
        (224, (64, 128, 128, 4, 4)), (256, (64, 128, 128, 4, 4)), (4096, (128, 128, 256, 8, 3)),
    ],
    ("block", 4096, 4096): [
        (1, (16, 64, 128, 4, 4, 4)), (16, (16, 64, 128, 4, 4, 4)), (32, (64, 64, 128, 4, 4, 2)),
        (64, (64, 64, 128, 4, 4, 2)), (96, (64, 128, 128, 4, 4, 2)), (128, (64, 64, 128, 4, 4)),
        (144, (128, 64, 128, 4, 4)), (160, (128, 64, 128, 4, 4)), (192, (128, 64, 128, 4, 4)),
        (224, (128, 64, 128, 4, 4)), (256, (64, 128, 128, 4, 4, 2)), (4096, (64, 128, 128, 4, 3)),
    ],
    ("channel", 24576, 4096): [
        (1, (16, 64, 128, 4, 4)), (16, (16, 64, 128, 4, 4)), (32, (64, 64, 128, 4, 4)), (64, (64, 64, 128, 4, 4)),
        (96, (64, 64, 128, 4, 4)), (128, (64, 64, 128, 4, 4)), (144, (64, 128, 128, 4, 4)),
        (160, (64, 128, 128, 4, 4)), (192, (64, 128, 128, 4, 4)), (224, (64, 128, 128, 4, 4)),
        (256, (128, 128, 256, 8, 3)), (4096, (128, 128, 256, 8, 3)),
    ],
    ("block", 24576, 4096): [
        (1, (16, 64, 128, 4, 4)), (16, (16, 64, 128, 4, 4)), (32, (32, 64, 128, 4, 4)), (64, (64, 64, 128, 4, 4)),
        (96, (64, 128, 128, 4, 3)), (128, (64, 128, 128, 4, 3)), (144, (128, 64, 128, 4, 4)),
        (160, (128, 64, 128, 4, 4)), (192, (64, 128, 128, 4, 3)), (224, (128, 64, 128, 4, 4)),
        (256, (128, 64, 128, 4, 4)), (4096, (64, 128, 128, 4, 3)),
    ],
    ("channel", 4096, 12288): [
        (1, (16, 32, 128, 4, 4, 4)), (16, (16, 32, 128, 4, 4, 4)), (32, (32, 64, 128, 4, 4, 4)),
        (64, (64, 64, 128, 4, 4, 2)), (96, (64, 128, 128, 4, 4, 2)), (128, (64, 128, 128, 4, 4, 2)),
        (144, (64, 128, 128, 4, 4, 2)), (160, (64, 128, 128, 4, 4, 2)), (192, (64, 128, 128, 4, 4, 2)),
        (224, (64, 128, 128, 4, 4, 2)), (256, (64, 128, 128, 4, 4, 2)), (4096, (128, 128, 256, 8, 3)),
    ],
    ("block", 4096, 12288): [
        (1, (16, 64, 128, 4, 4, 4)), (16, (16, 64, 128, 4, 4, 4)), (32, (64, 64, 128, 4, 4, 2)),
        (64, (64, 64, 128, 4, 4, 2)), (96, (64, 128, 128, 4, 4, 2)), (128, (64, 128, 128, 4, 4, 2)),
        (144, (64, 128, 128, 4, 4, 2)), (160, (64, 128, 128, 4, 4, 2)), (192, (64, 128, 128, 4, 4, 2)),
        (224, (64, 128, 128, 4, 4, 2)), (256, (64, 128, 128, 4, 4, 2)), (4096, (64, 128, 128, 4, 3)),
    ],
}


def _lookup(rows, m: int) -> tuple | None:
    """The first row (largest M, ...) whose M is at least m."""
    return next((row for row in rows if m <= row[0]), None)


def _backend_and_rows(row: tuple, m: int) -> tuple[str, int]:
    """A table row's (backend, the rows to run it on): m, or the row's padded count where it names one."""
    return row[1], max(m, row[2]) if len(row) > 2 else m


def choose_gemm(scheme: str, m: int, n: int, k: int, whole_blocks: bool = False) -> tuple[str, int]:
    """(one of BACKENDS or BLOCK_BACKENDS, the rows to run it on) for an [m, k] x [k, n] product with `scheme`
    ("block" or "channel") scales: m, or more where the table's row pads _scaled_mm's rows. whole_blocks: a block
    weight's scales are whole 128 x 128 blocks (kernels/fp8_quant.block_scales_of), which block_scaled_mm needs."""
    if scheme == "block":
        # torch's block recipe takes K's scales in whole runs of 4 blocks: at K = 256 it refused 2 ("scale_b must
        # have shape 4 x 8", H100, torch 2.11); N = 384 (3 blocks) ran
        if not whole_blocks or n % 128 or k % (4 * 128):
            return "triton", m
        row = _lookup(BLOCK_TABLE.get((n, k), BLOCK_DEFAULT), m)
        return ("triton", m) if row is None else _backend_and_rows(row, m)  # past the table's last row: Triton
    if n % 16 or k % 16:  # _scaled_mm needs both multiples of 16
        return "triton", m
    row = _lookup(TABLE.get((n, k), ()), m)
    if row is None:
        return DEFAULT_UP_TO[0] if m <= DEFAULT_UP_TO[1] else DEFAULT, m
    return _backend_and_rows(row, m)


def fast_accumulation(m: int) -> bool:
    """Whether a cuBLASLt product of m tokens accumulates fast (FAST_ACCUM_FROM)."""
    return m >= FAST_ACCUM_FROM


def cublaslt_algorithm(recipe: str, m: int, n: int, k: int) -> dict | None:
    """The cuBLASLt algorithm's configuration CUBLASLT_ALGOS names for this product, or None (torch's call)."""
    row = _lookup(CUBLASLT_ALGOS.get((recipe, n, k), ()), m)
    return None if row is None else row[1]


def cublaslt_named() -> bool:
    """Whether any product may run on an algorithm named here (the loader then readies kernels/cublaslt)."""
    return any(config is not None for rows in CUBLASLT_ALGOS.values() for _, config in rows)


def measured_tiles(scheme: str, m: int, n: int, k: int) -> Tiles | None:
    """The Triton kernel's tiles the sweep chose for this product, or None (kernels/fp8_gemm's rule)."""
    row = _lookup(TILES.get((scheme, n, k), ()), m)
    return None if row is None else row[1]


def apply_table(measured: dict) -> None:
    """Replace TABLE's and TILES' rows by the shapes a sweep (bench/fp8_gemm_table.py) measured:
    {"backends": {"NxK": [[M, backend[, rows]], ...]}, "tiles": {"scheme NxK": [[M, [tiles]], ...]}}, and
    optionally "block_backends" ({"NxK": rows} of BLOCK_TABLE), "fast_accum_from" (FAST_ACCUM_FROM) and
    "cublaslt_algos" ({"recipe NxK": [[M, configuration or null], ...]} of CUBLASLT_ALGOS)."""
    global FAST_ACCUM_FROM
    if "fast_accum_from" in measured:
        FAST_ACCUM_FROM = int(measured["fast_accum_from"])
    for key_name, table, backends in (("backends", TABLE, BACKENDS), ("block_backends", BLOCK_TABLE, BLOCK_BACKENDS)):
        for key, rows in measured.get(key_name, {}).items():
            n, k = map(int, key.split("x"))
            unknown = {backend for _, backend, *_ in rows} - set(backends)
            if unknown:
                raise ValueError(f"FP8 GEMM table row for {key} names {sorted(unknown)}; the backends are {backends}")
            table[(n, k)] = [(int(m), backend, *map(int, pad)) for m, backend, *pad in rows]
    for key, rows in measured.get("cublaslt_algos", {}).items():
        recipe, shape = key.split()
        if recipe not in CUBLASLT_RECIPES or any(c is not None and "id" not in c for _, c in rows):
            raise ValueError(f"cuBLASLt algorithms for {key!r}: the recipes are {CUBLASLT_RECIPES}, and each "
                             "configuration names its algorithm's id")
        n, k = map(int, shape.split("x"))
        CUBLASLT_ALGOS[(recipe, n, k)] = [(int(m), None if c is None else {
            name: v if name == "raw" else int(v) for name, v in c.items()}) for m, c in rows]
    for key, rows in measured.get("tiles", {}).items():
        scheme, shape = key.split()
        n, k = map(int, shape.split("x"))
        TILES[(scheme, n, k)] = [(int(m), tuple(int(v) for v in tiles)) for m, tiles in rows]


if os.environ.get(TABLE_ENV):
    with open(os.environ[TABLE_ENV]) as f:
        apply_table(json.load(f))
