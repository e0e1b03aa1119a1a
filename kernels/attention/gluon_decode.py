"""Paged decode attention over an 8-bit pool (fp8, int8) in Gluon, Triton's explicit-layout dialect: no shared
memory at all.

Why: the engine's Triton decode kernel over an fp8 pool is bound by shared memory (ncu: L1/shared 75-79%,
DRAM 50-53%), because Triton stages both 8-bit operands through it and V crosses it three times. Here every
operand goes from global memory straight into the registers of the tensor-core instruction (mma.sync
m16n8k16, one warp a program), which Triton's own layouts cannot express. Two freedoms make that possible:

- q . k sums over the head dimension in any order, so K's channels are renumbered: the B operand of
  S = q K^T wants, per thread, channels {2c, 2c+1, 2c+8, 2c+9} (+16 j) of one token (c = lane % 4); renumbered,
  they are two runs of 16 contiguous bytes, two 16-byte loads. q is loaded in the same order, once.
- O^T = V^T P^T puts V^T as the A operand, whose thread holds 16 channels (m = lane / 4 + 8 r) of four tokens;
  with the output's channels renumbered the same way (undone at the store), each is 16 contiguous bytes.
P^T comes out of S's accumulator with no data movement (rows 0-7 of the M = 16 tile are the GQA group's
heads, so GROUP <= 8). The tile is one KV block (16 tokens). With no shared memory and 128-140 registers an SM
holds 14-16 of these one-warp programs, whose loads in flight hide the latency; the next block's id is read a
step ahead. The scales are the engine's: fp8's per KV head join the softmax scale and the output, int8's per
channel multiply q (in the renumbered order) and the output. Offline sm_90 SASS (bench/studies/fp8_decode_gluon.py
--sass): 244 instructions per 16-token tile for fp8 (4 KB of K and V), 330 for int8, against the engine's
Triton kernel's 671 per warp per 8 KB and its shared-memory round trips.

The engine's decode path over an 8-bit pool wherever it fits (gluon_decode_fits: block size 16, head_dim 128,
GQA group <= 8, sm_80 and up); kernels/attention/triton_backend.paged_decode_attention falls back to its Triton
kernel elsewhere. H200 (bench/studies/fp8_decode_gluon.py; 2026-12-02, e3fc8a5): 1.13-1.50x the Triton kernel's speed over the
same fp8 pool, 3.0-3.9 TB/s over its bytes, with the same error against float64.
"""
from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2

from kernels.attention.decode_common import (INT8_TO_FP16_PTX, LOG2E, fp8_decode_output, merge_splits,
                                             merge_writes_fp8, split_partials)
from kernels.attention.triton_kv_store import kv_scale_args
from kernels.fp8_quant import QuantizedActivations
from kernels.kv_quant import is_quantized
from kernels.triton_runtime import INTERPRET, num_sms

BLOCK_T = 16  # tokens per tile: one KV block of the engine's block size
D_HEAD = 128
RESIDENT_PER_SM = 14  # one-warp programs an SM holds at once: fp8's 140 registers (int8's 128: 16)

MMA = gl.constexpr(gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, 1], instr_shape=[16, 8]))
A_OP = gl.constexpr(gl.DotOperandLayout(operand_index=0, parent=MMA.value, k_width=2))
B_OP = gl.constexpr(gl.DotOperandLayout(operand_index=1, parent=MMA.value, k_width=2))
# K's tile [tokens, channels] as loaded: a thread holds bytes 16 c .. 16 c + 15 and 64 + 16 c .. of tokens g and
# g + 8 (g = lane / 4, c = lane % 4), so each 16-byte load of a warp reads whole 32-byte sectors
K_LOADED = gl.constexpr(gl.DistributedLinearLayout(
    reg_bases=[[0, 1], [0, 2], [0, 4], [0, 8], [0, 64], [8, 0]],
    lane_bases=[[0, 16], [0, 32], [1, 0], [2, 0], [4, 0]], warp_bases=[], block_bases=[], shape=[16, 128]))
