"""The FP8 weight and activation formats of FP8 Linear layers, in torch: the references kernels/fp8_gemm.py
reproduces, and what the CPU computes (weights dequantized at load). Torch-only: no Triton needed.

A tensor [R, C] is float8_e4m3fn with a float32 scale per row and group of `group` columns (ceil at the
edge): x ~= float32(q) * scale, scale = max|x| / 448 over the group, q = x / scale rounded to nearest even.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from kernels.kv_quant import FP8_DTYPE, FP8_MAX

MIN_SCALE = 1e-12  # an all-zero group quantizes to zeros instead of dividing by zero


class QuantizedActivations(NamedTuple):
    """Activations already in FP8, as an FP8 GEMM takes them: what a producer that quantizes its own output
    (kernels/fp8_fused_quant.py) hands to the Linear layer after it instead of a tensor."""

    q: torch.Tensor  # float8_e4m3fn [M, K]
    scale: torch.Tensor  # float32 [M, G]: a scale per token (G = 1) or per token and group of K's columns
    dtype: torch.dtype  # the activations' own dtype: the GEMM's output dtype


def quantize_rows_ref(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (float8_e4m3fn [M, K], float32 scales [M, ceil(K / group)]), a scale per row and group."""
    m, k = x.shape
    groups = -(-k // group)
    padded = torch.nn.functional.pad(x.float(), (0, groups * group - k)).view(m, groups, group)
    scale = (padded.abs().amax(-1) / FP8_MAX).clamp_min(MIN_SCALE)
    q = (padded / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.view(m, groups * group)[:, :k].contiguous(), scale


def dequantize_rows(q: torch.Tensor, scale: torch.Tensor, group: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """q [R, C] of float8 times its scales [R, ceil(C / group)], a scale per row and group of columns."""
    return (q.to(dtype) * scale.to(dtype).repeat_interleave(group, 1)[:, : q.shape[1]]).to(dtype)


def quantize_weight_per_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A plain weight [N, K] as float8_e4m3fn with a float32 scale per output row, [N, 1]."""
    return quantize_rows_ref(w, w.shape[1])


def fp8_gemm_ref(a: torch.Tensor, a_scale: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, group_k: int,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
    """The GEMM in float64 over the dequantized operands (scales per group_k columns of K)."""
    out = dequantize_rows(a, a_scale, group_k, torch.float64) @ dequantize_rows(w, w_scale, group_k, torch.float64).T
    return out if bias is None else out + bias.double()


def quantize_blocks_ref(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """A plain weight [N, K] in the fine-grained checkpoint format: float8_e4m3fn [N, K] and the float32
    `weight_scale_inv` [ceil(N / bn), ceil(K / bk)], a scale per bn x bk block (ceil at the edges)."""
    (n, k), (bn, bk) = w.shape, block
    gn, gk = -(-n // bn), -(-k // bk)
    padded = torch.nn.functional.pad(w.float(), (0, gk * bk - k, 0, gn * bn - n)).view(gn, bn, gk, bk)
    scale = (padded.abs().amax((1, 3)) / FP8_MAX).clamp_min(MIN_SCALE)
    q = (padded / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.view(gn * bn, gk * bk)[:n, :k].contiguous(), scale


def dequantize_blocks(q: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int],
                      dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The fine-grained format's weight: q * weight_scale_inv, each scale over its block."""
    (n, k), (bn, bk) = q.shape, block
    per_element = scale_inv.to(dtype).repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
    return q.to(dtype) * per_element
