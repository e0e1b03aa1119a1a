"""FP8 Linear weights: load an FP8 checkpoint's weights and scales into the tensor-parallel linear layers
(each through its own weight_loader, so they shard like the plain weights), or quantize plain weights
at load, then run the layers' products through the FP8 GEMM (kernels/fp8_gemm.py) on CUDA.

After loading, an FP8 layer holds `weight` float8_e4m3fn [N, K] (this rank's shard), `weight_scale`
float32 [N, G] and `fp8_group_k`: G = 1 is a scale per output row; else one per row and group of
fp8_group_k input columns. A checkpoint's 128 x 128 block scales are repeated over their rows at load,
so any row shard (a fused q/k/v or gate/up piece, a column-parallel split inside a block) takes its rows'
scales exactly. A row-parallel split inside a block shrinks the K group to the largest power of two
dividing both the block and the shard, so that every group still lies in one checkpoint block.

On CUDA, the modules whose output only an FP8 layer reads (the models list them: the RMSNorms before
qkv_proj and gate_up_proj, SiLU-and-mul before down_proj) are told that layer's activation groups and write
their output quantized (kernels/fp8_fused_quant.py); the GEMM then skips its own quantization kernel.
Where a channel layer's tensor-wise product has one reader that can apply its scales as it reads it (that norm or
SiLU-and-mul, or the attention layer's fused prologue after qkv_proj), the product goes to it unscaled
(scale_in_readers). NANOSERVE_FP8_FUSED_QUANT=0 turns both off (every FP8 GEMM quantizes its input and scales its
product itself), to compare. A checkpoint that bounds its activations' scales (fbgemm_fp8's activation_scale_ub)
gives each layer `fp8_max_scale`: its GEMM quantizes its own input under that bound (kernels/fp8_gemm.quantize_rows),
as the producers' fused quantization does not bound it, and its experts stay weight-only (their activations are not
quantized).

On a GPU without FP8 tensor cores (before Ada: an A100, an A10) the Linear layers keep their FP8 weights and run the
weight-only GEMM (kernels/fp8_gemm.weight_only_fp8_gemm: each W tile widened to the model dtype in the kernel, the
activations not quantized), so the weights keep FP8's memory (runs_weight_only_fp8_gemms; NANOSERVE_FP8_WEIGHT_ONLY=0
dequantizes them at load instead); its experts keep FP8 too, read as bytes by the weight-only MoE kernels
(Fp8Experts.weight_bytes). On the CPU the weights are dequantized at load
(weight * scale, in float32, then the model dtype) and the layers stay plain: the products are exact in the model
dtype; activations are not quantized (the log says so).

A mixture of experts' stacked weights (layers/fused_moe.StackedExperts: w13 [E, 2I, H], w2 [E, H, I]) convert the
same way, each whole or not at all: fp8 w13 and w2 with scales w13_scale [E, 2I, G13] and w2_scale [E, H, G2] in
the same canonical form (block scales repeated over their rows; under tensor parallelism gate/up take their rows'
scales, down_proj's K groups shrink to gcd(128, I / tp) where a rank's slice starts inside a block). On CUDA the
fused MoE kernels read them as FP8 (kernels/fused_moe.Fp8Experts: weight-only, the activations stay in the model
dtype); on the CPU they are dequantized like the Linear layers.
"""
from __future__ import annotations

import logging
import math
import os
from dataclasses import replace

import torch
from torch import nn

from executor_svc.layers.fused_moe import StackedExperts
from executor_svc.layers.linear import ColumnParallelLinear, RowParallelLinear
from executor_svc.layers.parallel import tp_rank, tp_size
from kernels.fp8_quant import (activation_max_scale, block_scales_of, dequantize_rows, quantize_blocks_on_rows,
                               quantize_weight_per_channel, rows_sharing_scales)
from kernels.kv_quant import FP8_DTYPE
from scheduler_svc.common.weight_quantization import WeightQuantization

log = logging.getLogger("nanoserve.executor")

