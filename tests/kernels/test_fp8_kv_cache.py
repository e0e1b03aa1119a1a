"""The fp8 KV cache's format (kernels/kv_quant.py) and the torch backend over an fp8 pool: values are
stored as x / scale rounded to the nearest e4m3 value, anything beyond +-448 is clamped (never NaN),
and attention over the pool equals a float64 attention over the dequantized values, per KV head."""
from __future__ import annotations

import pytest
import torch

from kernels.attention.torch_backend import TorchAttentionBackend
from kernels.kv_quant import FP8_DTYPE, FP8_MAX, KVScales, as_bytes, dequantize, quantize, scales_from_amax
from support.paged_batches import make_batch, reference_attention, rel_error

E4M3_VALUES = torch.arange(256, dtype=torch.uint8).view(FP8_DTYPE).float()
E4M3_VALUES = E4M3_VALUES[~E4M3_VALUES.isnan()].unique()  # every finite e4m3 value, sorted


def nearest_e4m3(x: torch.Tensor) -> torch.Tensor:
    """The e4m3 values closest to x (either one at a tie), by search over the whole table."""
    return E4M3_VALUES[(x[..., None] - E4M3_VALUES).abs().argmin(-1)]


def fp8_pool(k_cache, v_cache, heads_scale):
    """A float pool as an fp8 one with per-head scales, and the float64 values it holds."""
    scales = KVScales(heads_scale.clone(), heads_scale.flip(0).clone())
    k8, v8 = quantize(k_cache, scales.k), quantize(v_cache, scales.v)
    return k8, v8, scales, dequantize(k8, scales.k, torch.float64), dequantize(v8, scales.v, torch.float64)


def test_quantize_stores_the_nearest_e4m3_value_of_x_over_its_heads_scale():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(64, 3, 8, generator=gen) * torch.tensor([0.01, 1.0, 30.0])[:, None]
    scale = torch.tensor([0.002, 0.5, 0.25])
    stored = quantize(x, scale).float()
    expected = nearest_e4m3(x / scale[:, None])
    assert torch.equal(stored, expected)
    # and back: within half an e4m3 step (1/16 relative) of x
    back = dequantize(quantize(x, scale), scale, torch.float32)
    normal = (x / scale[:, None]).abs() >= 2 ** -6
    assert ((back - x).abs() <= x.abs() / 16 + 1e-12)[normal].all()


def test_values_beyond_the_scale_range_are_clamped_to_448_never_nan_or_inf():
    scale = torch.tensor([0.5, 2.0])
    x = torch.tensor([[[1e6, -1e6, 300.0, -224.0], [1e30, -1e30, 900.0, 3.0]]])  # [1, 2 heads, 4]
    stored = quantize(x, scale).float()
    assert torch.isfinite(stored).all()
    assert stored.tolist() == [[[448.0, -448.0, 448.0, -448.0], [448.0, -448.0, 448.0, 1.5]]]


def test_calibrated_scales_store_values_up_to_15x_the_calibrated_maximum_unclamped():
    amax = torch.tensor([28.0, 0.0, 2.8])
    scales = scales_from_amax(amax)
    assert scales.tolist() == pytest.approx([1.0, 1.0, 0.1])  # a head never seen keeps 1.0
    x = (amax * 15)[None, :, None]
    back = dequantize(quantize(x, scales), scales, torch.float32)
    assert ((back - x).abs() <= x / 16).all() and (quantize(x, scales).float().abs() < FP8_MAX).all()


