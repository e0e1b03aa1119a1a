"""The attention layer: position-encode q and k, write this step's K/V into the paged pool, then attend.

This is the one place a token's K/V is written: by the backend's store_kvcache at the slots of
meta.slot_mapping (computed in executor_svc/input_batch.py), or, on CUDA when the backend's
capabilities say fused_norm_rope_store, by one kernel that also does the q/k norm and RoPE. An fp8
pool with a rotation (--kv-cache-rotation hadamard, kernels/kv_rotation.py) takes the unfused chain
everywhere, K and q rotated by one matmul each between RoPE and the store: the fused kernel would
store K unrotated. The math
lives in a kernels/ backend; this layer only owns its slice of the KV pool, which the KV pool
(executor_svc/kv_cache.py) assigns after allocating it, and with an fp8 pool its dequantization scales.
"""
import torch
from torch import nn

from executor_svc.layers.layernorm import RMSNorm
from executor_svc.layers.rotary import RotaryEmbedding
from kernels.attention.base import AttentionBackend, AttentionMetadata
from kernels.fp8_quant import UnscaledProduct
from kernels.kv_quant import KVScales
from kernels.kv_rotation import rotate


class Attention(nn.Module):
    # an FP8 qkv_proj may hand its product over unscaled (executor_svc/layers/fp8.scale_in_readers): the fused
    # prologue scales q, k and v as it reads them; any other path scales the product first (split_qkv)
    applies_fp8_product_scales = True

    def __init__(self, num_heads: int, head_dim: int, scale: float, num_kv_heads: int):
        super().__init__()
        self.num_heads = num_heads  # local to this rank
        self.head_dim = head_dim
        self.scale = scale
        self.num_kv_heads = num_kv_heads  # local to this rank
        # [N, block_size, H_kv, D] views into the pool, set by the KV pool.
        self.k_cache = torch.tensor([])
        self.v_cache = torch.tensor([])
        self.kv_scales: KVScales | None = None  # a quantized pool's scales of this layer, set by the KV pool
        # [D, D] orthogonal, on the device: K and q are rotated before the store and attention
        # (kernels/kv_rotation.py, --kv-cache-rotation); None: stored as they come
        self.kv_rotation: torch.Tensor | None = None
        self.backend: AttentionBackend | None = None  # set by the model loader
        # set (CUDA, an FP8 o_proj: executor_svc/layers/fp8.quantize_in_producers): a decode step's output goes to
        # o_proj in FP8, a scale per token and this many columns, where the backend writes it so (decode_fp8)
        self.fp8_group: int | None = None
        # set with fp8_group where that reader's GEMM is the block recipe: the scales go out M-major, as it reads them
        self.fp8_m_major = False
        # set while the forward is captured in pieces (executor_svc/piecewise_graphs.py): called with q after the
        # K/V store in place of attention, it returns the buffer the rest of the forward reads the output from
        self.cut = None

    def _fused_prologue(self, x: torch.Tensor) -> bool:
        """Whether q/k norm, RoPE and the K/V store run as one kernel: on CUDA with a backend that has it, and no
        rotation (it goes between RoPE and the store, which the fused kernel does in one go)."""
        if self.backend is None:
            raise RuntimeError("attention layer has no backend: load the model with model_loader.load_model")
        return x.is_cuda and self.backend.capabilities.fused_norm_rope_store and self.kv_rotation is None

    def split_qkv(self, qkv: torch.Tensor | UnscaledProduct, q_size: int, kv_size: int) -> tuple:
        """(q, k, v, product_scales) of a fused qkv projection's output. An FP8 product handed over unscaled keeps
        its scales for the fused prologue to apply as it reads q, k and v ((token [T, 1], q's, k's, v's columns'));
        on any other path it is scaled here, in one pass (as the projection would have scaled it)."""
        scales = None
        if isinstance(qkv, UnscaledProduct):
            if self._fused_prologue(qkv.product):
                scales = (qkv.row_scale, *qkv.col_scale.split([q_size, kv_size, kv_size]))
                qkv = qkv.product
            else:
                from kernels.fp8_gemm import scaled

                qkv = scaled(qkv)
        return *qkv.split([q_size, kv_size, kv_size], dim=-1), scales

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                meta: AttentionMetadata, rotary_emb: RotaryEmbedding, q_norm: RMSNorm | None = None,
                k_norm: RMSNorm | None = None, product_scales: tuple | None = None) -> torch.Tensor:
        """q [T, H, D], k [T, H_kv, D], v [T, H_kv*D] -> [T, H*D]: q/k RMSNorm (when given), RoPE,
        the rotation of q and k (when set), the K/V store, attention. product_scales (split_qkv): q, k and v are an
        unscaled FP8 product's, which the fused prologue scales as it reads them. With fp8_group set, a decode step's
        output may come as QuantizedActivations for o_proj."""
        if self.k_cache.numel() == 0:
            raise RuntimeError("attention layer has no KV cache: the KV pool must assign k_cache/v_cache")
        if self._fused_prologue(q):
            # q/k norm, RoPE and the K/V store in one kernel: the same rounding as the chain below
            q_w = q_norm.weight if q_norm is not None else None
            k_w = k_norm.weight if k_norm is not None else None
            eps = q_norm.eps if q_norm is not None else 1e-6
            q, k = self.backend.norm_rope_store_kvcache(positions, q, k, v, rotary_emb.cos, rotary_emb.sin,
                                                        self.k_cache, self.v_cache, meta.slot_mapping, q_w, k_w, eps,
                                                        self.kv_scales, product_scales)
        else:
            if product_scales is not None:
                raise ValueError("an unscaled FP8 product reaches attention only where the fused prologue runs")
            if q_norm is not None:
                q, k = q_norm(q), k_norm(k)
            q, k = rotary_emb(positions, q, k)
            k = k.view(-1, self.num_kv_heads, self.head_dim)
            if self.kv_rotation is not None:
                q, k = rotate(q.view(-1, self.num_heads, self.head_dim), self.kv_rotation), rotate(k, self.kv_rotation)
            v = v.view(-1, self.num_kv_heads, self.head_dim)
            self.backend.store_kvcache(k, v, self.k_cache, self.v_cache, meta.slot_mapping, self.kv_scales)
        q = q.view(-1, self.num_heads, self.head_dim)
        if self.cut is not None:
            return self.cut(self, q)
        if self.fp8_group is not None and meta.is_decode and self.backend.capabilities.fp8_decode_output:
            quantized = self.backend.decode_fp8(q, self.k_cache, self.v_cache, meta, self.scale, self.kv_scales,
                                                self.fp8_group, self.fp8_m_major)
            if quantized is not None:
                return quantized
        return self.attend(q, meta)

    def attend(self, q: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """q [T, H, D] (normed, rotated, its K/V stored) over the pool -> [T, H*D]."""
        out = self.backend.forward(q, self.k_cache, self.v_cache, meta, self.scale, self.kv_scales)
        return out.reshape(-1, self.num_heads * self.head_dim)
