"""The fp8 KV cache's number format, in torch: what a stored K/V value is, and the reference
quantize-on-write and dequantize-on-load every backend reproduces.

A pool of dtype float8_e4m3fn holds, for each layer, K and V divided by a float32 scale per KV head
(a per-layer scale is the same value repeated over the heads):

    stored = clamp(x / scale, -448, 448) cast to float8_e4m3fn (round to nearest even)
    x     ~= float32(stored) * scale

The division runs in float32 whatever the activation dtype. The clamp keeps values beyond the range
finite: a cast of 464 or more would give NaN (e4m3fn has no infinity). The Triton kernels
(kernels/triton_fp8.py, kernels/attention/triton_backend.py) round and clamp the same way; the
attention kernels fold the multiply by the scale into the softmax scale (K) and the output (V).

Torch-only, so the torch backend runs on a CPU without Triton.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max


@dataclass(frozen=True)
class KVScales:
    """One layer's dequantization scales of an fp8 pool: float32 [H_kv] each, on the pool's device."""

    k: torch.Tensor
    v: torch.Tensor


def is_fp8(t: torch.Tensor | torch.dtype) -> bool:
    return (t if isinstance(t, torch.dtype) else t.dtype) == FP8_DTYPE


def quantize(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [..., H_kv, D] in any float dtype, scale [H_kv] -> float8_e4m3fn [..., H_kv, D]."""
    return (x.float() / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def dequantize(stored: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """float8_e4m3fn [..., H_kv, D], scale [H_kv] -> float32(stored) * scale in `dtype`."""
    return (stored.float() * scale[:, None]).to(dtype)


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """An fp8 tensor viewed as uint8 (other dtypes as they are): copies, gathers and scatters move its
    bytes unchanged, on every device (several torch ops have no float8 kernel, index_copy_ on the CPU)."""
    return t.view(torch.uint8) if is_fp8(t) else t


# A calibrated absolute maximum maps to 448 / 16: later prompts exceed a short calibration pass (on
# SmolLM2 by up to 1.6x in half the heads), and e4m3's relative precision is the same in every binade,
# so four binades of headroom cost nothing but values 2^-10 below the maximum, which barely count.
CALIBRATION_HEADROOM = 16.0


def scales_from_amax(amax: torch.Tensor) -> torch.Tensor:
    """The scale that stores a calibrated absolute maximum as 448 / CALIBRATION_HEADROOM; 1.0 where
    nothing was seen."""
    amax = amax.float()
    return torch.where(amax > 0, amax * CALIBRATION_HEADROOM / FP8_MAX, torch.ones_like(amax))