# the scores of the group's heads: rows 0-7 of S's accumulator [16, 16] (its m + 8 register dropped)
S_HEADS = gl.constexpr(gl.DistributedLinearLayout(
    reg_bases=[[0, 1], [0, 8]], lane_bases=[[0, 2], [0, 4], [1, 0], [2, 0], [4, 0]], warp_bases=[], block_bases=[],
    shape=[8, 16]))
# V's tile as loaded: 16 contiguous bytes (channels 16 g ..) of tokens 2c, 2c + 1, 2c + 8, 2c + 9
V_LOADED = gl.constexpr(gl.DistributedLinearLayout(
    reg_bases=[[0, 1], [0, 2], [0, 4], [0, 8], [1, 0], [8, 0]],
    lane_bases=[[2, 0], [4, 0], [0, 16], [0, 32], [0, 64]], warp_bases=[], block_bases=[], shape=[16, 128]))


@gluon.jit
def _to_fp16(x, KV_FORMAT: gl.constexpr, PTX_INT8: gl.constexpr):
    """8-bit values to fp16, exactly: e4m3 in one instruction a pair; int8 four at a time by the engine's inline PTX
    (kernels/attention/decode_common.INT8_TO_FP16_PTX)."""
    if KV_FORMAT == 2 and PTX_INT8:
        return gl.inline_asm_elementwise(INT8_TO_FP16_PTX, "=r,=r,r", [x], dtype=gl.float16, is_pure=True, pack=4)
    return x.to(gl.float16)


@gluon.jit
def _k_operand(k):
    """K [16, 128] fp16 in K_LOADED -> K^T [128, 16] as the B operand, channels renumbered (no data movement):
    loaded channel 64 j2 + 16 c + 8 j1 + 4 j0 + 2 h + e becomes logical channel 64 j2 + 32 j1 + 16 j0 + 8 h + 2 c + e,
    the B operand's k for thread c."""
    k = gl.reshape(k, [16, 2, 4, 2, 2, 2, 2])  # [token, j2, c, j1, j0, h, e]
    k = gl.permute(k, [0, 1, 3, 4, 5, 2, 6])  # [token, j2, j1, j0, h, c, e]
    k = gl.reshape(k, [16, 128])
    return gl.convert_layout(gl.permute(k, [1, 0]), B_OP, assert_trivial=True)


@gluon.jit
def _v_operand(v):
    """V [16, 128] fp16 in V_LOADED -> V^T [128, 16] as the A operand: loaded channel 16 g + r becomes
    logical row 8 r + g (a register permutation; the fp16 halves repack into the MMA's token pairs)."""
    v = gl.permute(v, [1, 0])
    v = gl.reshape(v, [8, 16, 16])
    v = gl.permute(v, [1, 0, 2])
    v = gl.reshape(v, [128, 16])
    return gl.convert_layout(v, A_OP, assert_trivial=True)


@gluon.jit
def _attend_block(acc, m_i, l_i, q, k, v, start, seqlen, qk_scale, MASK: gl.constexpr, KV_FORMAT: gl.constexpr,
                  PTX_INT8: gl.constexpr):
    """One online-softmax step over the 16 tokens start.. of K and V (already loaded, 8-bit)."""
    k = _to_fp16(k, KV_FORMAT, PTX_INT8)
    v = _to_fp16(v, KV_FORMAT, PTX_INT8)
    s = gl.zeros([16, 16], gl.float32, MMA)
    s = mma_v2(q, _k_operand(k), s) * qk_scale  # [heads padded to 16, tokens]
    # rows 0-7 hold the group's heads: keep them (a register half, no data movement)
    s, _ = gl.split(gl.permute(gl.reshape(s, [2, 8, 16]), [1, 2, 0]))
    s = gl.convert_layout(s, S_HEADS, assert_trivial=True)
    if MASK:
        pos = start + gl.arange(0, 16, layout=gl.SliceLayout(0, S_HEADS))
        s = gl.where((pos < seqlen)[None, :], s, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(s, 1))
    alpha = gl.exp2(m_i - m_new)
    p = gl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + gl.sum(p, 1)
    p_t = gl.convert_layout(gl.permute(p.to(gl.float16), [1, 0]), B_OP, assert_trivial=True)  # [tokens, 8]
    alpha = gl.convert_layout(alpha, gl.SliceLayout(0, MMA))
    acc = mma_v2(_v_operand(v), p_t, acc * alpha[None, :])  # O^T [128 channels, 8 heads]
    return acc, m_new, l_i


