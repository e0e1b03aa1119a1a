"""Triton paged attention, the GPU path: varlen causal prefill and split-K decode (the K/V store is
kernels/attention/triton_kv_store.py; decode over an 8-bit pool runs kernels/attention/gluon_decode.py
where it fits).

Every kernel reads or writes the pool [N, block_size, H_kv, D] in place, through the block table or
the slot mapping, so paging never copies K/V. The same kernels run on the CPU under
TRITON_INTERPRET=1 (set before this module is imported). There, loads are upcast to fp32 because the
interpreter computes bf16 wrongly, and every tl.dot keeps its tiles >= 16 as the GPU requires.

A quantized pool (kernels/kv_quant.py: fp8, int8) is a compile-time branch (KV_FORMAT), so the other
dtypes compile to the kernels they always were. The store quantizes on write; attention converts the
8-bit values, exactly, to q's dtype for its dots and applies the dequantization scales once per program:
K's scale joins the softmax scale (fp8, per KV head) or multiplies q per channel (int8:
q . k = sum_d (q_d s_d) k_d), V's scales the accumulated output (per head, or per channel).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import fused_ops
from kernels.attention.base import AttentionCapabilities, AttentionMetadata
from kernels.attention.decode_common import (INT8_TO_FP16_PTX, LOG2E, fp8_decode_output, fp8_output, fp8_output_args,
                                             fp8_output_supported, merge_splits, merge_writes_fp8, split_partials)
from kernels.attention.names import TRITON
from kernels.attention.triton_tuning import (DecodeConfig, PrefillConfig, decode_config, decode_num_splits,
                                              prefill_config)
from kernels.attention.triton_kv_store import KV_PLAIN, check_last_dim_contiguous, kv_scale_args, store_kvcache
from kernels.fp8_quant import QuantizedActivations
from kernels.kv_quant import QUANTIZED_DTYPES, KVScales
from kernels.triton_runtime import INTERPRET, num_sms

try:
    from kernels.attention import gluon_decode
except ImportError:  # a Triton without Gluon: every decode takes the Triton kernel
    gluon_decode = None


# ---------------------------------------------------------------------------------------------
# Shared pieces of both attention kernels
# ---------------------------------------------------------------------------------------------


@triton.jit
def _load_rows(ptrs, row_mask, offs_d, D: tl.constexpr, BLOCK_D: tl.constexpr,
               MASK_ROWS: tl.constexpr, UPCAST: tl.constexpr):
    """Load a [rows, BLOCK_D] tile, masking only what can be out of range (masks cost bandwidth)."""
    if MASK_ROWS:
        x = tl.load(ptrs, mask=row_mask[:, None] & (offs_d < D)[None, :], other=0.0)
    elif BLOCK_D != D:
        x = tl.load(ptrs, mask=(offs_d < D)[None, :], other=0.0)
    else:
        x = tl.load(ptrs)
    if UPCAST:
        x = x.to(tl.float32)
    return x


@triton.jit
def _fp16_for_fp8_dots(q, FP16_DOTS: tl.constexpr):
    """Over an fp8 pool the dots run in fp16: e4m3 converts to fp16 in one instruction on sm_89+ but
    to bf16 through more, so with bf16 dots fp8 decode ran at 0.8x a bf16 pool's speed (1.23-1.32x in
    fp16: bench/studies/fp8_decode_variants.py). q, bf16 or fp16, is clamped into fp16's range once."""
    if FP16_DOTS:
        q = tl.minimum(tl.maximum(q.to(tl.float32), -65504.0), 65504.0).to(tl.float16)
    return q


@triton.jit
def _k_scaled(q, qk_scale, k_scale_ptr, kv_head, offs_d, D: tl.constexpr, KV_FORMAT: tl.constexpr):
    """(q, qk_scale) with K's dequantization scale in, once per program: fp8's (per KV head) joins the
    softmax scale, int8's (per channel) multiplies q in fp32, before q is rounded to the dots' dtype."""
    if KV_FORMAT == 1:
        qk_scale = qk_scale * tl.load(k_scale_ptr + kv_head)
    elif KV_FORMAT == 2:
        q = q.to(tl.float32) * tl.load(k_scale_ptr + kv_head * D + offs_d, mask=offs_d < D, other=0.0)[None, :]
    return q, qk_scale


