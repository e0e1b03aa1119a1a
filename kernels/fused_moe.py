"""The mixture-of-experts block as Triton kernels, with its torch reference beside it.

A token's hidden state goes to its top-k experts (softmax router), each expert runs a SwiGLU MLP, and
the expert outputs are summed with the router's weights. On a GPU:

1. route: softmax over the router logits and the top-k, renormalised when the model says so (one kernel);
2. group: the (token, slot) pairs are sorted by expert and each expert's run padded to a multiple of
   BLOCK_M, so that every M tile of the GEMMs belongs to one expert. Up to SINGLE_PROGRAM_PAIRS pairs (every
   decode step) one program counts them, plans the tiles, writes the padding ids and scatters the pairs: one
   launch after the route kernel (a decode step is 48 MoE layers of small kernels replayed back to back in a
   CUDA graph, where each node costs a few microseconds however little it does). Past it the route kernel
   counts as it picks, and the plan and a grid of scattering programs follow;
3. gate/up GEMM with SiLU-and-mul fused into its epilogue: h[pair] = silu(x W_gate^T) * (x W_up^T);
4. down GEMM whose epilogue scales each row by the pair's routing weight;
5. the sum over a token's k rows (torch).

Every shape depends on the token count only (the sorted list has room for the worst padding, and
tiles past the real end exit at once, reading the end from the device), so nothing syncs with the
host and the whole block can be captured in the decode CUDA graphs.

Weight layout (stacked at load time from the per-expert checkpoint tensors):
  w13 [E, 2 * I, H]: rows [0, I) are expert e's gate_proj, rows [I, 2I) its up_proj;
  w2  [E, H, I]:     expert e's down_proj.
Under tensor parallelism I is this rank's slice of every expert.

FP8 experts (float8_e4m3fn w13 and w2, with float32 scales per row or per row and group of input columns: a block
checkpoint's, or per row from --quantization fp8) are read as FP8, widened to the activations' dtype in registers
and multiplied there (weight-only FP8: decode reads half the bytes; the activations are not quantized), the group
scales applied to each K tile's product, the row scales in the epilogue.

Under TRITON_INTERPRET=1 the loads are upcast to fp32 (the interpreter computes bf16 wrongly). The torch
reference of the whole block (the CPU path) is kernels/moe_reference.py, which needs no Triton.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field, replace

import torch
import triton
import triton.language as tl

from kernels.fp8_gemm import E4M3_AS_FP16_UNSCALE, e4m3_as_fp16
from kernels.fp8_quant import SCALE_BLOCK_ROWS, rows_sharing_scales
from kernels.triton_runtime import INTERPRET


# ---------------------------------------------------------------------------------------------
# 1. route: softmax + top-k (+ renormalise)
# ---------------------------------------------------------------------------------------------


@triton.jit(do_not_specialize=["num_tokens"])
def _route_kernel(logits_ptr, weights_ptr, ids_ptr, counts_ptr, num_tokens, num_experts, stride_t,
                  TOP_K: tl.constexpr, RENORMALIZE: tl.constexpr, COUNT: tl.constexpr, BLOCK_T: tl.constexpr,
                  BLOCK_E: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, BLOCK_E)
    row_ok = rows < num_tokens
    mask = row_ok[:, None] & (cols < num_experts)[None, :]
    logits = tl.load(logits_ptr + rows.to(tl.int64)[:, None] * stride_t + cols[None, :], mask=mask,
                     other=-float("inf")).to(tl.float32)
    row_max = tl.where(row_ok, tl.max(logits, axis=1), 0.0)  # rows past the end: no inf - inf
    p = tl.where(mask, tl.exp(logits - row_max[:, None]), 0.0)
    p = p / tl.where(row_ok, tl.sum(p, axis=1), 1.0)[:, None]
    # k rounds of argmax, twice: the first sums the chosen weights for the renormalisation; a tie goes to
    # the lower expert id, as torch.topk does on the CPU
    total = tl.full([BLOCK_T], 1.0, dtype=tl.float32)
    if RENORMALIZE:
        remaining = tl.where(mask, p, -1.0)
        total = tl.zeros([BLOCK_T], dtype=tl.float32)
        for j in tl.static_range(TOP_K):
            best = tl.max(remaining, axis=1)
            idx = tl.min(tl.where(remaining == best[:, None], cols[None, :], BLOCK_E), axis=1)
            total += best
            remaining = tl.where(cols[None, :] == idx[:, None], -1.0, remaining)
    remaining = tl.where(mask, p, -1.0)
    for j in tl.static_range(TOP_K):
        best = tl.max(remaining, axis=1)
        idx = tl.min(tl.where(remaining == best[:, None], cols[None, :], BLOCK_E), axis=1)
        # a row of NaN logits matches no maximum: it still names a real expert, as every id indexes the
        # counts, the cursors and the weights (a garbage row may compute garbage, never write out of bounds)
        idx = tl.minimum(idx, num_experts - 1)
        tl.store(weights_ptr + rows * TOP_K + j, best / total, mask=row_ok)
        tl.store(ids_ptr + rows * TOP_K + j, idx, mask=row_ok)
        if COUNT:  # each expert's pairs, for group_by_expert (saves it a counting pass)
            tl.atomic_add(counts_ptr + idx, 1, mask=row_ok, sem="relaxed")
        remaining = tl.where(cols[None, :] == idx[:, None], -1.0, remaining)


def route(router_logits: torch.Tensor, top_k: int, renormalize: bool,
          counts: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k] fp32, expert ids [T, k] int32) from router logits [T, E]; route_ref's contract.
    counts ([E] int32, zeroed), when given, gains each expert's number of picks."""
    num_tokens, num_experts = router_logits.shape
    weights = torch.empty(num_tokens, top_k, dtype=torch.float32, device=router_logits.device)
    ids = torch.empty(num_tokens, top_k, dtype=torch.int32, device=router_logits.device)
    block_e = triton.next_power_of_2(num_experts)
    block_t = max(1, min(16, 4096 // block_e))
    _route_kernel[(triton.cdiv(num_tokens, block_t),)](
        router_logits, weights, ids, ids if counts is None else counts, num_tokens, num_experts,
        router_logits.stride(0), TOP_K=top_k, RENORMALIZE=renormalize, COUNT=counts is not None, BLOCK_T=block_t,
        BLOCK_E=block_e, num_warps=4)
    return weights, ids


# ---------------------------------------------------------------------------------------------
# 2. group the (token, slot) pairs by expert, each expert's run padded to BLOCK_M
# ---------------------------------------------------------------------------------------------


@dataclass
class ExpertGroups:
    sorted_pairs: torch.Tensor   # [capacity] int32: pair index t * k + j, grouped by expert; num_pairs = padding
    block_expert: torch.Tensor   # [capacity / BLOCK_M] int32: the expert of each M tile
    num_padded: torch.Tensor     # [1] int32: tiles at or past num_padded / BLOCK_M hold nothing
    num_pairs: int


@triton.jit(do_not_specialize=["num_pairs"])
def _count_kernel(ids_ptr, counts_ptr, num_pairs, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < num_pairs
    expert = tl.load(ids_ptr + offs, mask=ok, other=0)
    tl.atomic_add(counts_ptr + expert, 1, mask=ok, sem="relaxed")


@triton.jit
def _scatter_pairs(ids_ptr, cursor_ptr, sorted_pairs_ptr, offs, num_pairs):
    ok = offs < num_pairs
    expert = tl.load(ids_ptr + offs, mask=ok, other=0)
    # the order inside an expert's run is the atomics' order: a row's result does not depend on it
    slot = tl.atomic_add(cursor_ptr + expert, 1, mask=ok, sem="relaxed")
    tl.store(sorted_pairs_ptr + slot, offs, mask=ok)


@triton.jit(do_not_specialize=["num_pairs", "num_tiles"])
def _plan_tiles_kernel(counts_ptr, cursor_ptr, block_expert_ptr, num_padded_ptr, ids_ptr, sorted_pairs_ptr,
                       num_experts, num_pairs, num_tiles, BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr,
                       BLOCK: tl.constexpr, COUNT: tl.constexpr, SCATTER: tl.constexpr, BLOCK_P: tl.constexpr):
    """One program: each expert's padded run start (the cursor the scatter advances), every tile's expert,
    the padded end and the padding ids at the end of each run; with COUNT, each expert's pairs counted first
    (else read from counts); with SCATTER, the pairs scattered as well."""
    experts = tl.arange(0, BLOCK_E)
    expert_ok = experts < num_experts
    if COUNT:
        counts = tl.zeros([BLOCK_E], dtype=tl.int32)
        for start in range(0, num_pairs, BLOCK_P):
            offs = start + tl.arange(0, BLOCK_P)
            ok = offs < num_pairs
            counts += tl.histogram(tl.load(ids_ptr + offs, mask=ok, other=0), BLOCK_E, mask=ok)
    else:
        counts = tl.load(counts_ptr + experts, mask=expert_ok, other=0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    padded_end = tl.cumsum(padded, axis=0)
    run_start = padded_end - padded
    tl.store(cursor_ptr + experts, run_start, mask=expert_ok)
    tl.store(num_padded_ptr, tl.sum(padded, axis=0))
    for start in range(0, num_tiles, BLOCK):
        tile = start + tl.arange(0, BLOCK)
        # a tile's expert: how many runs end at or before its first row (past the last run: clamped)
        ended = tl.sum((padded_end[None, :] <= (tile * BLOCK_M)[:, None]).to(tl.int32), axis=1)
        tl.store(block_expert_ptr + tile, tl.minimum(ended, num_experts - 1), mask=tile < num_tiles)
    # the rows between a run's last pair and its padded end hold the padding id (rows past the padded end are
    # never read: their tiles exit at once)
    for row in range(0, BLOCK_M - 1):
        tl.store(sorted_pairs_ptr + run_start + counts + row, num_pairs, mask=expert_ok & (counts + row < padded))
    if SCATTER:
        tl.debug_barrier()  # the cursors stored above, before any thread's atomics advance them
        for start in range(0, num_pairs, BLOCK_P):
            _scatter_pairs(ids_ptr, cursor_ptr, sorted_pairs_ptr, start + tl.arange(0, BLOCK_P), num_pairs)


@triton.jit(do_not_specialize=["num_pairs"])
def _scatter_kernel(ids_ptr, cursor_ptr, sorted_pairs_ptr, num_pairs, BLOCK: tl.constexpr):
    _scatter_pairs(ids_ptr, cursor_ptr, sorted_pairs_ptr, tl.program_id(0) * BLOCK + tl.arange(0, BLOCK), num_pairs)


# up to this many (token, slot) pairs (every decode step), one program counts, plans and scatters them: one
# launch after the route kernel, where a count, a plan and a scatter kernel after a fill were four (a decode step
# replays 48 layers of small kernels in a CUDA graph, ~3 us a node on the H200: bench/RESULTS.md). Past it a grid
# of programs scatters, rather than one SM's worth of atomics (a 2k-token prefill has 16k pairs at top-8).
SINGLE_PROGRAM_PAIRS = 4096


def group_by_expert(ids: torch.Tensor, num_experts: int, block_m: int,
                    counts: torch.Tensor | None = None) -> ExpertGroups:
    """Sort the pairs by expert and pad each expert's run to a multiple of block_m, in fixed shapes (capacity =
    P + min(E, P) * (block_m - 1) covers the worst padding). counts: each expert's pairs, as route counted
    them; without it the planning program (up to SINGLE_PROGRAM_PAIRS) or a kernel counts first."""
    flat = ids.reshape(-1)
    num_pairs = flat.numel()
    capacity = triton.cdiv(num_pairs + min(num_experts, num_pairs) * (block_m - 1), block_m) * block_m
    device = ids.device
    block = 256
    grid = (max(1, triton.cdiv(num_pairs, block)),)
    one_program = num_pairs <= SINGLE_PROGRAM_PAIRS
    if counts is None and not one_program:
        counts = torch.zeros(num_experts, dtype=torch.int32, device=device)
        _count_kernel[grid](flat, counts, num_pairs, BLOCK=block)
    cursor = torch.empty(num_experts, dtype=torch.int32, device=device)
    sorted_pairs = torch.empty(capacity, dtype=torch.int32, device=device)
    block_expert = torch.empty(capacity // block_m, dtype=torch.int32, device=device)
    num_padded = torch.empty(1, dtype=torch.int32, device=device)
    block_e = triton.next_power_of_2(num_experts)
    _plan_tiles_kernel[(1,)](cursor if counts is None else counts, cursor, block_expert, num_padded, flat,
                             sorted_pairs, num_experts, num_pairs, capacity // block_m, BLOCK_M=block_m,
                             BLOCK_E=block_e, BLOCK=max(1, 8192 // block_e), COUNT=counts is None,
                             SCATTER=one_program, BLOCK_P=1024, num_warps=4)
    if not one_program:
        _scatter_kernel[grid](flat, cursor, sorted_pairs, num_pairs, BLOCK=block)
    return ExpertGroups(sorted_pairs, block_expert, num_padded, num_pairs)


# ---------------------------------------------------------------------------------------------
# 3 + 4. the grouped GEMMs
# ---------------------------------------------------------------------------------------------


@triton.jit
def _tile_ids(num_tiles_m, num_tiles_n, GROUP_M: tl.constexpr):
    """(M tile, N tile) of this program in a 1-D grid. GROUP_M 0: M tiles vary fastest (consecutive programs, on
    the SMs at the same time, read one weight tile: decode, where an expert has a tile or two). Otherwise the N
    tiles of GROUP_M M tiles run together, so the gathered activation rows of an M tile are read from HBM once
    for all its N tiles rather than once per N tile (prefill, where the activations outgrow the L2)."""
    pid = tl.program_id(0)
    if GROUP_M == 0:
        return pid % num_tiles_m, pid // num_tiles_m
    in_group = GROUP_M * num_tiles_n
    first_m = pid // in_group * GROUP_M
    group_size = tl.minimum(num_tiles_m - first_m, GROUP_M)
    return first_m + (pid % in_group) % group_size, (pid % in_group) // group_size


@triton.jit
def _tile_pairs(sorted_pairs_ptr, block_expert_ptr, pid_m, num_pairs, BLOCK_M: tl.constexpr):
    """An M tile's pairs (padding rows masked off) and its expert."""
    pair = tl.load(sorted_pairs_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    return pair, pair < num_pairs, tl.load(block_expert_ptr + pid_m).to(tl.int64)


@triton.jit
def _undo_decode(scales, W_BYTES: tl.constexpr):
    """Weight scales as they apply to the weights read: times 2^8 where they were read as bytes (e4m3_as_fp16)."""
    if W_BYTES:
        return scales * E4M3_AS_FP16_UNSCALE
    return scales


@triton.jit
def _scaled_dot(a, w, acc, s_ptrs, s_tile_ptr, k, n_ok, SCALES: tl.constexpr, GROUP_K: tl.constexpr,
                BLOCK_K: tl.constexpr, PRECISION: tl.constexpr, W_PER_TILE: tl.constexpr, W_BYTES: tl.constexpr):
    """acc + a . w for one K tile. FP8 weights (SCALES > 0) are widened to the activations' dtype, exactly (e4m3's
    values are all bf16 values; W_BYTES: read as their values / 2^8, which the scales undo); with a scale per group of
    GROUP_K columns (SCALES 2: a block checkpoint's, the K tile inside one group) the tile's product is scaled as it
    joins the accumulator, per-row scales (SCALES 1) wait for the epilogue. W_PER_TILE (per_tile): the tile's rows
    share their scales, so one scalar a group from its first row (s_tile_ptr), not a [BLOCK_N] vector a K tile."""
    if SCALES == 0:
        return tl.dot(a, w, acc, input_precision=PRECISION)
    w = w.to(a.dtype)
    if SCALES == 1:
        return tl.dot(a, w, acc, input_precision=PRECISION)
    group = (k * BLOCK_K) // GROUP_K
    if W_PER_TILE:
        return acc + tl.dot(a, w, input_precision=PRECISION) * _undo_decode(tl.load(s_tile_ptr + group), W_BYTES)
    s = _undo_decode(tl.load(s_ptrs + group, mask=n_ok, other=0.0), W_BYTES)
    return acc + tl.dot(a, w, input_precision=PRECISION) * s[None, :]


@triton.jit
def _row_scaled(acc, s_ptrs, n_ok, SCALES: tl.constexpr, W_BYTES: tl.constexpr):
    """The epilogue's per-row weight scale (SCALES 1; W_BYTES: see _undo_decode), else acc as it is."""
    if SCALES == 1:
        return acc * _undo_decode(tl.load(s_ptrs, mask=n_ok, other=0.0), W_BYTES)[None, :]
    return acc


@triton.jit
def _weight_tile(w_ptr, s_ptr, expert, pid_n, n, stride_we, stride_wn, stride_se, stride_sn,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """A program's output columns of expert e's weight [N, K] and its first K tile's pointers: (offs_n, n_ok, offs_k,
    the weight tile [K, N], and, for FP8 weights, the rows' scales and the tile's first row's scales)."""
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    w_ptrs = w_ptr + expert * stride_we + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None]
    s_tile = s_ptr + expert * stride_se + (pid_n * BLOCK_N).to(tl.int64) * stride_sn
    return offs_n, offs_n < n, offs_k, w_ptrs, s_tile + tl.arange(0, BLOCK_N).to(tl.int64) * stride_sn, s_tile


@triton.jit
def _gate_up_tile(w_ptr, s_ptr, expert, pid_n, inter, stride_we, stride_wn, stride_se, stride_sn,
                  BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """_weight_tile over w13's gate rows, with the up rows' pointers `inter` rows below: (offs_n, n_ok, offs_k, gate
    and up weight tiles, gate and up scales, gate and up tiles' first rows' scales)."""
    offs_n, n_ok, offs_k, g_ptrs, sg_ptrs, sg_tile = _weight_tile(w_ptr, s_ptr, expert, pid_n, inter, stride_we,
                                                                  stride_wn, stride_se, stride_sn, BLOCK_N, BLOCK_K)
    up = inter * stride_sn
    return offs_n, n_ok, offs_k, g_ptrs, g_ptrs + inter * stride_wn, sg_ptrs, sg_ptrs + up, sg_tile, sg_tile + up


@triton.jit
def _store_weighted(out_ptr, acc, weights_ptr, pair, row_ok, offs_n, n_ok, stride_ot):
    """The down projection's rows [M, N], rounded to the output dtype as HF's projection rounds, times each pair's
    routing weight."""
    y = acc.to(out_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(weights_ptr + pair, mask=row_ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + pair.to(tl.int64)[:, None] * stride_ot + offs_n[None, :], y * w[:, None],
             mask=row_ok[:, None] & n_ok[None, :])


@triton.jit
def _gate_up_loads(a_ptrs, g_ptrs, u_ptrs, row_ok, n_ok, offs_k, k, hidden, BLOCK_K: tl.constexpr,
                   EVEN_K: tl.constexpr, UPCAST: tl.constexpr, W_BYTES: tl.constexpr):
    """K tile k of the activations [M, K] and of the gate and up weights [K, N], zeros past the edges (fp32 in the
    interpreter; W_BYTES: FP8 weights given as their bytes, read as their values / 2^8 in fp16)."""
    if EVEN_K:
        a = tl.load(a_ptrs, mask=row_ok[:, None], other=0.0)
        g = tl.load(g_ptrs, mask=n_ok[None, :], other=0.0)
        u = tl.load(u_ptrs, mask=n_ok[None, :], other=0.0)
    else:
        k_ok = offs_k < hidden - k * BLOCK_K
        a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        g = tl.load(g_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        u = tl.load(u_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
    if W_BYTES:
        g, u = e4m3_as_fp16(g), e4m3_as_fp16(u)
    if UPCAST:
        a, g, u = a.to(tl.float32), g.to(tl.float32), u.to(tl.float32)
    return a, g, u


@triton.jit(do_not_specialize=["num_pairs", "num_tiles_m"])
def _gate_up_silu_kernel(
    x_ptr, w_ptr, out_ptr, sorted_pairs_ptr, block_expert_ptr, num_padded_ptr, s_ptr,
    num_pairs, hidden, inter, stride_xt, stride_we, stride_wn, stride_ot, stride_se, stride_sn,
    num_tiles_m, TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, EVEN_K: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
    SCALES: tl.constexpr, GROUP_K: tl.constexpr, W_PER_TILE: tl.constexpr, W_BYTES: tl.constexpr = False,
):
    """out[pair, n] = silu(x[token] . w[e, n]) * (x[token] . w[e, inter + n]) for the tile's pairs. W_BYTES: FP8 w
    given as its bytes (GPUs before sm_89, where Triton has no e4m3 type)."""
    pid_m, pid_n = _tile_ids(num_tiles_m, tl.cdiv(inter, BLOCK_N), GROUP_M)
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return
    pair, row_ok, expert = _tile_pairs(sorted_pairs_ptr, block_expert_ptr, pid_m, num_pairs, BLOCK_M)
    token = (pair // TOP_K).to(tl.int64)
    offs_n, n_ok, offs_k, g_ptrs, u_ptrs, sg_ptrs, su_ptrs, sg_tile, su_tile = _gate_up_tile(
        w_ptr, s_ptr, expert, pid_n, inter, stride_we, stride_wn, stride_se, stride_sn, BLOCK_N, BLOCK_K)
    a_ptrs = x_ptr + token[:, None] * stride_xt + offs_k[None, :]
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k in range(0, tl.cdiv(hidden, BLOCK_K)):
        a, g, u = _gate_up_loads(a_ptrs, g_ptrs, u_ptrs, row_ok, n_ok, offs_k, k, hidden, BLOCK_K, EVEN_K, UPCAST,
                                 W_BYTES)
        acc_g = _scaled_dot(a, g, acc_g, sg_ptrs, sg_tile, k, n_ok, SCALES, GROUP_K, BLOCK_K, PRECISION, W_PER_TILE,
                             W_BYTES)
        acc_u = _scaled_dot(a, u, acc_u, su_ptrs, su_tile, k, n_ok, SCALES, GROUP_K, BLOCK_K, PRECISION, W_PER_TILE,
                             W_BYTES)
        a_ptrs += BLOCK_K
        g_ptrs += BLOCK_K
        u_ptrs += BLOCK_K
    acc_g = _row_scaled(acc_g, sg_ptrs, n_ok, SCALES, W_BYTES)
    acc_u = _row_scaled(acc_u, su_ptrs, n_ok, SCALES, W_BYTES)
    # rounded where HF's eager expert rounds: each projection's output, then silu, then the product
    gate = acc_g.to(out_ptr.dtype.element_ty).to(tl.float32)
    up = acc_u.to(out_ptr.dtype.element_ty).to(tl.float32)
    act = (gate / (1.0 + tl.exp(-gate))).to(out_ptr.dtype.element_ty).to(tl.float32)
    out_ptrs = out_ptr + pair.to(tl.int64)[:, None] * stride_ot + offs_n[None, :]
    tl.store(out_ptrs, act * up, mask=row_ok[:, None] & n_ok[None, :])


@triton.jit(do_not_specialize=["num_pairs", "num_tiles_m"])
def _down_weighted_kernel(
    h_ptr, w_ptr, out_ptr, weights_ptr, sorted_pairs_ptr, block_expert_ptr, num_padded_ptr, s_ptr,
    num_pairs, hidden, inter, stride_ht, stride_we, stride_wn, stride_ot, stride_se, stride_sn,
    num_tiles_m, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr, SCALES: tl.constexpr,
    GROUP_K: tl.constexpr, W_PER_TILE: tl.constexpr, W_BYTES: tl.constexpr = False,
):
    """out[pair, n] = weight[pair] * (h[pair] . w[e, n]) for the tile's pairs (n over hidden); W_BYTES as in
    _gate_up_silu_kernel."""
    pid_m, pid_n = _tile_ids(num_tiles_m, tl.cdiv(hidden, BLOCK_N), GROUP_M)
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return
    pair, row_ok, expert = _tile_pairs(sorted_pairs_ptr, block_expert_ptr, pid_m, num_pairs, BLOCK_M)
    offs_n, n_ok, offs_k, b_ptrs, s_ptrs, s_tile = _weight_tile(w_ptr, s_ptr, expert, pid_n, hidden, stride_we,
                                                                stride_wn, stride_se, stride_sn, BLOCK_N, BLOCK_K)
    a_ptrs = h_ptr + pair.to(tl.int64)[:, None] * stride_ht + offs_k[None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k in range(0, tl.cdiv(inter, BLOCK_K)):
        if EVEN_K:
            a = tl.load(a_ptrs, mask=row_ok[:, None], other=0.0)
            b = tl.load(b_ptrs, mask=n_ok[None, :], other=0.0)
        else:
            k_ok = offs_k < inter - k * BLOCK_K
            a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        if W_BYTES:
            b = e4m3_as_fp16(b)
        if UPCAST:
            a, b = a.to(tl.float32), b.to(tl.float32)
        acc = _scaled_dot(a, b, acc, s_ptrs, s_tile, k, n_ok, SCALES, GROUP_K, BLOCK_K, PRECISION, W_PER_TILE,
                          W_BYTES)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    _store_weighted(out_ptr, _row_scaled(acc, s_ptrs, n_ok, SCALES, W_BYTES), weights_ptr, pair, row_ok, offs_n,
                    n_ok, stride_ot)


# ---------------------------------------------------------------------------------------------
# tiles: chosen per shape by `python bench/kernels.py --moe-sweep` on the H200
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MoeTile:
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    group_m: int = 0  # 0: M tiles fastest; else the N tiles of group_m M tiles together (_tile_ids)


# (experts, hidden, intermediate per rank, top_k) -> [(most tokens, gate/up tile, down tile), ...] ascending;
# a step of more tokens than the last row uses the last row. Rows printed by `bench/kernels.py --moe-sweep` (each
# GEMM timed alone at that token count; the two tiles of a row share their M tile; H200, 2026-12-03, c8035ad).
# The -tp 2 slice (128, 2048, 384, 8) is in the sweep but not measured yet: it takes default_tiles.
MOE_TILES: dict[tuple[int, int, int, int], list[tuple[int, MoeTile, MoeTile]]] = {
    (128, 2048, 768, 8): [  # Qwen3-30B-A3B at one rank
        (1, MoeTile(16, 32, 128, 4, 4, 0), MoeTile(16, 128, 128, 4, 3, 0)),
        (16, MoeTile(16, 32, 128, 4, 4, 0), MoeTile(16, 32, 128, 4, 4, 0)),
        (64, MoeTile(16, 128, 128, 4, 3, 0), MoeTile(16, 128, 128, 4, 3, 0)),
        (128, MoeTile(16, 128, 128, 4, 3, 0), MoeTile(16, 64, 128, 4, 4, 0)),
        (256, MoeTile(32, 128, 128, 8, 3, 0), MoeTile(32, 128, 128, 4, 3, 0)),
        (512, MoeTile(64, 128, 64, 8, 4, 8), MoeTile(64, 128, 64, 8, 4, 8)),
        (2048, MoeTile(128, 128, 64, 8, 3, 8), MoeTile(128, 128, 64, 8, 3, 8)),
        (16384, MoeTile(128, 128, 64, 8, 3, 8), MoeTile(128, 256, 64, 8, 3, 8)),
    ],
}


# NANOSERVE_MOE_TILES names a JSON file that the sweep wrote (`bench/kernels.py --moe-sweep --moe-tiles-out`): its
# shapes' rows replace MOE_TILES' own, so that a sweep's choice can run in the engine before it is copied here
MOE_TILES_ENV = "NANOSERVE_MOE_TILES"


def apply_tiles(measured: dict) -> None:
    """Replace MOE_TILES' rows of the shapes a sweep measured: {"E H I k": [[most tokens, [up tile], [down tile]],
    ...]}, a tile as MoeTile's fields in order."""
    for key, rows in measured.items():
        shape = tuple(int(v) for v in key.split())
        MOE_TILES[shape] = [(int(most), MoeTile(*up), MoeTile(*down)) for most, up, down in rows]


def tiles_json(shape: tuple[int, int, int, int], rows: list[tuple[int, MoeTile, MoeTile]]) -> dict:
    """apply_tiles' input for one shape's rows."""
    return {" ".join(map(str, shape)): [[most, list(vars(up).values()), list(vars(down).values())]
                                        for most, up, down in rows]}


if os.environ.get(MOE_TILES_ENV):
    with open(os.environ[MOE_TILES_ENV]) as f:
        apply_tiles(json.load(f))


def default_tiles(num_tokens: int, top_k: int, num_experts: int) -> tuple[MoeTile, MoeTile]:
    """Before a sweep: small M tiles while experts see few tokens each, large ones for prefill."""
    if INTERPRET:
        return MoeTile(16, 32, 32, 1, 1), MoeTile(16, 32, 32, 1, 1)
    per_expert = num_tokens * top_k / num_experts
    if per_expert <= 16:
        return MoeTile(16, 64, 128, 4, 4), MoeTile(16, 64, 128, 4, 4)
    if per_expert <= 64:
        return MoeTile(32, 64, 128, 4, 4), MoeTile(32, 64, 128, 4, 4)
    return MoeTile(64, 128, 64, 8, 4), MoeTile(64, 128, 64, 8, 4)


def tiles_for(num_tokens: int, num_experts: int, hidden: int, inter: int, top_k: int,
              element_size: int = 2) -> tuple[MoeTile, MoeTile]:
    rows = MOE_TILES.get((num_experts, hidden, inter, top_k))
    if not rows or INTERPRET:
        tiles = default_tiles(num_tokens, top_k, num_experts)
    else:
        tiles = next(((up, down) for most, up, down in rows if num_tokens <= most), rows[-1][1:])
    return tuple(for_element_size(tile, element_size) for tile in tiles)


def for_element_size(tile: MoeTile, element_size: int) -> MoeTile:
    """The tiles are sized for 2-byte (bf16) operands; 4-byte ones (an fp32 model: the equivalence tests) halve
    BLOCK_K, so that each pipeline stage keeps its bytes and fits the shared memory (a gate/up tile of 32 x 64 x
    128 in fp32 would need 240 KB of sm_90's 227)."""
    if element_size <= 2 or tile.block_k <= 16:
        return tile
    return replace(tile, block_k=max(16, tile.block_k * 2 // element_size))


def _precision(x: torch.Tensor) -> str:
    # fp32 models (the equivalence tests) multiply in full fp32, not the tensor cores' tf32
    return "ieee" if x.dtype == torch.float32 else "tf32"


def _grid(groups: ExpertGroups, cols: int, tile: MoeTile) -> tuple[int]:
    return (_tiles_m(groups, tile) * triton.cdiv(cols, tile.block_n),)


def _tiles_m(groups: ExpertGroups, tile: MoeTile) -> int:
    return groups.sorted_pairs.numel() // tile.block_m


@dataclass(frozen=True)
class Fp8Experts:
    """The FP8 scales of stacked FP8 experts (executor_svc/layers/fp8.py makes them at load): float32, a row's
    scale per group of group_k input columns, w13_scale [E, 2I, G13] and w2_scale [E, H, G2]; a group as wide as
    the row (G = 1) is a scale per output row. `activations`: "bf16", fused_moe multiplies in the activation dtype
    (each FP8 weight tile widened in registers); "fp8", kernels/fused_moe_fp8_activations quantizes x and h per token
    and 128 columns and multiplies FP8 by FP8."""
    w13_scale: torch.Tensor
    w2_scale: torch.Tensor
    group_k13: int
    group_k2: int
    activations: str = "bf16"
    # the weights are read as their bytes and decoded in the kernel: GPUs before sm_89, where Triton has no e4m3 type
    weight_bytes: bool = False
    # 128 where every aligned run of 128 rows of each weight with group scales shares them (a 128 x 128 block
    # checkpoint whose blocks this rank's slice does not cut), else 1: set from the scales, so never wrong
    rows_sharing_scales: int = field(init=False)

    def __post_init__(self):
        grouped = [scale for scale in (self.w13_scale, self.w2_scale) if scale.shape[-1] > 1]
        shared = bool(grouped) and all(rows_sharing_scales(scale) == SCALE_BLOCK_ROWS for scale in grouped)
        object.__setattr__(self, "rows_sharing_scales", SCALE_BLOCK_ROWS if shared else 1)


def per_tile(fp8: Fp8Experts, scale: torch.Tensor, tile: MoeTile, second_half_at: int = 0) -> bool:
    """Whether each N tile of a weight with group scales takes one scale per group: aligned runs of rows share them
    and a tile lies inside one run (its start aligned; w13's up rows start `second_half_at` = inter rows down, which
    must be aligned too). A weight with a scale per row applies it in the epilogue instead."""
    runs = fp8.rows_sharing_scales
    return scale.shape[-1] > 1 and runs > 1 and runs % tile.block_n == 0 and second_half_at % tile.block_n == 0


def _scale_args(scale: torch.Tensor | None, group_k: int, k: int, tile: MoeTile, like: torch.Tensor) -> tuple:
    """(scale tensor, its two strides, SCALES, GROUP_K, the tile) for a GEMM over K = k: a plain weight passes a
    placeholder; groups narrower than the K tile shrink the tile to the group (a power of two dividing it)."""
    if scale is None:
        return like, 0, 0, 0, 1, tile
    if scale.shape[-1] == 1:
        return scale, scale.stride(0), scale.stride(1), 1, 1, tile
    if group_k % tile.block_k:
        block_k = group_k & -group_k  # the largest power of two dividing the group
        if block_k < 16 and not INTERPRET:
            raise ValueError(f"FP8 expert scales in groups of {group_k} columns: the GEMM needs groups of 16 or more")
        tile = replace(tile, block_k=min(tile.block_k, block_k))
    return scale, scale.stride(0), scale.stride(1), 2, group_k, tile


def gate_up_silu(x: torch.Tensor, w13: torch.Tensor, groups: ExpertGroups, top_k: int, tile: MoeTile,
                 fp8: Fp8Experts | None = None) -> torch.Tensor:
    """h [P, I]: silu(gate) * up of every (token, slot) pair, row t * k + j. FP8 w13 takes its scales (`fp8`)."""
    inter, hidden = w13.shape[1] // 2, w13.shape[2]
    h = torch.empty(groups.num_pairs, inter, dtype=x.dtype, device=x.device)
    s, stride_se, stride_sn, scales, group_k, tile = _scale_args(fp8 and fp8.w13_scale, fp8 and fp8.group_k13,
                                                                 hidden, tile, h)
    _gate_up_silu_kernel[_grid(groups, inter, tile)](
        x, _weight(w13, fp8), h, groups.sorted_pairs, groups.block_expert, groups.num_padded, s,
        groups.num_pairs, hidden, inter, x.stride(0), w13.stride(0), w13.stride(1), h.stride(0), stride_se, stride_sn,
        _tiles_m(groups, tile), TOP_K=top_k, BLOCK_M=tile.block_m, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k,
        GROUP_M=tile.group_m, EVEN_K=hidden % tile.block_k == 0, UPCAST=INTERPRET, PRECISION=_precision(x),
        SCALES=scales, GROUP_K=group_k, W_PER_TILE=scales == 2 and per_tile(fp8, s, tile, inter),
        W_BYTES=fp8 is not None and fp8.weight_bytes, num_warps=tile.num_warps, num_stages=tile.num_stages)
    return h


def _weight(w: torch.Tensor, fp8: Fp8Experts | None) -> torch.Tensor:
    """Stacked expert weights as the kernels read them: their bytes where Fp8Experts.weight_bytes."""
    return w.view(torch.uint8) if fp8 is not None and fp8.weight_bytes else w


def down_weighted(h: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor, groups: ExpertGroups,
                  tile: MoeTile, fp8: Fp8Experts | None = None) -> torch.Tensor:
    """y [P, H]: each pair's down projection times its routing weight. FP8 w2 takes its scales (`fp8`)."""
    hidden, inter = w2.shape[1], w2.shape[2]
    y = torch.empty(groups.num_pairs, hidden, dtype=h.dtype, device=h.device)
    s, stride_se, stride_sn, scales, group_k, tile = _scale_args(fp8 and fp8.w2_scale, fp8 and fp8.group_k2, inter,
                                                                 tile, y)
    _down_weighted_kernel[_grid(groups, hidden, tile)](
        h, _weight(w2, fp8), y, weights, groups.sorted_pairs, groups.block_expert, groups.num_padded, s,
        groups.num_pairs, hidden, inter, h.stride(0), w2.stride(0), w2.stride(1), y.stride(0), stride_se, stride_sn,
        _tiles_m(groups, tile), BLOCK_M=tile.block_m, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k,
        GROUP_M=tile.group_m, EVEN_K=inter % tile.block_k == 0, UPCAST=INTERPRET, PRECISION=_precision(h),
        SCALES=scales, GROUP_K=group_k, W_PER_TILE=scales == 2 and per_tile(fp8, s, tile),
        W_BYTES=fp8 is not None and fp8.weight_bytes, num_warps=tile.num_warps, num_stages=tile.num_stages)
    return y


def route_and_group(router_logits: torch.Tensor, top_k: int, renormalize: bool, block_m: int):
    """(weights, ids, groups, counts): route, then group by expert, in the fewest launches. Decode: the planning
    program counts (counts None); prefill: route counts as it picks, into a zeroed buffer (no counting pass)."""
    num_tokens, num_experts = router_logits.shape
    counts = None
    if num_tokens * top_k > SINGLE_PROGRAM_PAIRS:
        counts = torch.zeros(num_experts, dtype=torch.int32, device=router_logits.device)
    weights, ids = route(router_logits, top_k, renormalize, counts)
    return weights, ids, group_by_expert(ids, num_experts, block_m, counts), counts


def fused_moe(x: torch.Tensor, router_logits: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, top_k: int,
              renormalize: bool, tiles: tuple[MoeTile, MoeTile] | None = None,
              fp8: Fp8Experts | None = None) -> torch.Tensor:
    """The MoE block [T, H] of x [T, H] (contiguous rows), fused_moe_ref's contract. No host syncs. FP8 experts
    (w13 and w2 float8_e4m3fn, `fp8` their scales) are read as FP8 and multiplied in x's dtype."""
    if fp8 is not None and fp8.activations != "bf16":
        raise ValueError("FP8 activations run in kernels/fused_moe_fp8_activations.fused_moe_fp8_activations")
    num_tokens = x.shape[0]
    num_experts, inter, hidden = w13.shape[0], w13.shape[1] // 2, w13.shape[2]
    up_tile, down_tile = tiles or tiles_for(num_tokens, num_experts, hidden, inter, top_k, x.element_size())
    if num_tokens == 0:
        return torch.zeros_like(x)
    weights, ids, groups, counts = route_and_group(router_logits, top_k, renormalize, up_tile.block_m)
    h = gate_up_silu(x, w13, groups, top_k, up_tile, fp8)
    if down_tile.block_m != up_tile.block_m:  # the sweep avoids this (bench/moe_kernels.py): it regroups
        groups = group_by_expert(ids, num_experts, down_tile.block_m, counts)
    y = down_weighted(h, w2, weights.view(-1), groups, down_tile, fp8)
    return y.view(num_tokens, top_k, hidden).sum(dim=1)  # accumulated in fp32, rounded once
