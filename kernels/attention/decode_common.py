"""What both decode kernels (the Triton one in triton_backend.py, the Gluon one in gluon_decode.py) share:
base-2 softmax, the int8 -> fp16 conversion, and flash-decoding's split partials (their workspace, and the kernel
that merges them into the output). Also the FP8 output of a decode step for an FP8 o_proj (FP8_OUT_*): the
programs that write a token's heads quantize them as kernels/fp8_gemm.quantize_rows would quantize the bf16 output.
"""
from __future__ import annotations

import os
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from kernels.attention.triton_kv_store import fp8_scale, quantize_fp8
from kernels.fp8_quant import MIN_SCALE, QuantizedActivations, empty_quantized

LOG2E = 1.4426950408889634  # softmax runs in base 2: exp(x) = exp2(x * log2(e))
_MIN_SCALE = tl.constexpr(MIN_SCALE)

# the decode output for an FP8 o_proj: none; a scale per token (channel weights), whose last program to finish
# quantizes the token's row; a scale per head (a 1 x head_dim group: block weights of 128 columns, D = 128)
FP8_OUT_NONE, FP8_OUT_PER_TOKEN, FP8_OUT_PER_HEAD = 0, 1, 2
_ROW_CHUNK = tl.constexpr(1024)  # columns the last program quantizes at a time
# a split step's merge writes o_proj's FP8 input with a scale per token up to this many splits (a power of two): one
# program a token, its heads' splits in registers, its row quantized from them. Past it (a token's splits would not
# fit the registers) the merge writes bf16 only and kernels/fp8_gemm.quantize_rows quantizes it, which was faster
# than a program a head whose last counts and re-reads the row (bench/studies/fp8_merge_output.py).
ROW_MERGE_MAX_SPLITS = int(os.environ.get("NANOSERVE_FP8_ROW_MERGE_MAX_SPLITS", "4"))
ROW_MERGE_MAX_COLUMNS = 8192  # a token's row (heads x head_dim, powers of two) one merge program holds: 64 x 128


class Fp8Output(NamedTuple):
    """Where a decode kernel writes o_proj's FP8 input: values [T, H*D], scales [T, 1] or [T, H], and for per-token
    scales each (token, part)'s max |y| [T, parts] and the tokens' counters (zeros, left at zero)."""

    q: torch.Tensor
    scale: torch.Tensor
    mode: int
    part_amax: torch.Tensor
    counters: torch.Tensor


@triton.jit
def fp8_output(y, mask, o_row_ptr, q_row_ptr, scale_row_ptr, stride_qg, part_amax_row_ptr, counter_ptr, part,
               first_head, MODE: tl.constexpr, NUM_PARTS: tl.constexpr, BLOCK_PARTS: tl.constexpr, HEADS: tl.constexpr,
               D: tl.constexpr, BLOCK_D: tl.constexpr, ROW: tl.constexpr):
    """After a program stored heads [first_head, first_head + HEADS) of one token's output row (ROW = H * D columns,
    contiguous heads; y [rows, BLOCK_D] those values in fp32, rounded to the output's dtype, `mask` the real ones;
    the token's scales stride_qg apart: 1, or M-major for the block recipe):
    MODE per head, quantize each of them with its own scale, read back from the row (in registers beside the
    output, the per-head scales took the decode kernel from 128 sm_90 registers to 162, 4 programs an SM to 3);
    MODE per token, leave this part's max |y|, count the part in the token's counter, and, if it is the last of
    the token's NUM_PARTS to count, quantize the token's row from what every part stored (read from L2), then
    reset the counter. The barriers and the atomic's release order every thread's stores before the count, the
    last one's acquire and barrier its reads after (as kernels/fp8_gemm's split-K)."""
    if MODE == 2:
        tl.debug_barrier()  # this program's stores, before its threads read them back
        offs = tl.arange(0, BLOCK_D)
        for h in tl.static_range(HEADS):
            cols = (first_head + h) * D + offs
            x = tl.load(o_row_ptr + cols, mask=offs < D, other=0.0).to(tl.float32)
            scale = fp8_scale(tl.max(tl.abs(x), axis=0), _MIN_SCALE)
            tl.store(q_row_ptr + cols, quantize_fp8(x, scale).to(q_row_ptr.dtype.element_ty), mask=offs < D)
            tl.store(scale_row_ptr + (first_head + h) * stride_qg, scale)
    else:
        y = tl.where(mask, y, 0.0)
        tl.store(part_amax_row_ptr + part, tl.max(tl.max(tl.abs(y), axis=1), axis=0))
        tl.debug_barrier()
        counted = tl.atomic_add(counter_ptr, 1, sem="acq_rel", scope="gpu")
        if counted == NUM_PARTS - 1:
            tl.debug_barrier()
            parts = tl.arange(0, BLOCK_PARTS)
            amax = tl.load(part_amax_row_ptr + parts, mask=parts < NUM_PARTS, other=0.0, cache_modifier=".cg")
            scale = fp8_scale(tl.max(amax, axis=0), _MIN_SCALE)
            for start in tl.static_range(0, ROW, _ROW_CHUNK):
                offs = start + tl.arange(0, _ROW_CHUNK)
                x = tl.load(o_row_ptr + offs, mask=offs < ROW, other=0.0, cache_modifier=".cg").to(tl.float32)
                tl.store(q_row_ptr + offs, quantize_fp8(x, scale).to(q_row_ptr.dtype.element_ty), mask=offs < ROW)
            tl.store(scale_row_ptr, scale)
            tl.atomic_xchg(counter_ptr, 0)


