"""The sparse mixture-of-experts MLP: a softmax router picks each token's top-k experts, each expert is a
SwiGLU MLP, and their outputs are summed with the router's weights.

The experts' weights are stacked into the kernel's layout (kernels/fused_moe.py) as the checkpoint's
per-expert tensors stream in: w13 [E, 2I, H] (gate rows, then up rows) and w2 [E, H, I].

Tensor parallelism splits every expert's intermediate dimension I across ranks, as the dense MLP's
gate/up (column) and down (row) projections are split: each rank computes a partial sum of every
token's output from its slice, and one all-reduce after the block completes it. The router is
replicated, so every rank picks the same experts.

On CUDA the block is kernels/fused_moe.fused_moe; elsewhere its torch reference, kernels/moe_reference.py.
FP8 experts (an FP8 checkpoint's, or --quantization fp8) are loaded by executor_svc/layers/fp8.py: on CUDA
w13 and w2 stay float8_e4m3fn and `StackedExperts.fp8` holds their scales; elsewhere they are dequantized.
"""
from __future__ import annotations

import re

import torch
import torch.nn.functional as F
from torch import nn

from executor_svc.layers.parallel import all_reduce, shard_size, tp_rank
from kernels.fp8_quant import QuantizedActivations
from kernels.moe_reference import fused_moe_ref

try:
    from kernels import fused_moe as moe_kernels
    from kernels.fused_moe_fp8_activations import fused_moe_fp8_activations
except ImportError:  # no Triton: the torch reference everywhere
    moe_kernels = fused_moe_fp8_activations = None

_GATE, _UP, _DOWN = "gate", "up", "down"


class FusedMoE(nn.Module):
    def __init__(self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int, renormalize: bool):
        super().__init__()
        if not 0 < top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok={top_k} must be in [1, num_experts={num_experts}]")
        self.num_experts, self.top_k, self.renormalize = num_experts, top_k, renormalize
        self.inter_local = shard_size(intermediate_size, "moe_intermediate_size")
        self.gate = Router(num_experts, hidden_size)
        self.experts = StackedExperts(num_experts, hidden_size, self.inter_local)

    def forward(self, x: torch.Tensor | QuantizedActivations) -> torch.Tensor:
        """x [T, H], or QuantizedActivations with `plain` (the norm before wrote both: executor_svc/layers/fp8.py,
        quantize_in_producers): the router reads x as it is, FP8 experts that multiply FP8 activations the FP8 copy."""
        quantized = None
        if isinstance(x, QuantizedActivations):
            quantized, x = x, x.plain
        logits = F.linear(x, self.gate.weight)  # in the model's dtype, as HF
        w13, w2 = self.experts.w13, self.experts.w2
        fp8 = self.experts.fp8
        if moe_kernels is not None and x.is_cuda:
            if fp8 is not None and fp8.activations == "fp8":
                out = fused_moe_fp8_activations(x.contiguous(), logits, w13, w2, self.top_k, self.renormalize, fp8=fp8,
                                                quantized=quantized)
            else:
                out = moe_kernels.fused_moe(x.contiguous(), logits, w13, w2, self.top_k, self.renormalize, fp8=fp8)
        else:
            out = fused_moe_ref(x, logits, w13, w2, self.top_k, self.renormalize)
        return all_reduce(out)


class Router(nn.Module):
    """The replicated router: logits = x W^T, W [E, H]."""

    def __init__(self, num_experts: int, hidden_size: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size))
        self.weight.weight_loader = lambda param, loaded: param.data.copy_(loaded)


