"""The Gluon decode kernel over 8-bit pools (kernels/attention/gluon_decode.py, the engine's decode there) against
the Triton decode kernel; a benchmark.

  python bench/studies/fp8_decode_gluon.py                 # H200: error vs float64, then us and TB/s, uniform and ragged
  python bench/studies/fp8_decode_gluon.py --kv-cache-dtype int8
  python bench/studies/fp8_decode_gluon.py --device cpu    # the kernel's index logic under the Triton interpreter
  python bench/studies/fp8_decode_gluon.py --sass          # sm_90 registers and instruction counts, compiled offline

On the GPU every batch runs the Triton decode kernel over a bf16 pool and over the same pool in fp8 (or
int8), then the Gluon kernel over the 8-bit pool at its own split count and at 1, 2 and 4 splits (longest
contexts first, as the engine orders them).
Rows say microseconds per call (graph replay), TB/s over each pool's own bytes, the relative error against a
float64 reference that dequantizes the same 8-bit bytes, and the Gluon kernel's speed over the Triton kernel
on the same pool.
The batches: B in {64, 256} x C in {512, 1024, 4096}, and the throughput run's ragged batches (B = 256, 153,
59, 7 at steps 80, 400, 800, 1000, as bench/kernels.py --ragged draws them).

On the CPU Gluon cannot run, so its calls are mapped onto triton.language with the layouts dropped, and the
kernel runs in the interpreter on small batches (GQA groups 2, 3 and 4, empty and partly filled blocks,
splits; fp8 and int8): that checks the channel renumbering, the head slice, the masks, the scales and the
split partials, not the layouts.
"""
from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import os
import random
import re
import sys
import tempfile
import types
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path = [str(HERE.parent.parent)] + [p for p in sys.path if Path(p or ".").resolve() != HERE]
KERNEL_FILE = HERE.parent.parent / "kernels" / "attention" / "gluon_decode.py"
RAGGED_POINTS = [(256, 80), (153, 400), (59, 800), (7, 1000)]  # (batch, tokens generated so far)
UNIFORM = [(b, c) for b in (64, 256) for c in (512, 1024, 4096)]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--sass", action="store_true", help="compile for sm_90 offline and print the code's size")
    p.add_argument("--splits", type=int, nargs="+", default=[0, 1, 2, 4], help="0: the kernel's own choice")
    p.add_argument("--kv-cache-dtype", choices=["fp8", "int8"], default="fp8")
    p.add_argument("--out", default=str(HERE.parent / "results" / "fp8_decode_gluon.json"))
    return p.parse_args()


if "--device" in sys.argv and sys.argv[sys.argv.index("--device") + 1:][:1] == ["cpu"]:
    os.environ["TRITON_INTERPRET"] = "1"  # before any kernel is decorated

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402


# ---------------------------------------------------------------------------------------------
# Gluon under the interpreter: its calls onto triton.language, layouts dropped
# ---------------------------------------------------------------------------------------------


class _AnyLayout:
    def __init__(self, *args, **kwargs):
        pass


class _GluonOnTriton:
    """gl.* for the interpreter: layout arguments dropped, the rest looked up in triton.language when called
    (the interpreter patches tl's builtins while a kernel runs, so nothing may be bound earlier)."""

    constexpr = staticmethod(lambda value: value)
    SliceLayout = DistributedLinearLayout = NVMMADistributedLayout = DotOperandLayout = _AnyLayout
    arange = staticmethod(lambda start, end, layout=None: tl.arange(start, end))
    zeros = staticmethod(lambda shape, dtype, layout=None: tl.zeros(shape, dtype))
    full = staticmethod(lambda shape, value, dtype, layout=None: tl.full(shape, value, dtype))
    convert_layout = staticmethod(lambda x, layout, assert_trivial=False: x)

    def __getattr__(self, name):
        return getattr(tl, name)


