"""The fp8 KV cache's Hadamard rotation of K and q (kernels/kv_rotation.py, --kv-cache-rotation): H is
orthogonal, so attention over rotated q and K equals attention over the originals; the attention layer
rotates K before the fp8 store and q before attending, which equals a float64 attention over the
rotated, quantized K; and where a few channels dominate q.k, rotating first makes fp8's error smaller."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from executor_svc.layers.attention import Attention
from executor_svc.layers.rotary import RotaryEmbedding
from kernels.attention.torch_backend import TorchAttentionBackend
from kernels.kv_quant import FP8_DTYPE, KVScales, dequantize, quantize
from kernels.kv_rotation import hadamard_matrix, rotate
from support.paged_batches import make_batch, reference_attention, rel_error


@pytest.mark.parametrize("dim", [1, 2, 16, 64, 128])
def test_the_hadamard_matrix_is_symmetric_orthogonal_with_entries_of_one_over_root_d(dim):
    h = hadamard_matrix(dim, torch.float64)
    assert torch.equal(h, h.T)
    torch.testing.assert_close(h @ h.T, torch.eye(dim, dtype=torch.float64), rtol=0, atol=1e-14)
    torch.testing.assert_close(h.abs(), torch.full((dim, dim), dim ** -0.5, dtype=torch.float64), rtol=1e-15, atol=0)


@pytest.mark.parametrize("dim", [0, 3, 48, 192])
def test_a_head_dim_that_is_not_a_power_of_two_is_refused(dim):
    with pytest.raises(ValueError, match="power-of-two"):
        hadamard_matrix(dim)


@settings(max_examples=25, deadline=None)
@given(seqlens=st.lists(st.tuples(st.integers(1, 9), st.integers(0, 12)), min_size=1, max_size=4),
       log_dim=st.integers(2, 6), seed=st.integers(0, 2 ** 16))
def test_attention_over_rotated_q_and_k_equals_attention_over_the_originals(seqlens, log_dim, seed):
    seqlens_q = [q for q, _ in seqlens]
    seqlens_k = [q + prefix for q, prefix in seqlens]
    dim = 2 ** log_dim
    q, k_cache, v_cache, meta = make_batch(seqlens_q, seqlens_k, num_q_heads=4, num_kv_heads=2, head_dim=dim,
                                           block_size=4, dtype=torch.float64, seed=seed)
    h = hadamard_matrix(dim, torch.float64)
    plain = TorchAttentionBackend().forward(q, k_cache, v_cache, meta, dim ** -0.5)
    rotated = TorchAttentionBackend().forward(rotate(q, h), rotate(k_cache, h), v_cache, meta, dim ** -0.5)
    assert rel_error(rotated, plain.double()) < 1e-12


def attention_layer(num_heads, num_kv_heads, dim, num_blocks, block_size, rotation, scales, backend=None,
                    device="cpu"):
    """An attention layer over an fp8 pool of its own, the torch backend unless told."""
    layer = Attention(num_heads, dim, dim ** -0.5, num_kv_heads)
    layer.backend = backend or TorchAttentionBackend()
    layer.k_cache = torch.zeros(num_blocks, block_size, num_kv_heads, dim, dtype=FP8_DTYPE, device=device)
    layer.v_cache = torch.zeros_like(layer.k_cache)
    layer.kv_scales, layer.kv_rotation = scales, rotation
    return layer


def outlier_qkv(tokens, num_heads, num_kv_heads, dim, gen):
    """q, k, v [T, H, D] float32 whose K has four channels 20 times the others, as real models' K has."""
    q = torch.randn(tokens, num_heads, dim, generator=gen)
    k = torch.randn(tokens, num_kv_heads, dim, generator=gen)
    k[..., :4] *= 20
    return q, k, torch.randn(tokens, num_kv_heads, dim, generator=gen)


@pytest.mark.parametrize("seqlens_q, seqlens_k", [([7, 1, 12], [7, 1, 12]), ([1, 1], [1, 1])],
                         ids=["prefill", "one-token"])
def test_the_layer_stores_rotated_fp8_keys_and_attends_like_float64_over_them(seqlens_q, seqlens_k):
    heads, kv_heads, dim, block_size = 4, 2, 16, 4
    _, _, _, meta = make_batch(seqlens_q, seqlens_k, num_q_heads=heads, num_kv_heads=kv_heads, head_dim=dim,
                               block_size=block_size, seed=5)
    num_blocks = int(meta.block_tables.max()) + 1
    q, k, v = outlier_qkv(sum(seqlens_q), heads, kv_heads, dim, torch.Generator().manual_seed(6))
    positions = torch.cat([torch.arange(n) for n in seqlens_q])
    rope = RotaryEmbedding(dim, 64, 10000.0)
    scales = KVScales(torch.tensor([0.05, 0.02]), torch.tensor([0.01, 0.03]))
    h = hadamard_matrix(dim)
    layer = attention_layer(heads, kv_heads, dim, num_blocks, block_size, h, scales)

    out = layer(positions, q.clone(), k.clone(), v.flatten(1), meta, rope)

    # float64: RoPE, then H, on q and k; K and V quantized as the pool stores them
    cos, sin = rope.cos[positions].double()[:, None], rope.sin[positions].double()[:, None]

    def rope64(x):
        x1, x2 = x.double().chunk(2, -1)
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)

    h64 = h.double()
    k8, v8 = quantize(rope64(k) @ h64, scales.k), quantize(v, scales.v)
    slots = meta.slot_mapping
    assert torch.equal(layer.k_cache.view(torch.uint8).flatten(0, 1)[slots], k8.view(torch.uint8))
    k_pool, v_pool = torch.zeros(num_blocks * block_size, kv_heads, dim, dtype=torch.float64), \
        torch.zeros(num_blocks * block_size, kv_heads, dim, dtype=torch.float64)
    k_pool[slots], v_pool[slots] = dequantize(k8, scales.k, torch.float64), dequantize(v8, scales.v, torch.float64)
    shape = (num_blocks, block_size, kv_heads, dim)
    expected = reference_attention(rope64(q) @ h64, k_pool.view(shape), v_pool.view(shape), meta, dim ** -0.5)
    assert rel_error(out.view(-1, heads, dim), expected) < 1e-5


def fp8_logit_error(q, k, h):
    """The relative error of the logits q.k over fp8 K stored after rotating both by h (None: as they come)."""
    if h is not None:
        q, k = q @ h, k @ h
    scale = k.abs().amax() / 448 * 16
    k8 = dequantize(quantize(k[:, None], scale[None]), scale[None], torch.float64)[:, 0]
    exact = q.double() @ k.double().T
    return ((q.double() @ k8.T - exact).norm() / exact.norm()).item()


def test_rotating_first_shrinks_the_fp8_error_of_q_dot_k_when_a_few_channels_dominate():
    gen = torch.Generator().manual_seed(7)
    q, k, _ = outlier_qkv(256, 1, 1, 64, gen)
    q, k = q[:, 0], k[:, 0]
    q[:, :4] *= 5  # the queries lean on the same channels, so their logits are the outliers' products
    plain, rotated = fp8_logit_error(q, k, None), fp8_logit_error(q, k, hadamard_matrix(64))
    assert rotated < plain / 2, (plain, rotated)
