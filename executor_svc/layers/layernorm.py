"""RMSNorm, optionally fused with the residual add that precedes it in a pre-norm block.

On CUDA with Triton, one kernel does the add and the norm (kernels/fused_ops.py); elsewhere, torch. A norm
whose only reader is a Linear layer with FP8 weights is told so at load (`fp8_group`, by
executor_svc/layers/fp8.py) and then writes its output quantized for that GEMM (kernels/fp8_fused_quant.py); it
may then take the FP8 product before it (o_proj's, down_proj's) unscaled and apply its scales as it reads it.
"""
import torch
from torch import nn

from kernels.fp8_quant import QuantizedActivations, UnscaledProduct

try:
    from kernels import fp8_fused_quant, fp8_gemm, fused_ops
except ImportError:  # no Triton: torch everywhere (and no FP8 GEMM hands out an UnscaledProduct)
    fused_ops = fp8_fused_quant = fp8_gemm = None


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(hidden_size))
        self.weight.weight_loader = lambda param, loaded: param.data.copy_(loaded)
        self.fp8_group: int | None = None  # set: the output goes out in FP8, a scale per token and this many columns
        # and in the activation dtype too (QuantizedActivations.plain): a MoE router reads it beside the FP8 experts
        self.fp8_keeps_plain = False
        # set with fp8_group where that reader's GEMM is the block recipe: the scales go out M-major, as it reads them
        self.fp8_m_major = False

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        # Statistics in fp32 and the scale applied after casting back, as HF does.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)

    def forward(
        self, x: torch.Tensor | UnscaledProduct, residual: torch.Tensor | None = None
    ) -> torch.Tensor | QuantizedActivations | tuple[torch.Tensor | QuantizedActivations, torch.Tensor]:
        """norm(x); with `residual`, returns (norm(x + residual), x + residual).

        x is [T, hidden], or [T, H, D] for Qwen3's per-head q/k norm. With `fp8_group` set (CUDA only), the
        norm comes as QuantizedActivations.
        """
        if isinstance(x, UnscaledProduct):  # an FP8 o_proj's or down_proj's product, its scales left to this kernel
            if self.fp8_group is not None:
                return fp8_fused_quant.rms_norm_quant(x.product, self.weight, self.eps, self.fp8_group, residual,
                                                      scales=(x.row_scale, x.col_scale),
                                                      keep_plain=self.fp8_keeps_plain, m_major=self.fp8_m_major)
            x = fp8_gemm.scaled(x)
        if self.fp8_group is not None:
            return fp8_fused_quant.rms_norm_quant(x, self.weight, self.eps, self.fp8_group, residual,
                                                  keep_plain=self.fp8_keeps_plain, m_major=self.fp8_m_major)
        if fused_ops is not None and x.is_cuda and (residual is None or residual.dtype == x.dtype):
            return fused_ops.rms_norm(x, self.weight, self.eps, residual)
        if residual is None:
            return self._norm(x)
        x = x + residual  # in the activation dtype, as HF adds it
        return self._norm(x), x
