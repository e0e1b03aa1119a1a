"""The FP8 GEMM of FP8 Linear weights: y = (x quantized per token) @ (W quantized)^T, the scales applied in
fp32 on the accumulator, the output in the activation dtype.

A weight is float8_e4m3fn [N, K] with float32 scales [N, G]: G = 1 is a scale per output row (channel:
compressed-tensors checkpoints, --quantization fp8); G = ceil(K / group_k) is a scale per row and group of
group_k input columns (block checkpoints, their 128-row blocks repeated per row at load, so that a
tensor-parallel shard boundary inside a block costs nothing). Activations are quantized in the same
groups: per token for channel weights, per token and group_k columns for block weights (DeepSeek's
1 x 128), scale = max|x| / 448 over the group.

Four GEMMs, chosen per shape and token count by kernels/fp8_gemm_dispatch.py:
- `torch._scaled_mm` with row-wise scales (per token x per channel; channel weights only): cuBLASLt's
  outer-vector-scaled kernel on sm_90;
- `torch._scaled_mm` tensor-wise on unit scales (channel weights only), then `_scale_product_kernel` applies
  the per-token and per-channel scales to the bf16 product in place: cuBLASLt's plain FP8 kernels, which on
  the H200 stream W 1.3-1.6x faster than its outer-vector ones at decode's M (bench/RESULTS.md, 2026-12-04).
  The unscaled product (|x_q|, |w_q| <= 448) lies far inside bf16's range, so this costs one more bf16 rounding
  and nothing else;
- `torch.nn.functional.scaled_mm` with torch's block recipe (block weights whose scales are whole 128 x 128 blocks,
  activations per token and 128 columns): cuBLASLt's block-scaled kernels (CUDA 12.9 and up), which on the H200 beat
  the Triton kernel from about 128 tokens (bench/RESULTS.md, 2026-12-05);
- `_fp8_gemm_kernel`, Triton: channel weights accumulate over all of K and scale once in the epilogue;
  block weights scale each group's partial product (BLOCK_K = group_k) as it joins the accumulator.
  Either way the fp32 accumulator takes each K tile's product (at most 128 deep) in an fp32 add: Hopper's
  fp8 tensor cores accumulate with fewer bits (Triton's default there lets a whole K run so, which cost up
  to 2.5e-3 of max |y| at K = 2048 on the H200), DeepSeek-V3's promotion interval.
  At few tokens the product is a read of W by too few programs for the SMs: split-K gives each output tile
  SPLIT_K programs over slices of K, whose last one adds up the fp32 partials in the same launch.

On GPUs without FP8 tensor cores (before sm_89) `weight_only_fp8_gemm` runs the same Triton kernel with W_ONLY: the
activations are not quantized, and each W tile is read as bytes and widened to their dtype (e4m3_as_fp16: each value
/ 2^8 in three integer operations, the 2^8 folded into the scales), so the weights keep FP8's memory where no FP8
product can run.

The three cuBLASLt recipes above (row-wise, tensor-wise, block) run on the algorithm cuBLASLt's heuristic gives
torch, unless the dispatch's CUBLASLT_ALGOS names another for that shape and token count: then `cublaslt_product`
runs that one through kernels/cublaslt.py (the same product, on another of cuBLASLt's kernels, split-K ones included).
The row-wise and tensor-wise ones accumulate fast (unpromoted) from the dispatch's FAST_ACCUM_FROM tokens; torch
refuses fast accumulation with block scales.

Nothing syncs with the host or sizes by data, so all of it captures in the decode CUDA graphs. On the CPU
the engine never calls this (fp8 weights are dequantized at load); the Triton kernels still run, unchanged,
in Triton 3.6's interpreter (TRITON_INTERPRET=1), which dots float8 operands in fp32.
"""
from __future__ import annotations

import logging

import torch
import triton
import triton.language as tl

from kernels.attention.triton_kv_store import fp8_scale, quantize_fp8
from kernels.fp8_gemm_dispatch import cublaslt_algorithm
from kernels.fp8_quant import (MIN_SCALE, QuantizedActivations, UnscaledProduct, block_recipe_rows, empty_quantized,
                               m_major_in_place, rows_in_place)
from kernels.triton_runtime import INTERPRET

_MIN_SCALE = tl.constexpr(MIN_SCALE)
log = logging.getLogger("nanoserve.kernels")

# ---------------------------------------------------------------------------------------------
# Activation quantization: a scale per row (token) and group of columns
# ---------------------------------------------------------------------------------------------


