"""Which FP8 GEMM runs a Linear layer's product, per weight format, shape and token count: the one
dispatch table of kernels/fp8_gemm.py.

- block weights (a scale per 128 x 128 block): only the Triton kernel applies the scales per K group;
- channel weights (a scale per output row, activations per token): `torch._scaled_mm`'s row-wise GEMM
  or the Triton kernel, whichever bench/kernels.py --fp8-gemm measured faster at that shape and M.

TABLE maps (N, K) of a channel weight to [(largest M, backend), ...] in increasing M (an M between two rows
takes the larger row's); a shape not in it, or an M beyond its last row, takes DEFAULT. bench/kernels.py
--fp8-gemm measures both on the Qwen3-8B shape's GEMMs and prints the rows to put here. The rows below are
those it printed on the H200 (bench/RESULTS.md, 2026-12-03, 22473be): Triton's kernel wins at small M on the
wide products, torch._scaled_mm from M = 64 or 256 on.
"""
from __future__ import annotations

BACKENDS = ("scaled_mm", "triton")
DEFAULT = "scaled_mm"  # torch's row-wise FP8 GEMM (CUTLASS / cuBLASLt on sm_90): the faster at M >= 256 on every shape
TABLE: dict[tuple[int, int], list[tuple[int, str]]] = {
    (6144, 4096): [(1, "triton"), (16, "triton"), (64, "scaled_mm"), (256, "scaled_mm"), (4096, "scaled_mm")],
    (4096, 4096): [(1, "triton"), (16, "scaled_mm"), (64, "scaled_mm"), (256, "scaled_mm"), (4096, "scaled_mm")],
    (24576, 4096): [(1, "triton"), (16, "triton"), (64, "triton"), (256, "scaled_mm"), (4096, "scaled_mm")],
    (4096, 12288): [(1, "scaled_mm"), (16, "scaled_mm"), (64, "scaled_mm"), (256, "scaled_mm"), (4096, "scaled_mm")],
}


def choose_backend(scheme: str, m: int, n: int, k: int) -> str:
    """"scaled_mm" or "triton" for an [m, k] x [k, n] product with `scheme` ("block" or "channel") scales."""
    if scheme == "block" or n % 16 or k % 16:  # _scaled_mm needs both multiples of 16
        return "triton"
    for max_m, backend in TABLE.get((n, k), ()):
        if m <= max_m:
            return backend
    return DEFAULT