# int8 x as fp16, exactly, four values per 32-bit register: x ^ 0x80 is x + 128 as a byte, which PRMT places
# under 0x64, fp16 1024 + (x + 128), and a packed fp16 subtract of 1152 leaves x. One LOP3, two PRMT and two
# HSUB2 per four values, where Triton's own conversion extracts and converts each byte. (Inputs: one register
# of four int8; outputs: two of fp16 pairs; inline_asm_elementwise(..., "=r,=r,r", pack=4).)
INT8_TO_FP16_PTX = tl.constexpr("""{
    .reg .b32 t, c;
    xor.b32 t, $2, 0x80808080;
    prmt.b32 $0, t, 0x64646464, 0x4140;
    prmt.b32 $1, t, 0x64646464, 0x4342;
    mov.b32 c, 0x64806480;
    sub.f16x2 $0, $0, c;
    sub.f16x2 $1, $1, c;
    }""")


@triton.jit(do_not_specialize=["num_splits"])
def _merge_splits_kernel(
    part_acc_ptr, part_m_ptr, part_l_ptr, o_ptr, stride_ot, stride_oh, num_splits,
    q_out_ptr, q_scale_ptr, part_amax_ptr, counters_ptr, stride_qs, stride_qg,
    NUM_Q_HEADS: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr,
    FP8_OUT: tl.constexpr, BLOCK_Q_HEADS: tl.constexpr, HEADS: tl.constexpr,
):
    """Merge the splits' partial softmaxes of HEADS heads of one token: rescale each to the global max, then
    normalise. The splits are added in their order (unrolled, so that their loads all issue at once), so any HEADS
    gives the same bits. With FP8_OUT, quantize the output for an FP8 o_proj: per head (fp8_output), or per token
    from registers, where a program holds the token's every head (HEADS >= NUM_Q_HEADS)."""
    first_head = tl.program_id(0) * HEADS
    seq = tl.program_id(1)
    heads = first_head + tl.arange(0, HEADS)
    offs_d = tl.arange(0, BLOCK_D)
    h_mask = heads < NUM_Q_HEADS
    mask = h_mask[:, None] & (offs_d < D)[None, :]
    first = (seq * NUM_Q_HEADS + heads) * num_splits  # each head's first split
    m_max = tl.full([HEADS], float("-inf"), tl.float32)
    for s in tl.static_range(BLOCK_S):
        m_max = tl.maximum(m_max, tl.load(part_m_ptr + first + s, mask=h_mask & (s < num_splits),
                                          other=float("-inf")))
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)  # every split empty: keep exp2 finite
    l_sum = tl.zeros([HEADS], tl.float32)
    acc = tl.zeros([HEADS, BLOCK_D], tl.float32)
    for s in tl.static_range(BLOCK_S):
        valid = h_mask & (s < num_splits)
        w = tl.math.exp2(tl.load(part_m_ptr + first + s, mask=valid, other=float("-inf")) - m_max)
        l_sum += w * tl.load(part_l_ptr + first + s, mask=valid, other=0.0)
        part = tl.load(part_acc_ptr + (first + s)[:, None] * D + offs_d[None, :], mask=valid[:, None] & mask,
                       other=0.0)
        acc += w[:, None] * part
    y = (acc / tl.where(l_sum > 0, l_sum, 1.0)[:, None]).to(o_ptr.dtype.element_ty)
    row = seq.to(tl.int64)
    tl.store(o_ptr + row * stride_ot + heads[:, None] * stride_oh + offs_d[None, :], y, mask=mask)
    y = y.to(tl.float32)
    if FP8_OUT == 1:  # the token's whole row is here (HEADS >= NUM_Q_HEADS): its scale from registers
        y = tl.where(mask, y, 0.0)
        scale = fp8_scale(tl.max(tl.max(tl.abs(y), axis=1), axis=0), _MIN_SCALE)
        tl.store(q_out_ptr + row * (NUM_Q_HEADS * D) + heads[:, None] * D + offs_d[None, :],
                 quantize_fp8(y, scale).to(q_out_ptr.dtype.element_ty), mask=mask)
        tl.store(q_scale_ptr + row * stride_qs, scale)
    elif FP8_OUT == 2:
        fp8_output(y, mask, o_ptr + row * stride_ot, q_out_ptr + row * (NUM_Q_HEADS * D),
                   q_scale_ptr + row * stride_qs, stride_qg, part_amax_ptr, counters_ptr, tl.program_id(0),
                   first_head, FP8_OUT, (NUM_Q_HEADS + HEADS - 1) // HEADS, BLOCK_Q_HEADS, HEADS, D, BLOCK_D,
                   NUM_Q_HEADS * D)


