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


def untied_tokens(router_logits: torch.Tensor, top_k: int, count: int) -> torch.Tensor:
    """The first `count` tokens (indices, on the CPU) whose k-th and (k+1)-th router logits differ. At an exact tie
    (bf16 logits tie often) a route kernel and route_ref may pick different experts: an error that is not the
    experts' GEMMs', so a check of those compares these tokens."""
    top = router_logits.float().topk(top_k + 1, dim=-1).values
    return torch.nonzero(top[:, top_k - 1] != top[:, top_k]).flatten()[:count].cpu()


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


def fp8_activations_ref64(x: torch.Tensor, router_logits: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                          top_k: int, quantize_activations: bool = True, group: int = 128) -> torch.Tensor:
    """The block in float64 (renormalised routing) on w13 and w2 as given (FP8 experts dequantized), gate, up and h
    rounded to x's dtype where HF's expert rounds them; with quantize_activations, x and each pair's h go through the
    FP8 quantization per token and `group` columns of kernels/fused_moe_fp8_activations.py (h after its rounding)."""
    from kernels.fp8_quant import dequantize_rows, quantize_rows_ref

    def fq(t: torch.Tensor) -> torch.Tensor:
        return dequantize_rows(*quantize_rows_ref(t.float(), group), group, torch.float64)

    weights, ids = route_ref(router_logits, top_k, True)
    xs, w13, w2 = (fq(x) if quantize_activations else x.double()), w13.double(), w2.double()
    inter = w13.shape[1] // 2
    out = torch.zeros(x.shape, dtype=torch.float64, device=x.device)
    for t in range(x.shape[0]):
        for w, e in zip(weights[t].tolist(), ids[t].tolist()):
            gate = (w13[e, :inter] @ xs[t]).to(x.dtype).double()
            up = (w13[e, inter:] @ xs[t]).to(x.dtype).double()
            h = (F.silu(gate).to(x.dtype).double() * up).to(x.dtype)
            h = fq(h[None])[0] if quantize_activations else h.double()
            out[t] += w * (w2[e] @ h).to(x.dtype).double()
    return out


def block_quantized_experts(w: torch.Tensor, block: int = 128) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Stacked expert weights [E, N, K] as a fine-grained FP8 checkpoint holds them (a scale per block x block,
    each expert's weight blocked on its own) and as the loader lays them out: (fp8 [E, N, K], the scales repeated
    over their rows [E, N, ceil(K / block)], the dequantized weights in float64), on w's device."""
    from kernels.fp8_quant import dequantize_rows, quantize_blocks_on_rows

    e, n, k = w.shape
    q, scale = (torch.stack(parts) for parts in zip(*(quantize_blocks_on_rows(expert, block)
                                                        for expert in w.float())))
    dequantized = dequantize_rows(q.reshape(e * n, k), scale.reshape(e * n, -1), block, torch.float64)
    return q.to(w.device), scale.to(w.device), dequantized.view(e, n, k)
