"""The Triton kernels over an int8 KV pool (a scale per KV head and channel): store_kvcache and the fused
q/k-norm + RoPE + store write exactly the bytes kernels/kv_quant.quantize writes (rounded half away from
zero, overflow clamped to +-127, slots of -1 skipped), and paged prefill and decode attention match a
float64 attention over the dequantized pool.

On the CPU these run in Triton's interpreter (a child process, as in test_triton_attention.py); the GPU
tests check the compiled kernels at realistic shapes.
"""
from __future__ import annotations

import pytest
import torch
from support.interpreter_child import (INTERPRETING, KERNELS_RUN_HERE, assert_module_passes_under_interpreter,
                                       interpreter, needs_cuda)

pytest.importorskip("triton")

from kernels.kv_quant import INT8_DTYPE, KVScales, dequantize, quantize  # noqa: E402
from support.paged_batches import make_batch  # noqa: E402
from test_triton_fp8_kv import (PREFILL_CASES, check_attention_on_gpu, check_decode,  # noqa: E402
                                check_fused_prologue_on_gpu, check_mixed_step, check_prefill, prologue_pools,
                                random_rows)

if KERNELS_RUN_HERE:
    from kernels import fused_ops as fo
    from kernels.attention import triton_backend as ta


def channel_scales(heads, dim, gen, low, spread, device):
    """[heads, dim] scales that differ by head and by channel (so a per-head kernel would read them wrong)."""
    return (low + spread * torch.rand(heads, dim, generator=gen)).to(device)


def int8_batch(seqlens_q, seqlens_k, heads, block_size, *, seed, dtype=torch.float32, device="cpu"):
    """make_batch's q and pool, the pool quantized to int8 with per-channel scales (K spread over +-10),
    and its float64 values as stored."""
    hq, hkv, d = heads
    q, k_cache, v_cache, meta = make_batch(seqlens_q, seqlens_k, num_q_heads=hq, num_kv_heads=hkv, head_dim=d,
                                           block_size=block_size, dtype=dtype, device=device, seed=seed)
    gen = torch.Generator().manual_seed(seed)
    scales = KVScales(channel_scales(hkv, d, gen, 0.02, 0.1, device), channel_scales(hkv, d, gen, 0.01, 0.03, device))
    k8, v8 = quantize(k_cache * 3, scales.k, INT8_DTYPE), quantize(v_cache, scales.v, INT8_DTYPE)
    k64, v64 = dequantize(k8, scales.k, torch.float64), dequantize(v8, scales.v, torch.float64)
    return q, k8, v8, meta, scales, k64, v64


def check_store(device, dtype, num_blocks, block_size, heads, dim, tokens, seed):
    gen = torch.Generator().manual_seed(seed)
    shape = (num_blocks, block_size, heads, dim)
    k_cache = torch.randint(-127, 128, shape, generator=gen, dtype=INT8_DTYPE).to(device)
    v_cache = torch.randint(-127, 128, shape, generator=gen, dtype=INT8_DTYPE).to(device)
    before = k_cache.clone(), v_cache.clone()
    kv = random_rows(tokens, 2 * heads + 1, dim, gen=gen, dtype=dtype, device=device)
    key, value = kv[:, :heads], kv[:, heads:2 * heads]  # strided views of one projection
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:tokens]
    slots[::5] = -1
    slots = slots.to(device)
    scales = KVScales(channel_scales(heads, dim, gen, 0.1, 1.0, device),
                      channel_scales(heads, dim, gen, 0.01, 1.0, device))

    ta.store_kvcache(key, value, k_cache, v_cache, slots, scales)

    kept = slots >= 0
    for cache, old, rows, scale in ((k_cache, before[0], key, scales.k), (v_cache, before[1], value, scales.v)):
        expected = old.flatten(0, 1).clone()
        expected[slots[kept]] = quantize(rows[kept], scale, INT8_DTYPE)
        assert torch.equal(cache.flatten(0, 1), expected)  # untouched slots keep their bytes
        assert (cache.flatten(0, 1)[slots[kept]].abs() == 127).any(), "overflowing rows are clamped"


