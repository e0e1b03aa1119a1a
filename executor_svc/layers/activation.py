"""SwiGLU's gate: the fused gate_up projection is split in halves, silu(gate) * up.

On CUDA with Triton it is one kernel (kernels/fused_ops.py); elsewhere, torch. Before an FP8 down_proj it is
told so at load (`fp8_group`, by executor_svc/layers/fp8.py) and writes its output quantized for that GEMM
(kernels/fp8_fused_quant.py); after an FP8 gate_up_proj it may take that product unscaled and apply its scales as
it reads it.
"""
import torch
import torch.nn.functional as F
from torch import nn

from kernels.fp8_quant import QuantizedActivations, UnscaledProduct

try:
    from kernels import fp8_fused_quant, fp8_gemm, fused_ops
except ImportError:  # no Triton: torch everywhere (and no FP8 GEMM hands out an UnscaledProduct)
    fused_ops = fp8_fused_quant = fp8_gemm = None


class SiluAndMul(nn.Module):
    def __init__(self):
        super().__init__()
        self.fp8_group: int | None = None  # set: the output goes out in FP8, a scale per token and this many columns
        # set with fp8_group where that reader's GEMM is the block recipe: the scales go out M-major, as it reads them
        self.fp8_m_major = False

    def forward(self, x: torch.Tensor | UnscaledProduct) -> torch.Tensor | QuantizedActivations:
        if isinstance(x, UnscaledProduct):  # an FP8 gate_up_proj's product, its scales left to this kernel
            if self.fp8_group is not None:
                return fp8_fused_quant.silu_and_mul_quant(x.product, self.fp8_group, scales=(x.row_scale, x.col_scale),
                                                          m_major=self.fp8_m_major)
            x = fp8_gemm.scaled(x)
        if self.fp8_group is not None:
            return fp8_fused_quant.silu_and_mul_quant(x, self.fp8_group, m_major=self.fp8_m_major)
        if fused_ops is not None and x.is_cuda:
            return fused_ops.silu_and_mul(x)
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up
