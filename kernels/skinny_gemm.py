"""Skinny GEMM for decode-sized linear layers: out[M, N] = x[M, K] @ W[N, K]^T (+ bias), small M.

At decode M is the batch (1..64), so a linear layer is a pass over its weight: the kernel's only job
is to stream W at HBM bandwidth from every SM. Programs tile N (and M, padded to >= 16 rows for
tl.dot); when N alone gives too few programs, K is split inside the same launch: each split writes
its fp32 partial tile to a cached workspace and bumps a per-tile counter, and the split that arrives
last sums the partials in split order (deterministic whatever the arrival order), adds the bias,
stores the output and puts the counter back to 0 for the next call or CUDA-graph replay. No extra
kernel zeroes or casts anything, so one call is one launch.

`silu_and_mul_input` fuses SwiGLU into down_proj's operand load: x is [M, 2K] = [gate | up], and
the A tile is silu(gate) * up, rounded like kernels/fused_ops.silu_and_mul rounds its output.
Under TRITON_INTERPRET=1 (set before import) loads are upcast to fp32: the interpreter's bf16 is wrong.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from kernels.triton_runtime import INTERPRET, num_sms

MAX_M = 64  # skinny_supported's bound on M; set from GPU measurements against cuBLAS
MAX_SPLIT_K = 8  # the default table never splits K further


@dataclass(frozen=True)
class SkinnyConfig:
    block_m: int  # rows of x per program, >= 16 (tl.dot); M is padded to it by masks
    block_n: int  # rows of W per program
    block_k: int  # K step of the loop
    split_k: int  # programs sharing one output tile, each over a slice of K
    num_warps: int
    num_stages: int
    swap_ab: bool = True  # dot(W, x^T): W's rows fill the MMA's wide M side, x's few rows its N side


# Overrides by exact (M, N, K), consulted before the default heuristic (the benchmark's sweep fills it).
CONFIGS: dict[tuple[int, int, int], SkinnyConfig] = {}
_SMEM_BUDGET = 96 * 1024  # pipeline buffers per program: leaves room for 2 programs on an SM


def _default_config(M: int, N: int, K: int, elt: int, sms: int, silu_and_mul_input: bool) -> SkinnyConfig:
    """Enough programs to stream W from every SM (>= 2 per SM), with whole K tiles per split.

    Small N (o_proj, down_proj: N = 1024) gives 16-32 tiles of N, far too few for 132 SMs, so K is
    split until there are ~2 programs per SM, keeping >= 2 K tiles per split; narrower N tiles
    (32) come in when 64-wide ones split 8 ways still fall short. Each program then has 16-32 KB of
    W to load, and with 3-4 stages all of it is in flight at once.
    """
    block_m = min(64, max(16, triton.next_power_of_2(M)))
    block_k = min(128 if elt == 2 else 64, max(32, triton.next_power_of_2(K)))
    k_tiles = triton.cdiv(K, block_k)
    m_tiles = triton.cdiv(M, block_m)
    best = None
    for block_n in (64, 32):
        block_n = min(block_n, max(16, triton.next_power_of_2(N)))
        tiles = m_tiles * triton.cdiv(N, block_n)
        split = 1
        while tiles * split < 2 * sms and split < MAX_SPLIT_K and k_tiles >= 4 * split:
            split *= 2
        if best is None or tiles * split > best[0]:
            best = (tiles * split, block_n, split)
        if tiles * split >= 2 * sms:
            break
    _, block_n, split = best
    k_tiles_per_split = triton.cdiv(k_tiles, split)
    x_rows = 2 * block_m if silu_and_mul_input else block_m  # gate and up are both staged
    stage_bytes = (x_rows + block_n) * block_k * elt
    stages = max(2, min(4, k_tiles_per_split + 1, _SMEM_BUDGET // stage_bytes))
    return SkinnyConfig(block_m, block_n, block_k, split, 4, stages)


def config_for(M: int, N: int, K: int, *, dtype: torch.dtype = torch.bfloat16, sms: int | None = None,
               silu_and_mul_input: bool = False) -> SkinnyConfig:
    """The config for out[M, N] = x[M, K] @ W[N, K]^T: CONFIGS[(M, N, K)] if set, else the default.

    sms: SM count the default sizes its grid for (None: the current CUDA device's, 8 without one).
    """
    if (M, N, K) in CONFIGS:
        return CONFIGS[(M, N, K)]
    if sms is None:
        sms = num_sms(torch.device("cuda", torch.cuda.current_device())) if torch.cuda.is_available() else 8
    return _default_config(M, N, K, dtype.itemsize, sms, silu_and_mul_input)


# ---------------------------------------------------------------------------------------------
# Kernel
# ---------------------------------------------------------------------------------------------


@triton.jit
def _load_x_tile(ptrs, mask, K, SILU_AND_MUL: tl.constexpr, UPCAST: tl.constexpr):
    """A tile of x; with SILU_AND_MUL, silu(gate) * up from x = [gate | up], rounded as
    fused_ops.silu_and_mul rounds: silu to x's dtype, then the product to x's dtype."""
    dtype = ptrs.dtype.element_ty
    if SILU_AND_MUL:
        gate = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(ptrs + K, mask=mask, other=0.0).to(tl.float32)
        act = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
        a = (act * up).to(dtype)
    else:
        a = tl.load(ptrs, mask=mask, other=0.0)
    if UPCAST:
        a = a.to(tl.float32)
    return a


@triton.jit
def _store_out(acc, out_ptr, out_stride, bias_ptr, offs_m, offs_n, M, N, HAS_BIAS: tl.constexpr):
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
    mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
    ptrs = out_ptr + offs_m.to(tl.int64)[:, None] * out_stride + offs_n[None, :]
    tl.store(ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["M"])  # one compiled variant for every batch size
def _skinny_gemm_kernel(
    x_ptr, w_ptr, bias_ptr, out_ptr, partial_ptr, counter_ptr,
    M, N, K, x_stride, out_stride, k_per_split,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr, EVEN_K: tl.constexpr, SWAP_AB: tl.constexpr, HAS_BIAS: tl.constexpr,
    SILU_AND_MUL: tl.constexpr, UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    # M tiles vary fastest: programs that share W's rows start together and meet in L2.
    pid_m, pid_n, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < M
    k_lo = split * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    # W rows past N wrap around instead of being masked: W loads stay unmasked (EVEN_K), and the
    # wrapped columns are never stored.
    w_rows = (offs_n % N).to(tl.int64)
    x_ptrs = x_ptr + offs_m.to(tl.int64)[:, None] * x_stride + (k_lo + offs_k)[None, :]
    w_ptrs = w_ptr + w_rows[:, None] * K + (k_lo + offs_k)[None, :]
    if SWAP_AB:
        acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k in range(k_lo, k_hi, BLOCK_K):
        if EVEN_K:
            a = _load_x_tile(x_ptrs, m_mask[:, None], K, SILU_AND_MUL, UPCAST)
            w = tl.load(w_ptrs, eviction_policy="evict_first")  # read once: keep L2 for the rest
        else:
            k_mask = (k + offs_k) < k_hi
            a = _load_x_tile(x_ptrs, m_mask[:, None] & k_mask[None, :], K, SILU_AND_MUL, UPCAST)
            w = tl.load(w_ptrs, mask=k_mask[None, :], other=0.0, eviction_policy="evict_first")
        if UPCAST:
            w = w.to(tl.float32)
        if SWAP_AB:
            acc = tl.dot(w, tl.trans(a), acc, input_precision=DOT_PRECISION)
        else:
            acc = tl.dot(a, tl.trans(w), acc, input_precision=DOT_PRECISION)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if SWAP_AB:
        acc = tl.trans(acc)

    if SPLIT_K == 1:
        _store_out(acc, out_ptr, out_stride, bias_ptr, offs_m, offs_n, M, N, HAS_BIAS)
    else:
        # Partials [split_k, tiles, BLOCK_M, BLOCK_N]: each tile is one contiguous block.
        tile = pid_m * tl.num_programs(1) + pid_n
        tile_size: tl.constexpr = BLOCK_M * BLOCK_N
        split_stride = tl.num_programs(0) * tl.num_programs(1) * tile_size
        in_tile = tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
        tile_ptrs = partial_ptr + tile * tile_size + in_tile
        tl.store(tile_ptrs + split * split_stride, acc)
        tl.debug_barrier()  # every thread's stores precede the release below
        arrived = tl.atomic_add(counter_ptr + tile, 1, sem="acq_rel", scope="gpu")
        tl.debug_barrier()  # one thread acquired for the CTA: the others read after it
        if arrived == SPLIT_K - 1:  # the last split: all partials are in L2
            # In split order, whichever split got here last. Unrolled (SPLIT_K is a constexpr), so
            # the loads go out together rather than one L2 round trip per split.
            total = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
            for s in tl.static_range(SPLIT_K):
                total += tl.load(tile_ptrs + s * split_stride, cache_modifier=".cg")  # L2, not a stale L1
            _store_out(total, out_ptr, out_stride, bias_ptr, offs_m, offs_n, M, N, HAS_BIAS)
            tl.store(counter_ptr + tile, 0)  # clean for the next call or graph replay


# ---------------------------------------------------------------------------------------------
# Host side
# ---------------------------------------------------------------------------------------------

# (device, m_tiles, n_tiles, block_m, block_n, split_k) -> (fp32 partials, int32 counters).
# Kept for the process's life: a captured CUDA graph holds their addresses. Calls that share an
# entry must run in order on one stream (layers of a forward do), since the buffers are reused.
_WORKSPACES: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}


def split_k_workspace(device: torch.device, m_tiles: int, n_tiles: int, cfg: SkinnyConfig):
    """The partials and tile counters a split-K call with this grid uses; allocated on first use."""
    key = (device, m_tiles, n_tiles, cfg.block_m, cfg.block_n, cfg.split_k)
    if key not in _WORKSPACES:
        tiles = m_tiles * n_tiles
        partials = torch.empty(cfg.split_k * tiles * cfg.block_m * cfg.block_n, dtype=torch.float32, device=device)
        _WORKSPACES[key] = partials, torch.zeros(tiles, dtype=torch.int32, device=device)
    return _WORKSPACES[key]


_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def skinny_supported(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether skinny_linear takes (x, weight): on CUDA (or the interpreter), 2-D, contiguous,
    one float dtype, and M <= MAX_M."""
    return (
        (x.is_cuda or INTERPRET) and x.device == weight.device
        and x.dim() == 2 and weight.dim() == 2 and x.is_contiguous() and weight.is_contiguous()
        and x.dtype in _DTYPES and weight.dtype == x.dtype
        and x.shape[0] <= MAX_M
    )


def skinny_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
    silu_and_mul_input: bool = False, out: torch.Tensor | None = None, config: SkinnyConfig | None = None,
) -> torch.Tensor:
    """x [M, K] @ weight[N, K]^T + bias, as F.linear, in one launch; fp32 accumulation.

    silu_and_mul_input: x is [M, 2K] = [gate | up] and the operand is silu(gate) * up.
    out: an [M, N] tensor of x's dtype with a unit last stride to write into; returned.
    config: overrides config_for(M, N, K).
    """
    M, K = x.shape[0], weight.shape[1]
    N = weight.shape[0]
    if x.dim() != 2 or x.shape[1] != (2 * K if silu_and_mul_input else K):
        raise ValueError(f"x {tuple(x.shape)} does not fit weight {tuple(weight.shape)}"
                         f"{' with silu_and_mul_input' if silu_and_mul_input else ''}")
    if x.stride(-1) != 1 or not weight.is_contiguous():
        raise ValueError("x needs a unit last stride and weight must be contiguous")
    if weight.dtype != x.dtype:
        raise ValueError(f"weight dtype {weight.dtype} differs from x's {x.dtype}")
    if bias is not None and (bias.shape != (N,) or bias.stride(0) != 1):
        raise ValueError(f"bias must be a contiguous [{N}], got {tuple(bias.shape)}")
    if out is None:
        out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    elif out.shape != (M, N) or out.dtype != x.dtype or out.stride(-1) != 1:
        raise ValueError(f"out must be [{M}, {N}] {x.dtype} with a unit last stride")
    if M == 0:
        return out
    if K == 0:
        return out.copy_(bias.expand(M, N) if bias is not None else torch.zeros_like(out))
    cfg = config or config_for(M, N, K, dtype=x.dtype, sms=num_sms(x.device) if x.is_cuda else None,
                               silu_and_mul_input=silu_and_mul_input)
    m_tiles, n_tiles = triton.cdiv(M, cfg.block_m), triton.cdiv(N, cfg.block_n)
    k_tiles = triton.cdiv(K, cfg.block_k)
    cfg = replace(cfg, split_k=max(1, min(cfg.split_k, k_tiles)))  # no split without a K tile
    split_k = cfg.split_k
    k_per_split = triton.cdiv(k_tiles, split_k) * cfg.block_k
    if split_k > 1:
        partials, counters = split_k_workspace(x.device, m_tiles, n_tiles, cfg)
    else:
        partials, counters = out, out  # not touched with SPLIT_K = 1
    _skinny_gemm_kernel[(m_tiles, n_tiles, split_k)](
        x, weight, bias if bias is not None else out, out, partials, counters,
        M, N, K, x.stride(0), out.stride(0), k_per_split,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        SPLIT_K=split_k, EVEN_K=K % cfg.block_k == 0 and k_tiles % split_k == 0, SWAP_AB=cfg.swap_ab,
        HAS_BIAS=bias is not None, SILU_AND_MUL=silu_and_mul_input, UPCAST=INTERPRET,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return out