@functools.cache
def load_kernel_module(interpreted: bool) -> types.ModuleType:
    """kernels/attention/gluon_decode.py, or under the interpreter the same source with Gluon mapped onto triton.language
    (triton.jit reads each function's source from its file, so the rewritten module is written to a temp file);
    loaded once per process, so the kernels are decorated and the temp file written once."""
    if not interpreted:
        return importlib.import_module("kernels.attention.gluon_decode")
    src = KERNEL_FILE.read_text()
    src = re.sub(r"^from triton\.experimental.*$", "", src, flags=re.M)
    src = src.replace("@gluon.jit", "@triton.jit").replace(": gl.constexpr", ": tl.constexpr").replace("MMA.value", "None")
    path = Path(tempfile.mkdtemp(prefix="gluon-interp-")) / "gluon_decode_kernel_interpreted.py"
    path.write_text(src)
    module = types.ModuleType("gluon_decode_kernel_interpreted")
    module.__file__ = str(path)
    module.__dict__.update(gl=_GluonOnTriton(), tl=tl, triton=triton, mma_v2=lambda a, b, acc: tl.dot(a, b, acc))
    exec(compile(src, str(path), "exec"), module.__dict__)
    return module


# ---------------------------------------------------------------------------------------------
# inputs and the reference
# ---------------------------------------------------------------------------------------------


@functools.cache
def _variants_bench() -> types.ModuleType:
    spec = importlib.util.spec_from_file_location("fp8_decode_variants", HERE / "fp8_decode_variants.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def reference(q, k8, v8, scales, meta, scale: float) -> torch.Tensor:
    """float64 attention over the 8-bit pool dequantized by its scales: bench/studies/fp8_decode_variants.py's."""
    return _variants_bench().reference(torch, q, k8, v8, scales, meta, scale)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref).norm() / ref.norm()).item()


# (heads q/kv, context lengths, split counts, longest first, pool): GQA groups 2, 3 and 4, empty and partly
# filled blocks, more splits than a context has blocks
CHECK_CASES = [((4, 2), [37, 16, 5], [1, 2, 3], False, "fp8"), ((9, 3), [1, 33, 64, 17], [1, 4], True, "fp8"),
               ((32, 8), [100, 0, 48], [1, 3], False, "fp8"), ((16, 8), [15, 16, 17, 31, 32, 33], [1, 2], True, "fp8"),
               ((4, 2), [37, 16, 5], [1, 3], False, "int8"), ((16, 8), [15, 0, 33, 64], [1, 2], True, "int8")]


def check_case(gk, heads, seqlens, splits_list, longest_first, kind, seed, device="cpu") -> list[dict]:
    """The Gluon kernel and the Triton kernel on one fresh random batch over an fp8 or int8 pool (shuffled
    blocks), each against float64: a row per split count, with both relative errors."""
    from kernels.attention.base import AttentionMetadata
    from kernels.attention.triton_backend import triton_decode_attention
    from kernels.kv_quant import KVScales

    hq, hkv = heads
    gen = torch.Generator().manual_seed(seed)
    d, bs = 128, 16
    per_seq = [max(1, triton.cdiv(n, bs)) for n in seqlens]
    num_blocks = sum(per_seq) + 3
    if kind == "fp8":
        k8, v8 = ((torch.randn(num_blocks, bs, hkv, d, generator=gen) * 2).to(torch.float8_e4m3fn) for _ in "kv")
        scales = KVScales(torch.rand(hkv, generator=gen) + 0.5, torch.rand(hkv, generator=gen) + 0.5)
    else:  # int8 with a scale per KV head and channel
        k8, v8 = (torch.randint(-127, 128, (num_blocks, bs, hkv, d), generator=gen, dtype=torch.int8) for _ in "kv")
        scales = KVScales((torch.rand(hkv, d, generator=gen) + 0.5) / 64, (torch.rand(hkv, d, generator=gen) + 0.5) / 64)
    shuffled = torch.randperm(num_blocks, generator=gen)
    tables = torch.zeros(len(seqlens), max(per_seq), dtype=torch.int32)
    used = 0
    for i, n in enumerate(per_seq):
        tables[i, :n] = shuffled[used:used + n]
        used += n
    q = torch.randn(len(seqlens), hq, d, generator=gen).to(torch.bfloat16)
    lens = torch.tensor(seqlens, dtype=torch.int32)
    q, k8, v8, tables, lens = (t.to(device) for t in (q, k8, v8, tables, lens))
    scales = KVScales(scales.k.to(device), scales.v.to(device))
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(len(seqlens), dtype=torch.int64, device=device),
        cu_seqlens_q=torch.arange(len(seqlens) + 1, dtype=torch.int32, device=device), seqlens_k=lens,
        block_tables=tables, max_seqlen_q=1, max_seqlen_k=max(seqlens), block_size=bs,
        decode_order=torch.argsort(lens, descending=True).to(torch.int32) if longest_first else None)
    ref = reference(q, k8, v8, scales, meta, d ** -0.5)
    triton_err = rel_err(triton_decode_attention(q, k8, v8, meta, d ** -0.5, num_splits=1, kv_scales=scales), ref)
    rows = []
    for splits in splits_list:
        out = gk.gluon_decode(q, k8, v8, meta, d ** -0.5, scales, num_splits=splits)
        rows.append({"kv": kind, "heads": list(heads), "seqlens": seqlens, "splits": splits,
                     "longest_first": longest_first, "rel_err": rel_err(out, ref), "triton_rel_err": triton_err,
                     "finite": bool(torch.isfinite(out).all())})
    return rows