# the narrowest K group a GPU GEMM takes: the Linear GEMM dots FP8 by FP8, whose K is 32 or more on sm_89/sm_90
# (tests/kernels/test_gpu_compile.py); the weight-only GEMMs (experts', and Linear layers' before sm_89) widen W to
# 16 bits first: a 16-bit dot's 16
MIN_GPU_GROUP, MIN_GPU_WEIGHT_ONLY_GROUP = 32, 16
FUSED_QUANT_ENV = "NANOSERVE_FP8_FUSED_QUANT"
# FP8 experts on a GPU multiply FP8 activations (kernels/fused_moe_fp8_activations.py: "fp8", the default where their
# scales allow it) or widen their weights to the activation dtype ("bf16", weight-only); see moe_activations
MOE_ACTIVATIONS_ENV = "NANOSERVE_FP8_MOE_ACTIVATIONS"


FP8_MIN_CAPABILITY = (8, 9)  # FP8 tensor cores: Ada and Hopper on; an A100 (8.0) has none


def runs_fp8_gemms(device: torch.device) -> bool:
    """Whether FP8 weights stay FP8 on this device for the FP8 GEMMs: a CUDA GPU with FP8 tensor cores. Elsewhere (the
    CPU, or a GPU before Ada, where torch._scaled_mm and Triton's FP8 dots do not run): runs_weight_only_fp8_gemms."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= FP8_MIN_CAPABILITY


WEIGHT_ONLY_ENV = "NANOSERVE_FP8_WEIGHT_ONLY"


def runs_weight_only_fp8_gemms(device: torch.device) -> bool:
    """Whether the Linear layers keep FP8 weights for the weight-only GEMM: a CUDA GPU without FP8 tensor cores (the
    weights keep FP8's memory), unless NANOSERVE_FP8_WEIGHT_ONLY=0. Elsewhere they are dequantized at load."""
    return device.type == "cuda" and not runs_fp8_gemms(device) and os.environ.get(WEIGHT_ONLY_ENV, "1") != "0"


def linear_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    return [(name, m) for name, m in model.named_modules() if isinstance(m, (ColumnParallelLinear, RowParallelLinear))]


def _checkpoint_names(name: str, packed: dict) -> list[str]:
    """The checkpoint modules a layer of ours loads: q_proj, k_proj and v_proj for a fused qkv_proj."""
    head, _, leaf = name.rpartition(".")
    parts = [ckpt for ckpt, (fused, _) in packed.items() if fused == leaf] or [leaf]
    return [f"{head}.{p}" if head else p for p in parts]


def prepare_checkpoint_layers(model: nn.Module, quant: WeightQuantization) -> int:
    """Before loading an FP8 checkpoint: give each converted layer (a Linear layer, or a block of stacked experts)
    an fp8 weight and its scale parameter (named as in the checkpoint), both with weight_loaders. A layer that
    loads several checkpoint modules converts all of them or none. Returns the number of layers converted."""
    layers = [(name, layer, _checkpoint_names(name, model.packed_modules_mapping), _add_fp8_parameters)
              for name, layer in linear_layers(model)]
    layers += [(name, experts, [f"{name}.{e}.{proj}" for e in range(experts.num_experts)
                                for proj in ("gate_proj", "up_proj", "down_proj")], _add_fp8_expert_parameters)
               for name, experts in expert_layers(model)]
    converted = 0
    for name, layer, modules, add_parameters in layers:
        pieces = [quant.converts(module) for module in modules]
        if not any(pieces):
            continue
        if not all(pieces):
            raise ValueError(f"{name}: the checkpoint converts only some of the modules it loads")
        add_parameters(layer, quant)
        converted += 1
    return converted


def expert_layers(model: nn.Module) -> list[tuple[str, StackedExperts]]:
    return [(name, m) for name, m in model.named_modules() if isinstance(m, StackedExperts)]


def _add_fp8_expert_parameters(experts: StackedExperts, quant: WeightQuantization) -> None:
    """fp8 w13 / w2 (loaded by the experts' own loader, shard by shard) and their scales, named as the checkpoint's
    scale tensors: w13_<scale name> [E, 2I, G13], w2_<scale name> [E, H, G2], in the canonical per-row form."""
    num_experts, hidden, inter = experts.num_experts, experts.w13.shape[2], experts.inter_local
    for attr in ("w13", "w2"):
        plain = getattr(experts, attr)
        weight = nn.Parameter(torch.empty(plain.shape, dtype=FP8_DTYPE, device=plain.device), requires_grad=False)
        weight.weight_loader = plain.weight_loader
        weight.expected_shards = plain.expected_shards[:1]  # FP8 checkpoints store each expert's projections
        setattr(experts, attr, weight)
    group13 = experts.fp8_group_k13 = _k_group(quant, hidden, k_split=False)
    group2 = experts.fp8_group_k2 = _k_group(quant, inter, k_split=True)
    device = experts.w13.device
    rank = tp_rank()

    def load_w13_scale(param: nn.Parameter, loaded: torch.Tensor, shard_id) -> None:
        expert, part = shard_id  # gate_proj / up_proj [I_full, H]: this rank's rows, all of K's groups
        loaded = _checked_scale(loaded, quant, inter * tp_size(), hidden)
        per_row = _scales_per_row(loaded, quant, inter * tp_size(), 0, hidden, group13)
        offset = 0 if part == "gate" else inter
        param.data[expert, offset: offset + inter].copy_(per_row[rank * inter: (rank + 1) * inter])

    def load_w2_scale(param: nn.Parameter, loaded: torch.Tensor, shard_id) -> None:
        expert, _ = shard_id  # down_proj [H, I_full]: every row, this rank's K groups
        loaded = _checked_scale(loaded, quant, hidden, inter * tp_size())
        param.data[expert].copy_(_scales_per_row(loaded, quant, hidden, rank * inter, inter, group2)[:hidden])

    for attr, shape, loader in (("w13", (num_experts, 2 * inter, -(-hidden // group13)), load_w13_scale),
                                ("w2", (num_experts, hidden, -(-inter // group2)), load_w2_scale)):
        scale = nn.Parameter(torch.empty(shape, dtype=torch.float32, device=device), requires_grad=False)
        scale.weight_loader = loader
        scale.expected_shards = getattr(experts, attr).expected_shards
        experts.register_parameter(f"{attr}_{quant.scale_name}", scale)


def _add_fp8_parameters(layer: nn.Module, quant: WeightQuantization) -> None:
    n, k = layer.weight.shape
    row_parallel = isinstance(layer, RowParallelLinear)
    device = layer.weight.device
    weight = nn.Parameter(torch.empty(n, k, dtype=FP8_DTYPE, device=device), requires_grad=False)
    weight.weight_loader = layer.weight_loader  # fp8 bytes shard like any weight
    layer.weight = weight
    group = layer.fp8_group_k = _k_group(quant, k, k_split=row_parallel)
    scale = nn.Parameter(torch.empty(n, -(-k // group), dtype=torch.float32, device=device), requires_grad=False)

    def load_scale(param: nn.Parameter, loaded: torch.Tensor, *shard_id) -> None:
        loaded = _checked_scale(loaded, quant, param.shape[0] if row_parallel else _rows_of(layer, shard_id),
                                k * tp_size() if row_parallel else k)
        if row_parallel:  # every row, this rank's K columns
            param.data.copy_(_scales_per_row(loaded, quant, param.shape[0], tp_rank() * k, k, group)[: param.shape[0]])
        else:  # all of K; the layer's own loader takes this rank's rows
            layer.weight_loader(param, _scales_per_row(loaded, quant, _rows_of(layer, shard_id), 0, k, group),
                                *shard_id)

    scale.weight_loader = load_scale
    layer.register_parameter(quant.scale_name, scale)


def _checked_scale(loaded: torch.Tensor, quant: WeightQuantization, rows: int, cols: int) -> torch.Tensor:
    """A checkpoint's scale tensor for a rows x cols FP8 weight, refused where its shape is not the format's (the block
    grid [ceil(rows / bn), ceil(cols / bk)], which ModelOpt writes [.., 1, .., 1]; one scale per row, or one for the
    tensor) or its values are not finite and non-negative: either would load silently into wrong weights."""
    if quant.scheme == "block" and loaded.dim() == 4 and loaded.shape[1] == loaded.shape[3] == 1:
        loaded = loaded.reshape(loaded.shape[0], loaded.shape[2])
    if quant.scheme == "block":
        want = f"[{-(-rows // quant.block[0])}, {-(-cols // quant.block[1])}]"
        fits = list(loaded.shape) == [-(-rows // quant.block[0]), -(-cols // quant.block[1])]
    else:
        want = f"[{rows}, 1], [{rows}] or one value"
        fits = loaded.numel() == 1 or (loaded.numel() == rows and loaded.dim() <= 2 and loaded.shape[0] == rows)
    if not fits:
        raise ValueError(f"an FP8 scale of shape {list(loaded.shape)} for a {rows} x {cols} weight: the format "
                         f"({quant.describe()}) has {want}")
    values = loaded.float()
    if not bool(torch.isfinite(values).all()) or bool((values < 0).any()):
        bad = values[~torch.isfinite(values) | (values < 0)]
        raise ValueError(f"an FP8 scale holding {bad.numel()} values that are not finite and non-negative "
                         f"(e.g. {bad[0].item()})")
    return loaded


def _refuse_nan_bytes(name: str, q: torch.Tensor) -> None:
    """Refuse FP8 weights holding NaN (the bytes 0x7F and 0xFF): no quantizer writes them, so they mean a corrupted
    file, and one would make NaN of every product it enters. One pass over the bytes, on their device."""
    nan = (q.view(torch.uint8) & 0x7F) == 0x7F
    if bool(nan.any()):
        raise ValueError(f"{name}: its FP8 weight holds {int(nan.sum())} NaN values (bytes 0x7F or 0xFF), which no "
                         "FP8 quantizer writes: the checkpoint's file is corrupted")


def _k_group(quant: WeightQuantization, k: int, k_split: bool) -> int:
    """The input columns each scale of a rank's weight covers, K of them on this rank: all of them (channel scales),
    or the checkpoint block's, shrunk to gcd(block, K) where the ranks split K (a slice may start inside a block)."""
    if quant.scheme == "channel":
        return k
    block_k = quant.block[1]
    return math.gcd(block_k, k) if k_split and tp_size() > 1 else block_k


def _scales_per_row(loaded: torch.Tensor, quant: WeightQuantization, rows: int, col_start: int, cols: int,
                    group: int) -> torch.Tensor:
    """A checkpoint's scale tensor in the canonical form, float32 [rows, groups of the K columns [col_start, col_start
    + cols)]: channel scales [N, 1] as they are (one for the whole tensor: repeated over `rows`); block scales
    [ceil(N/bn), ceil(K/bk)] taken per input column, every `group`-th of those columns, and repeated over their
    block's rows (ceil-padded: the loaders read only the real ones)."""
    loaded = loaded.float()
    if quant.scheme == "channel":
        per_row = loaded.reshape(-1, 1)
        return per_row.expand(rows, 1) if per_row.shape[0] == 1 else per_row
    block_n, block_k = quant.block
    return loaded.repeat_interleave(block_k, 1)[:, col_start: col_start + cols: group].repeat_interleave(block_n, 0)


def _check_gpu_group(name: str, group: int, minimum: int = MIN_GPU_GROUP) -> None:
    if group < minimum:
        raise ValueError(f"{name}: its shard splits the FP8 scale blocks into groups of {group} columns; the GEMM "
                         f"needs {minimum}: choose another --tensor-parallel-size")


def _rows_of(layer: nn.Module, shard_id: tuple) -> int:
    """The checkpoint rows of one piece of a (fused) column-parallel layer, over all ranks."""
    if not shard_id:
        return layer.weight.shape[0] * tp_size()
    sid = shard_id[0]
    if hasattr(layer, "output_sizes"):
        return layer.output_sizes[sid]
    heads = layer.num_heads if sid == "q" else layer.num_kv_heads
    return heads * layer.head_dim * tp_size()


def quantize_plain(w: torch.Tensor, quant: WeightQuantization) -> tuple[torch.Tensor, torch.Tensor, int]:
    """A plain weight [N, K] quantized at load, as (fp8 weight, scales in the canonical form, K group): per output row
    (--quantization fp8), or in the square blocks of a block checkpoint's format (random weights drawn for a block
    checkpoint's config: model_loader's dummy format), each block's scale repeated over its rows as the loader lays a
    checkpoint's."""
    if quant.scheme == "block":
        return *quantize_blocks_on_rows(w, tuple(quant.block)), quant.block[1]
    q, scale = quantize_weight_per_channel(w)
    return q, scale, q.shape[1]


@torch.no_grad()
def finish_loading(model: nn.Module, quant: WeightQuantization, dtype: torch.dtype, device: torch.device) -> int:
    """After loading: quantize plain weights (online), give every FP8 layer its `weight_scale`, and where FP8 GEMMs
    do not run (runs_fp8_gemms) nor the weight-only ones (runs_weight_only_fp8_gemms: a GPU before Ada) dequantize them
    into plain weights of `dtype` (the CPU). Returns the number of FP8 layers."""
    fp8_gemms = runs_fp8_gemms(device)
    weight_only = not fp8_gemms and runs_weight_only_fp8_gemms(device)
    block_recipe = False  # whether block weights may also run on cuBLASLt's block-scaled kernels
    if fp8_gemms and quant.scheme == "block":
        from kernels.fp8_gemm import block_recipe_runs

        block_recipe = block_recipe_runs(device)
    count = 0
    for name, layer in linear_layers(model):
        if layer.weight.dtype != FP8_DTYPE:
            if quant.from_checkpoint:
                continue  # a module the checkpoint did not convert
            q, scale, layer.fp8_group_k = quantize_plain(layer.weight.data, quant)
        else:
            q, scale = layer.weight.data, getattr(layer, quant.scale_name).data
            delattr(layer, quant.scale_name)
            _refuse_nan_bytes(name, q)
        count += 1
        if not fp8_gemms and not weight_only:
            layer.weight = nn.Parameter(dequantize_rows(q, scale, layer.fp8_group_k).to(dtype), requires_grad=False)
            continue
        _check_gpu_group(name, layer.fp8_group_k, MIN_GPU_WEIGHT_ONLY_GROUP if weight_only else MIN_GPU_GROUP)
        layer.fp8_weight_only = weight_only
        layer.weight = nn.Parameter(q.contiguous(), requires_grad=False)
        layer.weight_scale = nn.Parameter(scale.contiguous(), requires_grad=False)
        layer.fp8_rows_sharing_scales = rows_sharing_scales(layer.weight_scale)
        layer.fp8_block_scales = (block_scales_of(layer.weight_scale, layer.fp8_group_k, layer.fp8_rows_sharing_scales)
                                  if block_recipe else None)
        if quant.activation_scale_ub is not None and not weight_only:
            layer.fp8_max_scale = activation_max_scale(quant.activation_scale_ub)
    expert_blocks = sum(_finish_experts(name, experts, quant, dtype, device, fp8_gemms, weight_only)
                        for name, experts in expert_layers(model))
    plain = str(dtype).removeprefix("torch.")
    if fp8_gemms:
        where = "FP8 GEMMs"
    elif weight_only:
        major, minor = torch.cuda.get_device_capability(device)
        where = (f"weight-only FP8 GEMMs: this GPU (sm_{major}{minor}) has no FP8 tensor cores, so the activations "
                 f"stay {plain} and each weight tile is widened in the kernel; the weights keep FP8's memory")
    elif device.type != "cuda":
        where = f"dequantized to {plain} on the CPU"
    else:
        major, minor = torch.cuda.get_device_capability(device)
        where = (f"dequantized to {plain}: this GPU (sm_{major}{minor}) has no FP8 tensor cores (sm_89 and up), so "
                 f"they take {plain}'s memory")
    log.info("fp8 weights (%s): %d linear layers%s, %s", quant.describe(), count,
             f" and {expert_blocks} expert blocks" if expert_blocks else "", where)
    if quant.unused:
        log.info("the checkpoint's static scales (%s) are not used: activations are quantized per token at run time",
                 ", ".join(quant.unused))
    if quant.activation_scale_ub is not None and fp8_gemms:
        log.info("fp8 activations: a token's max counts for at most %g in its scale (activation_scale_ub); larger "
                 "values saturate", quant.activation_scale_ub)
    if fp8_gemms:
        from kernels.fp8_gemm import split_counters, unit_scale
        from kernels.fp8_gemm_dispatch import cublaslt_named

        split_counters(device)  # before the decode graphs are captured: a split-K GEMM counts its tiles there
        unit_scale(device)  # and the tensor-wise GEMM's scales
        if cublaslt_named():  # and cuBLASLt's handle and workspace, where the dispatch names its algorithms
            from kernels import cublaslt

            cublaslt.prepare(device)
        fused = quantize_in_producers(model)
        unscaled = scale_in_readers(model)
        w8a8 = sum(1 for _, experts in expert_layers(model)
                   if getattr(experts, "fp8", None) is not None and experts.fp8.activations == "fp8")
        log.info("fp8 activations: %d of them quantized by the kernel that produces them; %d products scaled by the "
                 "kernel that reads them; %d of %d expert blocks multiply FP8 activations", fused, unscaled, w8a8,
                 expert_blocks)
    return count


def quantize_in_producers(model: nn.Module) -> int:
    """Tell each producer whose Linear layer (its only reader) has FP8 weights the groups that layer's GEMM
    quantizes its input in, so that it writes its output so (a CUDA model, after finish_loading); and each norm
    before a mixture of experts that multiplies FP8 activations to write its output both ways (its router reads it
    as it is). Returns the number of layers fed so."""
    from kernels.fp8_fused_quant import can_quantize_in_groups
    from kernels.fp8_gemm_dispatch import M_MAJOR_SCALES

    if os.environ.get(FUSED_QUANT_ENV, "1") == "0":
        return 0
    fed = 0
    for module in model.modules():
        for producer, moe in getattr(module, "fp8_router_producers", list)():
            fp8 = getattr(moe.experts, "fp8", None)
            if fp8 is not None and fp8.activations == "fp8":  # x per token and 128 columns, the router's x as it is
                from kernels.fused_moe_fp8_activations import GROUP

                producer.fp8_group, producer.fp8_keeps_plain = GROUP, True
                fed += 1
        for producer, layer in getattr(module, "fp8_activation_producers", list)():
            if layer.weight.dtype != FP8_DTYPE:
                continue  # a plain layer the checkpoint did not convert
            if getattr(layer, "fp8_max_scale", None) is not None:
                continue  # its scales are bounded, which only its own quantize_rows does
            k = layer.weight.shape[1]
            group = layer.fp8_group_k if layer.weight_scale.shape[1] > 1 else k
            if can_quantize_in_groups(group, k):
                producer.fp8_group = group
                # the block recipe reads its activations' scales M-major (kernels/fp8_gemm.block_scaled_mm_fp8_gemm)
                producer.fp8_m_major = M_MAJOR_SCALES and getattr(layer, "fp8_block_scales", None) is not None
                fed += 1
    return fed


def scale_in_readers(model: nn.Module) -> int:
    """Let each FP8 Linear layer with channel scales hand its product unscaled to its one reader where that reader
    quantizes its own output (quantize_in_producers set it) and so applies the scales as it reads (the tensor-wise
    GEMM's scale pass saved), or is the attention layer (`applies_fp8_product_scales`: its fused prologue scales q,
    k and v as it reads them). Not a row-parallel layer under tensor parallelism: its ranks' partial products are
    summed, each scaled by its own rank's token scales. Returns the number of such layers."""
    if os.environ.get(FUSED_QUANT_ENV, "1") == "0":
        return 0
    count = 0
    for module in model.modules():
        for layer, reader in getattr(module, "fp8_unscaled_readers", list)():
            if isinstance(layer, RowParallelLinear) and tp_size() > 1:
                continue
            applies = getattr(reader, "fp8_group", None) is not None or getattr(reader, "applies_fp8_product_scales",
                                                                                  False)
            if layer.weight.dtype == FP8_DTYPE and layer.weight_scale.shape[1] == 1 and applies:
                layer.fp8_unscaled_output = True
                count += 1
    return count


def _finish_experts(name: str, experts: StackedExperts, quant: WeightQuantization, dtype: torch.dtype,
                    device: torch.device, fp8_gemms: bool, weight_only: bool = False) -> int:
    """One StackedExperts after loading, as finish_loading does a Linear layer: quantized per row if plain (online),
    then FP8 with `experts.fp8` where FP8 GEMMs run (`fp8_gemms`: runs_fp8_gemms) or the weight-only ones
    (`weight_only`: read as bytes, Fp8Experts.weight_bytes), dequantized elsewhere. Returns 1 if it holds FP8
    weights, else 0."""
    from executor_svc.layers import fused_moe

    if experts.w13.dtype != FP8_DTYPE:
        if quant.from_checkpoint:
            return 0  # experts the checkpoint did not convert
        stacked = {}
        for attr in ("w13", "w2"):  # each expert on its own, as a checkpoint holds them (a block never spans two)
            parts = [quantize_plain(w, quant) for w in getattr(experts, attr).data]
            stacked[attr] = torch.stack([q for q, _, _ in parts]), torch.stack([scale for _, scale, _ in parts])
            setattr(experts, "fp8_group_k13" if attr == "w13" else "fp8_group_k2", parts[0][2])
    else:
        stacked = {attr: (getattr(experts, attr).data, getattr(experts, f"{attr}_{quant.scale_name}").data)
                   for attr in ("w13", "w2")}
        for attr in ("w13", "w2"):
            delattr(experts, f"{attr}_{quant.scale_name}")
            _refuse_nan_bytes(f"{name}.{attr}", stacked[attr][0])
    groups = {"w13": experts.fp8_group_k13, "w2": experts.fp8_group_k2}
    on_gpu = (fp8_gemms or weight_only) and fused_moe.moe_kernels is not None
    if on_gpu:
        _check_gpu_group(name, experts.fp8_group_k2, MIN_GPU_WEIGHT_ONLY_GROUP)  # gate/up's K (hidden) is never split
    for attr, (q, scale) in stacked.items():
        if not on_gpu:
            plain = dequantize_rows(q.reshape(-1, q.shape[-1]), scale.reshape(-1, scale.shape[-1]), groups[attr])
            setattr(experts, attr, nn.Parameter(plain.view(q.shape).to(dtype), requires_grad=False))
        else:
            setattr(experts, attr, nn.Parameter(q.contiguous(), requires_grad=False))
    if on_gpu:
        scales = stacked["w13"][1].contiguous(), stacked["w2"][1].contiguous()
        experts.fp8 = fused_moe.moe_kernels.Fp8Experts(*scales, experts.fp8_group_k13, experts.fp8_group_k2,
                                                       weight_bytes=not fp8_gemms)
        bounded = quant.activation_scale_ub is not None  # w8a8 experts would not bound their activations' scales
        experts.fp8 = replace(experts.fp8, activations=moe_activations(name, experts.fp8, bounded))
    return 1


def moe_activations(name: str, scales, bounded: bool = False) -> str:
    """What FP8 experts (`scales`, a kernels/fused_moe.Fp8Experts) multiply on a GPU: "fp8" (w8a8: x and h quantized
    per token and 128 columns, FP8 by FP8 on the tensor cores; 1.12x the weight-only path on the Qwen3-30B-A3B shape,
    bench/RESULTS.md 2026-12-04) where their scales are per row or per 128 columns and the checkpoint does not bound
    the activations' scales (`bounded`: fbgemm_fp8's activation_scale_ub), else "bf16" (weight-only: each FP8
    weight tile widened to the activation dtype, exact). NANOSERVE_FP8_MOE_ACTIVATIONS=bf16 keeps every checkpoint
    weight-only; =fp8 refuses one whose scales do not allow it rather than falling back."""
    from kernels.fused_moe_fp8_activations import takes_fp8_activations

    asked = os.environ.get(MOE_ACTIVATIONS_ENV, "")
    if asked not in ("", "fp8", "bf16"):
        raise ValueError(f"{MOE_ACTIVATIONS_ENV}={asked!r}: expected 'fp8' (FP8 activations) or 'bf16' (weight-only)")
    if scales.weight_bytes:  # a GPU without FP8 tensor cores: weight-only
        if asked == "fp8":
            raise ValueError(f"{MOE_ACTIVATIONS_ENV}=fp8: FP8 activations need FP8 tensor cores (sm_89 and up)")
        return "bf16"
    if asked == "bf16":
        return "bf16"
    if bounded:
        if asked == "fp8":
            raise ValueError(f"{MOE_ACTIVATIONS_ENV}=fp8: the checkpoint bounds its activations' scales "
                             "(activation_scale_ub), which the FP8-activation experts do not apply")
        return "bf16"
    if takes_fp8_activations(scales):
        return "fp8"
    if asked == "fp8":
        raise ValueError(f"{MOE_ACTIVATIONS_ENV}=fp8: {name}'s expert scales come in groups of {scales.group_k13} "
                         f"and {scales.group_k2} columns; FP8 activations need 128 or a scale per row")
    return "bf16"
