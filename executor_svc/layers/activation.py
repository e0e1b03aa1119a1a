"""SwiGLU's gate: the fused gate_up projection is split in halves, silu(gate) * up.

On CUDA with Triton it is one kernel (kernels/fused_ops.py); elsewhere, torch.
"""
import torch
import torch.nn.functional as F
from torch import nn

try:
    from kernels import fused_ops
except ImportError:  # no Triton: torch everywhere
    fused_ops = None


class SiluAndMul(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if fused_ops is not None and x.is_cuda:
            return fused_ops.silu_and_mul(x)
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up