@gluon.jit
def _load_block(k_base, v_base, block, stride_kb, stride_kt, offs_kt, offs_kd, offs_vt, offs_vd):
    k = gl.load(k_base + block * stride_kb + offs_kt[:, None] * stride_kt + offs_kd[None, :])
    v = gl.load(v_base + block * stride_kb + offs_vt[:, None] * stride_kt + offs_vd[None, :])
    return k, v


@gluon.jit(do_not_specialize=["stride_bt"], do_not_specialize_on_alignment=["k_scale_ptr", "v_scale_ptr"])
def gluon_decode_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, o_ptr, part_acc_ptr, part_m_ptr, part_l_ptr,
    block_tables_ptr, seqlens_k_ptr, order_ptr, qk_scale, k_scale_ptr, v_scale_ptr,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_kb, stride_kt, stride_kh, stride_bt,
    NUM_Q_HEADS: gl.constexpr, GROUP: gl.constexpr, SPLIT: gl.constexpr, HAS_ORDER: gl.constexpr,
    KV_FORMAT: gl.constexpr, PTX_INT8: gl.constexpr,
):
    kv_head = gl.program_id(0)
    if HAS_ORDER:
        seq = gl.load(order_ptr + gl.program_id(1))
    else:
        seq = gl.program_id(1)
    split = gl.program_id(2)
    num_splits = gl.num_programs(2)
    seqlen = gl.load(seqlens_k_ptr + seq)
    blocks = gl.cdiv(seqlen, 16)
    per_split = gl.cdiv(blocks, num_splits)
    lo = split * per_split
    hi = gl.minimum(lo + per_split, blocks)  # blocks lo .. hi-1; the last may be partly filled
    full_hi = gl.maximum(gl.minimum(hi, seqlen // 16), lo)
    if KV_FORMAT == 1:  # fp8: K's scale per KV head joins the softmax scale
        qk_scale = qk_scale * gl.load(k_scale_ptr + kv_head)

    # q [16 (the group's heads, then padding), 128] as the A operand, its channels renumbered like K's
    offs_h = gl.arange(0, 16, layout=gl.SliceLayout(1, A_OP))
    offs_k = gl.arange(0, 128, layout=gl.SliceLayout(0, A_OP))
    q_chan = ((offs_k & 1) + 2 * ((offs_k >> 3) & 1) + 4 * ((offs_k >> 4) & 1) + 8 * ((offs_k >> 5) & 1)
              + 16 * ((offs_k >> 1) & 3) + 64 * (offs_k >> 6))
    heads = kv_head * GROUP + offs_h
    q = gl.load(q_ptr + seq.to(gl.int64) * stride_qt + heads[:, None] * stride_qh + q_chan[None, :],
                mask=(offs_h < GROUP)[:, None], other=0.0)
    q = q.to(gl.float32)
    if KV_FORMAT == 2:  # int8: K's scale per channel multiplies q (q . k = sum_d (q_d s_d) k_d)
        q = q * gl.load(k_scale_ptr + kv_head * 128 + q_chan)[None, :]
    q = gl.minimum(gl.maximum(q, -65504.0), 65504.0).to(gl.float16)

    offs_kt = gl.arange(0, 16, layout=gl.SliceLayout(1, K_LOADED))
    offs_kd = gl.arange(0, 128, layout=gl.SliceLayout(0, K_LOADED))
    offs_vt = gl.arange(0, 16, layout=gl.SliceLayout(1, V_LOADED))
    offs_vd = gl.arange(0, 128, layout=gl.SliceLayout(0, V_LOADED))
    k_base = k_cache_ptr + kv_head * stride_kh
    v_base = v_cache_ptr + kv_head * stride_kh
    bt = block_tables_ptr + seq.to(gl.int64) * stride_bt

    acc = gl.zeros([128, 8], gl.float32, MMA)
    m_i = gl.full([8], float("-inf"), gl.float32, gl.SliceLayout(1, S_HEADS))
    l_i = gl.zeros_like(m_i)
    # the next block's id is fetched a step ahead, so a step waits on one load, not two in a row. Its K and V are
    # not: the many one-warp programs an SM holds hide their latency, and a prefetch in registers costs 128 of
    # them (Triton keeps each loaded byte in a register of its own): 255 registers and spills, offline
    block = gl.load(bt + gl.maximum(gl.minimum(lo, blocks - 1), 0))  # an empty split reads block 0
    for b in range(lo, full_hi):
        next_block = gl.load(bt + gl.minimum(b + 1, hi - 1))
        k, v = _load_block(k_base, v_base, block.to(gl.int64), stride_kb, stride_kt, offs_kt, offs_kd, offs_vt,
                           offs_vd)
        acc, m_i, l_i = _attend_block(acc, m_i, l_i, q, k, v, b * 16, seqlen, qk_scale, False, KV_FORMAT, PTX_INT8)
        block = next_block
    if full_hi < hi:  # the context's last, partly filled block: V's unwritten rows must not meet p = 0 as NaN
        k, v = _load_block(k_base, v_base, block.to(gl.int64), stride_kb, stride_kt, offs_kt, offs_kd, offs_vt,
                           offs_vd)
        pos_v = full_hi * 16 + offs_vt
        v = gl.where((pos_v < seqlen)[:, None], v, gl.zeros_like(v))
        acc, m_i, l_i = _attend_block(acc, m_i, l_i, q, k, v, full_hi * 16, seqlen, qk_scale, True, KV_FORMAT,
                                      PTX_INT8)

    # back to channel order: logical row 8 r + g is channel 16 g + r
    offs_c = gl.arange(0, 128, layout=gl.SliceLayout(1, MMA))
    chan = 16 * (offs_c & 7) + (offs_c >> 3)
    if KV_FORMAT == 1:  # V's dequantization scale, on the sum of p * v
        acc = acc * gl.load(v_scale_ptr + kv_head)
    else:
        acc = acc * gl.load(v_scale_ptr + kv_head * 128 + chan)[:, None]
    offs_g = gl.arange(0, 8, layout=gl.SliceLayout(0, MMA))
    heads = kv_head * GROUP + offs_g
    out_mask = (offs_g < GROUP)[None, :]
    l_out = gl.convert_layout(l_i, gl.SliceLayout(0, MMA))
    if SPLIT:  # unnormalised partials in the engine's layout, for decode_common.merge_splits
        part = (seq * NUM_Q_HEADS + heads) * num_splits + split
        gl.store(part_m_ptr + part, gl.convert_layout(m_i, gl.SliceLayout(0, MMA)), mask=offs_g < GROUP)
        gl.store(part_l_ptr + part, l_out, mask=offs_g < GROUP)
        gl.store(part_acc_ptr + part[None, :] * 128 + chan[:, None], acc, mask=out_mask)
    else:
        out = acc / gl.where(l_out > 0, l_out, 1.0)[None, :]
        o_ptrs = o_ptr + seq.to(gl.int64) * stride_ot + heads[None, :] * stride_oh + chan[:, None]
        gl.store(o_ptrs, out.to(o_ptr.dtype.element_ty), mask=out_mask)


def gluon_num_splits(num_seqs: int, num_kv_heads: int, max_seqlen_k: int, sm_count: int) -> int:
    """Splits of each context: about as many one-warp programs as the SMs hold at once (RESIDENT_PER_SM), and
    at least two while there are fewer than two such waves, each split keeping at least 4 blocks.

    H200 (bench/studies/fp8_decode_gluon.py --splits 0 1 2 3 4 6 8; 2026-12-02, e3fc8a5): the throughput run's ragged batches of
    256 and 153 sequences (2,048 and 1,224 programs) ran fastest at 2 splits, 1.1-1.4x faster than at 1, where
    the longest contexts end the step alone; 59 and 64 sequences at 4 (3 and 5 were 1.1-1.3x slower: a wave
    and a bit of programs); 7 at ~24."""
    resident = RESIDENT_PER_SM * sm_count
    programs = num_seqs * num_kv_heads
    splits = max(round(resident / programs), 2 if programs < 2 * resident else 1)
    return max(1, min(splits, triton.cdiv(max(max_seqlen_k, 1), BLOCK_T) // 4, 32))


def gluon_decode_fits(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether gluon_decode runs this layer's decode: an 8-bit pool of 16-token blocks, head_dim 128, a GQA
    group of at most 8 and a 16-bit q, on a GPU with mma.sync m16n8k16 (sm_80 and up)."""
    if INTERPRET or not q.is_cuda or not is_quantized(k_cache):
        return False
    num_q_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_cache.shape[2]
    return (head_dim == D_HEAD and k_cache.shape[1] == BLOCK_T and num_q_heads % num_kv_heads == 0
            and num_q_heads // num_kv_heads <= 8 and q.dtype in (torch.bfloat16, torch.float16)
            and torch.cuda.get_device_capability(q.device) >= (8, 0))


def gluon_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta, scale: float,
                 kv_scales, num_splits: int | None = None, out: torch.Tensor | None = None,
                 fp8_group: int | None = None, fp8_m_major: bool = False
                 ) -> torch.Tensor | tuple[torch.Tensor, QuantizedActivations | None]:
    """Attention of one query token per sequence over its paged context in an fp8 or int8 pool, dequantized by
    kv_scales, where gluon_decode_fits; num_splits only changes speed (None: gluon_num_splits). fp8_group: also the
    output in FP8 for an FP8 o_proj (decode_common.fp8_output), written by the split merge (fp8_m_major: its scales
    laid out for the block recipe): returns (out, that), that None when the context is not split, or split into more
    than the merge writes FP8 from (decode_common.merge_writes_fp8)."""
    num_seqs, num_q_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    group = num_q_heads // num_kv_heads
    assert head_dim == D_HEAD and k_cache.shape[1] == BLOCK_T and group <= 8, (head_dim, k_cache.shape, group)
    assert k_cache.stride() == v_cache.stride()
    k_scale, v_scale, kv_format = kv_scale_args(k_cache, kv_scales, meta.seqlens_k)
    if out is None:  # contiguous rows: the FP8 output's last program reads a token's row back
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if num_splits is None:
        num_splits = gluon_num_splits(num_seqs, num_kv_heads, meta.max_seqlen_k, num_sms(q.device))
    fp8 = (fp8_decode_output(out, num_kv_heads, num_splits, fp8_group, fp8_m_major)
           if fp8_group and num_splits > 1 and merge_writes_fp8(num_splits, num_q_heads, head_dim, fp8_group) else None)
    partials = split_partials(out, num_splits)
    part_acc, part_m, part_l = partials
    order = meta.decode_order
    gluon_decode_kernel[(num_kv_heads, num_seqs, num_splits)](
        q, k_cache, v_cache, out, part_acc, part_m, part_l, meta.block_tables, meta.seqlens_k,
        order if order is not None else meta.seqlens_k, scale * LOG2E, k_scale, v_scale,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), meta.block_tables.stride(0),
        NUM_Q_HEADS=num_q_heads, GROUP=group, SPLIT=num_splits > 1, HAS_ORDER=order is not None,
        KV_FORMAT=kv_format, PTX_INT8=not INTERPRET, num_warps=1)
    if num_splits > 1:
        merge_splits(partials, out, num_splits, head_dim, fp8 and fp8.output)
    if fp8_group is None:
        return out
    return out, fp8 and fp8.quantized
