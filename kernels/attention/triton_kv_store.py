"""Writing K/V into the paged pool in Triton: store_kvcache, and the quantize-on-write (fp8, int8) that
it shares with the fused attention prologue (kernels/fused_ops.qk_norm_rope_store).

kernels/kv_quant.py defines the formats and is the torch reference; quantize_fp8 and quantize_int8 give
its bytes exactly. Each pool format is a compile-time branch of the kernels (KV_FORMAT: KV_PLAIN for the
model's dtype, stored as it always was, KV_FP8 with a scale per KV head, KV_INT8 per head and channel).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.kv_quant import KVScales, is_fp8, is_int8, is_quantized
from kernels.triton_runtime import INTERPRET

KV_PLAIN, KV_FP8, KV_INT8 = 0, 1, 2  # a pool's format: the kernels' KV_FORMAT

# ---------------------------------------------------------------------------------------------
# quantize-on-write
# ---------------------------------------------------------------------------------------------

FP8_MAX = tl.constexpr(448.0)
# Triton 3.6's interpreter casts fp32 to float8e4nv wrongly: a value that rounds up into the next
# power of two comes out in the lower one (31.7 -> 16, not 32), ties do not go to even, and
# subnormals are cut. There the value is rounded onto the fp8 grid first, so the cast is exact.
_ROUND_BEFORE_CAST = tl.constexpr(INTERPRET)
_SUBNORMAL_LIMIT = tl.constexpr(2.0 ** -6)  # e4m3's smallest normal
_SUBNORMAL_SNAP = tl.constexpr(1.5 * 2.0 ** 14)  # x + this - this rounds x to a multiple of 2^-9 (e4m3's step there)
_KEPT_BITS = tl.constexpr(-(1 << 20))  # sign, exponent and the 3 top mantissa bits of an fp32


@triton.jit
def quantize_fp8(x, scale):
    """x / scale in fp32 (IEEE division, as torch divides), clamped to +-448 so that the cast to
    float8_e4m3fn that follows rounds to nearest even and never makes NaN; scale broadcasts."""
    y = tl.math.div_rn(x.to(tl.float32), scale)
    y = tl.minimum(tl.maximum(y, -FP8_MAX), FP8_MAX)
    if _ROUND_BEFORE_CAST:
        y = _round_to_e4m3(y)
    return y


@triton.jit
def fp8_scale(amax, min_scale: tl.constexpr):
    """The scale of a group whose largest magnitude is amax: amax / 448 by IEEE division, as torch divides on the CPU
    (kernels/fp8_quant.group_scales), and at least min_scale. Triton's `/` is div.full.f32, not correctly rounded:
    with it the kernels' scales agreed with CUDA torch's (a multiply by 1/448) and not with the CPU's exact quotients
    where amax / 448 is exact (amax's mantissa a multiple of 7), groups with many exact ties x / scale that a scale an
    ulp up rounds all one way. A CPU emulation of that ulp reproduced, token for token, how far a w8a8 MoE layer on
    the H200 was from the CPU reference (1-3e-2 of its norm, 2026-12-04)."""
    return tl.maximum(tl.math.div_rn(amax, FP8_MAX), min_scale)


@triton.jit
def quantize_int8(x, scale):
    """x / scale in fp32 (IEEE division), rounded to the nearest integer with ties away from zero and
    clamped to +-127, as kernels/kv_quant.quantize does: an integral fp32 that casts to int8 exactly."""
    y = tl.math.div_rn(x.to(tl.float32), scale)
    y = tl.where(y >= 0, tl.floor(y + 0.5), tl.ceil(y - 0.5))
    return tl.minimum(tl.maximum(y, -127.0), 127.0)


@triton.jit
def _round_to_e4m3(y):
    """y (within +-448) rounded to nearest even on the e4m3 grid, in fp32: 3 mantissa bits for normal
    values, steps of 2^-9 below 2^-6 (sign kept, -0 included)."""
    bits = y.to(tl.int32, bitcast=True)
    lsb = (bits >> 20) & 1  # the lowest mantissa bit that e4m3 keeps
    normal = ((bits + 0x7FFFF + lsb) & _KEPT_BITS).to(tl.float32, bitcast=True)
    small = (tl.abs(y) + _SUBNORMAL_SNAP) - _SUBNORMAL_SNAP
    small = small * tl.where(bits < 0, -1.0, 1.0)  # a multiply, not 0 - x, keeps -0
    return tl.where(tl.abs(y) < _SUBNORMAL_LIMIT, small, normal)


# ---------------------------------------------------------------------------------------------
# store_kvcache
# ---------------------------------------------------------------------------------------------


# a layer's scales are a row of the pool's [2, L, H_kv(, D)]: any alignment, one compiled variant
@triton.jit(do_not_specialize_on_alignment=["k_scale_ptr", "v_scale_ptr"])
def _store_kvcache_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr, k_scale_ptr, v_scale_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kcb, stride_kct, stride_kch, stride_vcb, stride_vct, stride_vch,
    BLOCK_SIZE: tl.constexpr, D: tl.constexpr, HKV_D: tl.constexpr, BLOCK: tl.constexpr, KV_FORMAT: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token)
    offs = tl.arange(0, BLOCK)
    head = offs // D
    d = offs % D
    # slot -1 (padding, or a prefix-cache hit already stored) masks the whole row.
    mask = (offs < HKV_D) & (slot >= 0)
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    k = tl.load(key_ptr + token * stride_kt + head * stride_kh + d, mask=mask)
    v = tl.load(value_ptr + token * stride_vt + head * stride_vh + d, mask=mask)
    if KV_FORMAT == 1:  # fp8: per-KV-head scales
        k = quantize_fp8(k, tl.load(k_scale_ptr + head, mask=offs < HKV_D, other=1.0))
        v = quantize_fp8(v, tl.load(v_scale_ptr + head, mask=offs < HKV_D, other=1.0))
    elif KV_FORMAT == 2:  # int8: per KV head and channel, [H_kv, D] row-major like the token's row
        k = quantize_int8(k, tl.load(k_scale_ptr + offs, mask=offs < HKV_D, other=1.0))
        v = quantize_int8(v, tl.load(v_scale_ptr + offs, mask=offs < HKV_D, other=1.0))
    tl.store(k_cache_ptr + block * stride_kcb + offset * stride_kct + head * stride_kch + d,
             k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + block * stride_vcb + offset * stride_vct + head * stride_vch + d,
             v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def check_last_dim_contiguous(*tensors: torch.Tensor) -> None:
    for t in tensors:
        if t.stride(-1) != 1:
            raise ValueError(f"the head_dim axis must be contiguous, got strides {t.stride()}")


def kv_scale_args(k_cache: torch.Tensor, kv_scales: KVScales | None, unused: torch.Tensor) -> tuple:
    """(k_scale, v_scale, KV_FORMAT) for a kernel: a quantized cache's scales ([H_kv] for fp8, [H_kv, D]
    for int8); for other caches two pointers the kernel never reads."""
    if not is_quantized(k_cache):
        return unused, unused, KV_PLAIN
    if kv_scales is None:
        raise ValueError(f"a {k_cache.dtype} KV cache needs its layer's KVScales")
    if is_int8(k_cache) and kv_scales.k.shape != k_cache.shape[2:]:
        raise ValueError(f"an int8 KV cache takes scales per KV head and channel {tuple(k_cache.shape[2:])}, "
                         f"got {tuple(kv_scales.k.shape)}")
    return kv_scales.k, kv_scales.v, KV_FP8 if is_fp8(k_cache) else KV_INT8


def store_kvcache(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  slot_mapping: torch.Tensor, kv_scales: KVScales | None = None) -> None:
    """Scatter key/value [T, H_kv, D] into the caches at slot_mapping, skipping slots equal to -1
    (quantized to an fp8 or int8 cache as kernels/kv_quant.quantize does)."""
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    check_last_dim_contiguous(key, value, k_cache, v_cache)
    k_scale, v_scale, kv_format = kv_scale_args(k_cache, kv_scales, slot_mapping)
    _store_kvcache_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        BLOCK_SIZE=k_cache.shape[1], D=head_dim, HKV_D=num_kv_heads * head_dim,
        BLOCK=triton.next_power_of_2(num_kv_heads * head_dim), KV_FORMAT=kv_format, num_warps=4,
    )
