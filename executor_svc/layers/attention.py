"""The attention layer: write this step's K/V into the paged pool, then attend over it.

The math lives in a kernels/ backend; this layer only owns its slice of the KV pool, which the
model runner assigns after allocating the pool. On CUDA with the Triton backend the K/V store is
fused into the q/k norm + RoPE kernel before this layer (kernels/fused_ops.qk_norm_rope_store).
"""
import torch
from torch import nn

from kernels.attention.base import AttentionBackend, AttentionMetadata


class Attention(nn.Module):
    def __init__(self, num_heads: int, head_dim: int, scale: float, num_kv_heads: int):
        super().__init__()
        self.num_heads = num_heads  # local to this rank
        self.head_dim = head_dim
        self.scale = scale
        self.num_kv_heads = num_kv_heads  # local to this rank
        # [N, block_size, H_kv, D] views into the pool, set by the model runner.
        self.k_cache = torch.tensor([])
        self.v_cache = torch.tensor([])
        self.backend: AttentionBackend | None = None  # set by the model loader

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata,
                kv_stored: bool = False) -> torch.Tensor:
        """q [T, H*D], k/v [T, H_kv*D] -> [T, H*D]. kv_stored: a fused kernel already wrote k/v to the pool."""
        if self.k_cache.numel() == 0:
            raise RuntimeError("attention layer has no KV cache: the model runner must assign k_cache/v_cache")
        if self.backend is None:
            raise RuntimeError("attention layer has no backend: load the model with model_loader.load_model")
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if not kv_stored:
            self.backend.store_kvcache(k, v, self.k_cache, self.v_cache, meta.slot_mapping)
        out = self.backend.forward(q, self.k_cache, self.v_cache, meta, self.scale)
        return out.reshape(-1, self.num_heads * self.head_dim)
