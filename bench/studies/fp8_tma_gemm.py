"""Can a TMA-fed, persistent Triton FP8 GEMM stream the Qwen3-8B weights at decode sizes (M = 64-256) faster than
torch._scaled_mm and the present Triton kernel (kernels/fp8_gemm.py)? A study: the kernel lives here until it wins.

The kernel (`tma_fp8_gemm`, channel scales only): c [M, N] = (a [M, K] @ w [N, K]^T) * a_scale [M, 1] * w_scale [N, 1]^T
(+ bias [N]), a and w float8_e4m3fn. Its operands come through TMA: host-side tensor descriptors
(triton.tools.tensor_descriptor.TensorDescriptor), which Triton's launcher encodes on the host at each launch and
passes by value as kernel parameters: no device allocation, no global scratch, no sync, so a call captures in a CUDA
graph like a plain launch (the study times every variant as graph replays). TMA zero-fills rows and columns past M, N
and K on loads and clips the output tile on its store; it needs 16-byte row strides: K % 16 == 0 and N * the output's
element size % 16 == 0.
One program per SM loops over work units: an output tile, or with split-K an output tile's share of K. Units are
numbered M tile fastest, then K split, then N tile, so the programs running at once read the same W slice for all of
M's tiles: W comes from HBM once, the other M tiles read it from L2. The K loop is software-pipelined num_stages deep
(TMA loads in flight while wgmma runs); `warp_specialize` asks Triton to split loads and MMA into their own warps.
Numerics as kernels/fp8_gemm.py: each K tile's product (BLOCK_K = 128) joins the fp32 accumulator in an fp32 add
(max_num_imprecise_acc = 128), the scales apply once in the epilogue. Split-K units write fp32 partials and the last one
of a tile to count itself in kernels/fp8_gemm.split_counters adds them up (one launch, counters left at zero).

    python bench/studies/fp8_tma_gemm.py --out fp8_tma_gemm.json   # H200: the study, 2-3 minutes
    python bench/studies/fp8_tma_gemm.py --interpret-check          # CPU: the kernel in Triton's interpreter
    python bench/studies/fp8_tma_gemm.py --compile-check            # CPU: every swept config compiled for sm_90

The study, per Qwen3-8B product and M: torch._scaled_mm with row-wise scales on M rows and on 256 (the better),
kernels/fp8_gemm.triton_fp8_gemm on its dispatch table's tiles, and this kernel over SWEEP's configs and split
counts. Each variant is timed as a CUDA graph of calls over enough copies of W to exceed L2 (and L2 flushed between
replays): microseconds a call, W's TB/s (N * K bytes / time), TFLOP/s, and the max error against float64 on the same
fp8 values and scales, of max |reference|, twice: with the bf16 output timed (what the engine gets) and with an fp32
output (the accumulation's error alone: bf16's own rounding is up to 3.9e-3 of max |reference|, more than the bound).
A variant fails, and is never the best, where the fp32 error exceeds 2e-3 or the bf16 one 2e-3 plus bf16's rounding.
Each config also runs with W prefetched into L2 PREFETCH K tiles ahead (cp.async.bulk.prefetch.L2 per row) and as a
programmatic dependent launch (`--variants`). On the H200 (bench/RESULTS.md, 2026-12-04) the kernel won on o_proj and
down_proj only, prefetching doubled its time and PDL moved nothing; the split-K path's fp32 output was wrong in some
cells, cause not found.
"""
from __future__ import annotations

import argparse
import itertools
import json
import math
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path = [str(HERE.parent.parent)] + [p for p in sys.path if Path(p or ".").resolve() != HERE]
from bench.studies import triton_mode_from_argv  # noqa: E402

triton_mode_from_argv(sys.argv)  # before any kernel is decorated

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.tools.tensor_descriptor import TensorDescriptor  # noqa: E402

from bench.fp8_gemm_table import QWEN3_8B_GEMMS, cold_graph_us, weight_copies  # noqa: E402
from kernels.fp8_gemm import PROMOTE_K, SPLIT_COUNTERS, split_counters  # noqa: E402
from kernels.triton_runtime import INTERPRET, num_sms  # noqa: E402