@triton.jit
def _v_scaled(acc, v_scale_ptr, kv_head, offs_d, D: tl.constexpr, KV_FORMAT: tl.constexpr):
    """The accumulated p V times V's dequantization scale (per KV head for fp8, per channel for int8)."""
    if KV_FORMAT == 1:
        acc = acc * tl.load(v_scale_ptr + kv_head)
    elif KV_FORMAT == 2:
        acc = acc * tl.load(v_scale_ptr + kv_head * D + offs_d, mask=offs_d < D, other=0.0)[None, :]
    return acc


@triton.jit
def _int8_to_fp16(x):
    """int8 x as fp16, exactly (INT8_TO_FP16_PTX)."""
    return tl.inline_asm_elementwise(INT8_TO_FP16_PTX, "=r,=r,r", [x], dtype=tl.float16, is_pure=True, pack=4)


@triton.jit
def _fp16_in_registers(x):
    """x, fp16, through an opaque copy (one PTX mov a value, which ptxas removes). Triton otherwise folds V's
    e4m3 -> fp16 conversion into the shared-memory load of p @ V's operand, which this layout (V [tokens, D],
    the dot's K along tokens) can only read a byte at a time: 256 LDS.U8 a tile and 248 registers a thread in
    the decode kernel (two programs an SM, ncu). Kept apart, V converts in registers and returns through shared
    memory as fp16 by ldmatrix.trans: 149 registers (sm_90 SASS, bench/studies/fp8_decode_variants.py's vreg)."""
    return tl.inline_asm_elementwise("mov.b16 $0, $1;", "=h,h", [x], dtype=tl.float16, is_pure=False, pack=1)


