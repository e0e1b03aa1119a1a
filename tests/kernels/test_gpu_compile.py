"""The FP8 path's Triton kernels compile for the GPUs they run on, on any host: Triton's compiler runs without a GPU
(to PTX, then ptxas to a cubin), so what the CPU interpreter accepts and the GPU compiler refuses (a plain Python
float global, an FP8 dot under K = 32, a scalar/tensor mix-up) fails here, in CI, before a GPU is lent. Each kernel is
compiled at the configurations the engine launches it with: on the Qwen3-8B shape block (128-column groups) and
channel weights, split-K, the decode kernels' FP8 output per token and per head; on Qwen3-30B-A3B's experts the tiles
the MoE dispatch picks at a decode step and at a prefill chunk, FP8 activations and weight-only; and the weight-only
Linear GEMM of GPUs without FP8 tensor cores for sm_80 and sm_86 (which refuse Triton's e4m3 type), and sm_90."""
from __future__ import annotations

import inspect

import pytest

pytest.importorskip("triton")

FP8 = "*fp8e4nv"


def compile_for_gpu(fn, pointers: dict[str, str], constexprs: dict, floats: tuple[str, ...] = (),
                    num_warps: int = 4, num_stages: int = 3, capability: int = 90, as_launched: bool = False):
    """fn compiled for sm_`capability`: `pointers` types the pointer arguments (others *fp32), `floats` the fp32
    scalars, every other argument i32; constexprs not given take their defaults. as_launched: specialised as a launch
    on 16-byte-aligned tensors would be, every pointer and integer argument divisible by 16 except those the kernel
    opts out of (what sets the loads' layouts)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler.compiler import ASTSource

    defaults = {p.name: p.default for p in inspect.signature(fn.fn).parameters.values()
                if p.default is not inspect.Parameter.empty}
    constexprs = {**{name: value for name, value in defaults.items() if name not in constexprs}, **constexprs}
    signature, attrs = {}, {}
    opted_out = set(fn.do_not_specialize) | set(fn.do_not_specialize_on_alignment)
    for i, arg in enumerate(fn.arg_names):
        if arg in constexprs:
            signature[arg] = "constexpr"
        elif arg.endswith("_ptr"):
            signature[arg] = pointers.get(arg, "*fp32")
        else:
            signature[arg] = "fp32" if arg in floats else "i32"
        if as_launched and arg not in constexprs and arg not in floats and arg not in opted_out:
            attrs[(i,)] = [["tt.divisibility", 16]]
    return triton.compile(ASTSource(fn, signature, constexprs=constexprs, attrs=attrs),
                          target=GPUTarget("cuda", capability, 32), options={"num_warps": num_warps,
                                                                             "num_stages": num_stages})


# the most shared memory a program may take: A100 (sm_80), A10 / RTX 30xx (sm_86), H100 / H200 (sm_90)
SHARED_MEMORY_LIMIT = {80: 163 * 1024, 86: 99 * 1024, 90: 227 * 1024}


def assert_compiles(fn, pointers, constexprs, capability: int = 90, **kwargs):
    """fn compiles for that GPU, and its programs fit the GPU's shared memory (a launch would fail otherwise)."""
    compiled = compile_for_gpu(fn, pointers, constexprs, capability=capability, **kwargs)
    assert f".target sm_{capability}" in compiled.asm["ptx"] and len(compiled.asm["cubin"]) > 0
    assert compiled.metadata.shared <= SHARED_MEMORY_LIMIT[capability], (compiled.metadata.shared, constexprs)


# (grouped, rows of W sharing their scales, split-K, tiles): block weights (one scalar a tile, or a vector), channel
# weights promoted every 128 of K, split and unsplit
GEMMS = [(True, True, 1, (64, 128, 128)), (True, False, 2, (16, 64, 128)), (False, False, 1, (128, 128, 256)),
         (False, False, 4, (16, 32, 128))]


@pytest.mark.parametrize("grouped, per_tile, split_k, tiles", GEMMS)
def test_the_fp8_gemm_compiles_for_sm90(grouped, per_tile, split_k, tiles):
    from kernels import fp8_gemm

    block_m, block_n, block_k = tiles
    assert_compiles(fp8_gemm._fp8_gemm_kernel,
                    {"a_ptr": FP8, "w_ptr": FP8, "bias_ptr": "*bf16", "c_ptr": "*bf16", "counter_ptr": "*i32"},
                    dict(GROUPED=grouped, W_PER_TILE=per_tile, HAS_BIAS=not grouped, BLOCK_M=block_m, BLOCK_N=block_n,
                         BLOCK_K=block_k, GROUP_M=8, PROMOTE_K=128, SPLIT_K=split_k),
                    num_warps=8 if block_m == 128 else 4)


