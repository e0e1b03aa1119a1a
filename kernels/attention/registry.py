"""Which attention backend runs: one named by --attention-backend, or the best for the device.

Backends are imported only when chosen: the Triton and flash-attn ones need packages a CPU executor
may not have.
"""
from __future__ import annotations

import importlib

import torch

from kernels.attention.base import AttentionBackend
from kernels.attention.names import ATTENTION_BACKEND_CHOICES, AUTO, FLASH_ATTN, TORCH, TRITON

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


def get_backend(name: str, device: torch.device, block_size: int = 16, fp8_kv_cache: bool = False) -> AttentionBackend:
    """The backend called `name`, or for 'auto' the best one for the device, the block size and the
    pool's dtype (fp8_kv_cache: --kv-cache-dtype fp8)."""
    if name not in ATTENTION_BACKEND_CHOICES:
        raise ValueError(f"unknown attention backend {name!r}; choose from {ATTENTION_BACKEND_CHOICES}")
    if name == AUTO:
        name = auto_backend_name(device, block_size, fp8_kv_cache)
    cls = backend_class(name)
    if fp8_kv_cache and not cls.capabilities.fp8_kv_cache:
        raise ValueError(f"attention backend {name!r} cannot read an fp8 KV cache; use --attention-backend "
                         "auto or --kv-cache-dtype auto")
    return cls()


def auto_backend_name(device: torch.device, block_size: int, fp8_kv_cache: bool = False) -> str:
    """On CUDA flash_attn when it imports and takes the block size and the pool's dtype, else triton;
    on the CPU the torch reference."""
    if device.type != "cuda":
        return TORCH
    try:
        import flash_attn  # noqa: F401
    except ImportError:
        return TRITON
    caps = backend_class(FLASH_ATTN).capabilities
    usable = caps.supports_block_size(block_size) and (caps.fp8_kv_cache or not fp8_kv_cache)
    return FLASH_ATTN if usable else TRITON
