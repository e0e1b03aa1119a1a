"""Rotary position embedding (RoPE), neox layout: the head's two halves are the rotated pairs.

On CUDA with Triton, one kernel rotates q and k in place (kernels/fused_ops.py); elsewhere, torch.
"""
import math

import torch
from torch import nn

try:
    from kernels import fused_ops
except ImportError:  # no Triton: torch everywhere
    fused_ops = None

SUPPORTED_ROPE_TYPES = ("default", "llama3")


def rope_config(config) -> tuple[float, dict]:
    """(theta, scaling) from an HF config.

    transformers 5 keeps everything in `config.rope_parameters`; older configs have `rope_theta`
    and an optional `rope_scaling` dict whose type is under "rope_type" or "type".
    """
    params = dict(getattr(config, "rope_parameters", None) or {})
    theta = params.get("rope_theta", getattr(config, "rope_theta", None))
    if theta is None:
        raise ValueError("config has neither rope_parameters['rope_theta'] nor rope_theta")
    scaling = dict(getattr(config, "rope_scaling", None) or {}) or params
    scaling["rope_type"] = scaling.get("rope_type", scaling.get("type")) or "default"
    if scaling["rope_type"] not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"rope type {scaling['rope_type']!r} is not supported; supported: {SUPPORTED_ROPE_TYPES}")
    if scaling.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError("partial_rotary_factor != 1 is not supported")
    return float(theta), scaling


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    """Llama 3.1: slow down low frequencies by `factor`, keep high ones, blend in between."""
    factor = scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(is_medium, blended, scaled)


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_position: int, theta: float, scaling: dict | None = None):
        super().__init__()
        exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
        inv_freq = 1.0 / (theta ** exponents)
        if scaling and scaling.get("rope_type") == "llama3":
            inv_freq = _llama3_inv_freq(inv_freq, scaling)
        # Angles in fp32 (as HF), cast to the activation dtype at use.
        angles = torch.arange(max_position, dtype=torch.float32)[:, None] * inv_freq[None, :]
        self.register_buffer("cos", angles.cos(), persistent=False)  # [max_position, D/2]
        self.register_buffer("sin", angles.sin(), persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate q [T, H_q, D] and k [T, H_kv, D] by each token's position [T].

        On CUDA the rotation is in place (q and k are returned); the torch path returns new tensors.
        """
        if fused_ops is not None and q.is_cuda and q.stride(-1) == 1 and k.stride(-1) == 1:
            return fused_ops.rotary_embedding(positions, q, k, self.cos, self.sin)
        cos = self.cos[positions].unsqueeze(1).to(q.dtype)  # [T, 1, D/2]
        sin = self.sin[positions].unsqueeze(1).to(q.dtype)
        return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
