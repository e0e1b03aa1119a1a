"""The attention-backend interface every implementation (torch, triton, flash_attn) follows.

Shapes, with T = tokens in the step, B = sequences in the step:
  q                 [T, H_q, D]
  key, value        [T, H_kv, D]               (the new tokens' K/V, written by store_kvcache)
  k_cache, v_cache  [N, block_size, H_kv, D]   (one layer's slice of the KV pool)
  output            [T, H_q, D]
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass
class AttentionMetadata:
    """Where each step's tokens live in the paged KV pool.

    Sequence i owns query tokens cu_seqlens_q[i]:cu_seqlens_q[i+1]; they are the *last*
    seqlens_q[i] tokens of its context of seqlens_k[i] tokens, so a cached prefix or an earlier
    prefill chunk gives seqlens_k[i] > seqlens_q[i]. Attention is causal within the context.
    """

    slot_mapping: torch.Tensor  # int64 [T]: block_id * block_size + offset; -1 means do not store
    cu_seqlens_q: torch.Tensor  # int32 [B + 1]: prefix sums of query lengths
    seqlens_k: torch.Tensor  # int32 [B]: context length of each sequence, new tokens included
    block_tables: torch.Tensor  # int32 [B, max_blocks]: padded with 0 beyond each table's end
    max_seqlen_q: int  # max query length in the step (host int)
    max_seqlen_k: int  # max context length in the step (host int)
    block_size: int  # tokens per block
    # int32 [num_decodes]: the order in which decode programs take the one-token sequences, longest
    # context first, so a ragged batch does not end on a tail of long programs; None is batch order
    decode_order: torch.Tensor | None = None
    # the first num_decodes sequences bring one query token each (tokens 0..num_decodes-1). A mixed
    # step can run them through a decode kernel: in a prefill kernel each would fill a whole query tile
    num_decodes: int = 0

    @property
    def num_seqs(self) -> int:
        return self.seqlens_k.shape[0]

    @property
    def is_decode(self) -> bool:
        """Every sequence brings exactly one query token."""
        return self.max_seqlen_q == 1

    @property
    def is_mixed(self) -> bool:
        """One-token sequences first, then sequences with several new tokens."""
        return 0 < self.num_decodes < self.num_seqs

    def decode_part(self) -> "AttentionMetadata":
        """The leading one-token sequences of a mixed step; their tokens are q[:num_decodes]."""
        d = self.num_decodes
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:d], cu_seqlens_q=self.cu_seqlens_q[: d + 1], seqlens_k=self.seqlens_k[:d],
            block_tables=self.block_tables[:d], max_seqlen_q=1, max_seqlen_k=self.max_seqlen_k,
            block_size=self.block_size, decode_order=self.decode_order, num_decodes=d)

    def prefill_part(self) -> "AttentionMetadata":
        """The sequences after the leading one-token ones; cu_seqlens_q keeps its offsets into the
        step's tokens (it starts at num_decodes, not 0)."""
        d = self.num_decodes
        return AttentionMetadata(
            slot_mapping=self.slot_mapping, cu_seqlens_q=self.cu_seqlens_q[d:], seqlens_k=self.seqlens_k[d:],
            block_tables=self.block_tables[d:], max_seqlen_q=self.max_seqlen_q, max_seqlen_k=self.max_seqlen_k,
            block_size=self.block_size)


class AttentionBackend(Protocol):
    name: str

    def store_kvcache(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        """Scatter key/value rows into the cache at slot_mapping, skipping slots equal to -1."""

    def forward(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        """Causal paged attention of q over each sequence's cached context; returns [T, H_q, D]."""


BACKEND_NAMES = ("auto", "torch", "triton", "flash_attn")


def get_backend(name: str, device: torch.device, block_size: int = 16) -> AttentionBackend:
    """Pick a backend by name. 'auto': on CUDA flash_attn when it imports and the block size suits
    its paged cache, else triton; on the CPU the torch reference."""
    if name not in BACKEND_NAMES:
        raise ValueError(f"unknown attention backend {name!r}; choose from {BACKEND_NAMES}")
    if name == "auto":
        name = "torch"
        if device.type == "cuda":
            from kernels.attention.flash_backend import supports_block_size

            name = "triton"
            try:
                import flash_attn  # noqa: F401

                if supports_block_size(block_size):
                    name = "flash_attn"
            except ImportError:
                pass
    if name == "torch":
        from kernels.attention.torch_backend import TorchAttentionBackend

        return TorchAttentionBackend()
    if name == "triton":
        from kernels.attention.triton_backend import TritonAttentionBackend

        return TritonAttentionBackend()
    from kernels.attention.flash_backend import FlashAttentionBackend

    return FlashAttentionBackend()