TOKENS = [64, 96, 128, 144, 160, 192, 224, 256]
MAX_ERROR = 2e-3  # of max |reference|: the accumulation's error, measured on an fp32 output
BF16_ROUNDING = 2.0**-8  # bf16's own rounding of an output, relative: up to 3.9e-3 of max |reference| by itself
SM90_SHARED_BYTES = 227 * 1024  # the most shared memory a program may take on an H100/H200

# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages, warp_specialize): each compiled once per output dtype and
# split-or-not, for every shape and M
SWEEP = [
    (64, 64, 128, 4, 4, False), (64, 64, 128, 4, 6, False),
    (64, 128, 128, 4, 4, False), (64, 128, 128, 4, 6, False),
    (64, 256, 128, 8, 3, False), (64, 256, 128, 8, 4, False),
    (128, 64, 128, 4, 4, False), (128, 64, 128, 4, 6, False),
    (128, 128, 128, 8, 3, False), (128, 128, 128, 8, 4, False),
    # (128, 256) is left out: 255 registers on 8 warps, and its fp32-output epilogue (the accuracy check's) needs
    # more shared memory than an SM has
    # Triton 3.6 warp-specialises on sm_90 only one warpgroup's 64-row tiles: with 8 warps it leaves the loop as it
    # is, and BLOCK_M = 128 on 4 warps fails in its NVGPUWarpSpecialization pass (both found compiling as
    # --compile-check does)
    (64, 64, 128, 4, 6, True), (64, 128, 128, 4, 4, True), (64, 128, 128, 4, 6, True),
]
# (PREFETCH, PDL) per config: W's tiles prefetched into L2 that many K tiles ahead of the TMA loads (0: none), and the
# kernel launched as a programmatic dependent of the one before (it prefetches, then waits for that kernel's end)
PREFETCH_PDL = [(0, False), (8, False), (0, True), (8, True)]
SPLITS = (1, 2, 3, 4)  # split-K counts timed per config where the units stay within MAX_WAVES of the SMs
MAX_WAVES = 4


# ---------------------------------------------------------------------------------------------
# The kernel
# ---------------------------------------------------------------------------------------------


@triton.jit
def _epilogue(acc, off_m, off_n, m, n, a_scale_ptr, w_scale_ptr, bias_ptr, c_desc,
              HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    rows = off_m + tl.arange(0, BLOCK_M)
    cols = off_n + tl.arange(0, BLOCK_N)
    a_s = tl.load(a_scale_ptr + rows, mask=rows < m, other=0.0)
    w_s = tl.load(w_scale_ptr + cols, mask=cols < n, other=0.0)
    acc = acc * (a_s[:, None] * w_s[None, :])
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=cols < n, other=0.0).to(tl.float32)[None, :]
    c_desc.store([off_m, off_n], acc.to(c_desc.dtype))  # TMA clips rows >= m and columns >= n


