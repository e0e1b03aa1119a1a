"""Paged attention in plain torch: the reference backend, and the one used on CPU.

One step is one batched SDPA call: each sequence's context is gathered from its blocks into a
padded [B, max_seqlen_k] tensor, its queries padded to [B, max_seqlen_q], and a boolean mask
encodes both causality and each sequence's length.
"""
import torch
import torch.nn.functional as F

from kernels.attention_backend import AttentionMetadata


class TorchAttentionBackend:
    name = "torch"

    def store_kvcache(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        """Write token t's K/V into flat slot slot_mapping[t]; slots of -1 are skipped."""
        keep = slot_mapping >= 0
        if not bool(keep.all()):
            key, value, slot_mapping = key[keep], value[keep], slot_mapping[keep]
        heads, dim = k_cache.shape[-2:]
        # view (not reshape) so that a non-contiguous cache fails loudly instead of writing a copy
        k_cache.view(-1, heads, dim).index_copy_(0, slot_mapping, key.to(k_cache.dtype))
        v_cache.view(-1, heads, dim).index_copy_(0, slot_mapping, value.to(v_cache.dtype))

    def forward(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        num_seqs, max_q, max_k = meta.num_seqs, meta.max_seqlen_q, meta.max_seqlen_k
        seqlens_k = meta.seqlens_k.long()
        key, value, key_valid = self._gather_context(k_cache, v_cache, meta)

        # Query slot i of sequence b sits at context position seqlens_k[b] - seqlens_q[b] + i.
        seqlens_q = (meta.cu_seqlens_q[1:] - meta.cu_seqlens_q[:-1]).long()
        slot = torch.arange(max_q, device=q.device)
        q_pos = (seqlens_k - seqlens_q).unsqueeze(1) + slot  # [B, max_q]
        k_pos = torch.arange(max_k, device=q.device)
        mask = (k_pos <= q_pos.unsqueeze(-1)) & key_valid.unsqueeze(1)  # [B, max_q, max_k]

        if max_q == 1:  # decode: one query per sequence, so the batch is already "padded"
            q_padded = q.unsqueeze(1)
        else:
            seq_of_token, slot_of_token = self._token_coordinates(meta, q.shape[0])
            q_padded = q.new_zeros(num_seqs, max_q, *q.shape[1:])
            q_padded[seq_of_token, slot_of_token] = q

        out = F.scaled_dot_product_attention(
            q_padded.transpose(1, 2),  # [B, H_q, max_q, D]
            key.transpose(1, 2),  # [B, H_kv, max_k, D]
            value.transpose(1, 2),
            attn_mask=mask.unsqueeze(1),  # padded query rows still see key 0, so no NaN rows
            scale=scale,
            enable_gqa=True,
        ).transpose(1, 2)  # [B, max_q, H_q, D]

        if max_q == 1:
            return out.squeeze(1)
        return out[seq_of_token, slot_of_token]

    @staticmethod
    def _gather_context(k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata):
        """Each sequence's K/V as [B, max_seqlen_k, H_kv, D] and its validity mask [B, max_seqlen_k].

        Positions past a sequence's length come from padding or stale slots; they are zeroed
        so that garbage in an uninitialised pool (even NaN) cannot leak through 0 * NaN.
        """
        max_k, block_size = meta.max_seqlen_k, meta.block_size
        num_blocks = -(-max_k // block_size)
        block_tables = meta.block_tables[:, :num_blocks].long()
        key = k_cache[block_tables].flatten(1, 2)[:, :max_k]
        value = v_cache[block_tables].flatten(1, 2)[:, :max_k]
        valid = torch.arange(max_k, device=key.device) < meta.seqlens_k.long().unsqueeze(1)
        keep = valid[:, :, None, None]
        return torch.where(keep, key, 0), torch.where(keep, value, 0), valid

    @staticmethod
    def _token_coordinates(meta: AttentionMetadata, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(sequence index, slot within the sequence's queries) of each packed query token."""
        cu = meta.cu_seqlens_q.long()
        seqlens_q = cu[1:] - cu[:-1]
        seq_of_token = torch.repeat_interleave(
            torch.arange(meta.num_seqs, device=cu.device), seqlens_q, output_size=num_tokens
        )
        slot_of_token = torch.arange(num_tokens, device=cu.device) - cu[seq_of_token]
        return seq_of_token, slot_of_token
