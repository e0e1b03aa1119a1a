"""Random paged batches (q and a pool whose blocks are shuffled across sequences) and the float64
dense attention they must give: shared by the attention-kernel tests of every backend."""
from __future__ import annotations

import torch

from kernels.attention.base import AttentionMetadata


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def make_batch(seqlens_q, seqlens_k, *, num_q_heads, num_kv_heads, head_dim, block_size, dtype=torch.float32,
               device="cpu", seed=0):
    """Random q and caches; each sequence's blocks are a shuffled, non-contiguous pick of the pool."""
    gen = torch.Generator().manual_seed(seed)
    num_seqs = len(seqlens_k)
    blocks_needed = [cdiv(k, block_size) for k in seqlens_k]
    num_blocks = sum(blocks_needed) + 3  # spare blocks that no table points to
    order = torch.randperm(num_blocks, generator=gen)
    block_tables = torch.zeros(num_seqs, max(max(blocks_needed), 1), dtype=torch.int32)
    used = 0
    for i, n in enumerate(blocks_needed):
        block_tables[i, :n] = order[used:used + n].to(torch.int32)
        used += n
    # Slots of each sequence's new tokens: the last seqlens_q positions of its context.
    slots = []
    for i, (nq, nk) in enumerate(zip(seqlens_q, seqlens_k)):
        pos = torch.arange(nk - nq, nk)
        slots.append(block_tables[i, pos // block_size].long() * block_size + pos % block_size)
    cache_shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(cache_shape, generator=gen).to(dtype)
    v_cache = torch.randn(cache_shape, generator=gen).to(dtype)
    q = torch.randn(sum(seqlens_q), num_q_heads, head_dim, generator=gen).to(dtype)
    cu_seqlens_q = torch.tensor([0] + torch.tensor(seqlens_q).cumsum(0).tolist(), dtype=torch.int32)
    meta = AttentionMetadata(
        slot_mapping=torch.cat(slots) if slots else torch.zeros(0, dtype=torch.int64),
        cu_seqlens_q=cu_seqlens_q.to(device),
        seqlens_k=torch.tensor(seqlens_k, dtype=torch.int32, device=device),
        block_tables=block_tables.to(device),
        max_seqlen_q=max(seqlens_q),
        max_seqlen_k=max(seqlens_k),
        block_size=block_size,
    )
    meta.slot_mapping = meta.slot_mapping.to(device)
    return q.to(device), k_cache.to(device), v_cache.to(device), meta


def reference_attention(q, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """Dense causal attention in float64: gather each context from its blocks, mask, softmax."""
    num_q_heads, num_kv_heads = q.shape[1], k_cache.shape[2]
    cu = meta.cu_seqlens_q.tolist()
    out = torch.zeros(q.shape, dtype=torch.float64, device=q.device)
    for i, nk in enumerate(meta.seqlens_k.tolist()):
        nq = cu[i + 1] - cu[i]
        if nq == 0 or nk == 0:
            continue
        blocks = meta.block_tables[i, :cdiv(nk, meta.block_size)].long()
        k = k_cache[blocks].flatten(0, 1)[:nk].double().repeat_interleave(num_q_heads // num_kv_heads, dim=1)
        v = v_cache[blocks].flatten(0, 1)[:nk].double().repeat_interleave(num_q_heads // num_kv_heads, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q[cu[i]:cu[i + 1]].double(), k) * scale
        # Query r sits at context position nk - nq + r and sees keys up to it.
        visible = torch.arange(nk, device=q.device)[None, :] <= (nk - nq + torch.arange(nq, device=q.device))[:, None]
        scores = scores.masked_fill(~visible, float("-inf"))
        out[cu[i]:cu[i + 1]] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)
    return out


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref).norm() / ref.norm()).item()
