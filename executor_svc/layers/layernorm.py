"""RMSNorm, optionally fused with the residual add that precedes it in a pre-norm block.

On CUDA with Triton, one kernel does the add and the norm (kernels/fused_ops.py); elsewhere, torch.
"""
import torch
from torch import nn

try:
    from kernels import fused_ops
except ImportError:  # no Triton: torch everywhere
    fused_ops = None


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(hidden_size))
        self.weight.weight_loader = lambda param, loaded: param.data.copy_(loaded)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        # Statistics in fp32 and the scale applied after casting back, as HF does.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """norm(x); with `residual`, returns (norm(x + residual), x + residual).

        x is [T, hidden], or [T, H, D] for Qwen3's per-head q/k norm.
        """
        if fused_ops is not None and x.is_cuda and (residual is None or residual.dtype == x.dtype):
            return fused_ops.rms_norm(x, self.weight, self.eps, residual)
        if residual is None:
            return self._norm(x)
        x = x + residual  # in the activation dtype, as HF adds it
        return self._norm(x), x