@triton.jit
def _attend_tile(
    acc, m_i, l_i, q, q_pos, k_base, v_base, block_table_row, start, end, qk_scale,
    stride_kb, stride_kt, stride_vb, stride_vt, offs_d,
    D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    MASK_N: tl.constexpr, CAUSAL: tl.constexpr, UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
    KV_FORMAT: tl.constexpr, FP16_DOTS: tl.constexpr,
):
    """One online-softmax step over context positions start .. start+BLOCK_N (end excluded).

    K/V rows are gathered through the block table one token at a time, so BLOCK_N may span
    several KV blocks, or part of one.
    """
    pos = start + tl.arange(0, BLOCK_N)
    in_ctx = pos < end
    if MASK_N:
        block = tl.load(block_table_row + pos // BLOCK_SIZE, mask=in_ctx, other=0)
    else:
        block = tl.load(block_table_row + pos // BLOCK_SIZE)
    block = block.to(tl.int64)  # block * stride can pass 2**31 in a large pool
    offset = pos % BLOCK_SIZE
    k_ptrs = k_base + block[:, None] * stride_kb + offset[:, None] * stride_kt + offs_d[None, :]
    v_ptrs = v_base + block[:, None] * stride_vb + offset[:, None] * stride_vt + offs_d[None, :]
    k = _load_rows(k_ptrs, in_ctx, offs_d, D, BLOCK_D, MASK_N, UPCAST)
    v = _load_rows(v_ptrs, in_ctx, offs_d, D, BLOCK_D, MASK_N, UPCAST)
    # exact: every e4m3 and int8 value is a bf16, fp16 and fp32 value (q is fp16 or fp32 here:
    # _fp16_for_fp8_dots); the scales come outside the dots
    if KV_FORMAT == 2 and FP16_DOTS:  # int8 -> fp16 four values at a time (inline PTX), not one chain each
        k = _int8_to_fp16(k)
        v = _fp16_in_registers(_int8_to_fp16(v))
    elif KV_FORMAT != 0:
        k = k.to(q.dtype)
        v = v.to(q.dtype)
        if FP16_DOTS:
            v = _fp16_in_registers(v)

    qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
    if MASK_N:
        qk = tl.where(in_ctx[None, :], qk, float("-inf"))
    if CAUSAL:
        qk = tl.where(pos[None, :] <= q_pos[:, None], qk, float("-inf"))

    # Every row has seen at least one unmasked key by the first step, so m_new is finite.
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    alpha = tl.math.exp2(m_i - m_new)
    p = tl.math.exp2(qk - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return acc, m_new, l_i


# ---------------------------------------------------------------------------------------------
# Prefill: varlen, causal, paged
# ---------------------------------------------------------------------------------------------


# The block-table width changes every step, and a mixed step's prefill part starts its per-sequence
# arrays mid-tensor: neither may compile a new variant. Nor may a layer's scales, a row of the pool's
# [2, L, H_kv] (nor the unread stand-in for them, here seqlens_k).
@triton.jit(do_not_specialize=["stride_bt"],
            do_not_specialize_on_alignment=["block_tables_ptr", "seqlens_k_ptr", "cu_seqlens_q_ptr",
                                            "k_scale_ptr", "v_scale_ptr"])
def _prefill_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, o_ptr, block_tables_ptr, seqlens_k_ptr, cu_seqlens_q_ptr, qk_scale,
    k_scale_ptr, v_scale_ptr,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, stride_bt,
    GROUP: tl.constexpr, BLOCK_SIZE: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
    KV_FORMAT: tl.constexpr, FP16_DOTS: tl.constexpr,
):
    # The last query tiles see the most keys; launching them first shortens the grid's tail.
    m_block = tl.num_programs(0) - 1 - tl.program_id(0)
    head = tl.program_id(1)
    seq = tl.program_id(2)
    q_start = tl.load(cu_seqlens_q_ptr + seq)
    seqlen_q = tl.load(cu_seqlens_q_ptr + seq + 1) - q_start
    m_start = m_block * BLOCK_M
    if m_start >= seqlen_q:
        return
    seqlen_k = tl.load(seqlens_k_ptr + seq)
    ctx_off = seqlen_k - seqlen_q  # query i sits at context position ctx_off + i
    kv_head = head // GROUP

    offs_m = m_start + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    m_mask = offs_m < seqlen_q
    rows = (q_start + offs_m).to(tl.int64)
    q = _load_rows(q_ptr + rows[:, None] * stride_qt + head * stride_qh + offs_d[None, :],
                   m_mask, offs_d, D, BLOCK_D, True, UPCAST)
    q, qk_scale = _k_scaled(q, qk_scale, k_scale_ptr, kv_head, offs_d, D, KV_FORMAT)
    q = _fp16_for_fp8_dots(q, FP16_DOTS)
    q_pos = ctx_off + offs_m

    block_table_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
    k_base = k_cache_ptr + kv_head * stride_kh
    v_base = v_cache_ptr + kv_head * stride_vh
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)

    # Keys before the tile's first query position are visible to every row: no mask needed.
    full_hi = (ctx_off + m_start + 1) // BLOCK_N * BLOCK_N
    hi = tl.minimum(seqlen_k, ctx_off + m_start + BLOCK_M)
    for start in range(0, full_hi, BLOCK_N):
        acc, m_i, l_i = _attend_tile(
            acc, m_i, l_i, q, q_pos, k_base, v_base, block_table_row, start, seqlen_k, qk_scale,
            stride_kb, stride_kt, stride_vb, stride_vt, offs_d,
            D, BLOCK_D, BLOCK_SIZE, BLOCK_N, False, False, UPCAST, DOT_PRECISION, KV_FORMAT, FP16_DOTS)
    for start in range(full_hi, hi, BLOCK_N):  # the diagonal: causal and context-end masks
        acc, m_i, l_i = _attend_tile(
            acc, m_i, l_i, q, q_pos, k_base, v_base, block_table_row, start, seqlen_k, qk_scale,
            stride_kb, stride_kt, stride_vb, stride_vt, offs_d,
            D, BLOCK_D, BLOCK_SIZE, BLOCK_N, True, True, UPCAST, DOT_PRECISION, KV_FORMAT, FP16_DOTS)

    acc = _v_scaled(acc, v_scale_ptr, kv_head, offs_d, D, KV_FORMAT)  # on the sum of p * v
    out = acc / l_i[:, None]
    o_ptrs = o_ptr + rows[:, None] * stride_ot + head * stride_oh + offs_d[None, :]
    tl.store(o_ptrs, out.to(o_ptr.dtype.element_ty), mask=m_mask[:, None] & (offs_d < D)[None, :])


# ---------------------------------------------------------------------------------------------
# Decode: one query token per sequence, GQA-grouped, split over the context (flash-decoding)
# ---------------------------------------------------------------------------------------------


@triton.jit(do_not_specialize=["stride_bt"], do_not_specialize_on_alignment=["k_scale_ptr", "v_scale_ptr"])
def _decode_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, o_ptr, part_acc_ptr, part_m_ptr, part_l_ptr,
    block_tables_ptr, seqlens_k_ptr, order_ptr, qk_scale, k_scale_ptr, v_scale_ptr,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, stride_bt,
    q_out_ptr, q_scale_ptr, part_amax_ptr, counters_ptr, stride_qs, stride_qg,
    NUM_Q_HEADS: tl.constexpr, GROUP: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr, HAS_ORDER: tl.constexpr, UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
    KV_FORMAT: tl.constexpr, FP16_DOTS: tl.constexpr, FP8_OUT: tl.constexpr, BLOCK_KV_HEADS: tl.constexpr,
):
    # kv_head varies fastest, so neighbouring CTAs read neighbouring bytes of the same blocks.
    kv_head = tl.program_id(0)
    if HAS_ORDER:  # CTAs start in grid order: the longest contexts go first (LPT), leaving short ones last
        seq = tl.load(order_ptr + tl.program_id(1))
    else:
        seq = tl.program_id(1)
    split = tl.program_id(2)
    num_splits = tl.num_programs(2)
    seqlen_k = tl.load(seqlens_k_ptr + seq)
    # Splits take whole tiles of this sequence's own context, so any split count covers it all.
    tiles_per_split = tl.cdiv(tl.cdiv(seqlen_k, BLOCK_N), num_splits)
    lo = split * tiles_per_split * BLOCK_N
    hi = tl.maximum(tl.minimum(lo + tiles_per_split * BLOCK_N, seqlen_k), lo)
    full_hi = lo + (hi - lo) // BLOCK_N * BLOCK_N

    # All q heads of this kv head share one pass over its K/V: a [GROUP padded to 16, D] tile.
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    heads = kv_head * GROUP + offs_g
    g_mask = offs_g < GROUP
    q = _load_rows(q_ptr + seq.to(tl.int64) * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
                   g_mask, offs_d, D, BLOCK_D, True, UPCAST)
    q, qk_scale = _k_scaled(q, qk_scale, k_scale_ptr, kv_head, offs_d, D, KV_FORMAT)
    q = _fp16_for_fp8_dots(q, FP16_DOTS)

    block_table_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
    k_base = k_cache_ptr + kv_head * stride_kh
    v_base = v_cache_ptr + kv_head * stride_vh
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    for start in range(lo, full_hi, BLOCK_N):
        acc, m_i, l_i = _attend_tile(
            acc, m_i, l_i, q, 0, k_base, v_base, block_table_row, start, hi, qk_scale,
            stride_kb, stride_kt, stride_vb, stride_vt, offs_d,
            D, BLOCK_D, BLOCK_SIZE, BLOCK_N, False, False, UPCAST, DOT_PRECISION, KV_FORMAT, FP16_DOTS)
    for start in range(full_hi, hi, BLOCK_N):  # at most one ragged tile
        acc, m_i, l_i = _attend_tile(
            acc, m_i, l_i, q, 0, k_base, v_base, block_table_row, start, hi, qk_scale,
            stride_kb, stride_kt, stride_vb, stride_vt, offs_d,
            D, BLOCK_D, BLOCK_SIZE, BLOCK_N, True, False, UPCAST, DOT_PRECISION, KV_FORMAT, FP16_DOTS)

    # V's dequantization scale, on the sum of p * v (partials too: the merge is linear in acc)
    acc = _v_scaled(acc, v_scale_ptr, kv_head, offs_d, D, KV_FORMAT)
    out_mask = g_mask[:, None] & (offs_d < D)[None, :]
    if SPLIT:
        # Unnormalised partials; an empty split leaves m = -inf, l = 0, acc = 0.
        part = (seq * NUM_Q_HEADS + heads) * num_splits + split
        tl.store(part_m_ptr + part, m_i, mask=g_mask)
        tl.store(part_l_ptr + part, l_i, mask=g_mask)
        tl.store(part_acc_ptr + part[:, None] * D + offs_d[None, :], acc, mask=out_mask)
    else:
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # l = 0 only for an empty (padded) sequence
        o_ptrs = o_ptr + seq.to(tl.int64) * stride_ot + heads[:, None] * stride_oh + offs_d[None, :]
        tl.store(o_ptrs, out.to(o_ptr.dtype.element_ty), mask=out_mask)
        if FP8_OUT != 0:  # o_proj's FP8 input too (decode_common.fp8_output): this program is one of H_kv parts
            row = seq.to(tl.int64)
            fp8_output(out.to(o_ptr.dtype.element_ty).to(tl.float32), out_mask, o_ptr + row * stride_ot,
                       q_out_ptr + row * (NUM_Q_HEADS * D), q_scale_ptr + row * stride_qs, stride_qg,
                       part_amax_ptr + row * (NUM_Q_HEADS // GROUP), counters_ptr + row, kv_head, kv_head * GROUP,
                       FP8_OUT, NUM_Q_HEADS // GROUP, BLOCK_KV_HEADS, GROUP, D, BLOCK_D, NUM_Q_HEADS * D)


# ---------------------------------------------------------------------------------------------
# Host side
# ---------------------------------------------------------------------------------------------


def _block_d(head_dim: int) -> int:
    return max(16, triton.next_power_of_2(head_dim))


def _dot_precision(dtype: torch.dtype) -> str:
    # fp32 inputs would default to TF32 on the GPU; bf16/fp16 ignore the setting.
    return "ieee" if dtype == torch.float32 else "tf32"


def _fp16_dots(kv_format: int, dtype: torch.dtype) -> bool:
    # over a quantized pool; fp32 activations keep fp32 dots, and so does the interpreter, which upcasts
    # every load
    return kv_format != KV_PLAIN and dtype != torch.float32 and not INTERPRET


def paged_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            meta: AttentionMetadata, scale: float, out: torch.Tensor | None = None,
                            config: PrefillConfig | None = None, kv_scales: KVScales | None = None) -> torch.Tensor:
    """Causal varlen attention of q [T, H_q, D] over each sequence's paged context (an fp8 one
    dequantized by kv_scales)."""
    num_q_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_cache.shape[2]
    out = torch.empty_like(q) if out is None else out
    if q.shape[0] == 0:
        return out
    check_last_dim_contiguous(q, k_cache, v_cache, out)
    block_d = _block_d(head_dim)
    cfg = config or prefill_config(block_d, q.dtype)
    k_scale, v_scale, kv_format = kv_scale_args(k_cache, kv_scales, meta.seqlens_k)
    grid = (triton.cdiv(meta.max_seqlen_q, cfg.block_m), num_q_heads, meta.num_seqs)
    _prefill_kernel[grid](
        q, k_cache, v_cache, out, meta.block_tables, meta.seqlens_k, meta.cu_seqlens_q, scale * LOG2E,
        k_scale, v_scale, q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), meta.block_tables.stride(0),
        GROUP=num_q_heads // num_kv_heads, BLOCK_SIZE=k_cache.shape[1], D=head_dim, BLOCK_D=block_d,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, UPCAST=INTERPRET, DOT_PRECISION=_dot_precision(q.dtype),
        KV_FORMAT=kv_format, FP16_DOTS=_fp16_dots(kv_format, q.dtype), num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    return out


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           meta: AttentionMetadata, scale: float, out: torch.Tensor | None = None,
                           num_splits: int | None = None, kv_scales: KVScales | None = None) -> torch.Tensor:
    """Attention of one query token per sequence (token i belongs to sequence i) over its paged context
    (an 8-bit one dequantized by kv_scales): over an 8-bit pool the Gluon kernel where it fits (no shared
    memory; kernels/attention/gluon_decode.py), else the Triton kernel (triton_decode_attention).

    num_splits only changes speed; None picks it from the batch size, the context and the SM count.
    """
    if meta.num_seqs and gluon_decode is not None and gluon_decode.gluon_decode_fits(q, k_cache):
        return gluon_decode.gluon_decode(q, k_cache, v_cache, meta, scale, kv_scales, num_splits=num_splits, out=out)
    return triton_decode_attention(q, k_cache, v_cache, meta, scale, out=out, num_splits=num_splits,
                                   kv_scales=kv_scales)