def test_torch_backend_stores_quantized_rows_at_their_slots_and_skips_minus_one():
    gen = torch.Generator().manual_seed(1)
    num_blocks, block_size, heads, dim, tokens = 5, 4, 3, 8, 9
    k_cache = torch.randn(num_blocks, block_size, heads, dim, generator=gen).to(FP8_DTYPE)
    v_cache = torch.randn(num_blocks, block_size, heads, dim, generator=gen).to(FP8_DTYPE)
    before = as_bytes(k_cache).clone(), as_bytes(v_cache).clone()
    key, value = torch.randn(tokens, heads, dim, generator=gen) * 40, torch.randn(tokens, heads, dim, generator=gen)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:tokens]
    slots[[0, 5]] = -1
    scales = KVScales(torch.tensor([0.05, 0.1, 1.0]), torch.tensor([1.0, 0.01, 0.3]))

    TorchAttentionBackend().store_kvcache(key, value, k_cache, v_cache, slots, scales)

    kept = slots >= 0
    for cache, old, rows, scale in ((k_cache, before[0], key, scales.k), (v_cache, before[1], value, scales.v)):
        expected = old.flatten(0, 1).clone()
        expected[slots[kept]] = as_bytes(quantize(rows[kept], scale))
        assert torch.equal(as_bytes(cache).flatten(0, 1), expected)


@pytest.mark.parametrize("seqlens_q, seqlens_k", [([5, 17, 1], [5, 17, 1]), ([3, 1, 7], [11, 40, 7]),
                                                  ([1, 1, 1], [9, 1, 30])], ids=["prefill", "prefix", "decode"])
def test_torch_backend_attends_over_the_dequantized_fp8_pool_like_float64(seqlens_q, seqlens_k):
    q, k_cache, v_cache, meta = make_batch(seqlens_q, seqlens_k, num_q_heads=4, num_kv_heads=2, head_dim=16,
                                           block_size=4, seed=len(seqlens_k) + sum(seqlens_k))
    k8, v8, scales, k64, v64 = fp8_pool(k_cache * 20, v_cache, torch.tensor([0.03, 0.2]))
    out = TorchAttentionBackend().forward(q, k8, v8, meta, 0.25, scales)
    assert out.dtype == q.dtype
    assert rel_error(out, reference_attention(q, k64, v64, meta, 0.25)) < 1e-5
    # the scales matter: the same bytes read with other scales give another result
    wrong = KVScales(scales.v, scales.k)
    assert rel_error(TorchAttentionBackend().forward(q, k8, v8, meta, 0.25, wrong),
                     reference_attention(q, k64, v64, meta, 0.25)) > 1e-2


def test_mixed_step_over_an_fp8_pool_matches_float64():
    q, k_cache, v_cache, meta = make_batch([1, 1, 4, 6], [5, 23, 10, 6], num_q_heads=4, num_kv_heads=2,
                                           head_dim=16, block_size=4, seed=9)
    meta.num_decodes = 2
    k8, v8, scales, k64, v64 = fp8_pool(k_cache, v_cache, torch.tensor([1.0, 0.05]))
    out = TorchAttentionBackend().forward(q, k8, v8, meta, 0.25, scales)
    assert rel_error(out, reference_attention(q, k64, v64, meta, 0.25)) < 1e-5


def test_keys_that_overflow_their_scale_are_clamped_and_attention_stays_finite():
    q, k_cache, v_cache, meta = make_batch([6, 1], [6, 9], num_q_heads=2, num_kv_heads=1, head_dim=16,
                                           block_size=4, seed=4)
    k8, v8 = torch.zeros_like(k_cache, dtype=FP8_DTYPE), torch.zeros_like(v_cache, dtype=FP8_DTYPE)
    scales = KVScales(torch.tensor([0.01]), torch.tensor([0.01]))
    backend = TorchAttentionBackend()
    huge = torch.randn(q.shape[0], 1, 16) * 1e5  # 10^7 times the largest storable value
    backend.store_kvcache(huge, huge, k8, v8, meta.slot_mapping, scales)
    assert set(k8.float().flatten(0, 1)[meta.slot_mapping].abs().unique().tolist()) <= {448.0}
    out = backend.forward(q, k8, v8, meta, 0.25, scales)
    assert torch.isfinite(out).all()
