"""The fused MoE block with FP8 experts and FP8 activations (w8a8): x and each pair's h are quantized per token and
128 columns (DeepSeek's 1 x 128), and both GEMMs multiply FP8 by FP8 on the tensor cores, where the weight-only path
(kernels/fused_moe.py, `Fp8Experts` with activations "bf16") widens each weight tile to the activation dtype.

- x is quantized by kernels/fp8_gemm.quantize_rows, or comes quantized by the norm before the block (`quantized`);
- gate/up: each K tile's FP8 product is scaled by the activations' group scale, and by the weights' (128-column
  block scales) as it joins the fp32 accumulator; a weight's row scale (channel) multiplies the accumulator in the
  epilogue. The epilogue rounds gate and up to the activation dtype as HF's expert does, takes silu(gate) * up,
  rounds it, and quantizes it per token and 128 columns (the N tile is 128 wide: one group), writing h in FP8 with
  its scales;
- down: the same K-tile scaling over h's groups, the routing weight in the epilogue (kernels/fused_moe's store).

Routing, grouping by expert and the tiles are kernels/fused_moe's; the tiles are made to fit (gate/up's N tile is
one group of h; both K tiles lie in one group). Block weights need groups of exactly 128 columns
(`takes_fp8_activations`). Measured on the H200 (bench/RESULTS.md, 2026-12-04): as a layer, 1.08-1.32x the
weight-only path from 16 tokens on; in the engine, 1.12x its throughput on the Qwen3-30B-A3B shape. The loader gives
it to FP8 experts on a GPU by default wherever their scales allow (executor_svc/layers/fp8.moe_activations).
"""
from __future__ import annotations

from dataclasses import replace

import torch
import triton
import triton.language as tl

from kernels import fused_moe as fm
from kernels.attention.triton_kv_store import fp8_scale, quantize_fp8
from kernels.fp8_quant import MIN_SCALE, QuantizedActivations
from kernels.triton_runtime import INTERPRET

GROUP = 128  # activation groups (DeepSeek's 1 x 128) and the gate/up N tile that quantizes h
_MIN_SCALE = tl.constexpr(MIN_SCALE)


def takes_fp8_activations(fp8: fm.Fp8Experts) -> bool:
    """Whether these kernels can run experts with these scales: per row, or per row and GROUP columns."""
    return all(scale.shape[-1] == 1 or group == GROUP
               for scale, group in ((fp8.w13_scale, fp8.group_k13), (fp8.w2_scale, fp8.group_k2)))


@triton.jit
def _group_scaled_dot(a, w, acc, a_s, w_s_ptrs, w_s_tile_ptr, kg, n_ok, W_GROUPED: tl.constexpr,
                      W_PER_TILE: tl.constexpr):
    """acc + (a . w) * a's group scale [BLOCK_M] (* w's group scale for block weights): one K tile, inside one group of
    the activations and of the weights. W_PER_TILE: the tile's rows share their scales (Fp8Experts.rows_sharing_scales),
    so one scalar a group, from the tile's first row; otherwise a [BLOCK_N] vector, whose per-thread loads, outer
    product and registers (spills at 128 x 128 tiles) made the K loop three times as long (sm_90 SASS, 2026-12-04)."""
    part = tl.dot(a, w)
    if W_PER_TILE:
        return acc + part * (a_s * tl.load(w_s_tile_ptr + kg))[:, None]
    scale = a_s[:, None]
    if W_GROUPED:
        scale = scale * tl.load(w_s_ptrs + kg, mask=n_ok, other=0.0)[None, :]
    return acc + part * scale


