"""Fused small ops of a decoder block in Triton: RMSNorm (with the residual add), SiLU-and-mul, RoPE,
and the attention prologue (q/k RMSNorm, RoPE and the KV-pool store) as one launch.

Eager torch runs each of these as a chain of elementwise kernels; here each is one pass over memory.
The kernels round to the activation dtype where eager torch does (after the residual add, after
normalising, after silu, after each RoPE product), so on a GPU they reproduce the torch layers,
which match HF. Every load is upcast to fp32 at once: the CPU interpreter (TRITON_INTERPRET=1, set
before this module is imported) computes bf16 wrongly. Blocks are powers of two and masked, so any
hidden size or head_dim works. No wrapper syncs with the host or sizes anything by data, so all of
them can be captured in a CUDA graph. Each op's torch reference sits beside it.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.attention.triton_kv_store import kv_scale_args, quantize_fp8, quantize_int8
from kernels.kv_quant import KVScales, as_bytes, is_quantized, quantize
from kernels.triton_runtime import INTERPRET


PROLOGUE_TILE = 1024  # elements a program of the attention prologue takes: 8 heads of 128


def _num_warps(tile: int) -> int:
    # ~8 elements (16 bytes of bf16) per thread
    return 1 if INTERPRET else max(1, min(16, tile // 256))


def _heads_view(x: torch.Tensor, head_dim: int) -> torch.Tensor:
    """x as [T, H, head_dim] with unit stride in the last dim; a view whenever x allows one."""
    if x.dim() == 1:
        x = x[None]
    if x.dim() != 3 or x.shape[-1] != head_dim:
        x = x.reshape(-1, x.shape[-1]).unflatten(-1, (-1, head_dim))
    return x if x.stride(-1) == 1 else x.contiguous()


# ---------------------------------------------------------------------------------------------
# RMSNorm, optionally after the residual add
# ---------------------------------------------------------------------------------------------


@triton.jit(do_not_specialize=["num_rows"])  # one compiled variant for every token count
def _rms_norm_kernel(
    x_ptr, residual_ptr, weight_ptr, out_ptr, residual_out_ptr,
    num_rows, num_heads, dim, eps,
    x_stride_t, x_stride_h, r_stride_t, r_stride_h,
    HAS_RESIDUAL: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_D: tl.constexpr,
):
    # Row r is head r % num_heads of token r // num_heads; a 2D input has one head.
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    cols = tl.arange(0, BLOCK_D)
    mask = (rows < num_rows)[:, None] & (cols < dim)[None, :]
    t, h = (rows // num_heads).to(tl.int64), rows % num_heads
    x = tl.load(x_ptr + (t * x_stride_t + h * x_stride_h)[:, None] + cols[None, :], mask=mask, other=0.0)
    x = x.to(tl.float32)
    out_offs = rows.to(tl.int64)[:, None] * dim + cols[None, :]  # outputs are contiguous
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + (t * r_stride_t + h * r_stride_h)[:, None] + cols[None, :], mask=mask, other=0.0)
        # The sum is rounded as eager torch adds it, and the rounded sum is what gets normalised.
        x = (x + r.to(tl.float32)).to(residual_out_ptr.dtype.element_ty)
        tl.store(residual_out_ptr + out_offs, x, mask=mask)
        x = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, axis=1) / dim + eps)
    normed = (x * rstd[:, None]).to(x_ptr.dtype.element_ty).to(tl.float32)  # cast back before the scale, as HF
    w = tl.load(weight_ptr + cols, mask=cols < dim, other=0.0).to(tl.float32)
    tl.store(out_ptr + out_offs, normed * w[None, :], mask=mask)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm over the last dim of x: [T, hidden], or per head [T, H, D] (any strides, e.g. views
    of a fused qkv output). With `residual`, returns (norm(x + residual), x + residual)."""
    dim = x.shape[-1]
    xv = _heads_view(x, dim)
    num_tokens, num_heads, _ = xv.shape
    out = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    if residual is not None:
        assert residual.shape == x.shape and residual.dtype == x.dtype, "residual must match x"
        rv = _heads_view(residual, dim)
        residual_out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    else:
        rv, residual_out = xv, out  # unused by the kernel
    num_rows = num_tokens * num_heads
    if num_rows > 0:
        block_d = triton.next_power_of_2(dim)
        block_rows = max(1, min(32, 2048 // block_d))
        grid = (triton.cdiv(num_rows, block_rows),)
        _rms_norm_kernel[grid](
            xv, rv, weight, out, residual_out,
            num_rows, num_heads, dim, eps,
            xv.stride(0), xv.stride(1), rv.stride(0), rv.stride(1),
            HAS_RESIDUAL=residual is not None, BLOCK_ROWS=block_rows, BLOCK_D=block_d,
            num_warps=_num_warps(block_rows * block_d),
        )
    return out if residual is None else (out, residual_out)


def rms_norm_ref(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Eager torch, as executor_svc/layers/layernorm.py computes it."""
    h = x if residual is None else x + residual
    hf = h.float()
    out = weight * (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps)).to(h.dtype)
    return out if residual is None else (out, h)


# ---------------------------------------------------------------------------------------------
# SiLU-and-mul: SwiGLU's gate over the fused gate_up projection
# ---------------------------------------------------------------------------------------------


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, inter, x_stride, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    gate = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * x_stride + inter + cols, mask=mask, other=0.0).to(tl.float32)
    act = (gate / (1.0 + tl.exp(-gate))).to(out_ptr.dtype.element_ty).to(tl.float32)  # rounded, as F.silu
    tl.store(out_ptr + row * inter + cols, act * up, mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [..., 2I] -> silu(x[..., :I]) * x[..., I:], shape [..., I]."""
    inter = x.shape[-1] // 2
    rows = x.reshape(-1, x.shape[-1])
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty(*x.shape[:-1], inter, dtype=x.dtype, device=x.device)
    if rows.shape[0] > 0 and inter > 0:
        block = min(1024, triton.next_power_of_2(inter))
        grid = (rows.shape[0], triton.cdiv(inter, block))
        _silu_and_mul_kernel[grid](rows, out, inter, rows.stride(0), BLOCK=block, num_warps=_num_warps(block))
    return out


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """Eager torch, as executor_svc/layers/activation.py computes it."""
    gate, up = x.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


# ---------------------------------------------------------------------------------------------
# Rotary embedding, neox layout (the two halves of a head are the rotated pairs), in place
# ---------------------------------------------------------------------------------------------


@triton.jit
def _rotate_heads(base, h, num_heads, stride_h, half, cos, sin, d, d_mask):
    """Rotate heads h of one token at `base`, in place, in the activation dtype, after the fp32 cos/sin cache is cast
    to the activation dtype: eager torch's expressions, though on sm_90 the compiler fuses one product of each pair
    into a bf16 FMA, an ulp from eager torch (the fused prologue rounds as eager torch does)."""
    dtype = base.dtype.element_ty
    mask = (h < num_heads)[:, None] & d_mask[None, :]
    offs = h[:, None] * stride_h + d[None, :]
    c = cos.to(dtype).to(tl.float32)[None, :]
    s = sin.to(dtype).to(tl.float32)[None, :]
    x1 = tl.load(base + offs, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(base + offs + half, mask=mask, other=0.0).to(tl.float32)
    o1 = (x1 * c).to(dtype).to(tl.float32) - (x2 * s).to(dtype).to(tl.float32)
    o2 = (x2 * c).to(dtype).to(tl.float32) + (x1 * s).to(dtype).to(tl.float32)
    tl.store(base + offs, o1.to(dtype), mask=mask)
    tl.store(base + offs + half, o2.to(dtype), mask=mask)


@triton.jit
def _rotary_kernel(
    positions_ptr, q_ptr, k_ptr, cos_ptr, sin_ptr,
    num_q_heads, num_kv_heads, half,
    q_stride_t, q_stride_h, k_stride_t, k_stride_h, cache_stride,
    BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr,
):
    # Program (t, j) rotates heads [j * BLOCK_H, (j + 1) * BLOCK_H) of token t, in q and in k.
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    pos = tl.load(positions_ptr + t).to(tl.int64)
    d = tl.arange(0, BLOCK_HALF)
    d_mask = d < half
    cos = tl.load(cos_ptr + pos * cache_stride + d, mask=d_mask, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + pos * cache_stride + d, mask=d_mask, other=0.0).to(tl.float32)
    _rotate_heads(q_ptr + t * q_stride_t, h, num_q_heads, q_stride_h, half, cos, sin, d, d_mask)
    _rotate_heads(k_ptr + t * k_stride_t, h, num_kv_heads, k_stride_h, half, cos, sin, d, d_mask)


def rotary_embedding(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q [T, H_q, D] and k [T, H_kv, D] (or [T, H*D]) in place by each token's position [T].

    cos, sin: [max_position, D/2], the caches RotaryEmbedding builds (llama3 scaling is in them).
    q and k may be strided views (of a fused qkv output); their last dim must have unit stride.
    Returns q and k.
    """
    half = cos.shape[-1]
    qv, kv = _heads_view(q, 2 * half), _heads_view(k, 2 * half)
    assert qv.data_ptr() == q.data_ptr() and kv.data_ptr() == k.data_ptr(), "q, k need a unit last stride"
    assert cos.stride() == sin.stride() and cos.stride(-1) == 1
    num_tokens = positions.shape[0]
    assert qv.shape[0] == num_tokens and kv.shape[0] == num_tokens
    if num_tokens > 0:
        block_half = triton.next_power_of_2(half)
        max_heads = max(qv.shape[1], kv.shape[1])
        block_h = min(triton.next_power_of_2(max_heads), max(1, 2048 // block_half))
        grid = (num_tokens, triton.cdiv(max_heads, block_h))
        _rotary_kernel[grid](
            positions, qv, kv, cos, sin,
            qv.shape[1], kv.shape[1], half,
            qv.stride(0), qv.stride(1), kv.stride(0), kv.stride(1), cos.stride(0),
            BLOCK_H=block_h, BLOCK_HALF=block_half, num_warps=_num_warps(block_h * block_half),
        )
    return q, k


def rotary_embedding_ref(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Eager torch on [T, H, D], out of place, as executor_svc/layers/rotary.py computes it."""
    c = cos[positions].unsqueeze(1).to(q.dtype)
    s = sin[positions].unsqueeze(1).to(q.dtype)

    def rotate(x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)

    return rotate(q), rotate(k)


# ---------------------------------------------------------------------------------------------
# The attention prologue in one kernel: q/k RMSNorm (Qwen3), RoPE, and the store into the KV pool
# ---------------------------------------------------------------------------------------------


@triton.jit
def scaled_as_written(v, row_scale, col_scale_ptr, cols, mask, dtype: tl.constexpr):
    """v, values of an unscaled FP8 product (kernels/fp8_quant.UnscaledProduct) at `cols`, times the token's and
    their columns' scales, rounded to dtype: what kernels/fp8_gemm.scale_product would have written there."""
    col_scale = tl.load(col_scale_ptr + cols, mask=mask, other=0.0)
    return (v * (row_scale * col_scale)).to(dtype).to(tl.float32)


@triton.jit
def _load_product(ptr, offs, mask, row_scale, col_scale_ptr, cols, SCALED: tl.constexpr):
    """The values at ptr + offs in fp32; SCALED: an unscaled FP8 product's, scaled_as_written, so the kernel computes
    on the values scale_product would have written."""
    x = tl.load(ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if SCALED:
        x = scaled_as_written(x, row_scale, col_scale_ptr, cols, mask, ptr.dtype.element_ty)
    return x


@triton.jit
def _norm_rope_heads(base, h, num_heads, stride_h, cols, col_mask, dim, half, eps, weight_ptr, cos_ptr, sin_ptr,
                     pos, cache_stride, row_scale, col_scale_ptr, HAS_NORM: tl.constexpr, SCALED: tl.constexpr):
    """Heads h of one token at `base`, normalised (HAS_NORM) and rotated in registers, in the activation dtype; and
    their mask and offsets. Each element's RoPE partner (column `pair`: c + D/2 in the first half, c - D/2 in the
    second) is loaded a second time, from L1, and normalised by its row's rstd, so no value goes through global
    memory between the norm and RoPE. The sum of squares comes from the [heads, D] tile in rms_norm's layout, so it
    adds in _rms_norm_kernel's order; every product is rounded where the eager chain rounds it. SCALED: an unscaled
    FP8 product's heads (_load_product)."""
    dtype = base.dtype.element_ty
    first = cols < half
    pair = tl.where(first, cols + half, cols - half)
    angle = tl.where(first, cols, cols - half)
    cos = tl.load(cos_ptr + pos * cache_stride + angle, mask=col_mask, other=0.0).to(dtype).to(tl.float32)
    sin = tl.load(sin_ptr + pos * cache_stride + angle, mask=col_mask, other=0.0).to(dtype).to(tl.float32)
    mask = (h < num_heads)[:, None] & col_mask
    offs = h[:, None] * stride_h + cols
    x = _load_product(base, offs, mask, row_scale, col_scale_ptr, h[:, None] * dim + cols, SCALED)
    xp = _load_product(base, h[:, None] * stride_h + pair, mask, row_scale, col_scale_ptr, h[:, None] * dim + pair,
                       SCALED)
    if HAS_NORM:
        rstd = tl.rsqrt(tl.sum(x * x, axis=1) / dim + eps)[:, None]
        w = tl.load(weight_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
        wp = tl.load(weight_ptr + pair, mask=col_mask, other=0.0).to(tl.float32)
        # rms_norm's roundings: the normalised value, then its product with the weight (rms_norm's output dtype)
        x = ((x * rstd).to(dtype).to(tl.float32) * w).to(dtype).to(tl.float32)
        xp = ((xp * rstd).to(dtype).to(tl.float32) * wp).to(dtype).to(tl.float32)
    # x1 c - x2 s in the first half, x2 c + x1 s in the second, each product rounded before the sum as eager torch
    # rounds it (on sm_90: bf16 products, then an fp32 sum). Written as one sum with -sin, the compiler fused a product
    # into a bf16 FMA instead, as it does in _rotate_heads: an ulp apart.
    rotated = (x * cos).to(dtype).to(tl.float32)
    partner = (xp * sin).to(dtype).to(tl.float32)
    return tl.where(first, rotated - partner, rotated + partner).to(dtype), mask, offs


@triton.jit
def _store_heads_to_pool(x, cache_ptr, scale_ptr, slot, h, cols, mask, dim, stride_b, stride_s, stride_h,
                         NUM_KV_HEADS: tl.constexpr, BLOCK_SIZE: tl.constexpr, KV_FORMAT: tl.constexpr):
    """Heads h of a token's k or v (x, fp32 [HEADS, BLOCK_D]) into the pool row at `slot` (none for -1: padding, or
    a prefix-cache hit already stored); a quantized pool gets them quantized by their heads' scales (fp8), or int8's
    by their channels' ([H_kv, D] row-major)."""
    if KV_FORMAT == 1:
        x = quantize_fp8(x, tl.load(scale_ptr + h, mask=h < NUM_KV_HEADS, other=1.0)[:, None])
    elif KV_FORMAT == 2:
        x = quantize_int8(x, tl.load(scale_ptr + h[:, None] * dim + cols, mask=mask, other=1.0))
    base = cache_ptr + (slot // BLOCK_SIZE) * stride_b + (slot % BLOCK_SIZE) * stride_s
    tl.store(base + h[:, None] * stride_h + cols, x.to(cache_ptr.dtype.element_ty), mask=mask & (slot >= 0))


@triton.jit(do_not_specialize_on_alignment=["k_scale_ptr", "v_scale_ptr"])  # rows of the pool's scales
def _qk_norm_rope_store_kernel(
    positions_ptr, q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
    q_weight_ptr, k_weight_ptr, k_scale_ptr, v_scale_ptr, row_scale_ptr, q_col_scale_ptr, k_col_scale_ptr,
    v_col_scale_ptr, dim, half, eps,
    q_stride_t, q_stride_h, k_stride_t, k_stride_h, v_stride_t, v_stride_h, cache_stride,
    kc_stride_b, kc_stride_s, kc_stride_h, vc_stride_b, vc_stride_s, vc_stride_h,
    NUM_Q_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, BLOCK_SIZE: tl.constexpr, HAS_NORM: tl.constexpr,
    HEADS: tl.constexpr, BLOCK_D: tl.constexpr, KV_FORMAT: tl.constexpr, SCALED: tl.constexpr,
):
    # Program (t, g) takes HEADS heads of token t: q's [g * HEADS, ...) for g < Q_GROUPS, then k's (which it also
    # writes to the token's row of the pool), then v's (to the pool). Each does one pass over its heads; the grid is
    # the only thing sized by the token count, so no argument changes from step to step. SCALED: q, k and v are an
    # unscaled FP8 product's, scaled where they are read.
    Q_GROUPS: tl.constexpr = (NUM_Q_HEADS + HEADS - 1) // HEADS
    KV_GROUPS: tl.constexpr = (NUM_KV_HEADS + HEADS - 1) // HEADS
    t = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1)
    row_scale = 1.0
    if SCALED:
        row_scale = tl.load(row_scale_ptr + t)
    rows = tl.arange(0, HEADS)
    # column indices as a [HEADS, BLOCK_D] tile: every vector is loaded in the heads' own layout
    cols = tl.arange(0, BLOCK_D)[None, :] + tl.zeros([HEADS, 1], tl.int32)
    col_mask = cols < dim
    if g < Q_GROUPS + KV_GROUPS:
        pos = tl.load(positions_ptr + t).to(tl.int64)
        if g < Q_GROUPS:
            q_base = q_ptr + t * q_stride_t
            q, mask, offs = _norm_rope_heads(q_base, g * HEADS + rows, NUM_Q_HEADS, q_stride_h, cols, col_mask, dim,
                                             half, eps, q_weight_ptr, cos_ptr, sin_ptr, pos, cache_stride, row_scale,
                                             q_col_scale_ptr, HAS_NORM, SCALED)
            tl.store(q_base + offs, q, mask=mask)
        else:
            h = (g - Q_GROUPS) * HEADS + rows
            k_base = k_ptr + t * k_stride_t
            k, mask, offs = _norm_rope_heads(k_base, h, NUM_KV_HEADS, k_stride_h, cols, col_mask, dim, half, eps,
                                             k_weight_ptr, cos_ptr, sin_ptr, pos, cache_stride, row_scale,
                                             k_col_scale_ptr, HAS_NORM, SCALED)
            tl.store(k_base + offs, k, mask=mask)
            # the rotated k as rounded to the activation dtype above goes to the pool
            _store_heads_to_pool(k.to(tl.float32), k_cache_ptr, k_scale_ptr, tl.load(slot_mapping_ptr + t).to(tl.int64),
                                 h, cols, mask, dim, kc_stride_b, kc_stride_s, kc_stride_h, NUM_KV_HEADS, BLOCK_SIZE,
                                 KV_FORMAT)
    else:
        h = (g - Q_GROUPS - KV_GROUPS) * HEADS + rows
        slot = tl.load(slot_mapping_ptr + t).to(tl.int64)
        mask = (h < NUM_KV_HEADS)[:, None] & col_mask
        v = _load_product(v_ptr + t * v_stride_t, h[:, None] * v_stride_h + cols, mask & (slot >= 0), row_scale,
                          v_col_scale_ptr, h[:, None] * dim + cols, SCALED)
        _store_heads_to_pool(v, v_cache_ptr, v_scale_ptr, slot, h, cols, mask, dim, vc_stride_b, vc_stride_s,
                             vc_stride_h, NUM_KV_HEADS, BLOCK_SIZE, KV_FORMAT)


def qk_norm_rope_store(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
    sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
    q_norm_weight: torch.Tensor | None = None, k_norm_weight: torch.Tensor | None = None, eps: float = 1e-6,
    kv_scales: KVScales | None = None, product_scales: tuple[torch.Tensor, ...] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """rms_norm(q), rms_norm(k) (when the weights are given), RoPE on both, then store_kvcache(k, v,
    kv_scales): one launch, bit for bit rms_norm's kernel, then RoPE as eager torch rounds it (rotary_embedding_ref:
    each product rounded to the activation dtype, then their sum), then the store. On sm_90 the rotary_embedding
    kernel is an ulp off that: the compiler fuses one product of each pair into a bf16 FMA.

    q [T, H_q, D], k and v [T, H_kv, D] (or [T, H*D]): views of the fused qkv output with a unit
    last stride. q and k are normalised and rotated in place; k and v are written to
    k_cache/v_cache [N, block_size, H_kv, D] at slot_mapping [T] (-1: not stored). Returns q and k.
    product_scales (token [T, 1], then q's, k's and v's columns' [H * D, 1]): q, k and v are views of an unscaled
    FP8 product (kernels/fp8_quant.UnscaledProduct), scaled as they are read, so the result is the one for
    kernels/fp8_gemm.scale_product's output, without its pass (v is left unscaled in the product).
    """
    half = cos.shape[-1]
    head_dim = 2 * half
    qv, kv, vv = _heads_view(q, head_dim), _heads_view(k, head_dim), _heads_view(v, head_dim)
    assert qv.data_ptr() == q.data_ptr() and kv.data_ptr() == k.data_ptr(), "q, k need a unit last stride"
    assert kv.shape == vv.shape and q.dtype == k.dtype == v.dtype
    assert k_cache.shape == v_cache.shape and k_cache.shape[2:] == kv.shape[1:]
    assert k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    assert cos.stride() == sin.stride() and cos.stride(-1) == 1
    has_norm = q_norm_weight is not None
    if has_norm != (k_norm_weight is not None):
        raise ValueError("give both q_norm_weight and k_norm_weight, or neither")
    if has_norm and not (q_norm_weight.dtype == k_norm_weight.dtype == q.dtype):
        # rms_norm would return a wider tensor than q; in place the chain could not round alike.
        raise ValueError(f"norm weights must have q's dtype {q.dtype}, got {q_norm_weight.dtype}")
    num_tokens, num_q_heads, _ = qv.shape
    num_kv_heads = kv.shape[1]
    assert kv.shape[0] == num_tokens and positions.shape[0] == num_tokens and slot_mapping.shape[0] == num_tokens
    if num_tokens == 0:
        return q, k
    # A program takes HEADS heads of a token, a tile of PROLOGUE_TILE elements: (H_q + 2 H_kv) / HEADS programs a
    # token keep the SMs busy at decode's few tokens. The tile does not shrink to fewer heads: on 4 warps its rows
    # are laid out as in rms_norm's tile, so each row's sum of squares adds in the same order (test_gpu_compile.py).
    block_d = triton.next_power_of_2(head_dim)
    heads = max(1, PROLOGUE_TILE // block_d)
    grid = (num_tokens, triton.cdiv(num_q_heads, heads) + 2 * triton.cdiv(num_kv_heads, heads))
    weights = (q_norm_weight, k_norm_weight) if has_norm else (qv, kv)  # unused without the norm
    k_scale, v_scale, kv_format = kv_scale_args(k_cache, kv_scales, slot_mapping)
    if product_scales is not None:
        row_scale, *col_scales = product_scales
        assert row_scale.shape[0] >= num_tokens and row_scale.stride(0) == 1, (row_scale.shape, row_scale.stride())
        for view, cols in zip((qv, kv, vv), col_scales):
            assert cols.numel() == view.shape[1] * head_dim and cols.is_contiguous(), (cols.shape, view.shape)
    else:  # pointers the kernel never reads
        row_scale, col_scales = slot_mapping, (slot_mapping,) * 3
    _qk_norm_rope_store_kernel[grid](
        positions, qv, kv, vv, cos, sin, k_cache, v_cache, slot_mapping, *weights, k_scale, v_scale,
        row_scale, *col_scales, head_dim, half, eps,
        qv.stride(0), qv.stride(1), kv.stride(0), kv.stride(1), vv.stride(0), vv.stride(1), cos.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        NUM_Q_HEADS=num_q_heads, NUM_KV_HEADS=num_kv_heads, BLOCK_SIZE=k_cache.shape[1], HAS_NORM=has_norm,
        HEADS=heads, BLOCK_D=block_d, KV_FORMAT=kv_format, SCALED=product_scales is not None,
        num_warps=_num_warps(heads * block_d),
    )
    return q, k


def qk_norm_rope_store_ref(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
    sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
    q_norm_weight: torch.Tensor | None = None, k_norm_weight: torch.Tensor | None = None, eps: float = 1e-6,
    kv_scales: KVScales | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Eager torch, the unfused chain from the *_ref functions, writing q, k and the pool in place
    like qk_norm_rope_store (an fp8 pool as kernels/kv_quant.quantize). q, k, v are [T, H, D]."""
    normed_q, normed_k = q, k
    if q_norm_weight is not None:
        normed_q, normed_k = rms_norm_ref(q, q_norm_weight, eps), rms_norm_ref(k, k_norm_weight, eps)
    rotated_q, rotated_k = rotary_embedding_ref(positions, normed_q, normed_k, cos, sin)
    q.copy_(rotated_q)
    k.copy_(rotated_k)
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    heads, dim = k_cache.shape[-2:]
    new_k, new_v = rotated_k[keep], v.reshape(-1, heads, dim)[keep]
    if is_quantized(k_cache):
        new_k, new_v = quantize(new_k, kv_scales.k, k_cache.dtype), quantize(new_v, kv_scales.v, v_cache.dtype)
    as_bytes(k_cache).view(-1, heads, dim)[slots] = as_bytes(new_k.to(k_cache.dtype))
    as_bytes(v_cache).view(-1, heads, dim)[slots] = as_bytes(new_v.to(v_cache.dtype))
    return q, k
