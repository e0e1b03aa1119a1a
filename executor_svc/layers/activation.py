"""SwiGLU's gate: the fused gate_up projection is split in halves, silu(gate) * up.

On CUDA with Triton it is one kernel (kernels/fused_ops.py); elsewhere, torch. Before an FP8 down_proj it is
told so at load (`fp8_group`, by executor_svc/layers/fp8.py) and writes its output quantized for that GEMM
(kernels/fp8_fused_quant.py).
"""
import torch
import torch.nn.functional as F
from torch import nn

from kernels.fp8_quant import QuantizedActivations

try:
    from kernels import fp8_fused_quant, fused_ops
except ImportError:  # no Triton: torch everywhere
    fused_ops = fp8_fused_quant = None


class SiluAndMul(nn.Module):
    def __init__(self):
        super().__init__()
        self.fp8_group: int | None = None  # set: the output goes out in FP8, a scale per token and this many columns

    def forward(self, x: torch.Tensor) -> torch.Tensor | QuantizedActivations:
        if self.fp8_group is not None:
            return fp8_fused_quant.silu_and_mul_quant(x, self.fp8_group)
        if fused_ops is not None and x.is_cuda:
            return fused_ops.silu_and_mul(x)
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up
