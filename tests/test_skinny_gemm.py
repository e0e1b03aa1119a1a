"""The skinny GEMM (decode-sized linear layers, split-K in one launch) matches float64 and F.linear.

On the CPU the kernel runs in Triton's interpreter, which has to be on before it is decorated. So
unless TRITON_INTERPRET=1 is already set, one test re-runs this file in a fresh python with it set,
and the interpreter tests skip in this process. The interpreter runs a grid's programs one after
another, so there the split that arrives last is always the highest; the gpu tests cover real
concurrency (determinism, counters, CUDA-graph replay) at Qwen3-0.6B's shapes.
"""
from __future__ import annotations

import pytest
from interpreter_child import (INTERPRETING, KERNELS_RUN_HERE, assert_module_passes_under_interpreter,
                               interpreter, needs_cuda)
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

if KERNELS_RUN_HERE:
    from kernels import fused_ops as fo
    from kernels import skinny_gemm as sg
    from kernels.skinny_gemm import SkinnyConfig


def randn(*shape, gen, dtype, device="cpu") -> torch.Tensor:
    return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)


def cuda_inputs(M: int, N: int, K: int, gen) -> tuple[torch.Tensor, torch.Tensor]:
    """bf16 x [M, K] and weight [N, K] on the GPU."""
    return tuple(randn(*shape, gen=gen, dtype=torch.bfloat16, device="cuda") for shape in ((M, K), (N, K)))


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref).norm() / ref.norm()).item()


def max_rel(dtype: torch.dtype) -> float:
    return 1e-5 if dtype == torch.float32 else 1e-2


