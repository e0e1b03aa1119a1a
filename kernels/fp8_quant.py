"""The FP8 weight and activation formats of FP8 Linear layers, in torch: the references kernels/fp8_gemm.py
reproduces, and what the CPU computes (weights dequantized at load). Torch-only: no Triton needed.

A tensor [R, C] is float8_e4m3fn with a float32 scale per row and group of `group` columns (ceil at the
edge): x ~= float32(q) * scale, scale = max|x| / 448 over the group, q = x / scale rounded to nearest even.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from kernels.kv_quant import FP8_DTYPE, FP8_MAX

MIN_SCALE = 1e-12  # an all-zero group quantizes to zeros instead of dividing by zero


SCALE_BLOCK_ROWS = 128  # a fine-grained checkpoint's block height: the rows that share a scale


def rows_sharing_scales(scale: torch.Tensor, rows: int = SCALE_BLOCK_ROWS) -> int:
    """`rows` where every aligned run of that many rows of scale [..., R, G] (G > 1: per row and group) holds one
    scale per group, as a block checkpoint's repeated over their rows do where no block is cut (by a fused piece that
    starts inside one, or a rank's slice), else 1. The FP8 GEMMs then take one weight scale a tile and K group
    instead of a vector. Compares on the scales' device: call at load, not in a step."""
    *lead, r, g = scale.shape
    if g == 1 or r % rows:
        return 1
    runs = scale.reshape(-1, r // rows, rows, g)
    return rows if bool((runs == runs[:, :, :1]).all()) else 1


def block_scales_of(scale: torch.Tensor, group_k: int, rows_sharing: int) -> torch.Tensor | None:
    """A weight's scales [N, G] (the loader's form: each block's scale repeated over its rows) as whole 128 x 128
    blocks, [N / 128, G] contiguous, as torch's block recipe takes them (kernels/fp8_gemm.block_scaled_mm_fp8_gemm);
    None where they are not: K groups other than 128 columns, or runs of rows that do not share their scales (a block
    cut by a fused piece or a rank's slice), or N not a multiple of 128."""
    n, groups = scale.shape
    if group_k != SCALE_BLOCK_ROWS or groups == 1 or rows_sharing % SCALE_BLOCK_ROWS or n % SCALE_BLOCK_ROWS:
        return None
    return scale[::SCALE_BLOCK_ROWS].contiguous()


def group_scales(amax: torch.Tensor) -> torch.Tensor:
    """The scales of groups whose largest magnitudes are amax: amax / 448 by IEEE division on any device, as the
    kernels divide (kernels/attention/triton_kv_store.fp8_scale). CUDA torch divides a tensor by a Python scalar as a
    multiply by its reciprocal, an ulp off where the quotient is exact; a divisor tensor on amax's device is divided
    exactly."""
    return (amax / torch.full_like(amax, FP8_MAX)).clamp_min(MIN_SCALE)


def activation_max_scale(activation_scale_ub: float) -> float:
    """The largest scale a token's activations may take when their max counts for at most activation_scale_ub
    (fbgemm_fp8's bound): ub / 448 in float32 by IEEE division. min(amax, ub) / 448 = min(amax / 448, ub / 448), as
    division by 448 is monotone, so each quantizer caps the scale it would have taken."""
    return (torch.tensor(activation_scale_ub, dtype=torch.float32) / torch.tensor(FP8_MAX)).item()


# Quantized activations are allocated with their rows rounded up to a multiple of this, the rows past M left
# unwritten, so that an FP8 GEMM can run on more rows than M without a copy (kernels/fp8_gemm_dispatch pads M where
# cuBLASLt is faster on more rows; each output row depends on its own row only, and those rows are dropped).
ROW_CAPACITY = 256


# torch's block recipe (cuBLASLt's block-scaled kernels: kernels/fp8_gemm.block_scaled_mm_fp8_gemm) runs on M rounded up
# to this many rows, its activations' scales M-major with that leading dimension: on the H200 each Qwen3-8B product
# took the same time or less on 128 or 256 rows as on any M below (bench/RESULTS.md, 2026-12-05, item 5).
BLOCK_RECIPE_ROWS = 128


def block_recipe_rows(m: int) -> int:
    """The rows the block recipe runs a product of m tokens on: the leading dimension of M-major scales."""
    return -(-m // BLOCK_RECIPE_ROWS) * BLOCK_RECIPE_ROWS


def empty_quantized(m: int, k: int, groups: int, device, m_major: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Uninitialised fp8 values [m, k], the first m rows of a buffer whose rows are m rounded up to ROW_CAPACITY,
    and float32 scales [m, groups]: the first m rows of a row-major buffer as large, or (m_major: the block recipe's
    layout) of a [groups, block_recipe_rows(m)] buffer seen transposed, strides (1, block_recipe_rows(m)), which
    the block recipe reads as it is (the writers take both strides)."""
    rows = -(-m // ROW_CAPACITY) * ROW_CAPACITY
    q = torch.empty(rows, k, dtype=FP8_DTYPE, device=device)[:m]
    if m_major:
        scale = torch.empty(groups, block_recipe_rows(m), dtype=torch.float32, device=device).t()[:m]
    else:
        scale = torch.empty(rows, groups, dtype=torch.float32, device=device)[:m]
    return q, scale


def m_major_in_place(scale: torch.Tensor, rows: int) -> torch.Tensor | None:
    """scale [M, G] seen as `rows` rows M-major (strides (1, rows)), those past M from its buffer's spare columns, as
    the block recipe takes them; None where its buffer is not laid out so (empty_quantized's m_major) for that many
    rows."""
    m, groups = scale.shape
    laid_out = scale.stride() == (1, rows) or (groups == 1 and scale.stride(0) == 1)  # one group: either layout
    if rows < m or not laid_out:
        return None
    if (scale.storage_offset() + rows * groups) * scale.element_size() > scale.untyped_storage().nbytes():
        return None
    return scale.as_strided((rows, groups), (1, rows))


def rows_in_place(t: torch.Tensor, rows: int) -> torch.Tensor | None:
    """t [M, C] (row-major) seen as its first `rows` rows, those past M read from its buffer's spare capacity
    (unwritten: their values are garbage), or None where the buffer has no room for them."""
    if not t.is_contiguous() or rows < t.shape[0]:
        return None
    end = (t.storage_offset() + rows * t.shape[1]) * t.element_size()
    if end > t.untyped_storage().nbytes():
        return None
    return t.as_strided((rows, t.shape[1]), (t.shape[1], 1))


class QuantizedActivations(NamedTuple):
    """Activations already in FP8, as an FP8 GEMM takes them: what a producer that quantizes its own output
    (kernels/fp8_fused_quant.py) hands to the Linear layer after it instead of a tensor."""

    q: torch.Tensor  # float8_e4m3fn [M, K]
    # float32 [M, G]: a scale per token (G = 1) or per token and group of K's columns; row-major, or M-major for a
    # weight whose GEMM is the block recipe (empty_quantized's m_major)
    scale: torch.Tensor
    dtype: torch.dtype  # the activations' own dtype: the GEMM's output dtype
    # the values before quantization [M, K], in dtype, where another reader needs them too (a MoE router beside its
    # FP8 experts); None otherwise
    plain: torch.Tensor | None = None


class UnscaledProduct(NamedTuple):
    """An FP8 GEMM's product before its scales (kernels/fp8_gemm.unit_scaled_mm_fp8_gemm): the output is
    product * row_scale * col_scale^T in `dtype`. What a Linear layer hands to a reader that applies the scales as
    it reads the product (kernels/fp8_fused_quant), so that they cost no pass of their own; any other reader takes
    kernels/fp8_gemm.scaled(product)."""

    product: torch.Tensor  # bf16 [M, N]: x_q @ w_q^T
    row_scale: torch.Tensor  # float32 [M, 1]: the tokens'
    col_scale: torch.Tensor  # float32 [N, 1]: the weight's, per output channel
    dtype: torch.dtype  # the activations' dtype: the output's


def quantize_rows_ref(x: torch.Tensor, group: int,
                      max_scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (float8_e4m3fn [M, K], float32 scales [M, ceil(K / group)]), a scale per row and group; at most
    max_scale (activation_max_scale), past which values saturate at +-448."""
    m, k = x.shape
    groups = -(-k // group)
    padded = torch.nn.functional.pad(x.float(), (0, groups * group - k)).view(m, groups, group)
    scale = group_scales(padded.abs().amax(-1))
    if max_scale is not None:
        scale = scale.clamp_max(max_scale)
    q = (padded / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.view(m, groups * group)[:, :k].contiguous(), scale


def dequantize_rows(q: torch.Tensor, scale: torch.Tensor, group: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """q [R, C] of float8 times its scales [R, ceil(C / group)], a scale per row and group of columns."""
    return (q.to(dtype) * scale.to(dtype).repeat_interleave(group, 1)[:, : q.shape[1]]).to(dtype)


def quantize_weight_per_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A plain weight [N, K] as float8_e4m3fn with a float32 scale per output row, [N, 1]."""
    return quantize_rows_ref(w, w.shape[1])


def fp8_gemm_ref(a: torch.Tensor, a_scale: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, group_k: int,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
    """The GEMM in float64 over the dequantized operands (scales per group_k columns of K)."""
    out = dequantize_rows(a, a_scale, group_k, torch.float64) @ dequantize_rows(w, w_scale, group_k, torch.float64).T
    return out if bias is None else out + bias.double()


def quantize_blocks_ref(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """A plain weight [N, K] in the fine-grained checkpoint format: float8_e4m3fn [N, K] and the float32
    `weight_scale_inv` [ceil(N / bn), ceil(K / bk)], a scale per bn x bk block (ceil at the edges)."""
    (n, k), (bn, bk) = w.shape, block
    gn, gk = -(-n // bn), -(-k // bk)
    padded = torch.nn.functional.pad(w.float(), (0, gk * bk - k, 0, gn * bn - n)).view(gn, bn, gk, bk)
    scale = group_scales(padded.abs().amax((1, 3)))
    q = (padded / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.view(gn * bn, gk * bk)[:n, :k].contiguous(), scale


def quantize_blocks_on_rows(w: torch.Tensor, block: int | tuple[int, int] = SCALE_BLOCK_ROWS
                            ) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_blocks_ref with blocks of (rows, columns) (an int: square), the scales laid out as the loader lays a
    block checkpoint's (each block's scale repeated over its rows): float8_e4m3fn [N, K] and float32
    [N, ceil(K / columns)]."""
    block_n, block_k = block if isinstance(block, tuple) else (block, block)
    q, blocks = quantize_blocks_ref(w, (block_n, block_k))
    return q, blocks.repeat_interleave(block_n, 0)[: w.shape[0]].contiguous()


def dequantize_blocks(q: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int],
                      dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The fine-grained format's weight: q * weight_scale_inv, each scale over its block."""
    (n, k), (bn, bk) = q.shape, block
    per_element = scale_inv.to(dtype).repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
    return q.to(dtype) * per_element