def split_partials(out: torch.Tensor, num_splits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The splits' unnormalised partials for out [B, H_q, D] in one allocation: acc [B, H_q, splits, D], then
    max and sum [B, H_q, splits]. One split writes out directly: then the three are out, pointers the decode
    kernels never touch when SPLIT is False."""
    if num_splits == 1:
        return out, out, out
    num_seqs, num_q_heads, head_dim = out.shape
    n = num_seqs * num_q_heads * num_splits
    workspace = torch.empty(n * (head_dim + 2), dtype=torch.float32, device=out.device)
    part_acc, part_m, part_l = workspace.split([n * head_dim, n, n])
    return part_acc, part_m, part_l


def fp8_output_args(fp8_out: Fp8Output | None, like: torch.Tensor) -> tuple:
    """The kernels' (q, scales, parts' maxes, counters, scales' row and group strides, FP8_OUT) for fp8_out; with
    none, pointers they never read."""
    if fp8_out is None:
        return like, like, like, like, 0, 0, FP8_OUT_NONE
    return fp8_out.q, fp8_out.scale, fp8_out.part_amax, fp8_out.counters, *fp8_out.scale.stride(), fp8_out.mode


def merge_splits(partials: tuple[torch.Tensor, torch.Tensor, torch.Tensor], out: torch.Tensor, num_splits: int,
                 block_d: int, fp8_out: Fp8Output | None = None) -> None:
    """out [B, H_q, D] from the partials that split_partials allocated and a decode kernel wrote (and fp8_out's
    FP8 copy of it)."""
    num_seqs, num_q_heads, head_dim = out.shape
    part_acc, part_m, part_l = partials
    block_s, block_q_heads = triton.next_power_of_2(num_splits), triton.next_power_of_2(num_q_heads)
    *fp8_args, fp8_mode = fp8_output_args(fp8_out, out)
    per_token = fp8_mode == FP8_OUT_PER_TOKEN
    assert not per_token or merge_writes_fp8(num_splits, num_q_heads, head_dim, num_q_heads * head_dim), \
        "merge_writes_fp8 says where the merge may write a scale per token"
    heads = block_q_heads if per_token else 1  # a scale per token: a program a token
    _merge_splits_kernel[(triton.cdiv(num_q_heads, heads), num_seqs)](
        part_acc, part_m, part_l, out, out.stride(0), out.stride(1), num_splits, *fp8_args,
        NUM_Q_HEADS=num_q_heads, D=head_dim, BLOCK_D=block_d, BLOCK_S=block_s, FP8_OUT=fp8_mode,
        BLOCK_Q_HEADS=block_q_heads, HEADS=heads, num_warps=max(4, heads * block_d // 512),  # 32 x 128: 8 warps
    )


def merge_writes_fp8(num_splits: int, num_q_heads: int, head_dim: int, fp8_group: int) -> bool:
    """Whether a step split num_splits ways has its merge write o_proj's FP8 input (a scale per head always; per
    token up to ROW_MERGE_MAX_SPLITS splits of a row of at most ROW_MERGE_MAX_COLUMNS), rather than leave it to
    quantize_rows."""
    per_token = fp8_group >= num_q_heads * head_dim
    row = triton.next_power_of_2(num_q_heads) * triton.next_power_of_2(head_dim)
    return not per_token or (triton.next_power_of_2(num_splits) <= ROW_MERGE_MAX_SPLITS
                             and row <= ROW_MERGE_MAX_COLUMNS)


def fp8_output_supported(num_q_heads: int, head_dim: int, fp8_group: int) -> bool:
    """Whether the decode kernels write o_proj's FP8 input in groups of fp8_group columns: a scale per token (the
    group spans the row) or per head (the group is one head)."""
    return fp8_group >= num_q_heads * head_dim or fp8_group == head_dim


class Fp8Decode(NamedTuple):
    """A decode step's FP8 output, as the kernels write it and as o_proj reads it (the same tensors)."""

    output: Fp8Output  # what the kernels take
    quantized: QuantizedActivations  # what o_proj takes


