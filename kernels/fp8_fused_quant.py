"""RMSNorm (after the residual add) and SiLU-and-mul that write their output as FP8 activations with scales:
the input of the FP8 GEMM that follows them (kernels/fp8_gemm.py), so that no separate quantization kernel
runs between the producer and its GEMM (SiLU-and-mul with a scale per token writes its bf16 output once, for its
second kernel, which reads it back from L2). Either may also take an FP8 product before its scales
(kernels/fp8_quant.UnscaledProduct: gate_up_proj's for SiLU-and-mul, o_proj's and down_proj's for the norm after
the residual add) and apply them as it reads it.

Each kernel computes exactly what its plain version in kernels/fused_ops.py writes (rounded to the activation
dtype where that one rounds), then quantizes it as kernels/fp8_gemm.quantize_rows would: a scale per token
(channel weights) or per token and `group` columns (block weights, DeepSeek's 1 x 128), scale = max|y| / 448
over the group. So a fused producer feeds its GEMM the same bytes as the unfused chain, up to the order of the
norm's sum of squares.

A row is held as a [NUM_TILES, TILE] tile of columns (TILE = the scale group when there are several per row,
a power of two), so each group's max is one reduction over the tile's second axis and a row's max one more.
No wrapper syncs with the host or sizes anything by data: both capture in the decode CUDA graphs. Each op's
torch reference is beside it.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.attention.triton_kv_store import fp8_scale, quantize_fp8
from kernels.fp8_quant import MIN_SCALE, QuantizedActivations, empty_quantized, quantize_rows_ref
from kernels.fused_ops import rms_norm_ref, scaled_as_written, silu_and_mul_ref
from kernels.triton_runtime import INTERPRET

_MIN_SCALE = tl.constexpr(MIN_SCALE)
MAX_ROW_TILE = 4096  # columns one SiLU-and-mul program holds at once for scales per group (a norm: its whole row)
PER_TOKEN_CHUNK = 1024  # columns a SiLU-and-mul program takes with a scale per token (4 warps: 8 values a thread)


def can_quantize_in_groups(group: int, k: int) -> bool:
    """Whether these kernels write scales per `group` columns of a K-wide row: one per row (group >= k), or
    groups of a power of two (the tile's width)."""
    return group >= k or (group & (group - 1) == 0 and group >= 1)


def _tiles(k: int, group: int, max_cols: int) -> tuple[int, int, bool]:
    """(NUM_TILES, TILE, PER_ROW) for rows of k columns quantized in `group`s, at most max_cols per program
    (never fewer than one group)."""
    assert can_quantize_in_groups(group, k), f"scale groups of {group} columns need a power of two"
    per_row = group >= k
    tile = min(128, triton.next_power_of_2(k)) if per_row else group
    num_tiles = max(1, min(triton.next_power_of_2(triton.cdiv(k, tile)), max_cols // tile))
    return num_tiles, tile, per_row


def _num_warps(elements: int) -> int:
    return 1 if INTERPRET else max(1, min(16, elements // 256))  # ~8 elements a thread


@triton.jit
def _group_scales(v, PER_ROW: tl.constexpr):
    """v [NUM_TILES, TILE] -> the scale [NUM_TILES] of each tile (each group), or of the whole tile (one row)."""
    amax = tl.max(tl.abs(v), axis=1)
    if PER_ROW:
        amax = tl.zeros_like(amax) + tl.max(amax, axis=0)
    return fp8_scale(amax, _MIN_SCALE)


# ---------------------------------------------------------------------------------------------
# RMSNorm (with the residual add) -> FP8
# ---------------------------------------------------------------------------------------------


@triton.jit
def _rms_norm_quant_kernel(
    x_ptr, residual_ptr, weight_ptr, q_ptr, scale_ptr, residual_out_ptr, row_scale_ptr, col_scale_ptr, plain_ptr,
    dim, eps, num_groups, x_stride, r_stride, stride_sm, stride_sg,
    HAS_RESIDUAL: tl.constexpr, HAS_SCALES: tl.constexpr, PER_ROW: tl.constexpr, NUM_TILES: tl.constexpr,
    TILE: tl.constexpr, KEEP_PLAIN: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    tiles = tl.arange(0, NUM_TILES)
    cols = tiles[:, None] * TILE + tl.arange(0, TILE)[None, :]
    mask = cols < dim
    x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_SCALES:  # an unscaled FP8 product (o_proj's, down_proj's)
        x = scaled_as_written(x, tl.load(row_scale_ptr + row), col_scale_ptr, cols, mask, x_ptr.dtype.element_ty)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * r_stride + cols, mask=mask, other=0.0).to(tl.float32)
        x = (x + r).to(residual_out_ptr.dtype.element_ty)  # rounded as eager torch adds, then normalised
        tl.store(residual_out_ptr + row * dim + cols, x, mask=mask)
        x = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(tl.sum(x * x, axis=1), axis=0) / dim + eps)
    dtype = x_ptr.dtype.element_ty
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    # fused_ops._rms_norm_kernel's output, rounded to the activation dtype as it stores it
    y = ((x * rstd).to(dtype).to(tl.float32) * w).to(dtype).to(tl.float32)
    if KEEP_PLAIN:  # the norm's output as it is too, for a reader besides the FP8 GEMM (a MoE router)
        tl.store(plain_ptr + row * dim + cols, y.to(dtype), mask=mask)
    scale = _group_scales(y, PER_ROW)
    tl.store(q_ptr + row * dim + cols, quantize_fp8(y, scale[:, None]).to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(scale_ptr + row * stride_sm + tiles * stride_sg, scale, mask=tiles < num_groups)


def rms_norm_quant(x: torch.Tensor, weight: torch.Tensor, eps: float, group: int,
                   residual: torch.Tensor | None = None, scales: tuple[torch.Tensor, torch.Tensor] | None = None,
                   keep_plain: bool = False, m_major: bool = False
                   ) -> QuantizedActivations | tuple[QuantizedActivations, torch.Tensor]:
    """RMSNorm over x [T, hidden] (with `residual`: of x + residual, returned too, as fused_ops.rms_norm),
    written as FP8 with a scale per token and `group` columns (group >= hidden: per token). `scales` (per token
    [T, 1], per column [hidden, 1]): x is an unscaled product, which kernels/fp8_gemm.scale_product would have scaled
    first. keep_plain: the output in x's dtype too (`plain`: fused_ops.rms_norm's bytes), in the same pass. m_major:
    the scales laid out for the block recipe (kernels/fp8_quant.empty_quantized)."""
    num_rows, dim = x.shape
    assert weight.dtype == x.dtype, "the norm's weight must be in the activation dtype"
    if x.stride(1) != 1:
        x = x.contiguous()
    num_tiles, tile, per_row = _tiles(dim, group, max_cols=1 << 30)  # the whole row: the norm needs all of it
    num_groups = 1 if per_row else triton.cdiv(dim, group)
    q, scale = empty_quantized(num_rows, dim, num_groups, x.device, m_major)
    if residual is not None:
        assert residual.shape == x.shape and residual.dtype == x.dtype, "residual must match x"
        residual = residual if residual.stride(1) == 1 else residual.contiguous()
        residual_out = torch.empty_like(x)
    else:
        residual, residual_out = x, x  # unused by the kernel
    plain = torch.empty(num_rows, dim, dtype=x.dtype, device=x.device) if keep_plain else None
    if num_rows > 0:
        row_scale, col_scale = scales if scales is not None else (x, x)
        _rms_norm_quant_kernel[(num_rows,)](
            x, residual, weight, q, scale, residual_out, row_scale, col_scale, plain if keep_plain else x,
            dim, eps, num_groups, x.stride(0), residual.stride(0), *scale.stride(),
            HAS_RESIDUAL=residual_out is not x, HAS_SCALES=scales is not None, PER_ROW=per_row, NUM_TILES=num_tiles,
            TILE=tile, KEEP_PLAIN=keep_plain, num_warps=_num_warps(num_tiles * tile),
        )
    out = QuantizedActivations(q, scale, x.dtype, plain)
    return out if residual_out is x else (out, residual_out)


def rms_norm_quant_ref(x: torch.Tensor, weight: torch.Tensor, eps: float, group: int,
                       residual: torch.Tensor | None = None
                       ) -> QuantizedActivations | tuple[QuantizedActivations, torch.Tensor]:
    """The unfused chain in torch: the eager RMSNorm, then the activation quantization."""
    if residual is None:
        return _quantized(rms_norm_ref(x, weight, eps), group)
    normed, summed = rms_norm_ref(x, weight, eps, residual)
    return _quantized(normed, group), summed


def _quantized(y: torch.Tensor, group: int) -> QuantizedActivations:
    q, scale = quantize_rows_ref(y, min(group, y.shape[1]))
    return QuantizedActivations(q, scale, y.dtype)


# ---------------------------------------------------------------------------------------------
# SiLU-and-mul -> FP8
# ---------------------------------------------------------------------------------------------


@triton.jit
def _silu_and_mul_tile(x_ptr, row_offset, inter, cols, mask, row_scale, col_scale_ptr, HAS_SCALES: tl.constexpr):
    """silu(gate) * up at `cols`, rounded to the activation dtype where fused_ops._silu_and_mul_kernel rounds. With
    HAS_SCALES x is an unscaled product (kernels/fp8_gemm.unit_scaled_mm_fp8_gemm): gate and up are first scaled by
    the token's and their column's scales and rounded, as kernels/fp8_gemm.scale_product would write them."""
    dtype = x_ptr.dtype.element_ty
    gate = tl.load(x_ptr + row_offset + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row_offset + inter + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_SCALES:
        gate = scaled_as_written(gate, row_scale, col_scale_ptr, cols, mask, dtype)
        up = scaled_as_written(up, row_scale, col_scale_ptr, inter + cols, mask, dtype)
    act = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
    return (act * up).to(dtype).to(tl.float32)


@triton.jit
def _silu_and_mul_quant_kernel(
    x_ptr, q_ptr, scale_ptr, row_scale_ptr, col_scale_ptr, inter, num_groups, x_stride, stride_sm, stride_sg,
    HAS_SCALES: tl.constexpr, NUM_TILES: tl.constexpr, TILE: tl.constexpr,
):
    # scales per group: program (t, j) takes groups [j * NUM_TILES, (j + 1) * NUM_TILES) of token t, in one pass
    row = tl.program_id(0).to(tl.int64)
    tiles = tl.arange(0, NUM_TILES)
    first = tl.program_id(1) * NUM_TILES
    cols = first * TILE + tiles[:, None] * TILE + tl.arange(0, TILE)[None, :]
    row_scale = tl.load(row_scale_ptr + row) if HAS_SCALES else 1.0
    y = _silu_and_mul_tile(x_ptr, row * x_stride, inter, cols, cols < inter, row_scale, col_scale_ptr, HAS_SCALES)
    scale = _group_scales(y, False)
    tl.store(q_ptr + row * inter + cols, quantize_fp8(y, scale[:, None]).to(q_ptr.dtype.element_ty), mask=cols < inter)
    tl.store(scale_ptr + row * stride_sm + (first + tiles) * stride_sg, scale, mask=first + tiles < num_groups)


@triton.jit
def _silu_and_mul_chunk_kernel(
    x_ptr, h_ptr, amax_ptr, row_scale_ptr, col_scale_ptr, inter, num_chunks, x_stride,
    HAS_SCALES: tl.constexpr, CHUNK: tl.constexpr,
):
    # a scale per token, step 1: program (t, c) writes SiLU-and-mul's chunk c of token t and that chunk's max |y|
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    cols = chunk * CHUNK + tl.arange(0, CHUNK)
    mask = cols < inter
    row_scale = tl.load(row_scale_ptr + row) if HAS_SCALES else 1.0
    y = _silu_and_mul_tile(x_ptr, row * x_stride, inter, cols, mask, row_scale, col_scale_ptr, HAS_SCALES)
    tl.store(h_ptr + row * inter + cols, y.to(h_ptr.dtype.element_ty), mask=mask)
    tl.store(amax_ptr + row * num_chunks + chunk, tl.max(tl.abs(y), axis=0))


@triton.jit
def _quantize_by_chunk_maxes_kernel(h_ptr, amax_ptr, q_ptr, scale_ptr, inter, num_chunks,
                                    CHUNK: tl.constexpr, CHUNKS: tl.constexpr):
    # step 2: the token's scale from its chunks' maxes (_group_scales' expression), then chunk c quantized with it
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    slots = tl.arange(0, CHUNKS)
    amax = tl.max(tl.load(amax_ptr + row * num_chunks + slots, mask=slots < num_chunks, other=0.0), axis=0)
    scale = fp8_scale(amax, _MIN_SCALE)
    cols = chunk * CHUNK + tl.arange(0, CHUNK)
    mask = cols < inter
    y = tl.load(h_ptr + row * inter + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(q_ptr + row * inter + cols, quantize_fp8(y, scale).to(q_ptr.dtype.element_ty), mask=mask)
    if chunk == 0:
        tl.store(scale_ptr + row, scale)


def silu_and_mul_quant(x: torch.Tensor, group: int, max_cols: int | None = None,
                       scales: tuple[torch.Tensor, torch.Tensor] | None = None, m_major: bool = False
                       ) -> QuantizedActivations:
    """x [T, 2I] -> silu(x[:, :I]) * x[:, I:] as FP8 [T, I] with a scale per token and `group` columns
    (group >= I: per token). `scales` (per token [T, 1], per column [2I, 1]): x is an unscaled product, which
    kernels/fp8_gemm.scale_product would have scaled first. A program holds at most max_cols columns (at least one
    group; by default MAX_ROW_TILE). m_major: the scales laid out for the block recipe
    (kernels/fp8_quant.empty_quantized).

    Per group, one kernel: each program quantizes whole groups. Per token, two: a token's max needs its whole row,
    and one program a row would leave most SMs idle at decode's batch (and hold 12,288 columns in registers), so
    the first writes SiLU-and-mul in chunks with each chunk's max, the second quantizes each chunk by the max of
    its token's chunks (the activations' second read hits L2). One kernel whose programs of a token wait for each
    other's maxes was 1.7-2x slower than the pair at decode's M on the H200 (bench/studies/fp8_silu_per_token.py)."""
    num_rows, inter = x.shape[0], x.shape[1] // 2
    if x.stride(1) != 1:
        x = x.contiguous()
    has_scales = scales is not None
    row_scale, col_scale = scales if has_scales else (x, x)
    max_cols = max_cols or MAX_ROW_TILE
    num_tiles, tile, per_row = _tiles(inter, group, max_cols)
    num_groups = 1 if per_row else triton.cdiv(inter, group)
    q, scale = empty_quantized(num_rows, inter, num_groups, x.device, m_major)
    if num_rows == 0 or inter == 0:
        return QuantizedActivations(q, scale, x.dtype)
    if not per_row:
        _silu_and_mul_quant_kernel[(num_rows, triton.cdiv(num_groups, num_tiles))](
            x, q, scale, row_scale, col_scale, inter, num_groups, x.stride(0), *scale.stride(),
            HAS_SCALES=has_scales, NUM_TILES=num_tiles, TILE=tile, num_warps=_num_warps(num_tiles * tile))
        return QuantizedActivations(q, scale, x.dtype)
    chunk = min(num_tiles * tile, PER_TOKEN_CHUNK)
    num_chunks = triton.cdiv(inter, chunk)
    amax = torch.empty(num_rows, num_chunks, dtype=torch.float32, device=x.device)  # each chunk's max |y|
    h = torch.empty(num_rows, inter, dtype=x.dtype, device=x.device)
    _silu_and_mul_chunk_kernel[(num_rows, num_chunks)](
        x, h, amax, row_scale, col_scale, inter, num_chunks, x.stride(0),
        HAS_SCALES=has_scales, CHUNK=chunk, num_warps=_num_warps(chunk))
    _quantize_by_chunk_maxes_kernel[(num_rows, num_chunks)](
        h, amax, q, scale, inter, num_chunks, CHUNK=chunk, CHUNKS=triton.next_power_of_2(num_chunks),
        num_warps=_num_warps(chunk))
    return QuantizedActivations(q, scale, x.dtype)


def silu_and_mul_quant_ref(x: torch.Tensor, group: int) -> QuantizedActivations:
    """The unfused chain in torch: the eager SiLU-and-mul, then the activation quantization."""
    return _quantized(silu_and_mul_ref(x), group)