class StackedExperts(nn.Module):
    """Every expert's gate/up and down weights in two stacked tensors, this rank's slice of I.

    Loads one checkpoint tensor at a time with shard id (expert, "gate" | "up" | "down"), or a whole
    stacked tensor (transformers' own fused layout) with shard id "gate_up" | "down"."""

    def __init__(self, num_experts: int, hidden_size: int, inter_local: int):
        super().__init__()
        self.num_experts, self.inter_local = num_experts, inter_local
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * inter_local, hidden_size))
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden_size, inter_local))
        self.fp8 = None  # kernels.fused_moe.Fp8Experts once FP8 weights are loaded on CUDA (layers/fp8.py)
        for param in (self.w13, self.w2):
            param.weight_loader = self.weight_loader
        # the loader checks that every expert's every part arrived (or the stacked tensors)
        self.w13.expected_shards = ({(e, s) for e in range(num_experts) for s in (_GATE, _UP)}, {"gate_up"})
        self.w2.expected_shards = ({(e, _DOWN) for e in range(num_experts)}, {_DOWN})

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id) -> None:
        inter, rank = self.inter_local, tp_rank()
        if shard_id == "gate_up":  # [E, 2 * I_full, H]: gate rows, then up rows
            full = loaded.shape[1] // 2
            param.data[:, :inter].copy_(loaded[:, rank * inter: (rank + 1) * inter])
            param.data[:, inter:].copy_(loaded[:, full + rank * inter: full + (rank + 1) * inter])
            return
        if shard_id == _DOWN:  # [E, H, I_full]
            param.data.copy_(loaded[..., rank * inter: (rank + 1) * inter])
            return
        expert, part = shard_id
        if not 0 <= expert < self.num_experts:
            raise ValueError(f"checkpoint expert {expert} out of range: num_experts={self.num_experts}")
        if part == _DOWN:  # [H, I_full]: this rank's columns
            param.data[expert].copy_(loaded.narrow(1, rank * inter, inter))
        else:  # [I_full, H]: this rank's rows, into the gate or the up half
            offset = 0 if part == _GATE else inter
            param.data[expert, offset: offset + inter].copy_(loaded.narrow(0, rank * inter, inter))


# checkpoint spellings of an expert's three projections
EXPERT_PARTS = {"gate_proj": _GATE, "up_proj": _UP, "down_proj": _DOWN,  # Qwen-MoE
                "w1": _GATE, "w3": _UP, "w2": _DOWN}  # Mixtral
_PER_EXPERT = re.compile(r"^(.*\.experts)\.(\d+)\.(\w+)\.(weight|weight_scale_inv|weight_scale)$")
_STACKED = re.compile(r"^(.*\.experts)\.(gate_up_proj|down_proj)$")


def expert_checkpoint_name(ckpt_name: str) -> tuple[str, object] | None:
    """(our parameter, shard id) of a checkpoint tensor of the experts, or None for any other tensor. An FP8
    checkpoint's per-expert scales go to w13_<suffix> / w2_<suffix> (layers/fp8.py adds those parameters)."""
    m = _PER_EXPERT.match(ckpt_name)
    if m and m.group(3) in EXPERT_PARTS:
        part = EXPERT_PARTS[m.group(3)]
        suffix = "" if m.group(4) == "weight" else "_" + m.group(4)
        return f"{m.group(1)}.{'w2' if part == _DOWN else 'w13'}{suffix}", (int(m.group(2)), part)
    m = _STACKED.match(ckpt_name)
    if m:
        return (f"{m.group(1)}.w13", "gate_up") if m.group(2) == "gate_up_proj" else (f"{m.group(1)}.w2", _DOWN)
    return None


def refuse_unsupported(config, refused: dict) -> None:
    """Raise naming the first config field whose value this code would compute differently.
    refused: field -> predicate on its value that is True when unsupported (absent fields pass)."""
    for field, unsupported in refused.items():
        if hasattr(config, field) and unsupported(getattr(config, field)):
            arch = (getattr(config, "architectures", None) or ["this model"])[0]
            raise ValueError(f"{arch}: config field {field}={getattr(config, field)!r} is not supported by "
                             "nanoserve's MoE layer (softmax router, top-k, SwiGLU experts, no shared experts)")


def _nonzero(value) -> bool:
    return bool(value)


# Fields of other MoE variants (shared experts, grouped or biased top-k, other routers, scaled outputs).
# Present in a Qwen3-MoE or Mixtral config, they would change what the block computes.
OTHER_VARIANTS = {
    "shared_expert_intermediate_size": _nonzero, "n_shared_experts": _nonzero, "num_shared_experts": _nonzero,
    "moe_shared_expert_intermediate_size": _nonzero, "shared_expert_gate": _nonzero,
    "n_group": lambda v: v not in (None, 1), "topk_group": lambda v: v not in (None, 1),
    "topk_method": lambda v: v not in (None, "greedy"), "scoring_func": lambda v: v not in (None, "softmax"),
    "routed_scaling_factor": lambda v: v not in (None, 1, 1.0), "router_bias": _nonzero,
    "moe_router_bias": _nonzero, "first_k_dense_replace": _nonzero,
    "hidden_act": lambda v: v != "silu",
}