def close_to_triton(row: dict) -> bool:
    """As close to float64 as the Triton kernel, up to a rounding's worth (both round the output to bf16)."""
    return row["finite"] and row["rel_err"] < 2 * row["triton_rel_err"] + 1e-3


def interpreter_check(gk) -> list[dict]:
    """The kernel's logic against float64 and against the Triton kernel on the same inputs (interpreter)."""
    rows = []
    for seed, case in enumerate(CHECK_CASES):
        for row in check_case(gk, *case, seed=seed):
            rows.append(row)
            print(f"{row['kv']:>4} heads {row['heads'][0]:>2}/{row['heads'][1]}  seqlens {str(row['seqlens']):<26} "
                  f"splits {row['splits']}: rel err {row['rel_err']:.2e} (the Triton kernel {row['triton_rel_err']:.2e})")
            assert close_to_triton(row), row
    print("the Gluon kernel's logic matches float64 as closely as the Triton kernel does")
    return rows


# ---------------------------------------------------------------------------------------------
# the GPU benchmark
# ---------------------------------------------------------------------------------------------


def load_bench_kernels():
    """bench/kernels.py's Bench (inputs and timers), loaded by path: its name shadows the package."""
    spec = importlib.util.spec_from_file_location("bench_kernels", HERE.parent / "kernels.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def time_batches(gk, splits_list: list[int], kind: str) -> list[dict]:
    """Each batch: the Triton kernel over bf16 and over the 8-bit pool, then the Gluon kernel at each split
    count (0: its own choice)."""
    from kernels.attention.triton_backend import triton_decode_attention

    bench = load_bench_kernels().Bench(torch.device("cuda"), tiny=False)
    hq, hkv, d = bench.heads
    rng = random.Random(0)
    batches = [(f"{b} x {c}", [c] * b) for b, c in UNIFORM]
    for num_seqs, generated in RAGGED_POINTS:
        contexts = [rng.randint(100, 1024) + generated for _ in range(num_seqs)]
        batches.append((f"ragged {num_seqs}, ctx~{sum(contexts) // num_seqs}", contexts))
    runs = [(f"{n}", n) for n in splits_list]  # (name, splits)
    print(f"device: {bench.device_name}; heads {hq}/{hkv}, D {d}, block 16, {kind} pool (graph replay; us, and TB/s "
          "over each pool's bytes)")
    print(f"{'batch':>22} {'bf16':>13} {'triton ' + kind:>13} "
          + " ".join(f"{'gluon ' + name:>13}" for name, _ in runs) + f" {'best x triton':>13} {'err':>8}")
    rows = []
    for name, contexts in batches:
        q, k_cache, v_cache, meta = bench.paged_batch([1] * len(contexts), contexts)
        meta.decode_order = torch.argsort(meta.seqlens_k, descending=True, stable=True).to(torch.int32)
        k8, v8, scales = bench.quantized_pool(k_cache, v_cache, kind)
        ref = reference(q, k8, v8, scales, meta, d ** -0.5)
        tokens = sum(contexts)
        bytes_bf16, bytes_8bit = 2 * tokens * hkv * d * 2, 2 * tokens * hkv * d
        row = {"batch": name, "kv": kind, "num_seqs": len(contexts), "mean_context": tokens / len(contexts)}
        row["bf16_us"] = bench.time_us(lambda: triton_decode_attention(  # noqa: B023
            q, k_cache, v_cache, meta, d ** -0.5), graph=True)
        row["triton_us"] = bench.time_us(lambda: triton_decode_attention(  # noqa: B023
            q, k8, v8, meta, d ** -0.5, kv_scales=scales), graph=True)
        row["triton_rel_err"] = rel_err(triton_decode_attention(q, k8, v8, meta, d ** -0.5, kv_scales=scales), ref)
        for run, splits in runs:
            call = lambda: gk.gluon_decode(q, k8, v8, meta, d ** -0.5, scales,  # noqa: E731, B023
                                           num_splits=splits or None)  # noqa: B023
            row[f"gluon{run}_rel_err"] = rel_err(call(), ref)
            row[f"gluon{run}_us"] = bench.time_us(call, graph=True)
        best = min((r for r, _ in runs), key=lambda r: row[f"gluon{r}_us"])
        row["best"], row["best_over_triton"] = best, row["triton_us"] / row[f"gluon{best}_us"]
        rows.append(row)

        def cell(us: float, nbytes: int) -> str:
            return f"{us:>7.1f} {nbytes / us / 1e6:>5.2f}"

        print(f"{name:>22} {cell(row['bf16_us'], bytes_bf16)} {cell(row['triton_us'], bytes_8bit)} "
              + " ".join(cell(row[f"gluon{r}_us"], bytes_8bit) for r, _ in runs)
              + f" {row['best_over_triton']:>8.2f}x {best:>3} {max(row[f'gluon{r}_rel_err'] for r, _ in runs):>8.1e}")
        del q, k_cache, v_cache, k8, v8
        torch.cuda.empty_cache()
    return rows


def sass_summary(gk, kind: str) -> dict:
    """Registers, shared memory and instruction counts of the kernel for sm_90 (the 0.6B shape), offline."""
    from bench.studies import kernel_sass
    from triton.experimental.gluon._runtime import GluonASTSource

    fn = gk.gluon_decode_kernel
    kv_format, kv = (1, "*fp8e4nv") if kind == "fp8" else (2, "*i8")
    pointers = {"q_ptr": "*bf16", "k_cache_ptr": kv, "v_cache_ptr": kv, "o_ptr": "*bf16",
                "part_acc_ptr": "*fp32", "part_m_ptr": "*fp32", "part_l_ptr": "*fp32", "block_tables_ptr": "*i32",
                "seqlens_k_ptr": "*i32", "order_ptr": "*i32", "k_scale_ptr": "*fp32", "v_scale_ptr": "*fp32"}
    constexprs = dict(NUM_Q_HEADS=16, GROUP=2, SPLIT=False, HAS_ORDER=True, KV_FORMAT=kv_format, PTX_INT8=True)
    saved = kernel_sass.ASTSource
    kernel_sass.ASTSource = GluonASTSource  # the same compile and SASS count, through Gluon's front end
    try:
        result = kernel_sass.compile_sm90(fn, pointers, constexprs, num_warps=1, num_stages=1)
    finally:
        kernel_sass.ASTSource = saved
    result.pop("sass")
    print(f"sm_90, {kind}: {result['registers']} registers, {result['shared_bytes']} B shared, {result['programs_per_sm']} "
          f"programs an SM, {result['instructions']} instructions, {result['loop_instructions']} in the 16-token loop; "
          + ", ".join(f"{k} {v}" for k, v in result["watched"].items() if v))
    return result


def main() -> None:
    args = parse_args()
    results = {}
    if args.sass:
        results["sass"] = sass_summary(load_kernel_module(interpreted=False), args.kv_cache_dtype)
    elif args.device == "cpu":
        results["interpreter"] = interpreter_check(load_kernel_module(interpreted=True))
    else:
        results["device"] = torch.cuda.get_device_name()
        results["rows"] = time_batches(load_kernel_module(interpreted=False), args.splits, args.kv_cache_dtype)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
