"""Float64 references of the small ops of a decoder block, written from their definitions rather than from
the eager layers: shared by the fused-op and fused-FP8-producer kernel tests."""
from __future__ import annotations

import torch

EPS = 1e-6  # the RMSNorm epsilon the kernel tests use


def rms_norm64(x, weight, residual=None):
    h = x.double() if residual is None else x.double() + residual.double()
    return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + EPS) * weight.double()


def silu_and_mul64(x):
    gate, up = x.double().chunk(2, dim=-1)
    return gate * torch.sigmoid(gate) * up