def test_the_activation_quantizers_compile_for_gpu():
    from kernels import fp8_fused_quant, fp8_gemm

    assert_compiles(fp8_gemm._quantize_rows_kernel, {"x_ptr": "*bf16", "q_ptr": FP8}, {"BLOCK": 128},
                    floats=("max_scale",), num_warps=1)
    norm_pointers = {"x_ptr": "*bf16", "residual_ptr": "*bf16", "weight_ptr": "*bf16", "q_ptr": FP8,
                     "residual_out_ptr": "*bf16", "plain_ptr": "*bf16", "row_scale_ptr": "*fp32"}
    for per_row, tiles, tile, scales in ((False, 32, 128, False), (True, 32, 128, True)):  # block; channel, unscaled
        assert_compiles(fp8_fused_quant._rms_norm_quant_kernel, norm_pointers,
                        dict(HAS_RESIDUAL=True, HAS_SCALES=scales, PER_ROW=per_row, NUM_TILES=tiles, TILE=tile,
                             KEEP_PLAIN=per_row), floats=("eps",), num_warps=16)
    silu_pointers = {"x_ptr": "*bf16", "h_ptr": "*bf16", "q_ptr": FP8}
    assert_compiles(fp8_fused_quant._silu_and_mul_quant_kernel, silu_pointers,
                    dict(HAS_SCALES=False, NUM_TILES=32, TILE=128), num_warps=16)
    assert_compiles(fp8_fused_quant._silu_and_mul_chunk_kernel, silu_pointers, dict(HAS_SCALES=True, CHUNK=1024))
    assert_compiles(fp8_fused_quant._quantize_by_chunk_maxes_kernel, silu_pointers, dict(CHUNK=1024, CHUNKS=16))


@pytest.mark.parametrize("fp8_out", [1, 2])  # a scale per token (the last program quantizes the row), per head
def test_the_decode_kernels_fp8_output_compiles_for_sm90(fp8_out):
    from kernels.attention import decode_common, triton_backend

    pointers = {"q_ptr": "*bf16", "k_cache_ptr": "*bf16", "v_cache_ptr": "*bf16", "o_ptr": "*bf16",
                "block_tables_ptr": "*i32", "seqlens_k_ptr": "*i32", "order_ptr": "*i32", "q_out_ptr": FP8,
                "counters_ptr": "*i32"}
    assert_compiles(triton_backend._decode_kernel, pointers,
                    dict(NUM_Q_HEADS=32, GROUP=4, BLOCK_G=16, BLOCK_SIZE=16, D=128, BLOCK_D=128, BLOCK_N=64,
                         SPLIT=False, HAS_ORDER=True, UPCAST=False, DOT_PRECISION="tf32", KV_FORMAT=0,
                         FP16_DOTS=False, FP8_OUT=fp8_out, BLOCK_KV_HEADS=8),
                    floats=("qk_scale",), num_stages=2)
    heads, block_s, warps = (32, 4, 8) if fp8_out == 1 else (1, 32, 4)  # a program a token; a program a head
    for mode in (0, fp8_out):
        assert_compiles(decode_common._merge_splits_kernel, pointers,
                        dict(NUM_Q_HEADS=32, D=128, BLOCK_D=128, BLOCK_S=block_s, FP8_OUT=mode, BLOCK_Q_HEADS=32,
                             HEADS=heads), num_warps=warps)


