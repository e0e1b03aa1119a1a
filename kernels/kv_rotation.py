"""The fp8 KV cache's rotation of K and q (--kv-cache-rotation hadamard): an orthogonal matrix H over
head_dim, applied to K after RoPE (and the k-norm) before it is quantized, and to q before attention.

q.k = (q H).(k H) for orthogonal H, so attention is unchanged in exact arithmetic. What changes is
what the fp8 pool stores: e4m3 carries ~2.6% rms relative error per element whatever the scale, and
q.k is dominated by a few outlier channels, whose errors do not average out. The normalized
Walsh-Hadamard matrix spreads every channel over all D elements with equal weight, so each stored
element mixes all channels and the per-element errors average over the dot product (the QuaRot /
SpinQuant observation). V is stored as it comes.

H is symmetric (Sylvester's construction), so rotating a row vector is x @ H: one [T*H, D] x [D, D]
matmul, in the activation dtype (the model runner keeps H in it, on the device), so the step allocates
only the rotated q and k, from the CUDA graph's pool when captured. Torch-only.
"""
from __future__ import annotations

import torch


def hadamard_matrix(dim: int, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> torch.Tensor:
    """The normalized Walsh-Hadamard matrix [dim, dim]: symmetric, orthogonal, entries +-1/sqrt(dim)."""
    if dim <= 0 or dim & (dim - 1):
        raise ValueError(f"a Hadamard rotation needs a power-of-two head_dim, got {dim}")
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < dim:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return (h / dim ** 0.5).to(dtype=dtype, device=device)


def rotate(x: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """x [..., D] -> x @ h, a new tensor of x's dtype (h has it too)."""
    return torch.matmul(x, h)