def int8_prologue(device, dtype, norm, tokens, hq, hkv, d, seed):
    """prologue_pools over an int8 pool with small K scales: some rotated k beyond 127 * scale, clamped."""
    gen = torch.Generator().manual_seed(seed + 1)
    scales = KVScales(channel_scales(hkv, d, gen, 0.005, 0.015, device), channel_scales(hkv, d, gen, 0.1, 1.0, device))
    return prologue_pools(device, dtype, norm, tokens, hq, hkv, d, seed, scales, INT8_DTYPE), scales


# ---------------------------------------------------------------------------------------------
# CPU: the interpreter
# ---------------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.skipif(INTERPRETING, reason="this is the child process")
def test_int8_kernels_pass_under_the_interpreter():
    assert_module_passes_under_interpreter(__file__, "test_int8_kernels_pass_under_the_interpreter", timeout=900)


@interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_store_kvcache_quantizes_each_row_at_its_slot_per_channel_clamping_overflow(dtype):
    check_store("cpu", dtype, num_blocks=6, block_size=4, heads=3, dim=16, tokens=10, seed=int(dtype.itemsize))


@interpreter
def test_store_rounds_ties_away_from_zero_as_torch_does():
    y = torch.tensor([0.5, 1.5, 2.5, -0.5, -1.5, 126.5, -126.5, 127.5, 0.4999999, -0.4999999, 1e30, -1e30,
                      3.0, -0.0, 7.25, -7.75])
    rows = y.view(1, 1, 16)
    k_cache = torch.zeros(1, 1, 1, 16, dtype=INT8_DTYPE)
    v_cache = torch.zeros_like(k_cache)
    scales = KVScales(torch.ones(1, 16), torch.full((1, 16), 0.5))
    ta.store_kvcache(rows, rows, k_cache, v_cache, torch.zeros(1, dtype=torch.int64), scales)
    assert k_cache.flatten().tolist() == [1, 2, 3, -1, -2, 127, -127, 127, 0, 0, 127, -127, 3, 0, 7, -8]
    assert torch.equal(v_cache, quantize(rows, scales.v, INT8_DTYPE)[None])


@interpreter
@PREFILL_CASES
def test_prefill_over_an_int8_pool_matches_float64_over_the_dequantized_values(seqlens_q, seqlens_k):
    check_prefill(int8_batch, seqlens_q, seqlens_k)


@interpreter
@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_over_an_int8_pool_matches_float64_for_any_split_count(num_splits):
    check_decode(int8_batch, num_splits)


@interpreter
def test_a_mixed_step_over_an_int8_pool_matches_float64_and_per_head_scales_are_refused():
    backend, args, scales = check_mixed_step(int8_batch)
    with pytest.raises(ValueError, match="per KV head and channel"):
        backend.forward(*args, KVScales(scales.k[:, 0], scales.v[:, 0]))


@interpreter
@pytest.mark.parametrize("norm", [False, True])
def test_fused_prologue_stores_the_same_int8_bytes_as_the_unfused_chain_and_eager_torch(norm):
    pools, _ = int8_prologue("cpu", torch.float32, norm, tokens=5, hq=4, hkv=2, d=16, seed=3 + norm)
    for name in ("chain", "eager"):
        for got, want in zip(pools["fused"], pools[name]):
            assert torch.equal(got, want), name
    assert (pools["fused"][0].abs().amax() == 127), "the case should overflow some scale"


# ---------------------------------------------------------------------------------------------
# GPU: compiled kernels, realistic shapes
# ---------------------------------------------------------------------------------------------

GPU_HEADS = [(16, 8, 128), (9, 3, 64), (4, 2, 192)]


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_store_kvcache_writes_torch_quantized_int8_bytes(dtype):
    check_store("cuda", dtype, num_blocks=600, block_size=16, heads=8, dim=128, tokens=4096, seed=13)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("heads", GPU_HEADS)
def test_gpu_prefill_and_decode_over_an_int8_pool_match_float64(heads):
    check_attention_on_gpu(int8_batch, heads)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("norm", [False, True])
def test_gpu_fused_prologue_stores_the_unfused_chains_int8_bytes(norm):
    check_fused_prologue_on_gpu(*int8_prologue("cuda", torch.bfloat16, norm, tokens=256, hq=16, hkv=8, d=128, seed=5))
