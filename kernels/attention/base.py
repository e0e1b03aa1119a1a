"""The attention-backend interface every implementation (torch, triton, flash_attn) follows, and
what each can do (AttentionCapabilities). kernels/attention/registry.py picks one.

Shapes, with T = tokens in the step, B = sequences in the step:
  q                 [T, H_q, D]
  key, value        [T, H_kv, D]               (the new tokens' K/V, written by store_kvcache)
  k_cache, v_cache  [N, block_size, H_kv, D]   (one layer's slice of the KV pool)
  output            [T, H_q, D]

An fp8 pool (k_cache.dtype float8_e4m3fn) comes with the layer's KVScales; a backend quantizes on
write and dequantizes on load as kernels/kv_quant.py defines. Other pools take no scales.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Protocol

import torch

from kernels.fp8_quant import QuantizedActivations
from kernels.kv_quant import KVScales


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

    @cached_property
    def decode_part(self) -> "AttentionMetadata":
        """The leading one-token sequences of a mixed step; their tokens are q[:num_decodes]. Made once a step
        (every layer asks): its slices are host work."""
        d = self.num_decodes
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:d], cu_seqlens_q=self.cu_seqlens_q[: d + 1], seqlens_k=self.seqlens_k[:d],
            block_tables=self.block_tables[:d], max_seqlen_q=1, max_seqlen_k=self.max_seqlen_k,
            block_size=self.block_size, decode_order=self.decode_order, num_decodes=d)

    @cached_property
    def prefill_part(self) -> "AttentionMetadata":
        """The sequences after the leading one-token ones; cu_seqlens_q keeps its offsets into the
        step's tokens (it starts at num_decodes, not 0). Made once a step, as decode_part."""
        d = self.num_decodes
        return AttentionMetadata(
            slot_mapping=self.slot_mapping, cu_seqlens_q=self.cu_seqlens_q[d:], seqlens_k=self.seqlens_k[d:],
            block_tables=self.block_tables[d:], max_seqlen_q=self.max_seqlen_q, max_seqlen_k=self.max_seqlen_k,
            block_size=self.block_size)


@dataclass(frozen=True)
class AttentionCapabilities:
    """What a backend can do. Callers ask these, never a backend's name."""

    # it has norm_rope_store_kvcache (FusedNormRopeStore): q/k RMSNorm, RoPE and the K/V store in one
    # CUDA launch, rounding as the unfused chain does
    fused_norm_rope_store: bool
    # store_kvcache and forward never sync with the host, so a decode step can be captured in a CUDA graph
    cuda_graph_safe: bool
    # its paged cache reads blocks whose token count is a multiple of this
    block_size_multiple: int = 1
    # the quantized pools it stores and attends over: torch.float8_e4m3fn (--kv-cache-dtype fp8), torch.int8
    quantized_kv_dtypes: tuple = ()
    # it has decode_fp8 (Fp8DecodeOutput): a decode step's output in FP8 for an FP8 o_proj, no quantizing pass
    fp8_decode_output: bool = False

    def supports_block_size(self, block_size: int) -> bool:
        return block_size % self.block_size_multiple == 0


class AttentionBackend(Protocol):
    name: str  # a fact for logs and the handshake; callers ask `capabilities`
    capabilities: AttentionCapabilities

    def store_kvcache(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        kv_scales: KVScales | None = None,
    ) -> None:
        """Scatter key/value rows into the cache at slot_mapping, skipping slots equal to -1 (quantized
        by kv_scales when the cache is fp8)."""

    def forward(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        kv_scales: KVScales | None = None,
    ) -> torch.Tensor:
        """Causal paged attention of q over each sequence's cached context (dequantized by kv_scales when
        the cache is fp8); returns [T, H_q, D]."""


class FusedNormRopeStore(Protocol):
    """What a backend whose capabilities say fused_norm_rope_store has besides AttentionBackend."""

    def norm_rope_store_kvcache(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
        sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
        q_norm_weight: torch.Tensor | None, k_norm_weight: torch.Tensor | None, eps: float,
        kv_scales: KVScales | None = None, product_scales: tuple[torch.Tensor, ...] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """rms_norm(q), rms_norm(k) (when the weights are given) and RoPE on both, in place (CUDA
        tensors only), then store_kvcache(k, v, kv_scales); returns q and k. product_scales: q, k and v are an
        unscaled FP8 product's, scaled as they are read (kernels/fused_ops.qk_norm_rope_store)."""


class Fp8DecodeOutput(Protocol):
    """What a backend whose capabilities say fp8_decode_output has besides AttentionBackend."""

    def decode_fp8(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                   scale: float, kv_scales: KVScales | None, fp8_group: int,
                   m_major: bool = False) -> QuantizedActivations | None:
        """A decode step's output [T, H*D] as FP8 with a scale per token and fp8_group columns, the bytes
        kernels/fp8_gemm.quantize_rows gives for forward's output (m_major: its scales laid out for the block
        recipe, kernels/fp8_quant.empty_quantized); None where it cannot (the caller attends with forward)."""
