"""Which attention backend runs: one named by --attention-backend, or the best for the device.

Backends are imported only when chosen: the Triton and flash-attn ones need packages a CPU executor
may not have.
"""
from __future__ import annotations

import importlib

import torch

from kernels.attention.base import AttentionBackend, AttentionCapabilities
from kernels.attention.names import ATTENTION_BACKEND_CHOICES, AUTO, FLASH_ATTN, TORCH, TRITON
from kernels.kv_quant import is_quantized

# name -> (module, class)
_BACKENDS = {
    TORCH: ("kernels.attention.torch_backend", "TorchAttentionBackend"),
    TRITON: ("kernels.attention.triton_backend", "TritonAttentionBackend"),
    FLASH_ATTN: ("kernels.attention.flash_backend", "FlashAttentionBackend"),
}


def backend_class(name: str) -> type:
    """The class of backend `name` (not 'auto'), whose `capabilities` can be read before building it."""
    module, cls = _BACKENDS[name]
    return getattr(importlib.import_module(module), cls)


def get_backend(name: str, device: torch.device, block_size: int = 16,
                kv_cache_dtype: torch.dtype | None = None) -> AttentionBackend:
    """The backend called `name`, or for 'auto' the best one for the device, the block size and the
    pool's dtype (kv_cache_dtype; None or the model's dtype for an unquantized pool)."""
    if name not in ATTENTION_BACKEND_CHOICES:
        raise ValueError(f"unknown attention backend {name!r}; choose from {ATTENTION_BACKEND_CHOICES}")
    if name == AUTO:
        name = auto_backend_name(device, block_size, kv_cache_dtype)
    cls = backend_class(name)
    if not _reads(cls.capabilities, kv_cache_dtype):
        raise ValueError(f"attention backend {name!r} cannot read a {str(kv_cache_dtype).removeprefix('torch.')} "
                         "KV cache; use --attention-backend auto or --kv-cache-dtype auto")
    return cls()


def auto_backend_name(device: torch.device, block_size: int, kv_cache_dtype: torch.dtype | None = None) -> str:
    """On CUDA flash_attn when it imports and takes the block size and the pool's dtype, else triton;
    on the CPU the torch reference."""
    if device.type != "cuda":
        return TORCH
    try:
        import flash_attn  # noqa: F401
    except ImportError:
        pass
    else:
        caps = backend_class(FLASH_ATTN).capabilities
        if caps.supports_block_size(block_size) and _reads(caps, kv_cache_dtype):
            return FLASH_ATTN
    return TRITON


def _reads(caps: AttentionCapabilities, kv_cache_dtype: torch.dtype | None) -> bool:
    return not is_quantized(kv_cache_dtype) or kv_cache_dtype in caps.quantized_kv_dtypes
