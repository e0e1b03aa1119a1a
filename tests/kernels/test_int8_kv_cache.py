"""The int8 KV cache's format (kernels/kv_quant.py) and the torch backend over an int8 pool: values are
stored as x / scale rounded to the nearest integer (ties away from zero) with a scale per KV head and
channel, anything beyond +-127 is clamped (never wrapped), and attention over the pool equals a float64
attention over the dequantized values."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kernels.attention.torch_backend import TorchAttentionBackend
from kernels.kv_quant import INT8_DTYPE, INT8_MAX, KVScales, dequantize, quantize, round_half_away, scales_from_amax
from support.paged_batches import make_batch, reference_attention, rel_error

finite = st.floats(min_value=-1e30, max_value=1e30, allow_nan=False, allow_infinity=False)


@settings(max_examples=60, deadline=None)
@given(values=st.lists(finite, min_size=8, max_size=8),
       scales=st.lists(st.floats(min_value=1e-6, max_value=1e3), min_size=8, max_size=8))
def test_a_stored_value_is_within_half_a_step_of_x_or_clamped_to_127_never_wrapped(values, scales):
    x = torch.tensor(values).view(1, 2, 4)  # [token, KV heads, channels]
    scale = torch.tensor(scales).view(2, 4)
    stored = quantize(x, scale, INT8_DTYPE)
    assert stored.dtype == INT8_DTYPE and stored.abs().max() <= INT8_MAX
    y = x.double() / scale.double()
    inside = y.abs() <= INT8_MAX
    back = dequantize(stored, scale, torch.float64)
    # within half a step (plus float32's rounding of x / scale, which the store divides in)
    assert ((back - x.double()).abs() <= scale.double() * (0.5 + 1e-4))[inside].all()
    assert torch.equal(stored[~inside].sign(), y[~inside].sign().to(INT8_DTYPE))  # the sign of x, at +-127
    assert (stored[~inside].abs() == INT8_MAX).all()


def test_rounding_is_half_away_from_zero_as_the_kernels_round():
    y = torch.tensor([0.5, 1.5, 2.5, -0.5, -1.5, 0.49, -2.51])
    assert round_half_away(y).tolist() == [1.0, 2.0, 3.0, -1.0, -2.0, 0.0, -3.0]


def test_calibrated_scales_store_the_calibrated_maximum_at_127_over_the_headroom():
    amax = torch.tensor([[12.7, 0.0], [1.5, 0.3]])  # [KV heads, channels]
    scales = scales_from_amax(amax, INT8_DTYPE)
    assert scales.flatten().tolist() == pytest.approx([0.15, 1.0, 1.5 * 1.5 / 127, 0.3 * 1.5 / 127])  # unseen: 1.0
    stored = quantize(amax[None], scales, INT8_DTYPE)
    assert stored[0, 0, 0] == round(127 / 1.5) and stored[0, 1, 1] == round(127 / 1.5)


def int8_pool(k_cache, v_cache, gen):
    """A float pool as an int8 one with a scale per head and channel, and the float64 values it holds."""
    heads, dim = k_cache.shape[-2:]
    scales = KVScales(0.01 + 0.2 * torch.rand(heads, dim, generator=gen),
                      0.005 + 0.05 * torch.rand(heads, dim, generator=gen))
    k8, v8 = quantize(k_cache, scales.k, INT8_DTYPE), quantize(v_cache, scales.v, INT8_DTYPE)
    return k8, v8, scales, dequantize(k8, scales.k, torch.float64), dequantize(v8, scales.v, torch.float64)


def test_torch_backend_stores_quantized_rows_at_their_slots_and_skips_minus_one():
    gen = torch.Generator().manual_seed(1)
    num_blocks, block_size, heads, dim, tokens = 5, 4, 3, 8, 9
    k_cache = torch.randint(-127, 128, (num_blocks, block_size, heads, dim), generator=gen, dtype=INT8_DTYPE)
    v_cache = torch.randint(-127, 128, (num_blocks, block_size, heads, dim), generator=gen, dtype=INT8_DTYPE)
    before = k_cache.clone(), v_cache.clone()
    key, value = torch.randn(tokens, heads, dim, generator=gen) * 4, torch.randn(tokens, heads, dim, generator=gen)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:tokens]
    slots[[0, 5]] = -1
    scales = KVScales(0.01 + torch.rand(heads, dim, generator=gen) * 0.05,
                      0.01 + torch.rand(heads, dim, generator=gen) * 0.02)

    TorchAttentionBackend().store_kvcache(key, value, k_cache, v_cache, slots, scales)

    kept = slots >= 0
    for cache, old, rows, scale in ((k_cache, before[0], key, scales.k), (v_cache, before[1], value, scales.v)):
        expected = old.flatten(0, 1).clone()
        expected[slots[kept]] = quantize(rows[kept], scale, INT8_DTYPE)
        assert torch.equal(cache.flatten(0, 1), expected)


@pytest.mark.parametrize("seqlens_q, seqlens_k", [([5, 17, 1], [5, 17, 1]), ([3, 1, 7], [11, 40, 7]),
                                                  ([1, 1, 1], [9, 1, 30])], ids=["prefill", "prefix", "decode"])
def test_torch_backend_attends_over_the_dequantized_int8_pool_like_float64(seqlens_q, seqlens_k):
    q, k_cache, v_cache, meta = make_batch(seqlens_q, seqlens_k, num_q_heads=4, num_kv_heads=2, head_dim=16,
                                           block_size=4, seed=len(seqlens_k) + sum(seqlens_k))
    gen = torch.Generator().manual_seed(sum(seqlens_q))
    k8, v8, scales, k64, v64 = int8_pool(k_cache * 5, v_cache, gen)
    out = TorchAttentionBackend().forward(q, k8, v8, meta, 0.25, scales)
    assert out.dtype == q.dtype
    assert rel_error(out, reference_attention(q, k64, v64, meta, 0.25)) < 1e-5
    # the per-channel scales matter: the same bytes read with each head's mean scale give another result
    flat = KVScales(*(s.mean(1, keepdim=True).expand_as(s) for s in (scales.k, scales.v)))
    assert rel_error(TorchAttentionBackend().forward(q, k8, v8, meta, 0.25, flat),
                     reference_attention(q, k64, v64, meta, 0.25)) > 1e-2


def test_keys_that_overflow_their_scale_are_clamped_and_attention_stays_finite():
    q, k_cache, v_cache, meta = make_batch([6, 1], [6, 9], num_q_heads=2, num_kv_heads=1, head_dim=16,
                                           block_size=4, seed=4)
    k8, v8 = torch.zeros_like(k_cache, dtype=INT8_DTYPE), torch.zeros_like(v_cache, dtype=INT8_DTYPE)
    scales = KVScales(torch.full((1, 16), 0.01), torch.full((1, 16), 0.01))
    backend = TorchAttentionBackend()
    huge = torch.randn(q.shape[0], 1, 16) * 1e5  # 10^5 times the largest storable value
    backend.store_kvcache(huge, huge, k8, v8, meta.slot_mapping, scales)
    assert set(k8.flatten(0, 1)[meta.slot_mapping].abs().unique().tolist()) <= {127}
    out = backend.forward(q, k8, v8, meta, 0.25, scales)
    assert torch.isfinite(out).all()