def triton_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            meta: AttentionMetadata, scale: float, out: torch.Tensor | None = None,
                            num_splits: int | None = None, config: DecodeConfig | None = None,
                            kv_scales: KVScales | None = None, fp8_group: int | None = None,
                            fp8_m_major: bool = False) -> torch.Tensor | tuple[torch.Tensor, QuantizedActivations]:
    """paged_decode_attention by the split-K Triton kernel: any head size, block size and pool; config
    overrides the tiles. fp8_group (fp8_output_supported): also the output in FP8 for an FP8 o_proj, a scale per
    token and `fp8_group` columns, as kernels/fp8_gemm.quantize_rows would make it (fp8_m_major: its scales laid out
    for the block recipe): returns (out, that), that None where a split step's merge leaves it to quantize_rows
    (decode_common.merge_writes_fp8)."""
    num_seqs = meta.num_seqs
    num_q_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_cache.shape[2]
    group = num_q_heads // num_kv_heads
    if out is None:  # contiguous rows: the FP8 output's last program reads a token's row back
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    fp8_out = None
    if num_seqs == 0:
        return out if fp8_group is None else (out, fp8_decode_output(out, num_kv_heads, 1, fp8_group,
                                                                         fp8_m_major).quantized)
    check_last_dim_contiguous(q, k_cache, v_cache, out)
    block_d = _block_d(head_dim)
    k_scale, v_scale, kv_format = kv_scale_args(k_cache, kv_scales, meta.seqlens_k)
    cfg = config or decode_config(block_d, q.dtype, kv_format)
    if num_splits is None:
        num_splits = decode_num_splits(num_seqs, num_kv_heads, meta.max_seqlen_k, num_sms(q.device), cfg.block_n)
    if fp8_group is not None and (num_splits == 1 or merge_writes_fp8(num_splits, num_q_heads, head_dim, fp8_group)):
        fp8_out = fp8_decode_output(out, num_kv_heads, num_splits, fp8_group, fp8_m_major)
    partials = split_partials(out, num_splits)
    part_acc, part_m, part_l = partials
    *fp8_args, fp8_mode = fp8_output_args(None if num_splits > 1 else fp8_out and fp8_out.output, out)
    _decode_kernel[(num_kv_heads, num_seqs, num_splits)](
        q, k_cache, v_cache, out, part_acc, part_m, part_l, meta.block_tables, meta.seqlens_k,
        meta.decode_order if meta.decode_order is not None else meta.seqlens_k, scale * LOG2E, k_scale, v_scale,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), meta.block_tables.stride(0), *fp8_args,
        NUM_Q_HEADS=num_q_heads, GROUP=group, BLOCK_G=max(16, triton.next_power_of_2(group)),
        BLOCK_SIZE=k_cache.shape[1], D=head_dim, BLOCK_D=block_d, BLOCK_N=cfg.block_n,
        SPLIT=num_splits > 1, HAS_ORDER=meta.decode_order is not None, UPCAST=INTERPRET,
        DOT_PRECISION=_dot_precision(q.dtype), KV_FORMAT=kv_format, FP16_DOTS=_fp16_dots(kv_format, q.dtype),
        FP8_OUT=fp8_mode, BLOCK_KV_HEADS=triton.next_power_of_2(num_kv_heads),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    if num_splits > 1:
        merge_splits(partials, out, num_splits, block_d, fp8_out and fp8_out.output)
    return out if fp8_group is None else (out, fp8_out and fp8_out.quantized)