def linear64(a: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    out = a.double() @ weight.double().T
    return out if bias is None else out + bias.double()


def silu_and_mul64(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.double().chunk(2, dim=-1)
    return gate * torch.sigmoid(gate) * up


def counters_of(x: torch.Tensor, N: int, cfg) -> torch.Tensor:
    """The tile counters skinny_linear(x, W[N, :], config=cfg) used."""
    return sg.split_k_workspace(x.device, -(-x.shape[0] // cfg.block_m), -(-N // cfg.block_n), cfg)[1]


# ---------------------------------------------------------------------------------------------
# CPU: the interpreter
# ---------------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.skipif(INTERPRETING, reason="this is the child process")
def test_skinny_gemm_passes_under_the_interpreter():
    assert_module_passes_under_interpreter(__file__, "test_skinny_gemm_passes_under_the_interpreter", timeout=300)


# (M, N, K, dtype, bias, config): every edge, each split count and both operand orders, few programs.
EDGE_CASES = [
    (1, 16, 32, torch.float32, False, (16, 16, 32, 1, 4, 2, True)),  # one tile, 15 padded rows
    (5, 48, 96, torch.float32, True, (16, 16, 32, 2, 4, 2, False)),  # 3 K tiles over 2 splits: one short
    (16, 80, 96, torch.bfloat16, True, (16, 32, 32, 3, 4, 2, True)),  # N = 80: a wrapped, unstored N tail
    (33, 48, 32, torch.bfloat16, False, (16, 16, 32, 1, 4, 2, False)),  # 3 M tiles, the last with one row
    (33, 80, 96, torch.float32, True, (32, 16, 64, 2, 4, 2, True)),  # K = 96 with 64-wide K tiles: masked
    (5, 16, 96, torch.bfloat16, False, (16, 16, 16, 8, 4, 2, True)),  # split 8 > 6 K tiles: clamped
]


@interpreter
@pytest.mark.parametrize("M, N, K, dtype, has_bias, cfg", EDGE_CASES,
                         ids=[f"M{c[0]}-N{c[1]}-K{c[2]}-split{c[5][3]}" for c in EDGE_CASES])
def test_skinny_linear_matches_float64_at_ragged_edges(M, N, K, dtype, has_bias, cfg):
    gen = torch.Generator().manual_seed(M * 1000 + N + K)
    x, weight = randn(M, K, gen=gen, dtype=dtype), randn(N, K, gen=gen, dtype=dtype)
    bias = randn(N, gen=gen, dtype=dtype) if has_bias else None
    out = sg.skinny_linear(x, weight, bias, config=SkinnyConfig(*cfg))
    assert out.shape == (M, N) and out.dtype == dtype
    assert rel_error(out, linear64(x, weight, bias)) < max_rel(dtype)
    if dtype == torch.float32:
        torch.testing.assert_close(out, F.linear(x, weight, bias), rtol=1e-5, atol=1e-5)


@interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("split_k", [1, 2])
def test_silu_and_mul_input_matches_the_unfused_chain(dtype, split_k):
    """x = [gate | up]: the operand is rounded as fused_ops.silu_and_mul rounds its output, so the
    fused call is the chain silu_and_mul -> linear up to the sum's order."""
    gen = torch.Generator().manual_seed(11 + split_k)
    M, N, K = 5, 48, 96
    x, weight = randn(M, 2 * K, gen=gen, dtype=dtype), randn(N, K, gen=gen, dtype=dtype)
    bias = randn(N, gen=gen, dtype=dtype)
    out = sg.skinny_linear(x, weight, bias, silu_and_mul_input=True,
                           config=SkinnyConfig(16, 16, 32, split_k, 4, 2))
    chain64 = linear64(fo.silu_and_mul(x), weight, bias)  # the chain's rounded operand, exact product
    assert rel_error(out, chain64) < max_rel(dtype)
    # against the exact silu the operand's own bf16 rounding counts too
    assert rel_error(out, linear64(silu_and_mul64(x), weight, bias)) < 2 * max_rel(dtype)


@interpreter
def test_split_k_resets_its_counters_and_a_second_call_gives_the_same_result():
    gen = torch.Generator().manual_seed(3)
    M, N, K = 16, 48, 96
    cfg = SkinnyConfig(16, 16, 32, 3, 4, 2)
    x, weight = randn(M, K, gen=gen, dtype=torch.float32), randn(N, K, gen=gen, dtype=torch.float32)
    first = sg.skinny_linear(x, weight, config=cfg)
    partials, counters = sg.split_k_workspace(x.device, 1, 3, cfg)
    assert counters.shape == (3,) and torch.all(counters == 0)
    second = sg.skinny_linear(x, weight, config=cfg)
    assert torch.equal(first, second)
    assert sg.split_k_workspace(x.device, 1, 3, cfg)[0].data_ptr() == partials.data_ptr(), "cached, not reallocated"
    # new inputs through the same workspace: no stale partial leaks into the sum
    x2 = randn(M, K, gen=gen, dtype=torch.float32)
    assert rel_error(sg.skinny_linear(x2, weight, config=cfg), linear64(x2, weight)) < 1e-5
    assert torch.all(counters == 0)


@interpreter
def test_out_is_written_in_place_through_its_row_stride():
    gen = torch.Generator().manual_seed(4)
    M, N, K = 5, 16, 32
    x, weight = randn(M, K, gen=gen, dtype=torch.float32), randn(N, K, gen=gen, dtype=torch.float32)
    buffer = torch.full((M, N + 7), 123.0)
    out = buffer[:, :N]
    returned = sg.skinny_linear(x, weight, out=out, config=SkinnyConfig(16, 16, 32, 1, 4, 2))
    assert returned.data_ptr() == out.data_ptr()
    assert rel_error(out, linear64(x, weight)) < 1e-5
    assert torch.all(buffer[:, N:] == 123.0), "columns past N are not written"


@interpreter
def test_default_config_runs_and_a_table_entry_overrides_it(monkeypatch):
    gen = torch.Generator().manual_seed(5)
    M, N, K = 5, 48, 96
    x, weight = randn(M, K, gen=gen, dtype=torch.float32), randn(N, K, gen=gen, dtype=torch.float32)
    assert rel_error(sg.skinny_linear(x, weight), linear64(x, weight)) < 1e-5
    entry = SkinnyConfig(16, 32, 32, 2, 4, 2, False)
    monkeypatch.setitem(sg.CONFIGS, (M, N, K), entry)
    assert sg.config_for(M, N, K) is entry
    assert rel_error(sg.skinny_linear(x, weight), linear64(x, weight)) < 1e-5
    assert torch.all(counters_of(x, N, entry) == 0)


# (N, K) of Qwen3-0.6B's linear layers: hidden 1024, 16 q / 8 kv heads of 128, intermediate 3072
QWEN3_SHAPES = {"qkv_proj": (4096, 1024), "o_proj": (1024, 2048), "gate_up_proj": (6144, 1024),
                "down_proj": (1024, 3072)}


@interpreter
@pytest.mark.parametrize("M", [1, 8, 16, 32, 48, 64])
def test_default_configs_fill_an_h200_with_whole_k_tiles(M):
    for name, (N, K) in QWEN3_SHAPES.items():
        cfg = sg.config_for(M, N, K, sms=132, silu_and_mul_input=name == "down_proj")
        for block in (cfg.block_m, cfg.block_n, cfg.block_k):
            assert block >= 16 and block & (block - 1) == 0, "tl.dot needs power-of-two tiles of >= 16"
        assert cfg.block_m >= min(M, 64) and 1 <= cfg.split_k <= sg.MAX_SPLIT_K
        k_tiles = K // cfg.block_k
        assert k_tiles % cfg.split_k == 0 and k_tiles // cfg.split_k >= 2, "every split has >= 2 whole K tiles"
        programs = -(-M // cfg.block_m) * (N // cfg.block_n) * cfg.split_k
        assert programs >= 132, f"{name} M={M}: {programs} programs leave SMs idle"
        assert 2 <= cfg.num_stages <= 4


@interpreter
def test_skinny_supported_takes_small_contiguous_float_batches_only():
    w = torch.randn(16, 32, dtype=torch.bfloat16)
    assert sg.skinny_supported(torch.randn(sg.MAX_M, 32, dtype=torch.bfloat16), w)
    assert not sg.skinny_supported(torch.randn(sg.MAX_M + 1, 32, dtype=torch.bfloat16), w)
    assert not sg.skinny_supported(torch.randn(32, 4, dtype=torch.bfloat16).T, w), "non-contiguous x"
    assert not sg.skinny_supported(torch.randn(4, 32), w), "mixed dtypes"
    assert not sg.skinny_supported(torch.randn(2, 4, 32, dtype=torch.bfloat16), w), "3-D x"
    assert not sg.skinny_supported(torch.ones(4, 32, dtype=torch.int32), w.to(torch.int32))
    assert sg.skinny_supported(torch.randn(4, 32, dtype=torch.float16), w.to(torch.float16))


@interpreter
def test_mismatched_shapes_are_refused_and_an_empty_batch_gives_an_empty_output():
    w = torch.randn(16, 32)
    with pytest.raises(ValueError, match="does not fit"):
        sg.skinny_linear(torch.randn(4, 48), w)
    with pytest.raises(ValueError, match="does not fit"):
        sg.skinny_linear(torch.randn(4, 32), w, silu_and_mul_input=True)  # needs [4, 64]
    with pytest.raises(ValueError, match="out must be"):
        sg.skinny_linear(torch.randn(4, 32), w, out=torch.empty(4, 15))
    assert sg.skinny_linear(torch.randn(0, 32), w).shape == (0, 16)


# ---------------------------------------------------------------------------------------------
# GPU: compiled kernels at Qwen3-0.6B's shapes, bf16
# ---------------------------------------------------------------------------------------------


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("M", [1, 16, 48, 64])
@pytest.mark.parametrize("name", ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"])
def test_gpu_qwen3_shapes_match_float64_and_cublas(name, M):
    N, K = QWEN3_SHAPES[name]
    gen = torch.Generator().manual_seed(M + N)
    x, weight = cuda_inputs(M, N, K, gen)
    out = sg.skinny_linear(x, weight)
    assert rel_error(out, linear64(x, weight)) < 1e-2
    assert rel_error(out, F.linear(x, weight).double()) < 1e-2
    cfg = sg.config_for(M, N, K)
    if cfg.split_k > 1:
        assert torch.all(counters_of(x, N, cfg) == 0)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("M", [1, 33, 64])
def test_gpu_fused_down_proj_matches_the_unfused_chain(M):
    N, K = QWEN3_SHAPES["down_proj"]
    gen = torch.Generator().manual_seed(M)
    gate_up = randn(M, 2 * K, gen=gen, dtype=torch.bfloat16, device="cuda")
    weight = randn(N, K, gen=gen, dtype=torch.bfloat16, device="cuda")
    out = sg.skinny_linear(gate_up, weight, silu_and_mul_input=True)
    act = fo.silu_and_mul(gate_up)
    assert rel_error(out, linear64(act, weight)) < 1e-2
    assert rel_error(out, F.linear(act, weight).double()) < 1e-2
    assert rel_error(out, linear64(silu_and_mul64(gate_up), weight)) < 2e-2


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("swap_ab", [True, False])
@pytest.mark.parametrize("split_k", [1, 4])
def test_gpu_both_operand_orders_with_bias_and_any_split(swap_ab, split_k):
    gen = torch.Generator().manual_seed(split_k)
    M, (N, K) = 20, QWEN3_SHAPES["qkv_proj"]
    x, weight = cuda_inputs(M, N, K, gen)
    bias = randn(N, gen=gen, dtype=torch.bfloat16, device="cuda")
    out = sg.skinny_linear(x, weight, bias, config=SkinnyConfig(32, 64, 128, split_k, 4, 3, swap_ab))
    assert rel_error(out, linear64(x, weight, bias)) < 1e-2


@pytest.mark.gpu
@needs_cuda
def test_gpu_split_k_is_deterministic_and_leaves_its_counters_at_zero():
    gen = torch.Generator().manual_seed(6)
    M, (N, K) = 16, QWEN3_SHAPES["o_proj"]
    cfg = SkinnyConfig(16, 32, 128, 8, 4, 3)
    x, weight = cuda_inputs(M, N, K, gen)
    first = sg.skinny_linear(x, weight, config=cfg)
    for _ in range(20):  # arrival order varies from call to call; the sum's order does not
        assert torch.equal(sg.skinny_linear(x, weight, config=cfg), first)
    assert torch.all(counters_of(x, N, cfg) == 0)


@pytest.mark.gpu
@needs_cuda
def test_gpu_cuda_graph_replay_follows_new_inputs():
    gen = torch.Generator().manual_seed(7)
    M, dt = 32, torch.bfloat16
    weights = {name: randn(N, K, gen=gen, dtype=dt, device="cuda") for name, (N, K) in QWEN3_SHAPES.items()}

    def fresh():
        return {"x": randn(M, 1024, gen=gen, dtype=dt, device="cuda"),
                "attn": randn(M, 2048, gen=gen, dtype=dt, device="cuda")}

    static = fresh()

    def step(inputs):
        qkv = sg.skinny_linear(inputs["x"], weights["qkv_proj"])
        o = sg.skinny_linear(inputs["attn"], weights["o_proj"])
        gate_up = sg.skinny_linear(o, weights["gate_up_proj"])
        return qkv, o, sg.skinny_linear(gate_up, weights["down_proj"], silu_and_mul_input=True)

    step(static)  # compile and allocate the workspaces outside the graph
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = step(static)
    for _ in range(3):
        new = fresh()
        for name, tensor in new.items():
            static[name].copy_(tensor)
        graph.replay()
        torch.cuda.synchronize()
        for got, want in zip(outputs, step(new)):
            assert torch.equal(got, want)
    assert rel_error(outputs[0], linear64(new["x"], weights["qkv_proj"])) < 1e-2
