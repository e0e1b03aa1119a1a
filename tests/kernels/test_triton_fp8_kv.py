"""The Triton kernels over an fp8 KV pool: store_kvcache and the fused q/k-norm + RoPE + store write
exactly the bytes kernels/kv_quant.quantize writes (overflow clamped to +-448, slots of -1 skipped),
and paged prefill and decode attention match a float64 attention over the dequantized pool.

On the CPU these run in Triton's interpreter (a child process, as in test_triton_attention.py). Its
fp32 -> fp8 cast is wrong (values that round into the next power of two, ties, subnormals), so there
the store kernels round onto the e4m3 grid themselves before the cast
(kernels/attention/triton_kv_store.py); the GPU tests check the hardware cast at realistic shapes.
"""
from __future__ import annotations

import pytest
import torch
from support.interpreter_child import (INTERPRETING, KERNELS_RUN_HERE, assert_module_passes_under_interpreter,
                                       interpreter, needs_cuda)

pytest.importorskip("triton")

from kernels.kv_quant import FP8_DTYPE, KVScales, as_bytes, dequantize, quantize  # noqa: E402
from support.paged_batches import make_batch, reference_attention, rel_error  # noqa: E402
from test_fused_ops import EPS, prologue_inputs, split_heads, unfused_prologue  # noqa: E402
from test_kv_rotation import attention_layer, outlier_qkv  # noqa: E402

from executor_svc.layers.rotary import RotaryEmbedding  # noqa: E402
from kernels.kv_rotation import hadamard_matrix  # noqa: E402

if KERNELS_RUN_HERE:
    from kernels import fused_ops as fo
    from kernels.attention import triton_backend as ta


def fp8_batch(seqlens_q, seqlens_k, heads, block_size, *, seed, dtype=torch.float32, device="cpu"):
    """make_batch's q and pool, the pool quantized with distinct per-head scales (K spread over
    +-40, so scale 1 would not do), and its float64 values as stored."""
    hq, hkv, d = heads
    q, k_cache, v_cache, meta = make_batch(seqlens_q, seqlens_k, num_q_heads=hq, num_kv_heads=hkv, head_dim=d,
                                           block_size=block_size, dtype=dtype, device=device, seed=seed)
    gen = torch.Generator().manual_seed(seed)
    scales = KVScales((0.02 + 0.1 * torch.rand(hkv, generator=gen)).to(device),
                      (0.005 + 0.01 * torch.rand(hkv, generator=gen)).to(device))
    k8, v8 = quantize(k_cache * 10, scales.k), quantize(v_cache, scales.v)
    k64, v64 = dequantize(k8, scales.k, torch.float64), dequantize(v8, scales.v, torch.float64)
    return q, k8, v8, meta, scales, k64, v64


def random_rows(tokens, heads, dim, *, gen, dtype, device="cpu"):
    """Rows whose heads span 1e-4 .. 1e3 (subnormal, normal and overflowing values after the scales)."""
    magnitude = 10.0 ** torch.empty(tokens, heads, dim).uniform_(-4, 3, generator=gen)
    return (torch.randn(tokens, heads, dim, generator=gen) * magnitude).to(device=device, dtype=dtype)


# ---------------------------------------------------------------------------------------------
# CPU: the interpreter
# ---------------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.skipif(INTERPRETING, reason="this is the child process")
def test_fp8_kernels_pass_under_the_interpreter():
    assert_module_passes_under_interpreter(__file__, "test_fp8_kernels_pass_under_the_interpreter", timeout=900)


def check_store(device, dtype, num_blocks, block_size, heads, dim, tokens, seed):
    gen = torch.Generator().manual_seed(seed)
    k_cache = torch.randn(num_blocks, block_size, heads, dim, generator=gen).to(device=device, dtype=FP8_DTYPE)
    v_cache = torch.randn(num_blocks, block_size, heads, dim, generator=gen).to(device=device, dtype=FP8_DTYPE)
    before = as_bytes(k_cache).clone(), as_bytes(v_cache).clone()
    kv = random_rows(tokens, 2 * heads + 1, dim, gen=gen, dtype=dtype, device=device)
    key, value = kv[:, :heads], kv[:, heads:2 * heads]  # strided views of one projection
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:tokens]
    slots[::5] = -1
    slots = slots.to(device)
    scales = KVScales((0.1 + torch.rand(heads, generator=gen)).to(device),
                      (0.01 + torch.rand(heads, generator=gen)).to(device))

    ta.store_kvcache(key, value, k_cache, v_cache, slots, scales)

    kept = slots >= 0
    for cache, old, rows, scale in ((k_cache, before[0], key, scales.k), (v_cache, before[1], value, scales.v)):
        expected = old.flatten(0, 1).clone()
        expected[slots[kept]] = as_bytes(quantize(rows[kept], scale))
        assert torch.equal(as_bytes(cache).flatten(0, 1), expected)  # untouched slots keep their bytes
        stored = cache.flatten(0, 1)[slots[kept]].float()
        assert torch.isfinite(stored).all() and (stored.abs() == 448).any(), "overflowing rows are clamped"


@interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_store_kvcache_quantizes_each_row_at_its_slot_clamping_overflow(dtype):
    check_store("cpu", dtype, num_blocks=6, block_size=4, heads=3, dim=16, tokens=10, seed=int(dtype.itemsize))


@interpreter
def test_store_quantization_matches_torch_on_every_e4m3_boundary_and_tie():
    # every finite e4m3 value, the midpoints between neighbours and a hair either side, both signs
    values = torch.arange(256, dtype=torch.uint8).view(FP8_DTYPE).float()
    values = values[torch.isfinite(values)].unique()
    mids = (values[1:] + values[:-1]) / 2
    rows = torch.cat([values, mids, mids.nextafter(torch.tensor(1e9)), mids.nextafter(torch.tensor(-1e9)),
                      torch.tensor([-0.0, 460.0, 464.0, -1e30, 1e30])])
    rows = torch.cat([rows, torch.zeros(-rows.numel() % 16)]).view(-1, 1, 16)
    k_cache = torch.zeros(rows.shape[0], 1, 1, 16, dtype=FP8_DTYPE)
    v_cache = torch.zeros_like(k_cache)
    scales = KVScales(torch.ones(1), torch.tensor([0.75]))
    ta.store_kvcache(rows, rows, k_cache, v_cache, torch.arange(rows.shape[0]), scales)
    assert torch.equal(as_bytes(k_cache).flatten(), as_bytes(quantize(rows, scales.k)).flatten())
    assert torch.equal(as_bytes(v_cache).flatten(), as_bytes(quantize(rows, scales.v)).flatten())


def check_prefill(quantized_batch, seqlens_q, seqlens_k):
    """Prefill over a pool from quantized_batch matches float64 over the values it holds."""
    q, k8, v8, meta, scales, k64, v64 = quantized_batch(seqlens_q, seqlens_k, (4, 2, 24), 4, seed=sum(seqlens_k))
    out = ta.paged_prefill_attention(q, k8, v8, meta, 24 ** -0.5, kv_scales=scales)
    assert out.dtype == q.dtype
    assert rel_error(out, reference_attention(q, k64, v64, meta, 24 ** -0.5)) < 1e-3


def check_decode(quantized_batch, num_splits):
    """Decode over a pool from quantized_batch, split num_splits ways, matches float64."""
    q, k8, v8, meta, scales, k64, v64 = quantized_batch([1, 1, 1], [33, 1, 16], (6, 2, 16), 4, seed=num_splits)
    out = ta.paged_decode_attention(q, k8, v8, meta, 0.25, num_splits=num_splits, kv_scales=scales)
    assert rel_error(out, reference_attention(q, k64, v64, meta, 0.25)) < 1e-3


def check_mixed_step(quantized_batch):
    """A mixed step through the backend matches float64; returns what a refusal check needs."""
    q, k8, v8, meta, scales, k64, v64 = quantized_batch([1, 1, 4, 7], [5, 23, 10, 7], (4, 2, 16), 4, seed=8)
    meta.num_decodes = 2
    backend = ta.TritonAttentionBackend()
    out = backend.forward(q, k8, v8, meta, 0.25, scales)
    assert rel_error(out, reference_attention(q, k64, v64, meta, 0.25)) < 1e-3
    return backend, (q, k8, v8, meta, 0.25), scales


PREFILL_CASES = pytest.mark.parametrize("seqlens_q, seqlens_k", [([5, 17, 1], [5, 17, 1]), ([3, 16, 7], [11, 40, 7])],
                                        ids=["fresh", "prefix"])


@interpreter
@PREFILL_CASES
def test_prefill_over_an_fp8_pool_matches_float64_over_the_dequantized_values(seqlens_q, seqlens_k):
    check_prefill(fp8_batch, seqlens_q, seqlens_k)


