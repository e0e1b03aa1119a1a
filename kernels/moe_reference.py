"""The mixture-of-experts block in torch: the CPU path of executor_svc/layers/fused_moe.py and the reference of
the Triton kernels in kernels/fused_moe.py (weights in their layout: w13 [E, 2I, H], w2 [E, H, I]). No Triton
here, so the block runs wherever torch does."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def route_ref(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k] fp32, expert ids [T, k] int64): softmax in fp32, top-k, optionally renormalised."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def experts_ref(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
                ids: torch.Tensor) -> torch.Tensor:
    """sum_j weights[t, j] * down_e(silu(gate_e(x_t)) * up_e(x_t)) with e = ids[t, j], one expert at a time,
    rounding where HF's eager experts round (each projection's output and the activation in x's dtype)."""
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    inter = w13.shape[1] // 2
    for e in ids.unique().tolist():
        token, slot = torch.nonzero(ids == e, as_tuple=True)
        gate_up = F.linear(x[token], w13[e])
        h = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]
        y = F.linear(h, w2[e])
        out.index_add_(0, token, y.float() * weights[token, slot, None].float())
    return out.to(x.dtype)


def fused_moe_ref(x: torch.Tensor, router_logits: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, top_k: int,
                  renormalize: bool) -> torch.Tensor:
    """The whole block in torch: route, then the experts' weighted sum. [T, H] in x's dtype."""
    weights, ids = route_ref(router_logits, top_k, renormalize)
    return experts_ref(x, w13, w2, weights.to(x.dtype), ids)
