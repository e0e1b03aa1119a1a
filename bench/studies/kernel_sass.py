"""What the engine's attention kernels (and the weight-only FP8 GEMM) compile to on a Hopper GPU, without one:
registers, spills and an instruction histogram of each kernel, compiled for sm_90 (or sm_80) by Triton's own ptxas
on this machine. Not a
timing (that needs the device: bench/kernels.py, bench/studies/fp8_decode_variants.py), but it shows in seconds what
a kernel change does to the code, e.g. whether an operand is read from shared memory a byte at a time.

    python bench/studies/kernel_sass.py                              # decode and prefill, bf16 and fp8 pools, 0.6B shape
    python bench/studies/kernel_sass.py --model-shape qwen3-8b --kv-cache-dtype fp8 --kernels decode
    python bench/studies/kernel_sass.py --dump-dir /tmp/sass         # also writes each kernel's SASS
    python bench/studies/kernel_sass.py --model-shape qwen3-8b --kernels decode --kv-cache-dtype auto --decode-fp8-out 0 1 2
    python bench/studies/kernel_sass.py --model-shape qwen3-8b --kernels prologue   # q/k norm, RoPE, K/V store
    python bench/studies/kernel_sass.py --model-shape qwen3-8b --kernels weight-only --arch 80   # FP8 W as bytes

The launch constants are the ones paged_decode_attention / paged_prefill_attention pass on an H200
(kernels/attention/triton_tuning.py's configs, bf16 activations), or kernels/fused_ops.qk_norm_rope_store for the
attention prologue (with the q/k norm; `scaled` reads an FP8 qkv_proj's unscaled product), and the arguments are
specialised as a real launch would be: 16-byte-aligned pointers and strides divisible by 16, except where the kernel
opts out.
Programs per SM assume 64K registers and 227 KB of shared memory per SM. `loop` counts the instructions of
the full-tile loop, one tile's worth per warp: the cost of a tile to issue.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path = [str(HERE.parent.parent)] + [p for p in sys.path if Path(p or ".").resolve() != HERE]
os.environ.pop("TRITON_INTERPRET", None)  # compile for real, not for the interpreter

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler.compiler import ASTSource  # noqa: E402

from bench.nanovllm_workload import MODEL_SHAPES  # noqa: E402
from kernels.attention import triton_backend as tb  # noqa: E402
from kernels.attention.triton_tuning import DecodeConfig, PrefillConfig, decode_config, prefill_config  # noqa: E402

SM_REGISTERS, SM_MAX_WARPS = 65536, 64
SM_SHARED_BYTES = {80: 163 * 1024, 90: 227 * 1024}  # per SM: an A100's, a Hopper's
# opcodes worth a column: byte-wise shared loads, conversions, tensor-core ops, async copies, barriers
WATCHED = ["LDS.U8", "LDS.64", "LDS.128", "LDSM", "STS", "F2FP", "HMMA", "HGMMA", "LDGSTS", "BAR", "IMAD.MOV"]
OPCODE = re.compile(r"/\*[0-9a-f]{4}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]+)")
INSTRUCTION = re.compile(r"/\*([0-9a-f]{4})\*/\s+(.*?);")
BACKWARD_BRANCH = re.compile(r"BRA(?:\.U)? (0x[0-9a-f]+)")
TORCH_TO_TRITON = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32",
                   torch.float8_e4m3fn: "fp8e4nv", torch.int8: "i8"}


def signature(fn, pointer_types: dict[str, str], constexprs: dict) -> tuple[dict, dict]:
    """Argument types and the divisibility a launch would specialise on (pointers and integer arguments by
    16, except those the kernel lists in do_not_specialize(_on_alignment), and the float scale)."""
    opted_out = set(fn.do_not_specialize) | set(getattr(fn, "do_not_specialize_on_alignment", []))
    sig, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in constexprs:
            sig[name] = "constexpr"
            continue
        sig[name] = pointer_types.get(name, "fp32" if name == "qk_scale" else "i32")
        if name not in opted_out and name != "qk_scale":
            attrs[(i,)] = [["tt.divisibility", 16]]
    return sig, attrs


def first_loop_size(sass: str) -> int:
    """Instructions in the kernel's first loop (from the first backward branch's target to that branch): the
    full-tile loop of the attention kernels, whose size per tile is what a tile costs to issue."""
    for match in INSTRUCTION.finditer(sass):
        address, text = int(match.group(1), 16), match.group(2)
        target = BACKWARD_BRANCH.search(text)
        if target and int(target.group(1), 16) < address:
            return (address - int(target.group(1), 16)) // 16 + 1  # sm_90 instructions are 16 bytes
    return 0


def cuobjdump(kernel) -> tuple[str, str]:
    """(resource usage, SASS) of a compiled kernel's cubin, by the cuobjdump that ships with Triton."""
    tools = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(kernel.asm["cubin"])
        cubin.flush()
        usage = subprocess.run([tools / "cuobjdump", "-res-usage", cubin.name], capture_output=True, text=True,
                               check=True).stdout
        sass = subprocess.run([tools / "cuobjdump", "-sass", cubin.name], capture_output=True, text=True,
                              check=True).stdout
    return usage, sass