@triton.jit
def _prefetch_w(w_ptr, off_n, col, n, k, stride_w, nbytes, BLOCK_N: tl.constexpr):
    """Each of the tile's W rows from column `col`, `nbytes` of it (clipped to the row), into L2: one
    cp.async.bulk.prefetch.L2 a row, fire and forget (no shared memory, nothing to wait for). Rows past n repeat the
    last row; the clipped size stays a multiple of 16 as K is."""
    rows = tl.minimum(off_n + tl.arange(0, BLOCK_N), n - 1).to(tl.int64)
    size = tl.maximum(tl.minimum(nbytes, k - col), 16)  # never past the row; at least one 16-byte unit
    col = tl.minimum(col, k - 16)
    ptrs = w_ptr + rows * stride_w + col
    tl.inline_asm_elementwise("cp.async.bulk.prefetch.L2.global [$1], $2; // $0", "=r,l,r",
                              [ptrs, tl.full([BLOCK_N], 0, tl.int32) + size], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit(do_not_specialize=["m", "split_k"])
def _tma_fp8_gemm_kernel(
    a_desc, w_desc, c_desc, a_scale_ptr, w_scale_ptr, bias_ptr, partial_ptr, counter_ptr, w_ptr,
    m, n, k, split_k, stride_w,
    HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PROMOTE_K: tl.constexpr,
    WARP_SPECIALIZE: tl.constexpr, PREFETCH: tl.constexpr, PDL: tl.constexpr,
):
    num_m = tl.cdiv(m, BLOCK_M)
    num_kt = tl.cdiv(k, BLOCK_K)
    kts_per_split = tl.cdiv(num_kt, split_k)
    num_units = num_m * tl.cdiv(n, BLOCK_N) * split_k
    if PDL:
        # launched early (programmatic dependent launch): W does not depend on the kernel before, so its first
        # PREFETCH tiles stream into L2 while that kernel finishes; the activations are read only after the wait
        tl.extra.cuda.gdc_launch_dependents()
        if PREFETCH > 0:
            first = tl.program_id(0)
            first_split = (first // num_m) % split_k
            _prefetch_w(w_ptr, (first // (num_m * split_k)) * BLOCK_N, first_split * kts_per_split * BLOCK_K, n, k,
                        stride_w, PREFETCH * BLOCK_K, BLOCK_N)
        tl.extra.cuda.gdc_wait()
    # M tile fastest, then the K split, then the N tile: the programs running at once share W's slice in L2
    for unit in tl.range(tl.program_id(0), num_units, tl.num_programs(0), warp_specialize=WARP_SPECIALIZE):
        pid_m = unit % num_m
        split = (unit // num_m) % split_k
        pid_n = unit // (num_m * split_k)
        off_m = pid_m * BLOCK_M
        off_n = pid_n * BLOCK_N
        first_kt = split * kts_per_split
        last_kt = tl.minimum(first_kt + kts_per_split, num_kt)
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        if PREFETCH > 0:  # the unit's first PREFETCH tiles of W at once, then one tile PREFETCH ahead each step
            _prefetch_w(w_ptr, off_n, first_kt * BLOCK_K, n, k, stride_w,
                        (tl.minimum(first_kt + PREFETCH, last_kt) - first_kt) * BLOCK_K, BLOCK_N)
        for kt in range(first_kt, last_kt):
            if PREFETCH > 0:
                _prefetch_w(w_ptr, off_n, tl.minimum(kt + PREFETCH, last_kt - 1) * BLOCK_K, n, k, stride_w, BLOCK_K,
                            BLOCK_N)
            a = a_desc.load([off_m, kt * BLOCK_K])  # [BLOCK_M, BLOCK_K], zeros past m and k
            w = w_desc.load([off_n, kt * BLOCK_K])  # [BLOCK_N, BLOCK_K], K-major as fp8 wgmma needs
            acc = tl.dot(a, w.T, acc, max_num_imprecise_acc=PROMOTE_K)  # an fp32 add every 128 of K at most
        if not SPLIT:
            _epilogue(acc, off_m, off_n, m, n, a_scale_ptr, w_scale_ptr, bias_ptr, c_desc, HAS_BIAS, BLOCK_M, BLOCK_N)
        else:
            # as kernels/fp8_gemm._fp8_gemm_kernel: the fp32 partial to the workspace [split_k, m, n], then a count in
            # the tile's counter (release); the last to count adds the others' partials (acquire, reads from L2),
            # writes the tile and sets its counter back to 0. Nobody waits, so programs that loop cannot deadlock.
            rows = (off_m + tl.arange(0, BLOCK_M)).to(tl.int64)
            cols = (off_n + tl.arange(0, BLOCK_N)).to(tl.int64)
            tile_mask = (rows < m)[:, None] & (cols < n)[None, :]
            part = rows[:, None] * n + cols[None, :]
            tl.store(partial_ptr + (split * m).to(tl.int64) * n + part, acc, mask=tile_mask)
            tl.debug_barrier()
            tile = pid_n * num_m + pid_m
            counted = tl.atomic_add(counter_ptr + tile, 1, sem="acq_rel", scope="gpu")
            if counted == split_k - 1:
                tl.debug_barrier()
                for other in range(0, split_k):
                    acc += tl.load(partial_ptr + (other * m).to(tl.int64) * n + part,
                                   mask=tile_mask & (other != split), other=0.0, cache_modifier=".cg")
                _epilogue(acc, off_m, off_n, m, n, a_scale_ptr, w_scale_ptr, bias_ptr, c_desc, HAS_BIAS,
                          BLOCK_M, BLOCK_N)
                tl.atomic_xchg(counter_ptr + tile, 0)


def default_tiles(m: int, n: int, k: int) -> tuple:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages, warp_specialize, split_k) where no tiles are given: 128-column
    W tiles four stages deep, unsplit (a placeholder until the study says what wins)."""
    if INTERPRET:
        return 16, 16, 32, 1, 1, False, 1
    return 64 if m <= 64 else 128, 128, 128, 4 if m <= 64 else 8, 4, False, 1


def even_split(split_k: int, num_kt: int) -> int:
    """The split count that shares K's tiles out evenly with none empty (as kernels/fp8_gemm.triton_fp8_gemm)."""
    split_k = max(1, min(split_k, num_kt))
    return triton.cdiv(num_kt, triton.cdiv(num_kt, split_k))


def launch_plan(m: int, n: int, k: int, tiles: tuple, sms: int) -> dict:
    """The host side's arithmetic, apart from the launch: split count, units, grid (one program per SM at most)."""
    block_m, block_n, block_k, *_, split_k = tiles
    num_tiles = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
    split_k = even_split(split_k, triton.cdiv(k, block_k))
    if num_tiles > SPLIT_COUNTERS:
        split_k = 1
    units = num_tiles * split_k
    return {"split_k": split_k, "num_tiles": num_tiles, "units": units, "grid": min(units, sms)}


def tma_fp8_gemm(a: torch.Tensor, a_scale: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
                 out_dtype: torch.dtype, bias: torch.Tensor | None = None, tiles: tuple | None = None,
                 prefetch: int = 0, pdl: bool = False) -> torch.Tensor:
    """a [M, K] fp8 with per-token scales [M, 1], w [N, K] fp8 with per-channel scales [N, 1] -> [M, N] in out_dtype.
    `tiles`: (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages, warp_specialize, split_k), default_tiles' when None."""
    m, k = a.shape
    n = w.shape[0]
    if a_scale.shape[-1] != 1 or w_scale.shape[-1] != 1:
        raise ValueError("tma_fp8_gemm takes channel scales only: a_scale [M, 1], w_scale [N, 1]")
    if k % 16 or (n * torch.finfo(out_dtype).bits // 8) % 16:
        raise ValueError(f"TMA needs 16-byte rows: K = {k} and N = {n} in {out_dtype} do not give them")
    out = torch.empty(m, n, dtype=out_dtype, device=a.device)
    if m == 0:
        return out
    tiles = tiles or default_tiles(m, n, k)
    block_m, block_n, block_k, warps, stages, ws, _ = tiles
    plan = launch_plan(m, n, k, tiles, num_sms(a.device))
    split_k = plan["split_k"]
    if split_k > 1:
        partial, counters = torch.empty(split_k, m, n, dtype=torch.float32, device=a.device), split_counters(a.device)
    else:
        partial = counters = out
    a_desc = TensorDescriptor(a, [m, k], [a.stride(0), 1], [block_m, block_k])
    w_desc = TensorDescriptor(w, [n, k], [w.stride(0), 1], [block_n, block_k])
    c_desc = TensorDescriptor(out, [m, n], [out.stride(0), 1], [block_m, block_n])
    _tma_fp8_gemm_kernel[(plan["grid"],)](
        a_desc, w_desc, c_desc, a_scale.reshape(-1), w_scale.reshape(-1), bias if bias is not None else out,
        partial, counters, w, m, n, k, split_k, w.stride(0),
        HAS_BIAS=bias is not None, SPLIT=split_k > 1, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        PROMOTE_K=min(block_k, PROMOTE_K), WARP_SPECIALIZE=ws, PREFETCH=prefetch, PDL=pdl, num_warps=warps,
        num_stages=stages, **({"launch_pdl": True} if pdl else {}),
    )
    return out


# ---------------------------------------------------------------------------------------------
# --interpret-check: the kernel in Triton's interpreter, against float64
# ---------------------------------------------------------------------------------------------


def _random_fp8(rows: int, cols: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    from kernels.fp8_quant import quantize_rows_ref

    x = torch.randn(rows, cols, generator=gen) * torch.rand(rows, 1, generator=gen).add(0.1)
    return quantize_rows_ref(x, cols)


def interpret_check() -> None:
    """Ragged shapes (M, N, K none a multiple of their tiles; N a multiple of 4, K of 16: TMA's 16-byte rows in
    fp32), split-K (the interpreter's 8 "SMs" make the programs loop over several units), bias. fp32 output: the
    interpreter rounds bf16 wrongly."""
    from kernels.fp8_quant import fp8_gemm_ref

    assert INTERPRET, "TRITON_INTERPRET=1 must be set before the kernels are decorated"
    gen = torch.Generator().manual_seed(0)
    cases = [  # (M, N, K, tiles, bias)
        (5, 40, 208, (16, 16, 32, 1, 1, False, 1), False),
        (5, 40, 208, (16, 16, 32, 1, 1, False, 3), True),
        (37, 52, 96, (16, 32, 32, 1, 1, False, 2), True),
        (1, 8, 16, (16, 16, 32, 1, 1, False, 4), False),
        (19, 68, 400, (16, 32, 128, 1, 1, False, 2), False),
        (70, 24, 144, (32, 16, 64, 1, 1, True, 1), True),
        (45, 100, 64, (16, 16, 32, 1, 1, False, 1), False),  # 21 tiles: each of the 8 programs loops over several
    ]
    counters = split_counters(torch.device("cpu"))
    for m, n, k, tiles, with_bias in cases:
        a, a_s = _random_fp8(m, k, gen)
        w, w_s = _random_fp8(n, k, gen)
        bias = torch.randn(n, generator=gen) if with_bias else None
        out = tma_fp8_gemm(a, a_s, w, w_s, torch.float32, bias, tiles=tiles)
        ref = fp8_gemm_ref(a, a_s, w, w_s, k, bias)
        err = (out.double() - ref).abs().max().item() / ref.abs().max().item()
        plan = launch_plan(m, n, k, tiles, num_sms(a.device))
        print(f"M={m:>3} N={n:>3} K={k:>3} tiles={tiles} split_k={plan['split_k']} units={plan['units']} "
              f"grid={plan['grid']} bias={with_bias}: error {err:.1e} of max |ref|")
        assert err < 1e-5, err
        assert not counters.any(), "a split-K call left a counter set"
    try:
        tma_fp8_gemm(a[:, :8], a_s, w[:, :8], w_s, torch.bfloat16)
    except ValueError as e:
        print(f"K = 8 refused: {e}")
    else:
        raise AssertionError("K = 8 (8-byte rows) should be refused")
    print("interpret check passed")


# ---------------------------------------------------------------------------------------------
# --compile-check: each swept config compiled for sm_90 offline
# ---------------------------------------------------------------------------------------------


def compile_sm90(config: tuple, split: bool, out_dtype: str = "bf16", prefetch: int = 0, pdl: bool = False) -> dict:
    """One config compiled for sm_90 by Triton's own ptxas: shared memory, registers, spills (no GPU needed)."""
    import re

    from triton.backends.compiler import GPUTarget
    from triton.compiler.compiler import ASTSource

    from bench.studies.kernel_sass import cuobjdump

    block_m, block_n, block_k, warps, stages, ws = config
    fn = _tma_fp8_gemm_kernel
    types = {"a_desc": f"tensordesc<fp8e4nv[{block_m}, {block_k}]>",
             "w_desc": f"tensordesc<fp8e4nv[{block_n}, {block_k}]>",
             "c_desc": f"tensordesc<{out_dtype}[{block_m}, {block_n}]>", "a_scale_ptr": "*fp32", "w_scale_ptr": "*fp32",
             "bias_ptr": f"*{out_dtype}", "partial_ptr": "*fp32", "counter_ptr": "*i32", "w_ptr": "*fp8e4nv"}
    constexprs = dict(HAS_BIAS=False, SPLIT=split, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
                      PROMOTE_K=min(block_k, PROMOTE_K), WARP_SPECIALIZE=ws, PREFETCH=prefetch, PDL=pdl)
    sig, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in constexprs:
            sig[name] = "constexpr"
            continue
        sig[name] = types.get(name, "i32")
        if sig[name].startswith("*") or name in ("n", "k", "stride_w"):
            attrs[(i,)] = [["tt.divisibility", 16]]
    start = time.perf_counter()
    kernel = triton.compile(ASTSource(fn, sig, constexprs=constexprs, attrs=attrs), target=GPUTarget("cuda", 90, 32),
                            options={"num_warps": warps, "num_stages": stages})
    seconds = time.perf_counter() - start
    usage, sass = cuobjdump(kernel)
    ttgir = kernel.asm.get("ttgir", "")
    return {"shared_bytes": kernel.metadata.shared, "fits": kernel.metadata.shared <= SM90_SHARED_BYTES,
            "registers": int(re.search(r"REG:(\d+)", usage).group(1)),
            "local_bytes": int(re.search(r"LOCAL:(\d+)", usage).group(1)),
            "tma_loads": sass.count("UTMALDG"), "wgmma": sass.count("GMMA."), "prefetches": sass.count("UBLKPF"),
            "griddepcontrol": sass.count("ACQBULK") + sass.count("PREEXIT"),
            "warp_specialized": "ttg.warp_specialize" in ttgir, "compile_s": round(seconds, 1)}


def compile_check() -> bool:
    """SWEEP's configs for sm_90, each unsplit and split, with the study's bf16 output and its check's fp32 output:
    False where one fails to compile, needs more shared memory than an SM has or is not warp-specialised as asked."""
    print(f"{'BM':>4} {'BN':>4} {'BK':>4} {'warps':>5} {'stages':>6} {'ws':>3} {'split':>5} {'out':>4} {'smem KB':>8} "
          f"{'regs':>5} {'spill':>5} {'TMA':>4} {'GMMA':>5} {'ws on':>5} {'s':>5}")
    ok = True
    for config, split, out in itertools.product(SWEEP, (False, True), ("bf16", "fp32")):
        try:
            r = compile_sm90(config, split, out)
        except Exception as e:  # noqa: BLE001  a config that cannot compile is a finding, not a crash
            ok = False
            print(*config, split, out, f"FAILED: {type(e).__name__}: {str(e).splitlines()[0][:160]}")
            continue
        ok &= r["fits"] and r["warp_specialized"] == config[5]
        print(f"{config[0]:>4} {config[1]:>4} {config[2]:>4} {config[3]:>5} {config[4]:>6} {config[5]!s:>3.1} "
              f"{split!s:>5.1} {out:>4} {r['shared_bytes'] / 1024:>8.1f} {r['registers']:>5} {r['local_bytes']:>5} "
              f"{r['tma_loads']:>4} {r['wgmma']:>5} {r['warp_specialized']!s:>5.1} {r['compile_s']:>5}"
              + ("" if r["fits"] else "  TOO MUCH SHARED MEMORY")
              + ("" if r["warp_specialized"] == config[5] else "  NOT WARP-SPECIALISED"))
    print(f"\n{'BM':>4} {'BN':>4} {'BK':>4} {'warps':>5} {'stages':>6} {'prefetch':>8} {'pdl':>4} {'smem KB':>8} "
          f"{'regs':>5} {'TMA':>4} {'PF ops':>6} {'GDC ops':>7}")
    for config, (prefetch, pdl) in itertools.product([c for c in SWEEP if not c[5]], PREFETCH_PDL[1:]):
        try:
            r = compile_sm90(config, False, "bf16", prefetch, pdl)
        except Exception as e:  # noqa: BLE001
            ok = False
            print(*config, prefetch, pdl, f"FAILED: {type(e).__name__}: {str(e).splitlines()[0][:160]}")
            continue
        ok &= r["fits"] and (r["prefetches"] > 0) == (prefetch > 0)
        print(f"{config[0]:>4} {config[1]:>4} {config[2]:>4} {config[3]:>5} {config[4]:>6} {prefetch:>8} {pdl!s:>4.1} "
              f"{r['shared_bytes'] / 1024:>8.1f} {r['registers']:>5} {r['tma_loads']:>4} {r['prefetches']:>6} "
              f"{r['griddepcontrol']:>7}")
    return ok


# ---------------------------------------------------------------------------------------------
# The study (CUDA)
# ---------------------------------------------------------------------------------------------


def split_counts(m: int, n: int, config: tuple, sms: int) -> list[int]:
    """The split-K counts worth timing for a config: 1, and those that keep the units within MAX_WAVES of the SMs."""
    tiles = triton.cdiv(m, config[0]) * triton.cdiv(n, config[1])
    return [s for s in SPLITS if s == 1 or tiles * s <= MAX_WAVES * sms]


def measure(fn, weights, ref: torch.Tensor, scale: float, m: int, n: int, k: int, timing_ms: int) -> dict:
    """fn(w, out_dtype) -> [M, N]: its errors on the first copy of W, in bf16 (what the engine gets: bf16's rounding
    included) and in fp32 (the accumulation's alone: the one MAX_ERROR bounds), and its time in bf16 over all the
    copies. It fails where the fp32 error exceeds MAX_ERROR or the bf16 one MAX_ERROR + bf16's rounding."""
    try:
        err = (fn(weights[0], torch.bfloat16).double() - ref).abs().max().item() / scale
        acc_err = (fn(weights[0], torch.float32).double() - ref).abs().max().item() / scale
        us = cold_graph_us(lambda w: fn(w, torch.bfloat16), weights, timing_ms)
    except Exception as e:  # noqa: BLE001  a variant that cannot run is a result; the next one still runs
        return {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}", "fails": True}
    return {"us": us, "tb_s": n * k / us / 1e6, "tflops": 2 * m * n * k / us / 1e6, "err": err, "acc_err": acc_err,
            "fails": not (acc_err <= MAX_ERROR and err <= MAX_ERROR + BF16_ROUNDING)}  # NaN fails too


def best(variants: list[dict]) -> dict | None:
    ok = [v for v in variants if not v["fails"]]
    return min(ok, key=lambda v: v["us"]) if ok else None


def _cell(v: dict | None, width: int = 13) -> str:
    if v is None or "us" not in v:
        return f"{'-':>{width}}"
    return f"{v['us']:>6.1f} {v['tb_s']:>4.2f}{'!' if v['fails'] else ' '}".rjust(width)


def study(tokens: list[int], configs: list[tuple], timing_ms: int, gemms: list = QWEN3_8B_GEMMS,
          device: torch.device = torch.device("cuda"), variants: list = PREFETCH_PDL) -> dict:
    from kernels import fp8_gemm
    from kernels.fp8_quant import dequantize_rows, quantize_rows_ref

    sms = num_sms(device)
    gen = torch.Generator(device=device).manual_seed(0)
    started = time.perf_counter()
    shapes = []
    for name, n, k in gemms:
        w, w_s = quantize_rows_ref(torch.randn(n, k, generator=gen, device=device, dtype=torch.bfloat16) / k**0.5, k)
        weights = weight_copies(w)  # each call reads a copy that L2 lost long ago
        copies = len(weights)
        w64 = dequantize_rows(w, w_s, k, torch.float64)
        print(f"\n{name}: N = {n}, K = {k}, W {n * k / 1e6:.1f} MB, {copies} copies; us and W's TB/s ('!': fails "
              f"the accuracy check); errors of max |ref|, in bf16 and fp32 output")
        print(f"{'M':>4} {'scaled_mm':>13} {'rows':>4} {'triton':>13} {'tma (best)':>13} {'TFLOP/s':>7} {'err':>7} "
              f"{'fp32 err':>8} {'speedup':>7}  tma tiles (BM, BN, BK, warps, stages, ws, split)", flush=True)
        rows = []
        for m in tokens:
            x = torch.randn(m, k, generator=gen, device=device, dtype=torch.bfloat16)
            x *= torch.rand(m, 1, generator=gen, device=device, dtype=torch.bfloat16) + 0.1  # tokens of unequal scale
            a, a_s = fp8_gemm.quantize_rows(x, k)  # in a 256-row buffer, as the engine's activations are
            ref = dequantize_rows(a, a_s, k, torch.float64) @ w64.T
            scale = ref.abs().max().item()
            run = lambda fn: measure(fn, weights, ref, scale, m, n, k, timing_ms)  # noqa: E731

            scaled = [dict(run(lambda w, dt: fp8_gemm.scaled_mm_fp8_gemm(a, a_s, w, w_s, dt)), rows=m)]
            if m < 256:
                scaled.append(dict(run(lambda w, dt: fp8_gemm.scaled_mm_fp8_gemm(a, a_s, w, w_s, dt, rows=256)),
                                   rows=256))
            tiles = fp8_gemm._tiles(m, n, k, k, grouped=False)
            triton_v = dict(run(lambda w, dt: fp8_gemm.triton_fp8_gemm(a, a_s, w, w_s, k, dt)), tiles=tiles)
            sweep = []
            for config, (pf, pdl) in itertools.product(configs, variants):
                for split in split_counts(m, n, config, sms):
                    t = (*config, split)
                    v = run(lambda w, dt, t=t, pf=pf, pdl=pdl: tma_fp8_gemm(a, a_s, w, w_s, dt, tiles=t, prefetch=pf,
                                                                            pdl=pdl))
                    sweep.append(dict(v, tiles=t, prefetch=pf, pdl=pdl, **launch_plan(m, n, k, t, sms)))
            row = {"m": m, "scaled_mm": best(scaled), "scaled_mm_rows": scaled, "triton": triton_v,
                   "tma": best(sweep), "tma_sweep": sweep}
            existing = best([v for v in (row["scaled_mm"], triton_v) if v is not None and "us" in v])
            row["speedup"] = existing["us"] / row["tma"]["us"] if existing and row["tma"] else None
            rows.append(row)
            t = row["tma"]
            print(f"{m:>4} {_cell(row['scaled_mm'])} {row['scaled_mm']['rows'] if row['scaled_mm'] else '-':>4} "
                  f"{_cell(triton_v)} {_cell(t)} {t['tflops'] if t else 0:>7.0f} {t['err'] if t else 0:>7.1e} "
                  f"{t['acc_err'] if t else 0:>8.1e} "
                  f"{row['speedup'] or 0:>7.2f}  {t['tiles'] if t else '-'} pf {t['prefetch'] if t else '-'} "
                  f"pdl {t['pdl'] if t else '-'}; best us by (prefetch, pdl): " + ", ".join(
                      f"{pf},{int(pdl)}: {bv['us']:.1f}" for pf, pdl in variants
                      if (bv := best([v for v in sweep if v.get("prefetch") == pf and v.get("pdl") == pdl]))),
                  flush=True)
        shapes.append({"name": name, "n": n, "k": k, "copies": copies, "rows": rows})
        del weights, w, w64
        if device.type == "cuda":
            torch.cuda.empty_cache()
    print()
    for shape in shapes:
        done = [r for r in shape["rows"] if r["tma"] and r["speedup"]]
        if not done:
            print(f"{shape['name']:>12}: the new kernel has no passing variant")
            continue
        tb = [r["tma"]["tb_s"] for r in done]
        old = [r["tma"]["tb_s"] / r["speedup"] for r in done]
        speedups = [r["speedup"] for r in done]
        geo = math.exp(sum(map(math.log, speedups)) / len(speedups))
        print(f"{shape['name']:>12}: tma {min(tb):.2f}-{max(tb):.2f} TB/s against the better existing GEMM's "
              f"{min(old):.2f}-{max(old):.2f}; faster at {sum(s > 1 for s in speedups)} of {len(speedups)} M, "
              f"speedup {min(speedups):.2f}-{max(speedups):.2f} (geomean {geo:.2f})")
    seconds = time.perf_counter() - started
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else str(device)
    print(f"\n{seconds:.0f} s on {device_name}")
    return {"device": device_name, "sms": sms, "torch": torch.__version__,
            "triton": triton.__version__, "tokens": tokens, "sweep": configs, "splits": list(SPLITS),
            "max_error": MAX_ERROR, "bf16_rounding": BF16_ROUNDING, "timing_ms": timing_ms, "seconds": seconds,
            "shapes": shapes}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", default=",".join(map(str, TOKENS)), help="M values, comma-separated")
    p.add_argument("--out", default=None, help="write every measurement here as JSON")
    p.add_argument("--no-ws", action="store_true", help="leave the warp-specialised configs out of the sweep")
    p.add_argument("--variants", default=";".join(f"{pf},{int(pdl)}" for pf, pdl in PREFETCH_PDL),
                   help="(prefetch, pdl) pairs timed per config, e.g. '0,0;8,1'")
    p.add_argument("--timing-ms", type=int, default=10, help="do_bench's rep time per variant")
    p.add_argument("--interpret-check", action="store_true", help="the kernel in Triton's CPU interpreter")
    p.add_argument("--compile-check", action="store_true", help="the sweep compiled for sm_90, offline")
    args = p.parse_args()
    if args.interpret_check:
        interpret_check()
        return
    if args.compile_check:
        sys.exit(0 if compile_check() else 1)
    if not torch.cuda.is_available():
        sys.exit("the study needs a CUDA GPU (see --interpret-check and --compile-check)")
    configs = [c for c in SWEEP if not (args.no_ws and c[5])]
    variants = [(int(v.split(",")[0]), bool(int(v.split(",")[1]))) for v in args.variants.split(";")]
    result = study([int(m) for m in args.tokens.split(",")], configs, args.timing_ms, variants=variants)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
