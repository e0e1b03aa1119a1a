"""The torch paged-attention backend equals dense causal attention computed in float64."""
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kernels.attention.base import AttentionMetadata
from kernels.attention.torch_backend import TorchAttentionBackend


def make_paged_case(q_lens, k_lens, num_heads, num_kv_heads, head_dim, block_size, seed, dtype=torch.float32):
    """Random q, a random pool, and scattered block tables; returns (q, k_cache, v_cache, meta)."""
    gen = torch.Generator().manual_seed(seed)
    blocks_needed = [-(-k // block_size) for k in k_lens]
    num_blocks = sum(blocks_needed) + 3
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen, dtype=dtype)
    v_cache = torch.randn(shape, generator=gen, dtype=dtype)
    order = torch.randperm(num_blocks, generator=gen).tolist()
    width = max(blocks_needed) + 1  # one padding column more than needed
    tables = torch.zeros(len(k_lens), width, dtype=torch.int32)
    for i, n in enumerate(blocks_needed):
        tables[i, :n] = torch.tensor([order.pop() for _ in range(n)])
    q = torch.randn(sum(q_lens), num_heads, head_dim, generator=gen, dtype=dtype)
    meta = AttentionMetadata(
        slot_mapping=torch.full((sum(q_lens),), -1, dtype=torch.int64),
        cu_seqlens_q=torch.tensor([0] + list(q_lens)).cumsum(0).to(torch.int32),
        seqlens_k=torch.tensor(k_lens, dtype=torch.int32),
        block_tables=tables,
        max_seqlen_q=max(q_lens),
        max_seqlen_k=max(k_lens),
        block_size=block_size,
    )
    return q, k_cache, v_cache, meta


def dense_reference(q, k_cache, v_cache, meta, scale):
    """Per sequence: contiguous context from its blocks, causal attention in float64."""
    out = []
    cu = meta.cu_seqlens_q.tolist()
    group = q.shape[1] // k_cache.shape[2]
    for i, k_len in enumerate(meta.seqlens_k.tolist()):
        blocks = meta.block_tables[i].long()
        key = k_cache[blocks].flatten(0, 1)[:k_len].double().repeat_interleave(group, dim=1)  # [K, H, D]
        value = v_cache[blocks].flatten(0, 1)[:k_len].double().repeat_interleave(group, dim=1)
        qi = q[cu[i] : cu[i + 1]].double()  # [Q, H, D]
        q_pos = torch.arange(k_len - qi.shape[0], k_len)
        scores = torch.einsum("qhd,khd->hqk", qi, key) * scale
        scores.masked_fill_(torch.arange(k_len)[None, None, :] > q_pos[None, :, None], float("-inf"))
        out.append(torch.einsum("hqk,khd->qhd", scores.softmax(-1), value))
    return torch.cat(out)


@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize(
    "q_lens,k_lens",
    [
        ([5, 1, 12, 3], [5, 9, 30, 3]),  # prefill, decode, chunk after a prefix, prefill
        ([1, 1, 1], [1, 17, 40]),  # decode only
        ([7], [7]),  # one prefill
    ],
)
def test_paged_attention_matches_dense_float64_reference(block_size, q_lens, k_lens):
    q, k_cache, v_cache, meta = make_paged_case(q_lens, k_lens, 6, 2, 24, block_size, seed=block_size)
    scale = 1 / math.sqrt(24)
    out = TorchAttentionBackend().forward(q, k_cache, v_cache, meta, scale)
    assert out.shape == q.shape and out.dtype == q.dtype
    torch.testing.assert_close(out.double(), dense_reference(q, k_cache, v_cache, meta, scale), atol=2e-5, rtol=1e-5)


@settings(max_examples=25, deadline=None)
@given(
    seqs=st.lists(st.tuples(st.one_of(st.just(1), st.integers(1, 20)), st.integers(0, 20)), min_size=1, max_size=4),
    heads=st.sampled_from([(4, 4), (4, 2), (6, 1)]),
    head_dim=st.sampled_from([8, 24]),
    block_size=st.sampled_from([1, 4, 16]),
    seed=st.integers(0, 2**16),
    split_mixed=st.booleans(),
)
def test_paged_attention_in_float64_is_exact_for_any_lengths(seqs, heads, head_dim, block_size, seed, split_mixed):
    if split_mixed:  # one-token sequences first, attended apart from the rest (AttentionMetadata.num_decodes)
        seqs = sorted(seqs, key=lambda s: s[0] != 1)
    q_lens = [q for q, _ in seqs]
    k_lens = [q + prefix for q, prefix in seqs]
    q, k_cache, v_cache, meta = make_paged_case(q_lens, k_lens, *heads, head_dim, block_size, seed, torch.float64)
    if split_mixed:
        meta.num_decodes = next((i for i, n in enumerate(q_lens) if n != 1), len(q_lens))
    out = TorchAttentionBackend().forward(q, k_cache, v_cache, meta, 0.3)
    torch.testing.assert_close(out, dense_reference(q, k_cache, v_cache, meta, 0.3), atol=1e-10, rtol=1e-10)


def test_mixed_step_attends_to_its_one_token_rows_apart_and_gets_the_same_output():
    q, k_cache, v_cache, meta = make_paged_case([1, 1, 1, 9, 4], [30, 2, 17, 9, 12], 6, 2, 8, 4, seed=1)
    whole = TorchAttentionBackend().forward(q, k_cache, v_cache, meta, 0.4)
    meta.num_decodes = 3
    assert meta.is_mixed
    split = TorchAttentionBackend().forward(q, k_cache, v_cache, meta, 0.4)
    torch.testing.assert_close(split, whole, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(split.double(), dense_reference(q, k_cache, v_cache, meta, 0.4), atol=2e-5, rtol=1e-5)


def test_stale_slots_outside_each_context_do_not_leak_into_the_output():
    q, k_cache, v_cache, meta = make_paged_case([3, 1], [6, 10], 4, 2, 8, 4, seed=0)
    reference = dense_reference(q, k_cache, v_cache, meta, 0.5)
    in_use = torch.zeros(k_cache.shape[:2], dtype=torch.bool)
    for i, k_len in enumerate(meta.seqlens_k.tolist()):
        for pos in range(k_len):
            in_use[meta.block_tables[i, pos // 4], pos % 4] = True
    # Stale data from earlier owners of a block (finite: the pool is allocated with torch.zeros)
    k_cache[~in_use] = 1e4
    v_cache[~in_use] = -1e4
    out = TorchAttentionBackend().forward(q, k_cache, v_cache, meta, 0.5)
    torch.testing.assert_close(out.double(), reference, atol=2e-5, rtol=1e-5)


def test_store_kvcache_writes_each_token_at_its_slot_and_skips_minus_one():
    gen = torch.Generator().manual_seed(0)
    k_cache, v_cache = torch.randn(5, 4, 2, 8, generator=gen), torch.randn(5, 4, 2, 8, generator=gen)
    k_before, v_before = k_cache.clone(), v_cache.clone()
    key, value = torch.randn(4, 2, 8, generator=gen), torch.randn(4, 2, 8, generator=gen)
    slot_mapping = torch.tensor([13, -1, 2, 19])
    TorchAttentionBackend().store_kvcache(key, value, k_cache, v_cache, slot_mapping)
    expected_k, expected_v = k_before.view(20, 2, 8).clone(), v_before.view(20, 2, 8).clone()
    expected_k[[13, 2, 19]] = key[[0, 2, 3]]
    expected_v[[13, 2, 19]] = value[[0, 2, 3]]
    assert torch.equal(k_cache.view(20, 2, 8), expected_k)
    assert torch.equal(v_cache.view(20, 2, 8), expected_v)


def test_store_kvcache_into_a_layer_slice_of_the_pool_touches_only_that_layer():
    pool = torch.randn(2, 3, 5, 4, 2, 8)  # [k/v, layers, blocks, block_size, H_kv, D]
    before = pool.clone()
    key, value = torch.randn(2, 2, 8), torch.randn(2, 2, 8)
    TorchAttentionBackend().store_kvcache(key, value, pool[0, 1], pool[1, 1], torch.tensor([0, 7]))
    assert torch.equal(pool[0, 1].view(20, 2, 8)[[0, 7]], key)
    assert torch.equal(pool[1, 1].view(20, 2, 8)[[0, 7]], value)
    changed = (pool != before).flatten(2).any(-1)
    assert not changed[:, [0, 2]].any()
