"""The flash-attn backend: FlashAttention-2's varlen and kvcache entry points over the paged pool.

Used when `flash_attn` imports. FlashAttention-2 reads a paged cache only when a page holds a
multiple of 256 tokens, so this backend needs --block-size 256 (or 512, ...); with smaller blocks
`auto` picks the Triton backend instead. K/V are written by the Triton store_kvcache kernel. It reads
no fp8 pool (FlashAttention-2 has no fp8 paged path): with --kv-cache-dtype fp8, `auto` picks Triton.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.attention.base import AttentionCapabilities, AttentionMetadata
from kernels.attention.names import FLASH_ATTN

FLASH_PAGE_MULTIPLE = 256


class FlashAttentionBackend:
    name = FLASH_ATTN
    # its K/V store is the Triton kernel, which is graph-safe; q/k norm and RoPE stay unfused here
    capabilities = AttentionCapabilities(fused_norm_rope_store=False, cuda_graph_safe=True,
                                         block_size_multiple=FLASH_PAGE_MULTIPLE)

    def __init__(self) -> None:
        from flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache

        from kernels.attention.triton_kv_store import store_kvcache

        self._varlen = flash_attn_varlen_func
        self._kvcache = flash_attn_with_kvcache
        self._store = store_kvcache

    def store_kvcache(self, key, value, k_cache, v_cache, slot_mapping, kv_scales=None) -> None:
        self._store(key, value, k_cache, v_cache, slot_mapping)

    def forward(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float, kv_scales=None) -> torch.Tensor:
        if not self.capabilities.supports_block_size(meta.block_size):
            raise ValueError(f"flash_attn needs a block size that is a multiple of {FLASH_PAGE_MULTIPLE}, "
                             f"got {meta.block_size}; use --attention-backend triton")
        if meta.is_decode:
            out = self._kvcache(q.unsqueeze(1), k_cache, v_cache, cache_seqlens=meta.seqlens_k,
                                block_table=meta.block_tables, softmax_scale=scale, causal=True)
            return out.squeeze(1)
        cu_seqlens_k = F.pad(torch.cumsum(meta.seqlens_k, 0, dtype=torch.int32), (1, 0))
        return self._varlen(q, k_cache, v_cache, cu_seqlens_q=meta.cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                            max_seqlen_q=meta.max_seqlen_q, max_seqlen_k=meta.max_seqlen_k,
                            softmax_scale=scale, causal=True, block_table=meta.block_tables)