def test_the_narrowest_k_group_the_loader_lets_a_gpu_gemm_take_compiles_for_sm90_and_a_narrower_does_not():
    """Block weights split by tensor parallelism inside a 128-column block take groups of gcd(128, K / tp) columns,
    one K tile each. An FP8 by FP8 dot needs K >= 32 on sm_90, so the loader refuses narrower groups on a GPU
    (executor_svc/layers/fp8.MIN_GPU_GROUP) with an error that says what to change, rather than fail to compile."""
    from executor_svc.layers import fp8
    from kernels import fp8_gemm

    def compile_group(group):
        compile_for_gpu(fp8_gemm._fp8_gemm_kernel,
                         {"a_ptr": FP8, "w_ptr": FP8, "c_ptr": "*bf16", "counter_ptr": "*i32"},
                         dict(GROUPED=True, W_PER_TILE=False, HAS_BIAS=False, BLOCK_M=16, BLOCK_N=64, BLOCK_K=group,
                              GROUP_M=8, PROMOTE_K=group, SPLIT_K=1))

    compile_group(fp8.MIN_GPU_GROUP)
    with pytest.raises(Exception, match="K >= 32"):
        compile_group(fp8.MIN_GPU_GROUP // 2)
    fp8._check_gpu_group("down_proj", fp8.MIN_GPU_GROUP)
    with pytest.raises(ValueError, match="groups of 16 columns; the GEMM needs 32: choose another --tensor-parallel"):
        fp8._check_gpu_group("down_proj", 16)
    fp8._check_gpu_group("experts", 16, fp8.MIN_GPU_WEIGHT_ONLY_GROUP)  # weight-only dots widen W to 16 bits


# Qwen3-30B-A3B's experts (128, hidden 2048, moe_intermediate 768, top 8) at a decode step's and a prefill chunk's
# tokens: the tiles kernels/fused_moe.tiles_for picks there
MOE_SHAPE = dict(num_experts=128, hidden=2048, inter=768, top_k=8)


@pytest.mark.parametrize("num_tokens", [133, 4096])
@pytest.mark.parametrize("w_grouped", [True, False])  # block scales (128 columns), or a scale per row
def test_fp8_experts_with_fp8_activations_compile_for_gpu(num_tokens, w_grouped):
    import triton.language as tl

    from kernels import fused_moe as fm
    from kernels import fused_moe_fp8_activations as fa

    up, down = fa._fp8_tiles(*fm.tiles_for(num_tokens, **MOE_SHAPE))
    pointers = {"xq_ptr": FP8, "w_ptr": FP8, "hq_ptr": FP8, "sorted_pairs_ptr": "*i32", "block_expert_ptr": "*i32",
                "num_padded_ptr": "*i32", "out_ptr": "*bf16"}
    scales = dict(W_GROUPED=w_grouped, W_PER_TILE=w_grouped, UPCAST=False)
    assert_compiles(fa._gate_up_fp8_kernel, pointers,
                    dict(TOP_K=8, BLOCK_M=up.block_m, BLOCK_N=up.block_n, BLOCK_K=up.block_k, GROUP_M=up.group_m,
                         OUT_DTYPE=tl.bfloat16, **scales), num_warps=up.num_warps, num_stages=up.num_stages)
    assert_compiles(fa._down_fp8_kernel, pointers,
                    dict(BLOCK_M=down.block_m, BLOCK_N=down.block_n, BLOCK_K=down.block_k, GROUP_M=down.group_m,
                         **scales), num_warps=down.num_warps, num_stages=down.num_stages)


@pytest.mark.parametrize("num_tokens", [133, 4096])
@pytest.mark.parametrize("scales, group_k", [(1, 1), (2, 128)])  # weight-only: per row, per 128 x 128 block
@pytest.mark.parametrize("capability", [90, 80])  # sm_80: the weights as bytes (Triton has no e4m3 type there)
def test_weight_only_fp8_experts_compile_for_sm90_and_sm80(num_tokens, scales, group_k, capability):
    from kernels import fused_moe as fm

    up, down = fm.tiles_for(num_tokens, **MOE_SHAPE)
    pointers = {"x_ptr": "*bf16", "w_ptr": FP8 if capability >= 89 else "*u8", "h_ptr": "*bf16", "out_ptr": "*bf16",
                "sorted_pairs_ptr": "*i32", "block_expert_ptr": "*i32", "num_padded_ptr": "*i32"}
    common = dict(UPCAST=False, PRECISION="tf32", SCALES=scales, GROUP_K=group_k, W_PER_TILE=scales == 2,
                  W_BYTES=capability < 89)
    assert_compiles(fm._gate_up_silu_kernel, pointers,
                    dict(TOP_K=8, BLOCK_M=up.block_m, BLOCK_N=up.block_n, BLOCK_K=up.block_k, GROUP_M=up.group_m,
                         EVEN_K=True, **common), capability=capability, num_warps=up.num_warps,
                    num_stages=up.num_stages)
    assert_compiles(fm._down_weighted_kernel, pointers,
                    dict(BLOCK_M=down.block_m, BLOCK_N=down.block_n, BLOCK_K=down.block_k, GROUP_M=down.group_m,
                         EVEN_K=True, **common), capability=capability, num_warps=down.num_warps,
                    num_stages=down.num_stages)



@pytest.mark.parametrize("capability", [80, 86, 90])  # A100; A10, A40, RTX 30xx; and Hopper
@pytest.mark.parametrize("grouped", [True, False])
def test_the_weight_only_fp8_gemm_compiles_for_gpus_without_fp8_tensor_cores(capability, grouped):
    """FP8 weights read as bytes and widened to bf16 in the tile (fp8_gemm.e4m3_as_fp16): no e4m3 type anywhere,
    so it compiles where Triton refuses one, at the rule's tiles for a decode step and a prefill chunk."""
    from kernels import fp8_gemm

    assert_compiles(fp8_gemm._dequantize_kernel, {"w_ptr": "*u8", "out_ptr": "*bf16"},
                    dict(BLOCK_N=32, BLOCK_K=256), capability=capability)  # from WEIGHT_ONLY_DEQUANTIZE_FROM tokens
    for m in (16, 256):
        block_m, block_n, block_k, warps, stages = fp8_gemm._tiles(m, 4096, 4096, 128, grouped, weight_only=True)
        assert_compiles(fp8_gemm._fp8_gemm_kernel,
                        {"a_ptr": "*bf16", "w_ptr": "*u8", "c_ptr": "*bf16", "counter_ptr": "*i32"},
                        dict(GROUPED=grouped, W_PER_TILE=grouped, HAS_BIAS=False, BLOCK_M=block_m, BLOCK_N=block_n,
                             BLOCK_K=block_k, GROUP_M=8, PROMOTE_K=min(block_k, 128), SPLIT_K=1, W_ONLY=True,
                             PRECISION="tf32", UPCAST=False),
                        capability=capability, num_warps=warps, num_stages=stages)


# The attention prologue (kernels/fused_ops.qk_norm_rope_store) on the Qwen3-8B shape: 32 q and 8 kv heads of 128

def prologue_arguments(dtype: str, kv: str = "") -> tuple[dict, dict]:
    pointers = {name: f"*{dtype}" for name in ("q_ptr", "k_ptr", "v_ptr", "q_weight_ptr", "k_weight_ptr")}
    pointers |= {"k_cache_ptr": kv or f"*{dtype}", "v_cache_ptr": kv or f"*{dtype}", "positions_ptr": "*i64",
                 "slot_mapping_ptr": "*i64"}
    return pointers, dict(NUM_Q_HEADS=32, NUM_KV_HEADS=8, BLOCK_SIZE=16)


@pytest.mark.parametrize("kv_format, kv", [(0, ""), (1, FP8), (2, "*i8")])
@pytest.mark.parametrize("scaled", [False, True])  # an FP8 qkv_proj's unscaled product
def test_the_attention_prologue_compiles_for_sm90_without_shared_memory(kv_format, kv, scaled):
    """Every vector the prologue loads (cos, sin, norm weights) is loaded in its heads' tile layout, so no layout is
    converted through shared memory."""
    from kernels import fused_ops

    pointers, constexprs = prologue_arguments("bf16", kv)
    for norm in (True, False):
        compiled = compile_for_gpu(fused_ops._qk_norm_rope_store_kernel, pointers,
                                   dict(constexprs, HAS_NORM=norm, HEADS=8, BLOCK_D=128, KV_FORMAT=kv_format,
                                        SCALED=scaled), floats=("eps",), as_launched=True)
        assert compiled.metadata.shared == 0 and "convert_layout" not in compiled.asm["ttgir"]


def row_reduction_layouts(compiled) -> list[tuple]:
    """For each tt.reduce over axis 1 in compiled's TTGIR: its operand layout's along-the-row parameters (elements a
    thread, threads and warps along a row, order), which fix the order in which a row's terms are added."""
    import re

    ttgir = compiled.asm["ttgir"]
    layouts = dict(re.findall(r"^(#\w+) = #ttg\.blocked<(\{.*\})>$", ttgir, re.M))
    found = []
    for operand in re.findall(r"\}\) : \(tensor<\d+x\d+xf32, (#\w+)>\) -> tensor<\d+xf32", ttgir):
        params = dict(re.findall(r"(\w+) = \[([\d, ]+)\]", layouts[operand]))
        found.append(tuple(params[p].split(", ")[-1] for p in ("sizePerThread", "threadsPerWarp", "warpsPerCTA"))
                     + (params["order"],))
    return found


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_the_prologues_q_k_norm_adds_each_row_as_rms_norm_does(dtype, head_dim):
    """The prologue's q/k RMSNorm equals rms_norm's bit for bit (test_fused_ops' GPU tests) only if each row's sum of
    squares adds in the same order: each row laid out alike in both kernels' tiles, as the engine launches them."""
    from kernels import fused_ops

    rows = max(1, min(32, 2048 // head_dim))  # rms_norm's tile, as its wrapper picks it
    norm = compile_for_gpu(fused_ops._rms_norm_kernel, {name: f"*{dtype}" for name in (
        "x_ptr", "residual_ptr", "weight_ptr", "out_ptr", "residual_out_ptr")},
        dict(HAS_RESIDUAL=False, BLOCK_ROWS=rows, BLOCK_D=head_dim), floats=("eps",),
        num_warps=fused_ops._num_warps(rows * head_dim), as_launched=True)
    heads = fused_ops.PROLOGUE_TILE // head_dim
    pointers, constexprs = prologue_arguments(dtype)
    prologue = compile_for_gpu(fused_ops._qk_norm_rope_store_kernel, pointers,
                               dict(constexprs, HAS_NORM=True, HEADS=heads, BLOCK_D=head_dim, KV_FORMAT=0,
                                    SCALED=False), floats=("eps",),
                               num_warps=fused_ops._num_warps(heads * head_dim), as_launched=True)
    (norm_row,) = row_reduction_layouts(norm)
    assert row_reduction_layouts(prologue) == [norm_row, norm_row]  # q's heads or k's
