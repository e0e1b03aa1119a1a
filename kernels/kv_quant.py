"""The quantized KV caches' number formats, in torch: what a stored K/V value is, and the reference
quantize-on-write and dequantize-on-load every backend reproduces.

A pool of dtype float8_e4m3fn (--kv-cache-dtype fp8) holds, for each layer, K and V divided by a float32
scale per KV head (a per-layer scale is the same value repeated over the heads):

    stored = clamp(x / scale, -448, 448) cast to float8_e4m3fn (round to nearest even)
    x     ~= float32(stored) * scale

A pool of dtype int8 (--kv-cache-dtype int8) holds them divided by a scale per KV head and channel
(head_dim), rounded half away from zero and clamped to [-127, 127]:

    stored = clamp(round(x / scale), -127, 127)       x ~= stored * scale

int8's error is absolute (at most scale / 2), e4m3's relative (3 mantissa bits): with a scale fitted to
each channel int8 keeps SmolLM2's greedy top-1 at 98.8% where e4m3 stops near 97% whatever its scales
(bench/studies/kv_format_study.py). A channel's scale fits every token because K's outliers sit in fixed
channels; attention folds K's into q (q . k = sum_d (q_d s_d) k_d) and V's into the output.

The division runs in float32 whatever the activation dtype. The clamps keep values beyond the range
finite: a cast of 464 or more would give NaN (e4m3fn has no infinity), and an int8 cast would wrap. The
Triton kernels (kernels/attention/triton_kv_store.py, kernels/attention/triton_backend.py) round and
clamp the same way; the attention kernels fold the multiply by the scale into the softmax scale (K) and
the output (V).

Torch-only, so the torch backend runs on a CPU without Triton.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
INT8_DTYPE = torch.int8
INT8_MAX = 127.0  # symmetric: -128 is never stored
QUANTIZED_DTYPES = (FP8_DTYPE, INT8_DTYPE)


@dataclass(frozen=True)
class KVScales:
    """One layer's dequantization scales of a quantized pool, float32 on the pool's device: [H_kv] each for
    fp8 (a scale per KV head), [H_kv, D] for int8 (per KV head and channel)."""

    k: torch.Tensor
    v: torch.Tensor


def _dtype(t: torch.Tensor | torch.dtype | None) -> torch.dtype | None:
    return t if t is None or isinstance(t, torch.dtype) else t.dtype


def is_fp8(t: torch.Tensor | torch.dtype) -> bool:
    return _dtype(t) == FP8_DTYPE


def is_int8(t: torch.Tensor | torch.dtype) -> bool:
    return _dtype(t) == INT8_DTYPE


def is_quantized(t: torch.Tensor | torch.dtype | None) -> bool:
    """A pool stored as 8-bit values with scales (fp8 or int8), not in the model's dtype."""
    return _dtype(t) in QUANTIZED_DTYPES


def _per_value(scale: torch.Tensor) -> torch.Tensor:
    """A scale per head [H_kv] or per head and channel [H_kv, D], broadcastable over [..., H_kv, D]."""
    return scale[:, None] if scale.dim() == 1 else scale


def round_half_away(y: torch.Tensor) -> torch.Tensor:
    """Round to nearest, ties away from zero: the rule the Triton store kernels can reproduce exactly."""
    return torch.where(y >= 0, torch.floor(y + 0.5), torch.ceil(y - 0.5))


def quantize(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = FP8_DTYPE) -> torch.Tensor:
    """x [..., H_kv, D] in any float dtype -> `dtype` [..., H_kv, D]: float8_e4m3fn (scale [H_kv]) or int8
    (scale [H_kv, D])."""
    y = x.float() / _per_value(scale)
    if dtype == INT8_DTYPE:
        return round_half_away(y).clamp(-INT8_MAX, INT8_MAX).to(INT8_DTYPE)
    return y.clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def dequantize(stored: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A quantized [..., H_kv, D] -> float32(stored) * scale in `dtype`."""
    return (stored.float() * _per_value(scale)).to(dtype)


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """An fp8 tensor viewed as uint8 (other dtypes as they are): copies, gathers and scatters move its
    bytes unchanged, on every device (several torch ops have no float8 kernel, index_copy_ on the CPU)."""
    return t.view(torch.uint8) if is_fp8(t) else t


# A calibrated absolute maximum maps to 448 / 16: later prompts exceed a short calibration pass (on
# SmolLM2 by up to 1.6x in half the heads), and e4m3's relative precision is the same in every binade,
# so four binades of headroom cost nothing but values 2^-10 below the maximum, which barely count.
CALIBRATION_HEADROOM = 16.0
# int8's steps are even, so headroom costs resolution everywhere, and clamping costs the outliers:
# bench/studies/kv_format_study.py on SmolLM2, per channel, top-1 by headroom: 1x 97.2%, 1.5x 98.8%.
INT8_CALIBRATION_HEADROOM = 1.5


def scales_from_amax(amax: torch.Tensor, dtype: torch.dtype = FP8_DTYPE) -> torch.Tensor:
    """The scale that stores a calibrated absolute maximum as 448 / CALIBRATION_HEADROOM (fp8) or
    127 / INT8_CALIBRATION_HEADROOM (int8); 1.0 where nothing was seen."""
    amax = amax.float()
    top, headroom = (INT8_MAX, INT8_CALIBRATION_HEADROOM) if dtype == INT8_DTYPE else (FP8_MAX, CALIBRATION_HEADROOM)
    return torch.where(amax > 0, amax * headroom / top, torch.ones_like(amax))
