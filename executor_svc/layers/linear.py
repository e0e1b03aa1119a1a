"""Tensor-parallel linear layers (Megatron split) that load their own shard of each weight.

Column-parallel layers split W's output rows across ranks, so each rank computes a slice of the
output; row-parallel layers split W's input columns, so each rank computes a partial sum that an
all_reduce completes. A column layer feeding a row layer needs no communication in between.
"""
import torch
import torch.nn.functional as F
from torch import nn

from executor_svc.layers.parallel import all_reduce, shard_size, tp_rank, tp_size
from kernels.kv_quant import FP8_DTYPE

try:
    from kernels import fp8_gemm
except ImportError:  # no Triton: FP8 weights are dequantized at load (CPU)
    fp8_gemm = None


def _matmul(layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ W^T + bias; an FP8 weight (executor_svc/layers/fp8.py) goes through the FP8 GEMM, whose product may come
    back unscaled where the layer's one reader applies the scales (`fp8_unscaled_output`, set at load)."""
    if getattr(layer, "fp8_weight_only", False):  # FP8 weights on a GPU before sm_89
        return fp8_gemm.weight_only_fp8_gemm(x, layer.weight, layer.weight_scale, layer.fp8_group_k, bias,
                                             rows_sharing_scales=getattr(layer, "fp8_rows_sharing_scales", 1))
    if layer.weight.dtype == FP8_DTYPE:
        return fp8_gemm.fp8_linear(x, layer.weight, layer.weight_scale, layer.fp8_group_k, bias,
                                   unscaled=getattr(layer, "fp8_unscaled_output", False),
                                   rows_sharing_scales=getattr(layer, "fp8_rows_sharing_scales", 1),
                                   block_scales=getattr(layer, "fp8_block_scales", None),
                                   max_scale=getattr(layer, "fp8_max_scale", None))
    return F.linear(x, layer.weight, bias)


def _copy_rows(param: nn.Parameter, loaded: torch.Tensor, offset: int, rows: int) -> None:
    """Copy this rank's `rows` rows of `loaded` into param rows [offset, offset + rows)."""
    param.data.narrow(0, offset, rows).copy_(loaded.narrow(0, tp_rank() * rows, rows))


class ColumnParallelLinear(nn.Module):
    def __init__(self, input_size: int, output_size: int, bias: bool = False):
        super().__init__()
        self.output_size_local = shard_size(output_size, "output_size")
        self.weight = nn.Parameter(torch.empty(self.output_size_local, input_size))
        self.weight.weight_loader = self.weight_loader
        self.bias = None
        if bias:
            self.bias = nn.Parameter(torch.empty(self.output_size_local))
            self.bias.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        _copy_rows(param, loaded, 0, param.shape[0])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _matmul(self, x, self.bias)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of one input in one matmul (gate_proj and up_proj).

    Checkpoint tensor `shard_id` (an index into output_sizes) lands in its own block of rows.
    """

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False):
        self.output_sizes = output_sizes
        for i, size in enumerate(output_sizes):
            shard_size(size, f"output_sizes[{i}]")
        super().__init__(input_size, sum(output_sizes), bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int) -> None:
        offset = sum(self.output_sizes[:shard_id]) // tp_size()
        rows = self.output_sizes[shard_id] // tp_size()
        _copy_rows(param, loaded, offset, rows)


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v projections in one matmul; each rank owns whole heads of each.

    Output layout per rank: [q heads | k heads | v heads], each head `head_dim` wide.
    """

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool = False):
        self.head_dim = head_dim
        self.num_heads = shard_size(num_heads, "num_attention_heads")
        self.num_kv_heads = shard_size(num_kv_heads, "num_key_value_heads")
        super().__init__(hidden_size, (num_heads + 2 * num_kv_heads) * head_dim, bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str) -> None:
        q_rows = self.num_heads * self.head_dim
        kv_rows = self.num_kv_heads * self.head_dim
        offset, rows = {"q": (0, q_rows), "k": (q_rows, kv_rows), "v": (q_rows + kv_rows, kv_rows)}[shard_id]
        _copy_rows(param, loaded, offset, rows)


class RowParallelLinear(nn.Module):
    def __init__(self, input_size: int, output_size: int, bias: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(output_size, shard_size(input_size, "input_size")))
        self.weight.weight_loader = self.weight_loader
        self.bias = None
        if bias:  # not split: added once, on rank 0, before the sum over ranks
            self.bias = nn.Parameter(torch.empty(output_size))
            self.bias.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        if param is self.bias:
            param.data.copy_(loaded)
            return
        cols = param.shape[1]
        param.data.copy_(loaded.narrow(1, tp_rank() * cols, cols))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = self.bias if tp_rank() == 0 else None
        return all_reduce(_matmul(self, x, bias))
