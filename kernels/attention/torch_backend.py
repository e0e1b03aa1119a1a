"""Paged attention in plain torch: the reference backend, and the one used on CPU.

One step is one batched SDPA call: each sequence's context is gathered from its blocks into a
padded [B, max_seqlen_k] tensor, its queries padded to [B, max_seqlen_q], and a boolean mask
encodes both causality and each sequence's length.

An fp8 pool is written as kernels/kv_quant.py quantizes and read back through its dequantize, so the
whole engine runs with --kv-cache-dtype fp8 on the CPU too.
"""
import torch
import torch.nn.functional as F

from kernels.attention.base import AttentionCapabilities, AttentionMetadata
from kernels.attention.names import TORCH
from kernels.kv_quant import QUANTIZED_DTYPES, KVScales, as_bytes, dequantize, is_quantized, quantize


class TorchAttentionBackend:
    name = TORCH
    # store_kvcache asks the host whether any slot is -1, a sync no CUDA graph can capture
    capabilities = AttentionCapabilities(fused_norm_rope_store=False, cuda_graph_safe=False,
                                         quantized_kv_dtypes=QUANTIZED_DTYPES)

    def store_kvcache(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        kv_scales: KVScales | None = None,
    ) -> None:
        """Write token t's K/V into flat slot slot_mapping[t]; slots of -1 are skipped."""
        keep = slot_mapping >= 0
        if not bool(keep.all()):
            key, value, slot_mapping = key[keep], value[keep], slot_mapping[keep]
        heads, dim = k_cache.shape[-2:]
        if is_quantized(k_cache):
            key, value = quantize(key, kv_scales.k, k_cache.dtype), quantize(value, kv_scales.v, v_cache.dtype)
        # view (not reshape) so that a non-contiguous cache fails loudly instead of writing a copy
        as_bytes(k_cache).view(-1, heads, dim).index_copy_(0, slot_mapping, as_bytes(key.to(k_cache.dtype)))
        as_bytes(v_cache).view(-1, heads, dim).index_copy_(0, slot_mapping, as_bytes(value.to(v_cache.dtype)))

    def forward(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        kv_scales: KVScales | None = None,
    ) -> torch.Tensor:
        if not meta.is_mixed:
            return self._attend(q, k_cache, v_cache, meta, scale, kv_scales)
        # padded to the longest chunk, each one-token row would cost as much as that chunk
        d = meta.num_decodes
        out = torch.empty_like(q)
        out[:d] = self._attend(q[:d], k_cache, v_cache, meta.decode_part, scale, kv_scales)
        out[d:] = self._attend(q[d:], k_cache, v_cache, meta.prefill_part, scale, kv_scales)
        return out

    def _attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                scale: float, kv_scales: KVScales | None) -> torch.Tensor:
        """One batched SDPA over meta's sequences, whose tokens are q (cu_seqlens_q may start past 0)."""
        num_seqs, max_q, max_k = meta.num_seqs, meta.max_seqlen_q, meta.max_seqlen_k
        num_kv_heads = k_cache.shape[2]
        key, value = self._gather_context(k_cache, v_cache, meta, kv_scales, q.dtype)  # [B, H_kv, max_k, D]
        k_pos = torch.arange(max_k, device=q.device)
        key_valid = k_pos < meta.seqlens_k.long().unsqueeze(1)  # [B, max_k]

        if max_q == 1:
            # Decode: every query sees its whole context, so the query heads sharing a KV head can
            # stand in for a query length of H_q / H_kv, and one mask row serves them all.
            out = F.scaled_dot_product_attention(
                q.reshape(num_seqs, num_kv_heads, -1, q.shape[-1]),
                key,
                value,
                attn_mask=key_valid[:, None, None, :],
                scale=scale,
            )
            return out.reshape(q.shape)

        # Query slot i of sequence b sits at context position seqlens_k[b] - seqlens_q[b] + i.
        seq_of_token, slot_of_token, seqlens_q = self._token_coordinates(meta, q.shape[0])
        q_pos = (meta.seqlens_k.long() - seqlens_q).unsqueeze(1) + torch.arange(max_q, device=q.device)
        # padded query rows (q_pos past the end) still see key 0, so no row is fully masked
        mask = (k_pos <= q_pos.unsqueeze(-1)) & key_valid.unsqueeze(1)  # [B, max_q, max_k]
        q_padded = q.new_zeros(num_seqs, max_q, *q.shape[1:])
        q_padded[seq_of_token, slot_of_token] = q
        out = F.scaled_dot_product_attention(
            q_padded.transpose(1, 2),  # [B, H_q, max_q, D]
            key,
            value,
            attn_mask=mask.unsqueeze(1),
            scale=scale,
            enable_gqa=True,
        )
        return out.transpose(1, 2)[seq_of_token, slot_of_token]

    @staticmethod
    def _gather_context(k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                        kv_scales: KVScales | None, dtype: torch.dtype):
        """Each sequence's K and V, [B, H_kv, max_seqlen_k, D], read through its block table (and
        dequantized to `dtype` from a quantized pool).

        Positions past a sequence's length hold stale or padding slots, which the mask hides.
        That is exact only if they are finite (0 * NaN is NaN), so the pool must be allocated
        with torch.zeros, never torch.empty.
        """
        num_blocks = -(-meta.max_seqlen_k // meta.block_size)
        flat_ids = meta.block_tables[:, :num_blocks].reshape(-1).long()
        # index_select copies whole blocks at memcpy speed; advanced indexing took twice as long on the CPU
        shape = (meta.num_seqs, num_blocks * meta.block_size, *k_cache.shape[2:])
        key = as_bytes(k_cache).index_select(0, flat_ids).view(k_cache.dtype).view(shape)[:, : meta.max_seqlen_k]
        value = as_bytes(v_cache).index_select(0, flat_ids).view(v_cache.dtype).view(shape)[:, : meta.max_seqlen_k]
        if is_quantized(k_cache):
            key, value = dequantize(key, kv_scales.k, dtype), dequantize(value, kv_scales.v, dtype)
        return key.transpose(1, 2), value.transpose(1, 2)

    @staticmethod
    def _token_coordinates(meta: AttentionMetadata, num_tokens: int):
        """Each packed query token's (sequence, slot among that sequence's queries), and seqlens_q.
        Token 0 is the one at offset cu_seqlens_q[0] (a mixed step's prefill part starts past 0)."""
        cu = meta.cu_seqlens_q.long()
        cu = cu - cu[0]
        seqlens_q = cu[1:] - cu[:-1]
        seq_of_token = torch.repeat_interleave(
            torch.arange(meta.num_seqs, device=cu.device), seqlens_q, output_size=num_tokens
        )
        slot_of_token = torch.arange(num_tokens, device=cu.device) - cu[seq_of_token]
        return seq_of_token, slot_of_token, seqlens_q