class TritonAttentionBackend:
    """The AttentionBackend for CUDA: decode steps take the split-K kernel, all others prefill."""

    name = TRITON
    capabilities = AttentionCapabilities(fused_norm_rope_store=True, cuda_graph_safe=True,
                                         quantized_kv_dtypes=QUANTIZED_DTYPES, fp8_decode_output=True)

    def store_kvcache(self, key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                      v_cache: torch.Tensor, slot_mapping: torch.Tensor, kv_scales: KVScales | None = None) -> None:
        store_kvcache(key, value, k_cache, v_cache, slot_mapping, kv_scales)

    def norm_rope_store_kvcache(self, positions, q, k, v, cos, sin, k_cache, v_cache, slot_mapping,
                                q_norm_weight, k_norm_weight, eps, kv_scales=None, product_scales=None):
        """FusedNormRopeStore: kernels/fused_ops.qk_norm_rope_store, CUDA tensors only."""
        return fused_ops.qk_norm_rope_store(positions, q, k, v, cos, sin, k_cache, v_cache, slot_mapping,
                                            q_norm_weight, k_norm_weight, eps, kv_scales, product_scales)

    def decode_fp8(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                   scale: float, kv_scales: KVScales | None, fp8_group: int,
                   m_major: bool = False) -> QuantizedActivations | None:
        """Fp8DecodeOutput: a decode step, its output in FP8 for an FP8 o_proj, written by the decode kernels or
        their split merge, else (the Gluon kernel unsplit, a merge of many splits) quantized by quantize_rows; None
        where the groups are neither a token's nor a head's."""
        if not meta.is_decode or not fp8_output_supported(q.shape[1], q.shape[2], fp8_group):
            return None
        if meta.num_seqs and gluon_decode is not None and gluon_decode.gluon_decode_fits(q, k_cache):
            out, quantized = gluon_decode.gluon_decode(q, k_cache, v_cache, meta, scale, kv_scales,
                                                       fp8_group=fp8_group, fp8_m_major=m_major)
        else:
            out, quantized = triton_decode_attention(q, k_cache, v_cache, meta, scale, kv_scales=kv_scales,
                                                     fp8_group=fp8_group, fp8_m_major=m_major)
        if quantized is None:
            from kernels.fp8_gemm import quantize_rows

            quantized = QuantizedActivations(*quantize_rows(out.reshape(out.shape[0], -1), fp8_group, m_major),
                                             out.dtype)
        return quantized

    def forward(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float, kv_scales: KVScales | None = None) -> torch.Tensor:
        if meta.is_decode:
            return paged_decode_attention(q, k_cache, v_cache, meta, scale, kv_scales=kv_scales)
        if not meta.is_mixed:
            return paged_prefill_attention(q, k_cache, v_cache, meta, scale, kv_scales=kv_scales)
        # the prefill kernel writes only its own sequences' rows (cu_seqlens_q offsets into all of q)
        out = paged_prefill_attention(q, k_cache, v_cache, meta.prefill_part, scale, kv_scales=kv_scales)
        d = meta.num_decodes
        paged_decode_attention(q[:d], k_cache, v_cache, meta.decode_part, scale, out=out[:d], kv_scales=kv_scales)
        return out