@triton.jit(do_not_specialize=["num_rows"])
def _quantize_rows_kernel(x_ptr, q_ptr, scale_ptr, num_rows, k, group, x_stride, stride_sm, stride_sg, max_scale,
                          BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1)
    start = g * group
    amax = tl.zeros([BLOCK], dtype=tl.float32)
    for off in range(0, group, BLOCK):
        cols = start + off + tl.arange(0, BLOCK)
        mask = (cols < k) & (off + tl.arange(0, BLOCK) < group)
        x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    scale = tl.minimum(fp8_scale(tl.max(amax, axis=0), _MIN_SCALE), max_scale)  # values past it saturate
    tl.store(scale_ptr + row * stride_sm + g * stride_sg, scale)
    for off in range(0, group, BLOCK):
        cols = start + off + tl.arange(0, BLOCK)
        mask = (cols < k) & (off + tl.arange(0, BLOCK) < group)
        x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0)
        tl.store(q_ptr + row * k + cols, quantize_fp8(x, scale).to(q_ptr.dtype.element_ty), mask=mask)


def quantize_rows(x: torch.Tensor, group: int, m_major: bool = False,
                  max_scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """kernels/fp8_quant.quantize_rows_ref in one kernel: x [M, K] (unit stride in K); m_major: the scales laid out
    for the block recipe (kernels/fp8_quant.empty_quantized); max_scale: the largest scale a group may take."""
    m, k = x.shape
    if x.stride(1) != 1:
        x = x.contiguous()
    groups = -(-k // group)
    q, scale = empty_quantized(m, k, groups, x.device, m_major)
    if m > 0:
        block = min(1024, triton.next_power_of_2(group))
        _quantize_rows_kernel[(m, groups)](x, q, scale, m, k, group, x.stride(0), *scale.stride(),
                                           float("inf") if max_scale is None else max_scale, BLOCK=block,
                                           num_warps=1 if INTERPRET else max(1, min(8, block // 256)))
    return q, scale


# ---------------------------------------------------------------------------------------------
# The Triton GEMM
# ---------------------------------------------------------------------------------------------


@triton.jit
def e4m3_from_bytes(b):
    """float8_e4m3fn values given as their bytes (uint8) as float32, exactly (NaN included): the weight-only GEMM's
    reading of FP8 weights, since Triton has no e4m3 type before sm_89 (sm_80 and sm_86 refuse fp8e4nv)."""
    bits = b.to(tl.int32)
    exponent = (bits >> 3) & 0xF
    mantissa = bits & 0x7
    normal = ((exponent + 120) << 23) | (mantissa << 20)  # 1.m x 2^(e - 7), as float32 bits
    subnormal = (mantissa.to(tl.float32) * 0.001953125).to(tl.int32, bitcast=True)  # m x 2^-9
    sign = (bits & 0x80) << 24  # set by bits, so that -0.0 keeps its sign
    value = (tl.where(exponent == 0, subnormal, normal) | sign).to(tl.float32, bitcast=True)
    return tl.where((bits & 0x7F) == 0x7F, float("nan"), value)


# e4m3_as_fp16 reads each weight as its value / 2^8 (fp16's exponent bias is 15, e4m3's 7): the weight-only GEMM
# multiplies its scales by this, exactly
E4M3_AS_FP16_UNSCALE = tl.constexpr(256.0)


@triton.jit
def e4m3_as_fp16(b):
    """float8_e4m3fn values given as their bytes (uint8) as float16 holding each value / 2^8, exactly: the byte's
    exponent and mantissa fields are fp16's low exponent and high mantissa bits, its sign fp16's sign, so e4m3's
    subnormals land on fp16's with the same factor. A shift and two masks a byte, where e4m3_from_bytes takes about
    15 operations: the weight-only GEMM's decode, which issues once per W element a program reads. The NaN bytes
    (0x7F, 0xFF) read as +-480 / 2^8: the loader refuses weights that hold them (executor_svc/layers/fp8.py)."""
    bits = b.to(tl.uint16) << 7
    return ((bits & 0x3F80) | ((bits << 1) & 0x8000)).to(tl.float16, bitcast=True)


@triton.jit
def _fp8_gemm_epilogue(acc, rows64, cols64, row_mask, col_mask, a_scale_ptr, w_scale_ptr, bias_ptr, c_ptr, stride_cm,
                       stride_asm, GROUPED: tl.constexpr, HAS_BIAS: tl.constexpr, W_ONLY: tl.constexpr):
    if not GROUPED:  # channel scales apply once, to the whole accumulator
        w_s = tl.load(w_scale_ptr + cols64, mask=col_mask, other=0.0)
        if W_ONLY:  # the activations were not quantized; W was read as its values / 2^8 (e4m3_as_fp16)
            acc = acc * (w_s * E4M3_AS_FP16_UNSCALE)[None, :]
        else:
            a_s = tl.load(a_scale_ptr + rows64 * stride_asm, mask=row_mask, other=0.0)
            acc = acc * (a_s[:, None] * w_s[None, :])
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols64, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    c_ptrs = c_ptr + rows64[:, None] * stride_cm + cols64[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=row_mask[:, None] & col_mask[None, :])


@triton.jit(do_not_specialize=["m"])
def _fp8_gemm_kernel(
    a_ptr, a_scale_ptr, w_ptr, w_scale_ptr, bias_ptr, c_ptr, partial_ptr, counter_ptr,
    m, n, k, num_groups, stride_am, stride_wn, stride_cm, stride_asm, stride_asg,
    GROUPED: tl.constexpr, W_PER_TILE: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    PROMOTE_K: tl.constexpr, SPLIT_K: tl.constexpr, W_ONLY: tl.constexpr = False, PRECISION: tl.constexpr = "tf32",
    UPCAST: tl.constexpr = False,
):
    # W_ONLY (weight_only_fp8_gemm): a holds plain activations and W its FP8 bytes (uint8), widened to a's dtype exactly
    # in the tile and multiplied on bf16/fp16 tensor cores; no activation scales
    # programs ordered in GROUP_M-row bands, so that neighbours share W's tiles in L2
    pid = tl.program_id(0)
    num_pid_m, num_pid_n = tl.cdiv(m, BLOCK_M), tl.cdiv(n, BLOCK_N)
    band = pid // (GROUP_M * num_pid_n)
    first_m = band * GROUP_M
    band_rows = min(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % (GROUP_M * num_pid_n)) % band_rows
    pid_n = (pid % (GROUP_M * num_pid_n)) // band_rows
    # split-K: program (tile, split) sums K tiles [first_kt, last_kt) of its output tile (unsplit: a loop from 0,
    # which compiles to a tighter pipelined loop than one from a run-time start)
    split = tl.program_id(1)
    if SPLIT_K == 1:
        first_kt = 0
        last_kt = tl.cdiv(k, BLOCK_K)
    else:
        kts_per_split = tl.cdiv(tl.cdiv(k, BLOCK_K), SPLIT_K)
        first_kt = split * kts_per_split
        last_kt = tl.minimum(first_kt + kts_per_split, tl.cdiv(k, BLOCK_K))

    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask, col_mask = rows < m, cols < n
    rows64, cols64 = rows.to(tl.int64), cols.to(tl.int64)
    ks = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + rows64[:, None] * stride_am + first_kt * BLOCK_K + ks[None, :]
    w_ptrs = w_ptr + cols64[None, :] * stride_wn + first_kt * BLOCK_K + ks[:, None]  # W^T's tile [BLOCK_K, BLOCK_N]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for kt in range(first_kt, last_kt):
        k_mask = ks < k - kt * BLOCK_K
        a = tl.load(a_ptrs, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=k_mask[:, None] & col_mask[None, :], other=0.0)
        if W_ONLY:
            if UPCAST:  # the interpreter's bf16 arithmetic is wrong: fp32 there
                a = a.to(tl.float32)
            w = e4m3_as_fp16(w).to(a.dtype)  # exact in bf16 and fp32 too (at most 4 significant bits, 2^-17..2)
        if GROUPED:  # one K tile is one scale group
            if W_ONLY:  # no activation scales; W was read as its values / 2^8 (e4m3_as_fp16)
                a_s = tl.full([BLOCK_M], E4M3_AS_FP16_UNSCALE, tl.float32)
                part = tl.dot(a, w, input_precision=PRECISION)
            else:
                a_s = tl.load(a_scale_ptr + rows64 * stride_asm + kt * stride_asg, mask=row_mask, other=0.0)
                part = tl.dot(a, w)
            if W_PER_TILE:  # the tile's rows of W share their scale: one scalar
                w_s = tl.load(w_scale_ptr + (pid_n * BLOCK_N).to(tl.int64) * num_groups + kt)
                acc += part * (a_s * w_s)[:, None]
            else:
                w_s = tl.load(w_scale_ptr + cols64 * num_groups + kt, mask=col_mask, other=0.0)
                acc += part * (a_s[:, None] * w_s[None, :])
        elif W_ONLY:  # 16-bit products accumulate in fp32 on every GPU
            acc = tl.dot(a, w, acc, input_precision=PRECISION)
        else:
            acc = tl.dot(a, w, acc, max_num_imprecise_acc=PROMOTE_K)  # fp32 adds every 128 of K at most (Hopper)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if SPLIT_K == 1:
        _fp8_gemm_epilogue(acc, rows64, cols64, row_mask, col_mask, a_scale_ptr, w_scale_ptr, bias_ptr, c_ptr,
                           stride_cm, stride_asm, GROUPED, HAS_BIAS, W_ONLY)
    else:
        # Each split leaves its fp32 partial in the workspace [SPLIT_K, m, n] and counts itself in its tile's
        # counter; the split that counts last adds the others' partials to its own, writes the output and sets
        # the counter back to 0 for the next call (one launch, no memset: it replays in a CUDA graph). The barrier
        # and the atomic's release order every thread's partial before the count; the last one's acquire and
        # barrier order the reads after it, which go to L2 (.cg), where the other SMs' stores are.
        tile_mask = row_mask[:, None] & col_mask[None, :]
        part = rows64[:, None] * n + cols64[None, :]
        tl.store(partial_ptr + split * m * n + part, acc, mask=tile_mask)
        tl.debug_barrier()
        counted = tl.atomic_add(counter_ptr + pid, 1, sem="acq_rel", scope="gpu")
        if counted == SPLIT_K - 1:
            tl.debug_barrier()
            for other in tl.static_range(SPLIT_K):
                acc += tl.load(partial_ptr + other * m * n + part, mask=tile_mask & (other != split), other=0.0,
                               cache_modifier=".cg")
            _fp8_gemm_epilogue(acc, rows64, cols64, row_mask, col_mask, a_scale_ptr, w_scale_ptr, bias_ptr, c_ptr,
                               stride_cm, stride_asm, GROUPED, HAS_BIAS, W_ONLY)
            tl.atomic_xchg(counter_ptr + pid, 0)


PROMOTE_K = 128  # the channel kernel's fp32 add interval in K (DeepSeek-V3's): Hopper's fp8 accumulation is shorter



SPLIT_COUNTERS = 1 << 16  # output tiles a split-K GEMM may count in (256 KB a device): M <= 256 by 16 x 16 tiles
_device_tensors: dict[tuple[str, torch.device], torch.Tensor] = {}


def _per_device(name: str, device: torch.device, make) -> torch.Tensor:
    """The device's tensor of that name, made by make(device) on first use. The loader asks for each once FP8 weights
    are on CUDA (executor_svc/layers/fp8.finish_loading), so that they exist before the decode CUDA graphs are
    captured."""
    tensor = _device_tensors.get((name, device))
    if tensor is None:
        tensor = _device_tensors[(name, device)] = make(device)
    return tensor


def split_counters(device: torch.device) -> torch.Tensor:
    """The device's split-K tile counters: zeros, and left at zero by every split-K GEMM."""
    return _per_device("split_counters", device,
                       lambda d: torch.zeros(SPLIT_COUNTERS, dtype=torch.int32, device=d))


def _tiles(m: int, n: int, k: int, group_k: int, grouped: bool, weight_only: bool = False) -> tuple[int, ...]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages[, SPLIT_K]) for a GEMM of m rows: the sweep's choice for this
    shape and M (kernels/fp8_gemm_dispatch.TILES), else a rule: small m is weight-bound, so narrow N tiles put more
    programs on the SMs; large m takes 128 x 128 tiles. Block weights take BLOCK_K = group_k (one scale a tile). The
    weight-only GEMM (16-bit activations: twice the bytes a K column) takes the rule, 64 deep for channel weights."""
    from kernels.fp8_gemm_dispatch import measured_tiles

    block_k = group_k if grouped else 64 if weight_only else 128
    if INTERPRET:
        return 16, 16, min(block_k, 32) if not grouped else block_k, 1, 1
    tiles = None if weight_only else measured_tiles("block" if grouped else "channel", m, n, k)
    if tiles is not None and (not grouped or tiles[2] == group_k):
        return tiles
    if m <= 16:
        return 16, 64, block_k, 4, 4
    if m <= 64:
        return 64, 64, block_k, 4, 4
    return 128, 128, block_k, 8, 3


def triton_fp8_gemm(a: torch.Tensor, a_scale: torch.Tensor | None, w: torch.Tensor, w_scale: torch.Tensor,
                    group_k: int, out_dtype: torch.dtype, bias: torch.Tensor | None = None,
                    tiles: tuple[int, ...] | None = None, rows_sharing_scales: int = 1) -> torch.Tensor:
    """a [M, K] fp8 with scales [M, G] (row-major or M-major), w [N, K] fp8 with scales [N, G] -> [M, N] in out_dtype.
    a_scale None: the weight-only GEMM (weight_only_fp8_gemm), a plain activations in out_dtype.
    G = 1: per token x per channel; else a scale per group_k columns of K (group_k >= 32 on a GPU: an FP8 dot's K).
    `tiles` overrides _tiles' choice (the sweep of bench/fp8_gemm_table.py); a sixth entry, SPLIT_K > 1, splits
    K over that many programs per output tile (more programs for a weight-bound product of few rows).
    `rows_sharing_scales` (kernels/fp8_quant.rows_sharing_scales of w_scale, found at load): where an N tile lies
    in such a run, each K group takes one weight scale, not a vector of BLOCK_N (whose loads, outer product and
    registers made the loop of a 128 x 128 tile 413 sm_90 instructions against the channel kernel's 181)."""
    m, k = a.shape
    n = w.shape[0]
    grouped, weight_only = w_scale.shape[1] > 1, a_scale is None
    out = torch.empty(m, n, dtype=out_dtype, device=a.device)
    if m == 0:
        return out
    block_m, block_n, block_k, warps, stages, *split = tiles or _tiles(m, n, k, group_k, grouped, weight_only)
    num_tiles = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
    num_kt = triton.cdiv(k, block_k)
    split_k = min(split[0] if split else 1, num_kt)
    if split_k > 1:  # the splits share out K's tiles evenly; fewer splits when the last would get none
        split_k = triton.cdiv(num_kt, triton.cdiv(num_kt, split_k))
    if split_k > 1 and num_tiles <= SPLIT_COUNTERS:
        partial, counters = torch.empty(split_k, m, n, dtype=torch.float32, device=a.device), split_counters(a.device)
    else:
        split_k, partial, counters = 1, out, out
    if weight_only:  # W's bytes: Triton types no e4m3 before sm_89; a_scale only fills a pointer the kernel never reads
        a_scale, w = w_scale, w.view(torch.uint8)
    _fp8_gemm_kernel[(num_tiles, split_k)](
        a, a_scale, w, w_scale, bias if bias is not None else out, out, partial, counters,
        m, n, k, w_scale.shape[1], a.stride(0), w.stride(0), out.stride(0), *a_scale.stride(),
        GROUPED=grouped, W_PER_TILE=grouped and rows_sharing_scales % block_n == 0, HAS_BIAS=bias is not None,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=8, PROMOTE_K=min(block_k, PROMOTE_K),
        SPLIT_K=split_k, W_ONLY=weight_only, PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
        UPCAST=INTERPRET and weight_only, num_warps=warps, num_stages=stages,
    )
    return out


# from this many tokens the weight-only GEMM dequantizes W whole into a scratch in the activation dtype and multiplies
# on cuBLAS: the product is compute-bound there, and widening each W tile in every program that reads it (once per M
# tile) would cost tensor-core time, while one pass over W costs ~1% of a 4,096-token product (the rule vLLM's AWQ
# path follows, at the same 256; not measured here: no GPU without FP8 tensor cores has run it)
WEIGHT_ONLY_DEQUANTIZE_FROM = 256


def weight_only_fp8_gemm(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, group_k: int,
                         bias: torch.Tensor | None = None, rows_sharing_scales: int = 1) -> torch.Tensor:
    """x [..., K] (bf16, fp16 or fp32) @ (FP8 w [N, K] with scales [N, G])^T -> [..., N] in x's dtype, the activations
    not quantized. Below WEIGHT_ONLY_DEQUANTIZE_FROM tokens each W tile is widened to x's dtype in the kernel
    (exactly: every e4m3 value is a bf16 one), the products on 16-bit tensor cores, block scales per K tile and channel
    scales in the epilogue; from there W is dequantized whole (dequantize_fp8_weight: the weights the CPU serves)
    and the product is torch's. For GPUs without FP8 tensor cores (before sm_89), where FP8 weights would otherwise
    be dequantized at load and take 16-bit memory."""
    rows = x.reshape(-1, x.shape[-1])
    if rows.shape[0] >= WEIGHT_ONLY_DEQUANTIZE_FROM:
        return torch.nn.functional.linear(x, dequantize_fp8_weight(w, w_scale, group_k, x.dtype), bias)
    rows = rows if rows.stride(1) == 1 else rows.contiguous()
    out = triton_fp8_gemm(rows, None, w, w_scale, group_k, x.dtype, bias, rows_sharing_scales=rows_sharing_scales)
    return out.view(*x.shape[:-1], w.shape[0])


@triton.jit
def _dequantize_kernel(w_ptr, s_ptr, out_ptr, n, k, group, stride_wn, stride_sn, stride_on,
                       BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    rows = (tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    mask = (rows < n)[:, None] & (cols < k)[None, :]
    w = e4m3_from_bytes(tl.load(w_ptr + rows[:, None] * stride_wn + cols[None, :], mask=mask, other=0))
    s = tl.load(s_ptr + rows[:, None] * stride_sn + (cols // group)[None, :], mask=mask, other=0.0)
    tl.store(out_ptr + rows[:, None] * stride_on + cols[None, :], (w * s).to(out_ptr.dtype.element_ty), mask=mask)


def dequantize_fp8_weight(w: torch.Tensor, w_scale: torch.Tensor, group_k: int, dtype: torch.dtype) -> torch.Tensor:
    """FP8 w [N, K] times its scales [N, G] (a scale per row and group_k columns), in float32, rounded to dtype: what
    kernels/fp8_quant.dequantize_rows gives, in one kernel that reads W as bytes (any GPU)."""
    n, k = w.shape
    out = torch.empty(n, k, dtype=dtype, device=w.device)
    block_n, block_k = (16, 32) if INTERPRET else (32, 256)
    _dequantize_kernel[(triton.cdiv(n, block_n), triton.cdiv(k, block_k))](
        w.view(torch.uint8), w_scale, out, n, k, group_k, w.stride(0), w_scale.stride(0), out.stride(0),
        BLOCK_N=block_n, BLOCK_K=block_k, num_warps=1 if INTERPRET else 4)
    return out


def _padded_rows(t: torch.Tensor, rows: int, fill: float) -> torch.Tensor:
    """t [M, C] seen as `rows` rows (rows > M): its buffer's spare rows where it has them (the activations' and their
    scales': empty_quantized), else rows of `fill` appended (a copy). Each output row of a row-scaled product depends
    on its own row only, so whatever the spare rows hold changes none of the first M."""
    padded = rows_in_place(t, rows)
    return padded if padded is not None else torch.cat([t, t.new_full((rows - t.shape[0], t.shape[1]), fill)])


def scaled_mm_fp8_gemm(a: torch.Tensor, a_scale: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
                       out_dtype: torch.dtype, bias: torch.Tensor | None = None, rows: int = 0,
                       fast_accum: bool = False) -> torch.Tensor:
    """torch._scaled_mm with row-wise scales: per token [M, 1] x per channel [1, N]; W^T is column-major
    as a [N, K] row-major weight's transpose already is. rows > M runs the product on that many rows, where
    cuBLASLt is faster so (_padded_rows); the first M come back. fast_accum: the tensor cores' own accumulation
    over all of K, unpromoted (kernels/fp8_gemm_dispatch.fast_accumulation says where)."""
    m = a.shape[0]
    if rows > m:
        a, a_scale = _padded_rows(a, rows, 0.0), _padded_rows(a_scale, rows, 1.0)
    out = cublaslt_product("outer", m, a, w, a_scale.reshape(-1), w_scale.reshape(-1), out_dtype, fast_accum)
    if out is None:
        out = torch._scaled_mm(a, w.t(), scale_a=a_scale, scale_b=w_scale.view(1, -1), out_dtype=out_dtype,
                               use_fast_accum=fast_accum)
    out = out[:m]
    return out if bias is None else out + bias


def block_recipe_runs(device: torch.device) -> bool:
    """Whether torch's block recipe can run on `device`: torch.nn.functional.scaled_mm with its block scaling types,
    built against CUDA 12.9 or later (cuBLASLt's block-scaled kernels), on Hopper or later (the one measured); else
    block weights stay on the Triton kernel."""
    import torch.nn.functional as F

    if device.type != "cuda" or not hasattr(F, "scaled_mm") or not hasattr(F, "ScalingType") or not torch.version.cuda:
        return False
    cuda = tuple(int(v) for v in torch.version.cuda.split(".")[:2])
    return cuda >= (12, 9) and torch.cuda.get_device_capability(device) >= (9, 0)


def block_scaled_mm_fp8_gemm(a: torch.Tensor, a_scale: torch.Tensor, w: torch.Tensor, w_blocks: torch.Tensor,
                             out_dtype: torch.dtype, bias: torch.Tensor | None = None, rows: int = 0) -> torch.Tensor:
    """torch's block recipe: a [M, K] with scales [M, K / 128] (1 x 128), w [N, K] with one scale per 128 x 128 block,
    w_blocks [N / 128, K / 128] (kernels/fp8_quant.block_scales_of). The product runs on max(M, rows) rounded up to
    kernels/fp8_quant.BLOCK_RECIPE_ROWS: never slower on the H200, and a multiple of 4 (cuBLASLt refused other
    leading dimensions: CUBLAS_STATUS_NOT_SUPPORTED). cuBLASLt takes the activations' scales M-major, strides (1,
    rows): where their producer wrote them so (empty_quantized's m_major) they are read in place, else copied here
    (one small kernel). A bf16 output is the one measured (fp8_linear takes Triton for others). Always promoted:
    torch refuses fast accumulation with block scales."""
    import torch.nn.functional as F

    m = a.shape[0]
    rows = block_recipe_rows(max(rows, m))
    scale_a = m_major_in_place(a_scale, rows)
    if rows > m:
        a = _padded_rows(a, rows, 0.0)
    if scale_a is None:
        scale_a = (_padded_rows(a_scale, rows, 1.0) if rows > m else a_scale).t().contiguous().t()
    out = cublaslt_product("block", m, a, w, scale_a.t(), w_blocks, out_dtype, False)
    if out is None:
        out = F.scaled_mm(a, w.t(), scale_a, F.ScalingType.BlockWise1x128, w_blocks.t(),
                          F.ScalingType.BlockWise128x128, output_dtype=out_dtype)
    out = out[:m]
    return out if bias is None else out + bias


_cublaslt_plans: dict[tuple, tuple] = {}


def cublaslt_product(recipe: str, m: int, a: torch.Tensor, w: torch.Tensor, a_scale: torch.Tensor,
                     w_scale: torch.Tensor, out_dtype: torch.dtype, fast_accum: bool) -> torch.Tensor | None:
    """a [rows, K] @ w^T (its first m rows the tokens) on the cuBLASLt algorithm that
    kernels/fp8_gemm_dispatch.CUBLASLT_ALGOS names for `recipe` at m tokens, the scales as kernels/cublaslt's `recipe`
    takes them; None where it names none, or cuBLASLt refuses it for this product (a warning says so once): the caller
    then takes torch's call. A plan per row count and algorithm, made on its first call (host-side only, so also
    during a CUDA graph's capture: the loader readied the library first)."""
    config = cublaslt_algorithm(recipe, m, *w.shape)
    if config is None:
        return None
    from kernels import cublaslt

    key = (a.device, recipe, a.shape[0], *w.shape, a.stride(0), out_dtype, fast_accum, tuple(sorted(config.items())))
    entry = _cublaslt_plans.get(key)
    if entry is None:
        plan = cublaslt.Fp8Matmul(w.shape[0], w.shape[1], a.shape[0], out_dtype, recipe, fast_accum, a.device,
                                  a.stride(0))
        entry = _cublaslt_plans[key] = (plan, plan.built(config))
        if entry[1] is None:
            log.warning("cuBLASLt refuses algorithm %s for a %s product of %d x %d x %d; torch's call runs it", config,
                        recipe, a.shape[0], w.shape[0], w.shape[1])
    plan, algo = entry
    return None if algo is None else plan(a, w, algo, x_scale=a_scale, w_scale=w_scale)


@triton.jit(do_not_specialize=["m"])
def _scale_product_kernel(y_ptr, out_ptr, a_scale_ptr, w_scale_ptr, bias_ptr, m, n, stride_y, stride_out,
                          HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    rows = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    cols = (tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    row_mask, col_mask = rows < m, cols < n
    mask = row_mask[:, None] & col_mask[None, :]
    y = tl.load(y_ptr + rows[:, None] * stride_y + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    a_s = tl.load(a_scale_ptr + rows, mask=row_mask, other=0.0)
    w_s = tl.load(w_scale_ptr + cols, mask=col_mask, other=0.0)
    y = y * (a_s[:, None] * w_s[None, :])
    if HAS_BIAS:
        y += tl.load(bias_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + rows[:, None] * stride_out + cols[None, :], y.to(out_ptr.dtype.element_ty), mask=mask)


def scale_product(y: torch.Tensor, a_scale: torch.Tensor, w_scale: torch.Tensor, out_dtype: torch.dtype,
                  bias: torch.Tensor | None = None) -> torch.Tensor:
    """y [M, N] (an unscaled product x_q @ w_q^T) * a_scale [M, 1] * w_scale [N, 1] (+ bias), in fp32, into
    out_dtype: in y's own buffer where the dtypes match."""
    m, n = y.shape
    out = y if y.dtype == out_dtype else torch.empty(m, n, dtype=out_dtype, device=y.device)
    if m == 0:
        return out
    block_m, block_n = (16, 32) if INTERPRET else (4, 1024)
    _scale_product_kernel[(triton.cdiv(m, block_m), triton.cdiv(n, block_n))](
        y, out, a_scale, w_scale, bias if bias is not None else y, m, n, y.stride(0), out.stride(0),
        HAS_BIAS=bias is not None, BLOCK_M=block_m, BLOCK_N=block_n, num_warps=1 if INTERPRET else 4)
    return out


def scaled(product: UnscaledProduct) -> torch.Tensor:
    """The output an UnscaledProduct stands for, for a reader that cannot apply its scales."""
    return scale_product(product.product, product.row_scale, product.col_scale, product.dtype)


def unit_scale(device: torch.device) -> torch.Tensor:
    """A float32 1 on the device: the tensor-wise GEMM's scales."""
    return _per_device("unit_scale", device, lambda d: torch.ones((), dtype=torch.float32, device=d))


def unit_scaled_mm_fp8_gemm(a: torch.Tensor, a_scale: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
                            out_dtype: torch.dtype, bias: torch.Tensor | None = None, rows: int = 0,
                            fast_accum: bool = False) -> torch.Tensor:
    """torch._scaled_mm tensor-wise on unit scales (the unscaled product, in bf16, or fp32 for an fp32 output: fp16
    could overflow), then scale_product: channel weights only. rows > M and fast_accum as in scaled_mm_fp8_gemm."""
    product_dtype = torch.float32 if out_dtype == torch.float32 else torch.bfloat16
    return scale_product(unit_scaled_product(a, w, product_dtype, rows, fast_accum), a_scale, w_scale, out_dtype, bias)


def unit_scaled_product(a: torch.Tensor, w: torch.Tensor, product_dtype: torch.dtype, rows: int = 0,
                        fast_accum: bool = False) -> torch.Tensor:
    """x_q @ w_q^T, unscaled, in product_dtype: torch._scaled_mm tensor-wise on unit scales, on `rows` rows if more
    than M (_padded_rows); the first M rows. fast_accum as in scaled_mm_fp8_gemm."""
    m = a.shape[0]
    if rows > m:
        a = _padded_rows(a, rows, 0.0)
    one = unit_scale(a.device)
    out = cublaslt_product("tensor", m, a, w, one, one, product_dtype, fast_accum)
    if out is None:
        out = torch._scaled_mm(a, w.t(), scale_a=one, scale_b=one, out_dtype=product_dtype, use_fast_accum=fast_accum)
    return out[:m]


def fp8_linear(x: torch.Tensor | QuantizedActivations, w: torch.Tensor, w_scale: torch.Tensor, group_k: int,
               bias: torch.Tensor | None = None, unscaled: bool = False, rows_sharing_scales: int = 1,
               block_scales: torch.Tensor | None = None,
               max_scale: float | None = None) -> torch.Tensor | UnscaledProduct:
    """x [..., K] in bf16/fp16/fp32 through an FP8 weight (see the module docstring) -> [..., N] in x's dtype.
    x may come quantized already (QuantizedActivations [M, K], by the kernel that produced it), in the
    groups the weight's scales need; else one kernel quantizes it here. `unscaled`: the reader can apply the scales
    itself, so where the dispatch picks the tensor-wise GEMM (bf16 [M, K] activations, no bias) the product comes back
    as an UnscaledProduct, without scale_product's pass. `rows_sharing_scales`: triton_fp8_gemm's. `block_scales`:
    w's scales as whole 128 x 128 blocks (kernels/fp8_quant.block_scales_of), where they are (block_scaled_mm).
    `max_scale`: the largest scale x's tokens take here (kernels/fp8_quant.activation_max_scale; a producer that
    quantizes x does not bound its scales, so a layer with a bound is not fed so: executor_svc/layers/fp8.py)."""
    from kernels.fp8_gemm_dispatch import M_MAJOR_SCALES, choose_gemm, fast_accumulation

    grouped = w_scale.shape[1] > 1
    quantized = isinstance(x, QuantizedActivations)
    out_dtype, lead = x.dtype, (x.q if quantized else x).shape[:-1]
    n, k = w.shape
    m = lead.numel()
    backend, rows = choose_gemm("block" if grouped else "channel", m, n, k,
                                whole_blocks=block_scales is not None and out_dtype == torch.bfloat16)
    if quantized:
        a, a_scale = x.q, x.scale
        if a_scale.shape[1] != w_scale.shape[1]:
            raise ValueError(f"activations quantized in {a_scale.shape[1]} groups for a weight of {w_scale.shape[1]}")
        if max_scale is not None:
            raise ValueError("activations quantized by their producer for a layer that bounds their scales")
    else:  # the block recipe's scales written M-major, as it reads them
        a, a_scale = quantize_rows(x.reshape(-1, x.shape[-1]), group_k if grouped else k,
                                   m_major=M_MAJOR_SCALES and backend == "block_scaled_mm", max_scale=max_scale)
    fast = fast_accumulation(m)
    if backend == "block_scaled_mm":
        out = block_scaled_mm_fp8_gemm(a, a_scale, w, block_scales, out_dtype, bias, rows=rows)
    elif backend == "scaled_mm":
        out = scaled_mm_fp8_gemm(a, a_scale, w, w_scale, out_dtype, bias, rows=rows, fast_accum=fast)
    elif backend == "unit_scaled_mm":
        if unscaled and bias is None and out_dtype == torch.bfloat16 and len(lead) == 1:
            product = unit_scaled_product(a, w, torch.bfloat16, rows, fast)
            return UnscaledProduct(product, a_scale, w_scale, out_dtype)
        out = unit_scaled_mm_fp8_gemm(a, a_scale, w, w_scale, out_dtype, bias, rows=rows, fast_accum=fast)
    else:
        out = triton_fp8_gemm(a, a_scale, w, w_scale, group_k, out_dtype, bias,
                              rows_sharing_scales=rows_sharing_scales)
    return out.view(*lead, n)