@interpreter
@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_over_an_fp8_pool_matches_float64_for_any_split_count(num_splits):
    check_decode(fp8_batch, num_splits)


@interpreter
def test_mixed_step_over_an_fp8_pool_and_a_missing_scale_is_refused():
    backend, args, _ = check_mixed_step(fp8_batch)
    with pytest.raises(ValueError, match="KVScales"):
        backend.forward(*args)


def prologue_pools(device, dtype, norm, tokens, hq, hkv, d, seed, scales, cache_dtype):
    """The fused prologue, the unfused chain and eager torch over one quantized pool (`cache_dtype`, its
    layer's `scales`); returns their pools."""
    inputs = prologue_inputs(tokens, hq, hkv, d, gen=torch.Generator().manual_seed(seed), dtype=dtype, device=device)
    inputs["qkv"] *= 30
    pools = {}
    for name in ("fused", "chain", "eager"):
        x = {n: t.clone() for n, t in inputs.items()}
        x["k_cache"], x["v_cache"] = (torch.zeros_like(x["k_cache"]).to(cache_dtype),
                                      torch.zeros_like(x["v_cache"]).to(cache_dtype))
        q, k, v = split_heads(x["qkv"], hq, hkv, d)
        w = (x["q_norm_weight"], x["k_norm_weight"]) if norm else (None, None)
        args = (x["positions"], q, k, v, x["cos"], x["sin"], x["k_cache"], x["v_cache"], x["slot_mapping"])
        if name == "fused":
            fo.qk_norm_rope_store(*args, *w, EPS, scales)
        elif name == "chain":
            unfused_prologue(*args, *w, scales)
        else:
            fo.qk_norm_rope_store_ref(*args, *w, EPS, scales)
        pools[name] = (x["k_cache"], x["v_cache"])
    return pools


def fp8_prologue(device, dtype, norm, tokens, hq, hkv, d, seed):
    """prologue_pools over an fp8 pool with small K scales: some rotated k beyond 448 * scale, clamped."""
    gen = torch.Generator().manual_seed(seed + 1)
    scales = KVScales((0.001 + 0.004 * torch.rand(hkv, generator=gen)).to(device),
                      (0.01 + torch.rand(hkv, generator=gen)).to(device))
    return prologue_pools(device, dtype, norm, tokens, hq, hkv, d, seed, scales, FP8_DTYPE), scales


def check_fused_prologue_on_gpu(pools, scales):
    """The compiled fused prologue writes the unfused chain's bytes, and eager torch's values within rounding."""
    for got, want in zip(pools["fused"], pools["chain"]):
        assert torch.equal(as_bytes(got), as_bytes(want))
    for got, want, scale in zip(pools["fused"], pools["eager"], (scales.k, scales.v)):
        assert rel_error(dequantize(got, scale, torch.float32), dequantize(want, scale, torch.float64)) < 2e-2


def check_attention_on_gpu(quantized_batch, heads):
    """Compiled prefill and decode (any split count) over a pool from quantized_batch match float64."""
    seqlens_q = [1024, 300, 1, 17, 700]
    seqlens_k = [1024, 2100, 4096, 17, 3000]
    q, k8, v8, meta, scales, k64, v64 = quantized_batch(seqlens_q, seqlens_k, heads, 16, seed=10,
                                                        dtype=torch.bfloat16, device="cuda")
    out = ta.paged_prefill_attention(q, k8, v8, meta, heads[2] ** -0.5, kv_scales=scales)
    assert rel_error(out, reference_attention(q, k64, v64, meta, heads[2] ** -0.5)) < 1e-2
    lens = torch.randint(1, 4097, (40,), generator=torch.Generator().manual_seed(11)).tolist()
    q, k8, v8, meta, scales, k64, v64 = quantized_batch([1] * 40, lens, heads, 16, seed=12, dtype=torch.bfloat16,
                                                        device="cuda")
    ref = reference_attention(q, k64, v64, meta, heads[2] ** -0.5)
    # the engine's choice (the Gluon kernel where it fits) and the Triton kernel, which takes every shape
    for decode in (ta.paged_decode_attention, ta.triton_decode_attention):
        for num_splits in (None, 1, 4):
            out = decode(q, k8, v8, meta, heads[2] ** -0.5, num_splits=num_splits, kv_scales=scales)
            assert rel_error(out, ref) < 1e-2, (decode.__name__, num_splits)


