"""Which FP8 GEMM runs a Linear layer's product, per weight format, shape and token count: the one
dispatch table of kernels/fp8_gemm.py.

- block weights (a scale per 128 x 128 block): only the Triton kernel applies the scales per K group;
- channel weights (a scale per output row, activations per token): `torch._scaled_mm`'s row-wise GEMM
  or the Triton kernel, whichever bench/kernels.py --fp8-gemm measured faster at that shape and M.

TABLE maps (N, K) of a channel weight to [(largest M, backend), ...] in increasing M; a shape not in it
takes DEFAULT. bench/kernels.py --fp8-gemm measures both on the Qwen3-8B shape's GEMMs and prints the rows
to put here. None are yet: the table is empty and DEFAULT is the vendor GEMM, chosen without a measurement
(bench/RESULTS.md, 2026-12-03: the kernel table has not run on a GPU).
"""
from __future__ import annotations

BACKENDS = ("scaled_mm", "triton")
DEFAULT = "scaled_mm"  # torch's row-wise FP8 GEMM (CUTLASS / cuBLASLt on sm_90); not measured against Triton yet
TABLE: dict[tuple[int, int], list[tuple[int, str]]] = {}


def choose_backend(scheme: str, m: int, n: int, k: int) -> str:
    """"scaled_mm" or "triton" for an [m, k] x [k, n] product with `scheme` ("block" or "channel") scales."""
    if scheme == "block" or n % 16 or k % 16:  # _scaled_mm needs both multiples of 16
        return "triton"
    for max_m, backend in TABLE.get((n, k), ()):
        if m <= max_m:
            return backend
    return DEFAULT