def compile_sm90(fn, pointer_types: dict, constexprs: dict, num_warps: int, num_stages: int,
                 capability: int = 90) -> dict:
    """The kernel compiled for sm_90, or for sm_`capability` (a key of SM_SHARED_BYTES)."""
    sig, attrs = signature(fn, pointer_types, constexprs)
    kernel = triton.compile(ASTSource(fn, sig, constexprs=constexprs, attrs=attrs),
                            target=GPUTarget("cuda", capability, 32),
                            options={"num_warps": num_warps, "num_stages": num_stages})
    usage, sass = cuobjdump(kernel)
    opcodes = collections.Counter(OPCODE.findall(sass))
    registers = int(re.search(r"REG:(\d+)", usage).group(1))
    shared = kernel.metadata.shared
    programs = min(SM_REGISTERS // (registers * 32 * num_warps), SM_MAX_WARPS // num_warps,
                   SM_SHARED_BYTES[capability] // max(shared, 1))
    return {"registers": registers, "local_bytes": int(re.search(r"LOCAL:(\d+)", usage).group(1)),
            "shared_bytes": shared, "programs_per_sm": programs, "instructions": sum(opcodes.values()),
            "loop_instructions": first_loop_size(sass),
            "watched": {w: sum(c for op, c in opcodes.items() if op == w or op.startswith(w + ".")) for w in WATCHED},
            "sass": sass}


def _shared_arguments(shape: dict, kv_dtype: torch.dtype, dtype: torch.dtype) -> tuple[dict, dict]:
    """The pointer types and launch constants both attention kernels take, as their host functions pass them."""
    hq, hkv, d = shape["num_attention_heads"], shape["num_key_value_heads"], shape["head_dim"]
    kv_format = {torch.float8_e4m3fn: 1, torch.int8: 2}.get(kv_dtype, 0)  # triton_kv_store.KV_FP8 / KV_INT8
    act, kv = TORCH_TO_TRITON[dtype], TORCH_TO_TRITON[kv_dtype]
    pointers = {"q_ptr": f"*{act}", "k_cache_ptr": f"*{kv}", "v_cache_ptr": f"*{kv}", "o_ptr": f"*{act}",
                "block_tables_ptr": "*i32", "seqlens_k_ptr": "*i32", "k_scale_ptr": "*fp32", "v_scale_ptr": "*fp32"}
    constexprs = dict(GROUP=hq // hkv, BLOCK_SIZE=16, D=d, BLOCK_D=tb._block_d(d), UPCAST=False,
                      DOT_PRECISION=tb._dot_precision(dtype), KV_FORMAT=kv_format, FP16_DOTS=tb._fp16_dots(kv_format, dtype))
    return pointers, constexprs


def decode_case(shape: dict, kv_dtype: torch.dtype, dtype: torch.dtype = torch.bfloat16,
                config: DecodeConfig | None = None, fp8_out: int = 0) -> tuple:
    """The unsplit decode kernel; fp8_out: its FP8 output for an FP8 o_proj (decode_common.FP8_OUT_*)."""
    pointers, constexprs = _shared_arguments(shape, kv_dtype, dtype)
    cfg = config or decode_config(constexprs["BLOCK_D"], dtype, constexprs["KV_FORMAT"])
    pointers |= {"part_acc_ptr": "*fp32", "part_m_ptr": "*fp32", "part_l_ptr": "*fp32", "order_ptr": "*i32",
                 "q_out_ptr": "*fp8e4nv", "q_scale_ptr": "*fp32", "part_amax_ptr": "*fp32", "counters_ptr": "*i32"}
    group = constexprs["GROUP"]
    num_kv_heads = shape["num_attention_heads"] // group
    constexprs |= dict(NUM_Q_HEADS=shape["num_attention_heads"], BLOCK_G=max(16, triton.next_power_of_2(group)),
                       BLOCK_N=cfg.block_n, SPLIT=False, HAS_ORDER=True, FP8_OUT=fp8_out,
                       BLOCK_KV_HEADS=triton.next_power_of_2(num_kv_heads))
    return (tb._decode_kernel, pointers, constexprs, cfg.num_warps, cfg.num_stages,
            f"BLOCK_N {cfg.block_n}" + (f" fp8 out {fp8_out}" if fp8_out else ""))


def prefill_case(shape: dict, kv_dtype: torch.dtype, dtype: torch.dtype = torch.bfloat16,
                 config: PrefillConfig | None = None) -> tuple:
    pointers, constexprs = _shared_arguments(shape, kv_dtype, dtype)
    cfg = config or prefill_config(constexprs["BLOCK_D"], dtype)
    pointers |= {"cu_seqlens_q_ptr": "*i32"}
    constexprs |= dict(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n)
    return (tb._prefill_kernel, pointers, constexprs, cfg.num_warps, cfg.num_stages,
            f"BLOCK_M {cfg.block_m} BLOCK_N {cfg.block_n}")


def prologue_case(shape: dict, kv_dtype: torch.dtype, dtype: torch.dtype = torch.bfloat16, scaled: bool = False):
    """The attention prologue's program (8 heads of a token: q's, or k's and v's and their store), as
    kernels/fused_ops.qk_norm_rope_store launches it."""
    from kernels import fused_ops

    act, kv = TORCH_TO_TRITON[dtype], TORCH_TO_TRITON[kv_dtype]
    pointers = {name: f"*{act}" for name in ("q_ptr", "k_ptr", "v_ptr", "q_weight_ptr", "k_weight_ptr")}
    pointers |= {name: "*fp32" for name in ("cos_ptr", "sin_ptr", "k_scale_ptr", "v_scale_ptr", "row_scale_ptr",
                                            "q_col_scale_ptr", "k_col_scale_ptr", "v_col_scale_ptr")}
    pointers |= {"k_cache_ptr": f"*{kv}", "v_cache_ptr": f"*{kv}", "positions_ptr": "*i64", "slot_mapping_ptr": "*i64",
                 "eps": "fp32"}
    block_d = triton.next_power_of_2(shape["head_dim"])
    heads = max(1, fused_ops.PROLOGUE_TILE // block_d)
    constexprs = dict(NUM_Q_HEADS=shape["num_attention_heads"], NUM_KV_HEADS=shape["num_key_value_heads"],
                      BLOCK_SIZE=16, HAS_NORM=True, HEADS=heads, BLOCK_D=block_d,
                      KV_FORMAT={torch.float8_e4m3fn: 1, torch.int8: 2}.get(kv_dtype, 0), SCALED=scaled)
    return (fused_ops._qk_norm_rope_store_kernel, pointers, constexprs, fused_ops._num_warps(heads * block_d), 3,
            f"{heads} heads" + (" scaled" if scaled else ""))


def weight_only_case(shape: dict, kv_dtype: torch.dtype, dtype: torch.dtype = torch.bfloat16, tokens: int = 16,
                     grouped: bool = False):
    """The weight-only FP8 GEMM (kernels/fp8_gemm.weight_only_fp8_gemm, GPUs before sm_89: W read as bytes) at the
    rule's tiles for `tokens` rows of the shape's gate_up_proj, channel or 128 x 128 block weights; kv_dtype unused."""
    from kernels import fp8_gemm

    n, k = 2 * shape["intermediate_size"], shape["hidden_size"]
    block_m, block_n, block_k, warps, stages = fp8_gemm._tiles(tokens, n, k, 128, grouped, weight_only=True)
    pointers = {"a_ptr": f"*{TORCH_TO_TRITON[dtype]}", "w_ptr": "*u8", "c_ptr": f"*{TORCH_TO_TRITON[dtype]}",
                "bias_ptr": f"*{TORCH_TO_TRITON[dtype]}", "counter_ptr": "*i32", "a_scale_ptr": "*fp32",
                "w_scale_ptr": "*fp32", "partial_ptr": "*fp32"}
    constexprs = dict(GROUPED=grouped, W_PER_TILE=grouped, HAS_BIAS=False, BLOCK_M=block_m, BLOCK_N=block_n,
                      BLOCK_K=block_k, GROUP_M=8, PROMOTE_K=min(block_k, 128), SPLIT_K=1, W_ONLY=True,
                      PRECISION="tf32", UPCAST=False)
    return (fp8_gemm._fp8_gemm_kernel, pointers, constexprs, warps, stages,
            f"{'block' if grouped else 'channel'} {block_m}x{block_n}x{block_k}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kernels", nargs="+", choices=["decode", "prefill", "prologue", "weight-only"],
                   default=["decode", "prefill"])
    p.add_argument("--kv-cache-dtype", nargs="+", choices=["auto", "fp8", "int8"], default=["auto", "fp8"])
    p.add_argument("--model-shape", choices=sorted(MODEL_SHAPES), default="qwen3-0.6b")
    p.add_argument("--decode-configs", nargs="+", metavar="N,W,S",
                   help="decode tiles to compile instead of the engine's: BLOCK_N,warps,stages each")
    p.add_argument("--prefill-configs", nargs="+", metavar="M,N,W,S",
                   help="prefill tiles to compile instead of the engine's: BLOCK_M,BLOCK_N,warps,stages each")
    p.add_argument("--decode-fp8-out", nargs="+", type=int, choices=[0, 1, 2], default=[0],
                   help="the decode kernel's FP8 output for an FP8 o_proj: none, per token, per head")
    p.add_argument("--arch", type=int, choices=[80, 90], default=90, help="compile for sm_80 (an A100) or sm_90")
    p.add_argument("--dump-dir", help="write each kernel's SASS here")
    p.add_argument("--out", default=str(HERE.parent / "results" / "kernel_sass.json"))
    args = p.parse_args()
    shape = MODEL_SHAPES[args.model_shape]
    cases = {"decode": decode_case, "prefill": prefill_case, "prologue": prologue_case,
             "weight-only": weight_only_case}
    # each kernel's variants: the keyword arguments of its case
    variants = {"decode": [{"config": DecodeConfig(*map(int, c.split(",")))} for c in args.decode_configs or []]
                or [{}],
                "prefill": [{"config": PrefillConfig(*map(int, c.split(",")))} for c in args.prefill_configs or []]
                or [{}],
                "prologue": [{"scaled": False}, {"scaled": True}],
                "weight-only": [{"tokens": t, "grouped": g} for g in (False, True) for t in (16, 64)]}
    variants["decode"] = [{**v, "fp8_out": f} for v in variants["decode"] for f in args.decode_fp8_out]
    rows = []
    print(f"sm_{args.arch} code of the kernels, {args.model_shape} (heads {shape['num_attention_heads']}/"
          f"{shape['num_key_value_heads']}, D {shape['head_dim']}), bf16 activations")
    print(f"{'kernel':>8} {'KV':>5} {'tiles':>22} {'regs':>4} {'local':>5} {'smem':>6} {'prog/SM':>7} {'instr':>6} "
          f"{'loop':>5}  "
          + " ".join(f"{w:>8}" for w in WATCHED))
    for kernel_name, kv_name, variant in [(k, kv, v) for k in args.kernels
                                          for kv in (["-"] if k == "weight-only" else args.kv_cache_dtype)
                                          for v in variants[k]]:
        kv_dtype = {"fp8": torch.float8_e4m3fn, "int8": torch.int8}.get(kv_name, torch.bfloat16)
        fn, pointers, constexprs, warps, stages, tiles = cases[kernel_name](shape, kv_dtype, **variant)
        result = compile_sm90(fn, pointers, constexprs, warps, stages, capability=args.arch)
        tiles = f"{tiles} w{warps} s{stages}"
        print(f"{kernel_name:>8} {kv_name:>5} {tiles:>22} {result['registers']:>4} {result['local_bytes']:>5} "
              f"{result['shared_bytes']:>6} {result['programs_per_sm']:>7} {result['instructions']:>6} "
              f"{result['loop_instructions']:>5}  "
              + " ".join(f"{result['watched'][w]:>8}" for w in WATCHED))
        if args.dump_dir:
            Path(args.dump_dir).mkdir(parents=True, exist_ok=True)
            name = f"{kernel_name}_{kv_name}_{tiles.replace(' ', '_')}.sass"
            (Path(args.dump_dir) / name).write_text(result["sass"])
        rows.append({"kernel": kernel_name, "kv_cache_dtype": kv_name, "tiles": tiles,
                     **{k: v for k, v in result.items() if k != "sass"}})
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"model_shape": args.model_shape, "arch": f"sm_{args.arch}", "rows": rows}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