@interpreter
@pytest.mark.parametrize("norm", [False, True])
def test_fused_prologue_stores_the_same_fp8_bytes_as_the_unfused_chain_and_eager_torch(norm):
    pools, _ = fp8_prologue("cpu", torch.float32, norm, tokens=5, hq=4, hkv=2, d=16, seed=3 + norm)
    for name in ("chain", "eager"):
        for got, want in zip(pools["fused"], pools[name]):
            assert torch.equal(as_bytes(got), as_bytes(want)), name
    assert (pools["fused"][0].float().abs().amax() == 448.0), "the case should overflow some scale"


def rotated_layers(device, dtype, seqlens_q, seqlens_k, heads, block_size, seed):
    """The same step through a rotated attention layer over the Triton backend and over the torch
    backend (--kv-cache-rotation hadamard); returns (out, layer) for each."""
    hq, hkv, d = heads
    _, _, _, meta = make_batch(seqlens_q, seqlens_k, num_q_heads=hq, num_kv_heads=hkv, head_dim=d,
                               block_size=block_size, device=device, seed=seed)
    num_blocks = int(meta.block_tables.max()) + 1
    q, k, v = (x.to(device=device, dtype=dtype) for x in outlier_qkv(sum(seqlens_q), hq, hkv, d,
                                                                      torch.Generator().manual_seed(seed)))
    positions = torch.cat([torch.arange(nk - nq, nk) for nq, nk in zip(seqlens_q, seqlens_k)]).to(device)
    rope = RotaryEmbedding(d, max(seqlens_k), 10000.0).to(device)
    scales = KVScales(torch.full((hkv,), 0.02, device=device), torch.full((hkv,), 0.01, device=device))
    h = hadamard_matrix(d, dtype, device)
    results = {}
    for name, backend in (("triton", ta.TritonAttentionBackend()), ("torch", None)):
        layer = attention_layer(hq, hkv, d, num_blocks, block_size, h, scales, backend, device)
        out = layer(positions, q.clone(), k.clone(), v.flatten(1).clone(), meta, rope)
        results[name] = (out, layer)
    return results


@interpreter
def test_a_rotated_layer_over_triton_stores_the_torch_backends_fp8_bytes_and_attends_alike():
    results = rotated_layers("cpu", torch.float32, [6, 1, 9], [6, 1, 9], (4, 2, 16), 4, seed=21)
    (out, layer), (ref_out, ref_layer) = results["triton"], results["torch"]
    assert torch.equal(as_bytes(layer.k_cache), as_bytes(ref_layer.k_cache))
    assert torch.equal(as_bytes(layer.v_cache), as_bytes(ref_layer.v_cache))
    assert rel_error(out, ref_out.double()) < 1e-5


# ---------------------------------------------------------------------------------------------
# GPU: compiled kernels, the hardware fp8 cast, realistic shapes
# ---------------------------------------------------------------------------------------------

GPU_HEADS = [(16, 8, 128), (9, 3, 64), (4, 2, 192)]


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_store_kvcache_writes_torch_quantized_bytes(dtype):
    check_store("cuda", dtype, num_blocks=600, block_size=16, heads=8, dim=128, tokens=4096, seed=13)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("heads", GPU_HEADS)
def test_gpu_prefill_and_decode_over_an_fp8_pool_match_float64(heads):
    check_attention_on_gpu(fp8_batch, heads)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("norm", [False, True])
def test_gpu_fused_prologue_stores_the_unfused_chains_fp8_bytes(norm):
    check_fused_prologue_on_gpu(*fp8_prologue("cuda", torch.bfloat16, norm, tokens=256, hq=16, hkv=8, d=128, seed=5))


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("heads", [(16, 8, 128), (9, 3, 64)])
def test_gpu_rotated_layer_takes_the_unfused_chain_and_matches_the_torch_backend(heads):
    # the fused prologue would store K unrotated: with a rotation the layer norms, ropes, rotates, stores
    results = rotated_layers("cuda", torch.bfloat16, [300, 1, 17], [300, 900, 40], heads, 16, seed=22)
    (out, layer), (ref_out, ref_layer) = results["triton"], results["torch"]
    for got, want, scale in ((layer.k_cache, ref_layer.k_cache, layer.kv_scales.k),
                             (layer.v_cache, ref_layer.v_cache, layer.kv_scales.v)):
        assert rel_error(dequantize(got, scale, torch.float32), dequantize(want, scale, torch.float64)) < 1e-2
    assert rel_error(out, ref_out.double()) < 2e-2