def fp8_decode_output(out: torch.Tensor, num_kv_heads: int, num_splits: int, fp8_group: int,
                      m_major: bool = False) -> Fp8Decode:
    """The FP8 output's buffers for out [T, H_q, D]: values [T, H_q * D] and scales (kernels/fp8_quant.empty_quantized,
    rows rounded up as o_proj's padded GEMMs read them; m_major: laid out for the block recipe); with a scale per
    token and one split, the programs that write a token's heads (its H_kv programs) count in the device's zeroed
    counters (split, a merge program holds the token's row)."""
    from kernels.fp8_gemm import split_counters

    num_seqs, num_q_heads, head_dim = out.shape
    assert out.is_contiguous(), "the programs read a token's heads back as one row"
    if not fp8_output_supported(num_q_heads, head_dim, fp8_group):
        raise ValueError(f"the decode kernels write FP8 a scale per token or per head ({head_dim} columns), "
                         f"not per {fp8_group}")
    per_token = fp8_group >= num_q_heads * head_dim
    q, scale = empty_quantized(num_seqs, num_q_heads * head_dim, 1 if per_token else num_q_heads, out.device, m_major)
    counted = per_token and num_splits == 1
    part_amax = torch.empty(num_seqs, num_kv_heads, dtype=torch.float32, device=out.device) if counted else scale
    counters = split_counters(out.device)
    if counted and num_seqs > counters.numel():
        raise ValueError(f"FP8 decode output for {num_seqs} sequences: {counters.numel()} counters")
    mode = FP8_OUT_PER_TOKEN if per_token else FP8_OUT_PER_HEAD
    return Fp8Decode(Fp8Output(q, scale, mode, part_amax, counters), QuantizedActivations(q, scale, out.dtype))