@triton.jit(do_not_specialize=["num_pairs", "num_tiles_m"])
def _gate_up_fp8_kernel(
    xq_ptr, xs_ptr, w_ptr, ws_ptr, hq_ptr, hs_ptr, sorted_pairs_ptr, block_expert_ptr, num_padded_ptr,
    num_pairs, hidden, inter, stride_xq, stride_xs, stride_we, stride_wn, stride_wse, stride_wsn, stride_hs,
    num_tiles_m, TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, W_GROUPED: tl.constexpr, W_PER_TILE: tl.constexpr, OUT_DTYPE: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """hq[pair, n], hs[pair, n // BLOCK_N] = the FP8 quantization (per BLOCK_N = 128 columns) of
    silu(x[token] . w[e, n]) * (x[token] . w[e, inter + n]), x given as FP8 with scales per 128 columns."""
    pid_m, pid_n = fm._tile_ids(num_tiles_m, tl.cdiv(inter, BLOCK_N), GROUP_M)
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return
    pair, row_ok, expert = fm._tile_pairs(sorted_pairs_ptr, block_expert_ptr, pid_m, num_pairs, BLOCK_M)
    token = (pair // TOP_K).to(tl.int64)
    offs_n, n_ok, offs_k, g_ptrs, u_ptrs, sg_ptrs, su_ptrs, sg_tile, su_tile = fm._gate_up_tile(
        w_ptr, ws_ptr, expert, pid_n, inter, stride_we, stride_wn, stride_wse, stride_wsn, BLOCK_N, BLOCK_K)
    a_ptrs = xq_ptr + token[:, None] * stride_xq + offs_k[None, :]
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k in range(0, tl.cdiv(hidden, BLOCK_K)):
        a, g, u = fm._gate_up_loads(a_ptrs, g_ptrs, u_ptrs, row_ok, n_ok, offs_k, k, hidden, BLOCK_K, False, UPCAST,
                                     False)
        kg = (k * BLOCK_K) // 128
        a_s = tl.load(xs_ptr + token * stride_xs + kg, mask=row_ok, other=0.0)
        acc_g = _group_scaled_dot(a, g, acc_g, a_s, sg_ptrs, sg_tile, kg, n_ok, W_GROUPED, W_PER_TILE)
        acc_u = _group_scaled_dot(a, u, acc_u, a_s, su_ptrs, su_tile, kg, n_ok, W_GROUPED, W_PER_TILE)
        a_ptrs += BLOCK_K
        g_ptrs += BLOCK_K
        u_ptrs += BLOCK_K
    if not W_GROUPED:  # a scale per weight row
        acc_g = acc_g * tl.load(sg_ptrs, mask=n_ok, other=0.0)[None, :]
        acc_u = acc_u * tl.load(su_ptrs, mask=n_ok, other=0.0)[None, :]
    gate = acc_g.to(OUT_DTYPE).to(tl.float32)  # rounded where HF's expert rounds, as kernels/fused_moe does
    up = acc_u.to(OUT_DTYPE).to(tl.float32)
    act = (gate / (1.0 + tl.exp(-gate))).to(OUT_DTYPE).to(tl.float32)
    h = (act * up).to(OUT_DTYPE).to(tl.float32)  # what the weight-only path stores, then quantized as quantize_rows
    h = tl.where(n_ok[None, :], h, 0.0)
    scale = fp8_scale(tl.max(tl.abs(h), axis=1), _MIN_SCALE)  # [BLOCK_M]: this tile is one group
    pair64 = pair.to(tl.int64)
    tl.store(hq_ptr + pair64[:, None] * inter + offs_n[None, :],
             quantize_fp8(h, scale[:, None]).to(hq_ptr.dtype.element_ty), mask=row_ok[:, None] & n_ok[None, :])
    tl.store(hs_ptr + pair64 * stride_hs + pid_n, scale, mask=row_ok)


@triton.jit(do_not_specialize=["num_pairs", "num_tiles_m"])
def _down_fp8_kernel(
    hq_ptr, hs_ptr, w_ptr, ws_ptr, out_ptr, weights_ptr, sorted_pairs_ptr, block_expert_ptr, num_padded_ptr,
    num_pairs, hidden, inter, stride_hs, stride_we, stride_wn, stride_wse, stride_wsn, stride_ot,
    num_tiles_m, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    W_GROUPED: tl.constexpr, W_PER_TILE: tl.constexpr, UPCAST: tl.constexpr,
):
    """out[pair, n] = weight[pair] * (h[pair] . w[e, n]), h given as FP8 with scales per 128 columns."""
    pid_m, pid_n = fm._tile_ids(num_tiles_m, tl.cdiv(hidden, BLOCK_N), GROUP_M)
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return
    pair, row_ok, expert = fm._tile_pairs(sorted_pairs_ptr, block_expert_ptr, pid_m, num_pairs, BLOCK_M)
    pair64 = pair.to(tl.int64)
    offs_n, n_ok, offs_k, b_ptrs, s_ptrs, s_tile = fm._weight_tile(w_ptr, ws_ptr, expert, pid_n, hidden, stride_we,
                                                                   stride_wn, stride_wse, stride_wsn, BLOCK_N, BLOCK_K)
    a_ptrs = hq_ptr + pair64[:, None] * inter + offs_k[None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k in range(0, tl.cdiv(inter, BLOCK_K)):
        k_ok = offs_k < inter - k * BLOCK_K
        a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        if UPCAST:
            a, b = a.to(tl.float32), b.to(tl.float32)
        kg = (k * BLOCK_K) // 128
        a_s = tl.load(hs_ptr + pair64 * stride_hs + kg, mask=row_ok, other=0.0)
        acc = _group_scaled_dot(a, b, acc, a_s, s_ptrs, s_tile, kg, n_ok, W_GROUPED, W_PER_TILE)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    if not W_GROUPED:
        acc = acc * tl.load(s_ptrs, mask=n_ok, other=0.0)[None, :]
    fm._store_weighted(out_ptr, acc, weights_ptr, pair, row_ok, offs_n, n_ok, stride_ot)


def _fp8_tiles(up: fm.MoeTile, down: fm.MoeTile) -> tuple[fm.MoeTile, fm.MoeTile]:
    """The bf16 tiles made fit: gate/up's N tile is one 128-column group of h, and both K tiles lie in one group."""
    if INTERPRET:
        return fm.MoeTile(16, GROUP, 32, 1, 1), fm.MoeTile(16, 32, 32, 1, 1)
    return (replace(up, block_n=GROUP, block_k=min(up.block_k, GROUP)),
            replace(down, block_k=min(down.block_k, GROUP)))


def fused_moe_fp8_activations(x: torch.Tensor, router_logits: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                              top_k: int, renormalize: bool, tiles: tuple[fm.MoeTile, fm.MoeTile] | None = None, *,
                              fp8: fm.Fp8Experts, quantized: QuantizedActivations | None = None) -> torch.Tensor:
    """kernels/fused_moe.fused_moe's contract (its caller picks this one where `fp8.activations` is "fp8") with FP8
    experts whose scales are per row or per row and 128 columns, the activations quantized to FP8 per token and 128
    columns before each GEMM (x's given as `quantized` where its producer wrote them)."""
    from kernels.fp8_gemm import quantize_rows

    if not takes_fp8_activations(fp8):
        raise ValueError(f"FP8 activations need weight groups of {GROUP} columns (or a scale per row), not "
                         f"{fp8.group_k13} and {fp8.group_k2}")
    num_tokens, hidden = x.shape
    num_experts, inter = w13.shape[0], w13.shape[1] // 2
    up, down = _fp8_tiles(*(tiles or fm.tiles_for(num_tokens, num_experts, hidden, inter, top_k, x.element_size())))
    if num_tokens == 0:
        return torch.zeros_like(x)
    if quantized is None:
        xq, xs = quantize_rows(x, GROUP)
    else:  # x quantized by the kernel that produced it (the norm before the block: layers/fp8.quantize_in_producers)
        xq, xs = quantized.q, quantized.scale
        xs = xs if xs.stride(1) == 1 else xs.contiguous()  # the kernel reads a token's scales as a row
        if xq.shape != x.shape or xs.shape != (num_tokens, triton.cdiv(hidden, GROUP)):
            raise ValueError(f"x quantized as {tuple(xq.shape)} with scales {tuple(xs.shape)}; the experts take it "
                             f"per token and {GROUP} columns")
    weights, ids, groups, counts = fm.route_and_group(router_logits, top_k, renormalize, up.block_m)
    hq = torch.empty(groups.num_pairs, inter, dtype=w13.dtype, device=x.device)
    hs = torch.empty(groups.num_pairs, triton.cdiv(inter, GROUP), dtype=torch.float32, device=x.device)
    out_dtype = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}[x.dtype]
    _gate_up_fp8_kernel[(fm._tiles_m(groups, up) * triton.cdiv(inter, up.block_n),)](
        xq, xs, w13, fp8.w13_scale, hq, hs, groups.sorted_pairs, groups.block_expert, groups.num_padded,
        groups.num_pairs, hidden, inter, xq.stride(0), xs.stride(0), w13.stride(0), w13.stride(1),
        fp8.w13_scale.stride(0), fp8.w13_scale.stride(1), hs.stride(0), fm._tiles_m(groups, up),
        TOP_K=top_k, BLOCK_M=up.block_m, BLOCK_N=up.block_n, BLOCK_K=up.block_k, GROUP_M=up.group_m,
        W_GROUPED=fp8.w13_scale.shape[-1] > 1, W_PER_TILE=fm.per_tile(fp8, fp8.w13_scale, up, inter), OUT_DTYPE=out_dtype,
        UPCAST=INTERPRET, num_warps=up.num_warps, num_stages=up.num_stages)
    if down.block_m != up.block_m:
        groups = fm.group_by_expert(ids, num_experts, down.block_m, counts)
    y = torch.empty(groups.num_pairs, hidden, dtype=x.dtype, device=x.device)
    _down_fp8_kernel[(fm._tiles_m(groups, down) * triton.cdiv(hidden, down.block_n),)](
        hq, hs, w2, fp8.w2_scale, y, weights.view(-1), groups.sorted_pairs, groups.block_expert, groups.num_padded,
        groups.num_pairs, hidden, inter, hs.stride(0), w2.stride(0), w2.stride(1), fp8.w2_scale.stride(0),
        fp8.w2_scale.stride(1), y.stride(0), fm._tiles_m(groups, down), BLOCK_M=down.block_m, BLOCK_N=down.block_n,
        BLOCK_K=down.block_k, GROUP_M=down.group_m, W_GROUPED=fp8.w2_scale.shape[-1] > 1,
        W_PER_TILE=fm.per_tile(fp8, fp8.w2_scale, down), UPCAST=INTERPRET, num_warps=down.num_warps,
        num_stages=down.num_stages)
    return y.view(num_tokens, top_k, hidden).sum(dim=1)