@pytest.mark.gpu
@needs_cuda
def test_gpu_fp8_decode_replayed_from_a_cuda_graph_follows_new_lengths():
    q, k8, v8, meta, scales, k64, v64 = fp8_batch([1] * 8, [4096] * 8, (16, 8, 128), 16, seed=14,
                                                  dtype=torch.bfloat16, device="cuda")
    backend = ta.TritonAttentionBackend()
    backend.forward(q, k8, v8, meta, 128 ** -0.5, scales)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = backend.forward(q, k8, v8, meta, 128 ** -0.5, scales)
    meta.seqlens_k.copy_(torch.randint(1, 4097, (8,), generator=torch.Generator().manual_seed(15), dtype=torch.int32))
    graph.replay()
    torch.cuda.synchronize()
    assert rel_error(out, reference_attention(q, k64, v64, meta, 128 ** -0.5)) < 1e-2


@pytest.mark.gpu
@needs_cuda
def test_gpu_decode_over_an_8bit_pool_takes_the_gluon_kernel_exactly_where_it_fits():
    from kernels.attention import gluon_decode as gd

    def decode_batch(heads, block_size):
        return fp8_batch([1] * 5, [40, 300, 1, 17, 129], heads, block_size, seed=16, dtype=torch.bfloat16,
                         device="cuda")

    q, k8, v8, meta, scales, _, _ = decode_batch((16, 8, 128), 16)
    assert gd.gluon_decode_fits(q, k8)
    assert torch.equal(ta.paged_decode_attention(q, k8, v8, meta, 0.1, kv_scales=scales),
                       gd.gluon_decode(q, k8, v8, meta, 0.1, scales))
    assert not gd.gluon_decode_fits(q, k8.to(torch.bfloat16)), "a bf16 pool takes the Triton kernel"
    assert not gd.gluon_decode_fits(q.float(), k8), "so does an fp32 q"
    # head_dim 64, block size 32, a GQA group of 16: the Triton kernel
    for heads, block_size in (((9, 3, 64), 16), ((16, 8, 128), 32), ((16, 1, 128), 16)):
        q, k8, v8, meta, scales, _, _ = decode_batch(heads, block_size)
        assert not gd.gluon_decode_fits(q, k8), (heads, block_size)
        assert torch.equal(ta.paged_decode_attention(q, k8, v8, meta, 0.1, kv_scales=scales),
                           ta.triton_decode_attention(q, k8, v8, meta, 0.1, kv_scales=scales))


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("num_seqs", [5, 150])  # the Gluon kernel splits the contexts in many or in two
@pytest.mark.parametrize("per", ["token", "head"])
def test_gpu_decode_over_an_fp8_pool_writes_o_projs_fp8_input_as_the_quantization_of_its_output(num_seqs, per):
    """The backend's decode_fp8 over an fp8 pool (the Gluon kernel, its FP8 output written by the split merge, or
    quantize_rows after an unsplit step): the bytes quantize_rows makes of forward's output, five times over fresh
    inputs."""
    from kernels.fp8_gemm import quantize_rows, split_counters

    backend = ta.TritonAttentionBackend()
    for seed in range(5):
        seqlens_k = torch.randint(1, 2049, (num_seqs,), generator=torch.Generator().manual_seed(seed)).tolist()
        q, k8, v8, meta, scales, _, _ = fp8_batch([1] * num_seqs, seqlens_k, (32, 8, 128), 16, seed=50 + seed,
                                                  dtype=torch.bfloat16, device="cuda")
        group = 32 * 128 if per == "token" else 128
        quantized = backend.decode_fp8(q, k8, v8, meta, 0.1, scales, group)
        want_q, want_scale = quantize_rows(backend.forward(q, k8, v8, meta, 0.1, scales).reshape(num_seqs, -1), group)
        assert torch.equal(quantized.scale, want_scale)
        assert torch.equal(quantized.q.view(torch.uint8), want_q.view(torch.uint8))
        assert not split_counters(q.device).any()

    from kernels.attention import gluon_decode as gd

    # unsplit (from 462 sequences of 8 KV heads on 132 SMs), the Gluon kernel leaves the FP8 output to quantize_rows
    assert gd.gluon_decode(q, k8, v8, meta, 0.1, scales, num_splits=1, fp8_group=group)[1] is None
