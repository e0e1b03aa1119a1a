"""FP8 activations written by the kernels that produce them (kernels/fp8_fused_quant.py): the RMSNorm (with the
residual add) and SiLU-and-mul that write their output as float8_e4m3fn with a scale per token or per token and
group of columns. Each writes the bytes and scales of the unfused chain (the plain kernel, then the activation
quantization kernel) and, against float64, each scale is its group's max / 448 and each value is within e4m3's
rounding of the exact one. The FP8 GEMM takes the pair in place of a tensor, and a Llama block with FP8 weights
is fed by its producers, with the same products as unfused.

On the CPU the Triton kernels run in the interpreter (a child process, as in test_fused_ops.py), on ragged
sizes: hidden 192 and 576 (not multiples of 128, not powers of two), groups of 128 (block weights), of 16-64
(a row-parallel shard inside a 128-column block) and per token (channel weights). The gpu tests run the
compiled kernels at the Qwen3-8B shape and inside a CUDA graph.
"""
from __future__ import annotations

import pytest
import torch
from support.float64_ops import EPS, rms_norm64, silu_and_mul64
from support.interpreter_child import (INTERPRETING, KERNELS_RUN_HERE, assert_module_passes_under_interpreter,
                                       interpreter, needs_cuda)

pytest.importorskip("triton")

from kernels.fp8_quant import QuantizedActivations, dequantize_rows, quantize_rows_ref  # noqa: E402

if KERNELS_RUN_HERE:
    from kernels import fp8_fused_quant as fq
    from kernels import fp8_gemm
    from kernels import fused_ops as fo

FP8_MAX = 448.0
E4M3_HALF_STEP = 2.0**-4  # relative rounding of a normal e4m3 value (3 mantissa bits)
E4M3_SUBNORMAL_STEP = 2.0**-9  # e4m3's spacing below 2^-6, in units of the scale


def randn(*shape, gen, dtype, device="cpu") -> torch.Tensor:
    return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)


def activations(rows, cols, *, seed, dtype, device="cpu"):
    """Random activations with a few large channels, as real ones have, so that groups differ in scale."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=gen)
    x[:, torch.randperm(cols, generator=gen)[:3]] *= 20
    return x.to(device=device, dtype=dtype)


def columns_per_scale(qa: QuantizedActivations, group: int) -> int:
    return qa.q.shape[1] if qa.scale.shape[1] == 1 else group


def assert_quantizes_float64(qa: QuantizedActivations, exact: torch.Tensor, group: int, dtype: torch.dtype):
    """Each scale is its group's max |exact| / 448 and each value is within e4m3's rounding of the exact one (and
    the activation dtype's, which the kernels round to first)."""
    m, k = exact.shape
    num_groups = 1 if group >= k else -(-k // group)
    assert qa.q.dtype == torch.float8_e4m3fn and qa.q.shape == (m, k) and qa.scale.shape == (m, num_groups)
    cols = columns_per_scale(qa, group)
    padded = torch.nn.functional.pad(exact.abs(), (0, num_groups * cols - k)).view(m, num_groups, cols)
    # two roundings to bf16 before quantizing (2^-8 each to nearest on a GPU; the interpreter truncates: 2^-7)
    dtype_rel = 2.0**-6 if dtype == torch.bfloat16 else 1e-6
    torch.testing.assert_close(qa.scale.double(), padded.amax(-1) / FP8_MAX, rtol=dtype_rel, atol=0)
    values = dequantize_rows(qa.q, qa.scale, cols, torch.float64)
    per_column_scale = qa.scale.double().repeat_interleave(cols, 1)[:, :k]
    bound = (E4M3_HALF_STEP + dtype_rel) * exact.abs() + E4M3_SUBNORMAL_STEP * per_column_scale
    assert ((values - exact).abs() <= bound).all(), ((values - exact).abs() - bound).max()


def assert_same_quantization(qa: QuantizedActivations, q_ref: torch.Tensor, scale_ref: torch.Tensor, group: int):
    """The unfused chain's bytes and scales, up to the order the norm's sum of squares is added in: then a scale
    may move by an ulp and a rare value by one e4m3 step."""
    assert qa.q.shape == q_ref.shape and qa.scale.shape == scale_ref.shape
    torch.testing.assert_close(qa.scale, scale_ref, rtol=2.0**-7, atol=0)
    differ = qa.q.view(torch.uint8) != q_ref.view(torch.uint8)
    assert differ.float().mean().item() <= 2e-3, differ.sum().item()
    cols = columns_per_scale(qa, group)
    ours = dequantize_rows(qa.q, qa.scale, cols, torch.float64)
    theirs = dequantize_rows(q_ref, scale_ref, cols, torch.float64)
    per_column_scale = qa.scale.double().repeat_interleave(cols, 1)[:, : ours.shape[1]]
    step = 2 * E4M3_HALF_STEP * theirs.abs() + E4M3_SUBNORMAL_STEP * per_column_scale
    assert ((ours - theirs).abs() <= 1.01 * step + 1e-12).all()


# ---------------------------------------------------------------------------------------------
# CPU: the interpreter
# ---------------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.skipif(INTERPRETING, reason="this is the child process")
def test_fused_fp8_producers_pass_under_the_interpreter():
    assert_module_passes_under_interpreter(__file__, "test_fused_fp8_producers_pass_under_the_interpreter",
                                           timeout=600)


# (hidden, group): ragged blocks of 128, one scale per token (group >= hidden), groups inside a block
NORM_CASES = [(192, 128), (576, 128), (576, 576), (96, 128), (192, 32), (576, 64)]


@interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hidden, group", NORM_CASES)
@pytest.mark.parametrize("with_residual", [False, True])
def test_fused_rms_norm_writes_the_unfused_chains_fp8_and_matches_float64(dtype, hidden, group, with_residual):
    x = activations(5, hidden, seed=hidden + group, dtype=dtype)
    residual = activations(5, hidden, seed=hidden + group + 1, dtype=dtype) if with_residual else None
    weight = randn(hidden, gen=torch.Generator().manual_seed(group), dtype=dtype)
    out = fq.rms_norm_quant(x, weight, EPS, group, residual)
    plain = fo.rms_norm(x, weight, EPS, residual)
    if with_residual:
        (qa, summed), (plain, plain_summed) = out, plain
        assert torch.equal(summed, plain_summed)
    else:
        qa = out
    assert qa.dtype == dtype
    q_ref, scale_ref = fp8_gemm.quantize_rows(plain, min(group, hidden))
    assert_same_quantization(qa, q_ref, scale_ref, group)
    assert_quantizes_float64(qa, rms_norm64(x, weight, residual), group, dtype)
    if dtype == torch.float32:  # torch's reference chain too (the interpreter rounds bf16 its own way)
        ref = fq.rms_norm_quant_ref(x, weight, EPS, group, residual)
        ref = ref[0] if with_residual else ref
        assert_same_quantization(qa, ref.q, ref.scale, group)


# (intermediate, group, max_cols): per group in one or several programs a row, per token in chunks of the row (one
# chunk, or several whose maxes the second kernel joins); None: the engine's default
SILU_CASES = [(192, 128, None), (576, 128, 256), (576, 576, None), (576, 576, 128), (320, 32, 64), (160, 32, None)]


@interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("inter, group, max_cols", SILU_CASES)
def test_fused_silu_and_mul_writes_the_unfused_chains_fp8_and_matches_float64(dtype, inter, group, max_cols):
    x = activations(4, 2 * inter, seed=inter + group + (max_cols or 0), dtype=dtype)
    qa = fq.silu_and_mul_quant(x, group, max_cols=max_cols)
    assert qa.dtype == dtype
    q_ref, scale_ref = fp8_gemm.quantize_rows(fo.silu_and_mul(x), min(group, inter))
    assert_same_quantization(qa, q_ref, scale_ref, group)
    assert_quantizes_float64(qa, silu_and_mul64(x), group, dtype)
    if dtype == torch.float32:
        ref = fq.silu_and_mul_quant_ref(x, group)
        assert_same_quantization(qa, ref.q, ref.scale, group)


@interpreter
@pytest.mark.parametrize("rows", [5, 130])
@pytest.mark.parametrize("producer", ["norm", "silu_and_mul"])
def test_producers_write_the_same_scales_m_major_for_the_block_recipe(producer, rows):
    """m_major (a reader whose GEMM is torch's block recipe): the same bytes and scales, the scales laid out
    [groups, M rounded up to 128] and seen transposed, as cuBLASLt reads them, so no copy runs before the GEMM."""
    from kernels.fp8_quant import block_recipe_rows, m_major_in_place

    x = activations(rows, 512, seed=rows, dtype=torch.float32)
    if producer == "norm":
        weight = randn(512, gen=torch.Generator().manual_seed(1), dtype=torch.float32)
        residual = activations(rows, 512, seed=rows + 1, dtype=torch.float32)
        (row_major, summed), (m_major, summed_too) = (fq.rms_norm_quant(x, weight, EPS, 128, residual, m_major=m)
                                                      for m in (False, True))
        assert torch.equal(summed, summed_too)
    else:
        row_major, m_major = (fq.silu_and_mul_quant(x, 128, max_cols=128, m_major=m) for m in (False, True))
    leading = block_recipe_rows(rows)
    assert m_major.scale.stride() == (1, leading) and row_major.scale.stride() == (row_major.scale.shape[1], 1)
    assert torch.equal(m_major.scale, row_major.scale)
    assert torch.equal(m_major.q.view(torch.uint8), row_major.q.view(torch.uint8))
    assert m_major_in_place(m_major.scale, leading).data_ptr() == m_major.scale.data_ptr()


@interpreter
@pytest.mark.parametrize("inter, group, max_cols", [(576, 576, None), (576, 576, 128), (192, 128, None)])
def test_silu_and_mul_applies_an_unscaled_products_scales_as_scale_product_then_the_plain_kernels_would(
        inter, group, max_cols):
    """gate_up_proj's product before its per-token and per-channel scales (the tensor-wise FP8 GEMM's), scaled as
    SiLU-and-mul reads it: the same bytes as kernels/fp8_gemm.scale_product, then the fused kernel on its output."""
    gen = torch.Generator().manual_seed(inter + group)
    product = (activations(5, 2 * inter, seed=group, dtype=torch.float32) * 300).bfloat16()
    row_scale = torch.rand(5, 1, generator=gen) / 100 + 1e-3
    col_scale = torch.rand(2 * inter, 1, generator=gen) / 100 + 1e-3
    qa = fq.silu_and_mul_quant(product, group, max_cols=max_cols, scales=(row_scale, col_scale))
    scaled = fp8_gemm.scale_product(product.clone(), row_scale, col_scale, torch.bfloat16)
    ref = fq.silu_and_mul_quant(scaled, group, max_cols=max_cols)
    assert torch.equal(qa.scale, ref.scale) and torch.equal(qa.q.view(torch.uint8), ref.q.view(torch.uint8))
    assert qa.dtype == torch.bfloat16


@interpreter
def test_an_fp8_linear_hands_an_unscaled_product_only_where_the_tensor_wise_gemm_runs(monkeypatch):
    from kernels import fp8_gemm_dispatch as dispatch
    from kernels.fp8_quant import UnscaledProduct

    n, k = 64, 96
    x = activations(7, k, seed=3, dtype=torch.bfloat16)
    w, w_scale = quantize_rows_ref(randn(n, k, gen=torch.Generator().manual_seed(4), dtype=torch.float32), k)
    monkeypatch.setitem(dispatch.TABLE, (n, k), [(4, "triton"), (64, "unit_scaled_mm")])
    product = fp8_gemm.fp8_linear(x, w, w_scale, k, unscaled=True)
    assert isinstance(product, UnscaledProduct) and product.product.shape == (7, n)
    assert torch.equal(fp8_gemm.scaled(product), fp8_gemm.fp8_linear(x, w, w_scale, k))
    assert isinstance(fp8_gemm.fp8_linear(x[:3], w, w_scale, k, unscaled=True), torch.Tensor)  # Triton scales itself
    bias = torch.randn(n).bfloat16()
    assert isinstance(fp8_gemm.fp8_linear(x, w, w_scale, k, bias, unscaled=True), torch.Tensor)


@interpreter
def test_an_all_zero_token_quantizes_to_zeros_and_empty_batches_give_empty_pairs():
    x = activations(3, 192, seed=5, dtype=torch.float32)
    x[1] = 0.0
    weight = torch.ones(192)
    for qa in (fq.rms_norm_quant(x, weight, EPS, 128), fq.silu_and_mul_quant(torch.cat([x, x], 1), 128)):
        assert torch.isfinite(qa.scale).all() and not qa.q[1].float().any()
    empty = fq.rms_norm_quant(torch.empty(0, 192), weight, EPS, 128)
    assert empty.q.shape == (0, 192) and empty.scale.shape == (0, 2)
    assert fq.silu_and_mul_quant(torch.empty(0, 384), 192).scale.shape == (0, 1)


@interpreter
@pytest.mark.parametrize("group", [32, 192])  # block weights (a shard's groups) and channel weights
def test_the_fp8_gemm_on_a_producers_pair_equals_the_gemm_that_quantizes_its_input_itself(group):
    x = activations(5, 192, seed=7, dtype=torch.float32)
    weight = randn(192, gen=torch.Generator().manual_seed(1), dtype=torch.float32)
    w, w_scale = quantize_rows_ref(randn(40, 192, gen=torch.Generator().manual_seed(2), dtype=torch.float32), group)
    fused = fp8_gemm.fp8_linear(fq.rms_norm_quant(x, weight, EPS, group), w, w_scale, group)
    unfused = fp8_gemm.fp8_linear(fo.rms_norm(x, weight, EPS), w, w_scale, group)
    assert fused.shape == (5, 40) and fused.dtype == torch.float32
    torch.testing.assert_close(fused, unfused, rtol=1e-6, atol=1e-6)


@interpreter
def test_the_fp8_gemm_refuses_activations_quantized_in_other_groups_than_its_weights():
    x = activations(2, 192, seed=8, dtype=torch.float32)
    w, w_scale = quantize_rows_ref(x.repeat(4, 1), 32)  # 6 groups a row
    with pytest.raises(ValueError, match="quantized in 2 groups for a weight of 6"):
        fp8_gemm.fp8_linear(fq.rms_norm_quant(x, torch.ones(192), EPS, 128), w, w_scale, 32)


def tiny_llama(dtype):
    from transformers import LlamaConfig

    from executor_svc.models.llama import LlamaForCausalLM

    config = LlamaConfig(hidden_size=192, intermediate_size=320, num_attention_heads=4, num_key_value_heads=2,
                         num_hidden_layers=2, vocab_size=64, max_position_embeddings=64)
    with torch.device("cpu"):
        torch.set_default_dtype(dtype)
        try:
            model = LlamaForCausalLM(config)
        finally:
            torch.set_default_dtype(torch.float32)
    from executor_svc.model_loader import init_dummy_weights

    init_dummy_weights(model)
    return model.requires_grad_(False)


def to_fp8(layer, group):
    """The layer as executor_svc/layers/fp8.finish_loading leaves an FP8 layer on CUDA."""
    q, scale = quantize_rows_ref(layer.weight.data, group)
    layer.weight = torch.nn.Parameter(q, requires_grad=False)
    layer.weight_scale = torch.nn.Parameter(scale, requires_grad=False)
    layer.fp8_group_k = group


@interpreter
def test_a_llama_blocks_fp8_gemms_are_fed_by_their_producers_with_the_unfused_products(monkeypatch):
    # fp32: unfused, the CPU's layers run torch's norm, which rounds bf16 to nearest where the interpreter truncates
    from executor_svc.layers import fp8

    dtype = torch.float32
    model = tiny_llama(dtype)
    first, second = model.model.layers
    for layer in (first.self_attn.qkv_proj, first.self_attn.o_proj, first.mlp.gate_up_proj):
        to_fp8(layer, 128)  # block weights
    to_fp8(first.mlp.down_proj, 320)  # a channel weight: one scale per token
    to_fp8(second.self_attn.qkv_proj, 192)  # the second block's MLP stays plain, as a checkpoint may leave it
    for layer in (first.self_attn.qkv_proj, first.self_attn.o_proj):  # whole 128 x 128 blocks, as the loader finds
        layer.fp8_block_scales = layer.weight_scale[::128].contiguous()  # them (block_scales_of) for the block recipe

    monkeypatch.setenv(fp8.FUSED_QUANT_ENV, "0")
    assert fp8.quantize_in_producers(model) == 0 and first.input_layernorm.fp8_group is None
    assert fp8.scale_in_readers(model) == 0  # the attention layer would take qkv_proj's channel product otherwise
    monkeypatch.delenv(fp8.FUSED_QUANT_ENV)
    assert fp8.quantize_in_producers(model) == 5
    assert (first.input_layernorm.fp8_group, first.post_attention_layernorm.fp8_group, first.mlp.act_fn.fp8_group,
            second.input_layernorm.fp8_group) == (128, 128, 320, 192)
    # the attention layer before an FP8 o_proj (its decode steps may write FP8: tests/kernels/test_triton_attention.py)
    assert first.self_attn.attn.fp8_group == 128 and second.self_attn.attn.fp8_group is None
    assert second.post_attention_layernorm.fp8_group is None and second.mlp.act_fn.fp8_group is None
    assert model.model.norm.fp8_group is None, "the final norm feeds the LM head"
    # the block recipe's readers get their scales M-major (here fp32 runs the Triton GEMM, which reads either layout)
    assert (first.input_layernorm.fp8_m_major, first.self_attn.attn.fp8_m_major) == (True, True)
    assert not any(p.fp8_m_major for p in (first.post_attention_layernorm, first.mlp.act_fn, second.input_layernorm))

    gen = torch.Generator().manual_seed(3)
    hidden, residual = randn(6, 192, gen=gen, dtype=dtype), randn(6, 192, gen=gen, dtype=dtype)

    def block_products(block):
        normed, summed = block.input_layernorm(hidden, residual)
        qkv = block.self_attn.qkv_proj(normed)
        normed, _ = block.post_attention_layernorm(qkv[:, :192], summed)
        return qkv, block.mlp(normed)

    fused = [block_products(b) for b in (first, second)]
    assert isinstance(first.mlp.act_fn(torch.ones(6, 640, dtype=dtype)), QuantizedActivations)
    assert first.input_layernorm(hidden, residual)[0].scale.stride() == (1, 128)
    for producer in (first.input_layernorm, first.post_attention_layernorm, first.mlp.act_fn, second.input_layernorm,
                     first.self_attn.attn):
        producer.fp8_group = None
    unfused = [block_products(b) for b in (first, second)]
    for ours, theirs in zip(sum(fused, ()), sum(unfused, ())):
        assert ours.dtype == dtype
        torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4 * theirs.abs().max().item())


@interpreter
def test_a_channel_gate_up_proj_hands_silu_and_mul_its_product_unscaled_with_the_same_mlp_output():
    """bf16 (an unscaled product is only handed over in bf16): gate_up_proj with channel scales and an FP8 down_proj
    after SiLU-and-mul; the loader lets gate_up_proj's tensor-wise product reach SiLU-and-mul unscaled, and the MLP's
    output is the one it gives with the scale pass (the same bytes into down_proj). Block scales never do."""
    from executor_svc.layers import fp8
    from kernels.fp8_quant import UnscaledProduct

    model = tiny_llama(torch.bfloat16)
    first, second = model.model.layers
    to_fp8(first.mlp.gate_up_proj, 192)
    to_fp8(first.mlp.down_proj, 320)
    to_fp8(second.mlp.gate_up_proj, 128)  # block scales: applied inside the Triton GEMM
    to_fp8(second.mlp.down_proj, 128)
    fp8.quantize_in_producers(model)
    assert fp8.scale_in_readers(model) == 1 and first.mlp.gate_up_proj.fp8_unscaled_output
    assert not getattr(second.mlp.gate_up_proj, "fp8_unscaled_output", False)
    x = randn(6, 192, gen=torch.Generator().manual_seed(5), dtype=torch.bfloat16)
    assert isinstance(first.mlp.gate_up_proj(x), UnscaledProduct)  # 640 x 192 is not in the table: tensor-wise
    unscaled = first.mlp(x)
    first.mlp.gate_up_proj.fp8_unscaled_output = False
    assert isinstance(first.mlp.gate_up_proj(x), torch.Tensor)
    assert torch.equal(unscaled, first.mlp(x))
    first.mlp.act_fn.fp8_group = None  # a reader that writes no FP8 scales a handed product itself
    first.mlp.gate_up_proj.fp8_unscaled_output = True
    plain = first.mlp.act_fn(first.mlp.gate_up_proj(x))
    first.mlp.gate_up_proj.fp8_unscaled_output = False
    assert torch.equal(plain, first.mlp.act_fn(first.mlp.gate_up_proj(x)))


@interpreter
def test_o_proj_and_down_proj_hand_the_norm_after_them_their_products_unscaled_with_the_same_fp8_out(monkeypatch):
    """bf16, every projection FP8 with channel scales: o_proj's product reaches the post-attention norm and the first
    layer's down_proj's the second layer's input norm unscaled (each norm adds the residual and writes FP8), and what
    the norms write is what they write from the scaled products. The last down_proj feeds the final norm (plain): no.
    Under tensor parallelism the row-parallel layers keep their scale pass (their ranks' products are summed)."""
    from executor_svc.layers import fp8

    model = tiny_llama(torch.bfloat16)
    first, second = model.model.layers
    for block in (first, second):
        for layer, k in ((block.self_attn.qkv_proj, 192), (block.self_attn.o_proj, 192),
                         (block.mlp.gate_up_proj, 192), (block.mlp.down_proj, 320)):
            to_fp8(layer, k)
    fp8.quantize_in_producers(model)
    monkeypatch.setattr(fp8, "tp_size", lambda: 2)
    assert fp8.scale_in_readers(model) == 4  # the gate_up_projs and qkv_projs alone
    monkeypatch.setattr(fp8, "tp_size", lambda: 1)
    assert fp8.scale_in_readers(model) == 7
    assert not getattr(second.mlp.down_proj, "fp8_unscaled_output", False)
    gen = torch.Generator().manual_seed(6)
    attn_out, residual = randn(6, 192, gen=gen, dtype=torch.bfloat16), randn(6, 192, gen=gen, dtype=torch.bfloat16)

    def chain():
        normed, summed = first.post_attention_layernorm(first.self_attn.o_proj(attn_out), residual)
        return second.input_layernorm(first.mlp(normed), summed), summed

    (unscaled, unscaled_sum), post_sum = chain()
    for layer in (first.self_attn.o_proj, first.mlp.down_proj):
        layer.fp8_unscaled_output = False
    (scaled, scaled_sum), scaled_post_sum = chain()
    assert torch.equal(post_sum, scaled_post_sum) and torch.equal(unscaled_sum, scaled_sum)
    assert torch.equal(unscaled.scale, scaled.scale)
    assert torch.equal(unscaled.q.view(torch.uint8), scaled.q.view(torch.uint8))


@interpreter
def test_qkv_proj_hands_attention_its_product_unscaled_whose_scales_the_prologue_or_one_pass_applies(monkeypatch):
    """bf16, a channel FP8 qkv_proj: the loader lets its tensor-wise product reach the attention layer unscaled. Where
    the fused prologue runs (a CUDA backend that has it, no rotation) q, k and v stay views of the product and its
    scales go with them, split at q's and k's columns (the kernel's test checks that it then writes what it writes
    from the scaled product: tests/kernels/test_fused_ops.py); anywhere else split_qkv scales it first, to the bytes
    the projection's own scale pass gives. Block scales never hand it over."""
    from executor_svc.layers import fp8
    from executor_svc.layers.attention import Attention
    from kernels.attention.torch_backend import TorchAttentionBackend
    from kernels.fp8_quant import UnscaledProduct

    model = tiny_llama(torch.bfloat16)
    first, second = model.model.layers
    to_fp8(first.self_attn.qkv_proj, 192)
    to_fp8(second.self_attn.qkv_proj, 128)  # block scales: applied inside the Triton GEMM
    fp8.quantize_in_producers(model)
    assert fp8.scale_in_readers(model) == 1 and first.self_attn.qkv_proj.fp8_unscaled_output
    assert not getattr(second.self_attn.qkv_proj, "fp8_unscaled_output", False)
    attn = first.self_attn
    sizes = attn.q_size, attn.kv_size
    x = randn(6, 192, gen=torch.Generator().manual_seed(9), dtype=torch.bfloat16)
    product = attn.qkv_proj(x)
    assert isinstance(product, UnscaledProduct)  # 256 x 192 is not in the table: tensor-wise
    attn.qkv_proj.fp8_unscaled_output = False
    expected = attn.qkv_proj(x).split([sizes[0], sizes[1], sizes[1]], dim=-1)
    attn.attn.backend = TorchAttentionBackend()  # no fused prologue: scaled in one pass
    *qkv, scales = attn.attn.split_qkv(UnscaledProduct(product.product.clone(), *product[1:]), *sizes)
    assert scales is None and all(torch.equal(ours, theirs) for ours, theirs in zip(qkv, expected))
    monkeypatch.setattr(Attention, "_fused_prologue", lambda self, t: True)
    *qkv, scales = attn.attn.split_qkv(product, *sizes)
    assert qkv[0].data_ptr() == product.product.data_ptr(), "q, k and v stay views of the unscaled product"
    assert all(torch.equal(ours, theirs) for ours, theirs in zip(qkv, product.product.split([*sizes, sizes[1]], -1)))
    row_scale, *cols = scales
    assert row_scale is product.row_scale
    assert [c.shape[0] for c in cols] == [*sizes, sizes[1]] and torch.equal(torch.cat(cols), product.col_scale)


@interpreter
def test_a_norm_before_fp8_experts_writes_its_output_both_ways_and_the_experts_take_the_fp8_copy():
    """rms_norm_quant(keep_plain=True): the FP8 bytes of the plain call and, beside them, fused_ops.rms_norm's output
    (a MoE router reads it); fused_moe_fp8_activations given that FP8 copy gives what it gives quantizing x itself.
    Hidden 256 (two groups of 128), 4 experts top-2, fp32 (the interpreter's bf16 rounds by truncation)."""
    from kernels import fused_moe as fm
    from kernels.fused_moe_fp8_activations import GROUP, fused_moe_fp8_activations

    x, residual = activations(7, 256, seed=21, dtype=torch.float32), activations(7, 256, seed=22, dtype=torch.float32)
    weight = randn(256, gen=torch.Generator().manual_seed(23), dtype=torch.float32)
    both, summed = fq.rms_norm_quant(x, weight, EPS, GROUP, residual, keep_plain=True)
    fp8_only, _ = fq.rms_norm_quant(x, weight, EPS, GROUP, residual)
    plain, plain_sum = fo.rms_norm(x, weight, EPS, residual)
    assert fp8_only.plain is None and torch.equal(both.plain, plain) and torch.equal(summed, plain_sum)
    assert torch.equal(both.scale, fp8_only.scale) and torch.equal(both.q.view(torch.uint8), fp8_only.q.view(torch.uint8))

    gen = torch.Generator().manual_seed(24)
    logits = torch.randn(7, 4, generator=gen)
    w13, w2 = torch.randn(4, 2 * 128, 256, generator=gen) / 16, torch.randn(4, 256, 128, generator=gen) / 11
    q13, s13 = (t.view(4, 256, -1) for t in quantize_rows_ref(w13.reshape(-1, 256), 256))
    q2, s2 = (t.view(4, 256, -1) for t in quantize_rows_ref(w2.reshape(-1, 128), 128))
    experts = fm.Fp8Experts(s13, s2, 256, 128, activations="fp8")
    given = fused_moe_fp8_activations(plain, logits, q13, q2, 2, True, fp8=experts, quantized=both)
    itself = fused_moe_fp8_activations(plain, logits, q13, q2, 2, True, fp8=experts)
    assert torch.equal(given, itself)
    doubled = QuantizedActivations(both.q, both.scale * 2, both.dtype, both.plain)  # the copy is what the GEMMs read
    assert not torch.allclose(fused_moe_fp8_activations(plain, logits, q13, q2, 2, True, fp8=experts,
                                                        quantized=doubled), itself, rtol=0.1, atol=0.0)
    with pytest.raises(ValueError, match="per token and 128 columns"):
        fused_moe_fp8_activations(plain, logits, q13, q2, 2, True, fp8=experts,
                                  quantized=fq.rms_norm_quant(x, weight, EPS, 256, keep_plain=True))


@interpreter
def test_under_tensor_parallelism_silu_and_mul_quantizes_this_ranks_slice_in_down_projs_shard_groups():
    # rank 1 of 2 (its collective left out: this rank's partial sum is compared): intermediate 320 is 160 columns of
    # down_proj here, so block weights' groups shrink to gcd(128, 160) = 32 (as executor_svc/layers/fp8.py does);
    # the replicated norm before qkv_proj keeps the full hidden size's groups
    import math
    from unittest import mock

    from executor_svc.layers import fp8, linear, parallel

    tp = {"tp_rank": lambda: 1, "tp_size": lambda: 2}
    with mock.patch.multiple(parallel, **tp), mock.patch.multiple(linear, **tp), \
            mock.patch.object(linear, "all_reduce", lambda x: x):
        block = tiny_llama(torch.float32).model.layers[0]
        assert block.mlp.down_proj.weight.shape == (192, 160)
        to_fp8(block.self_attn.qkv_proj, 128)
        to_fp8(block.mlp.gate_up_proj, 128)
        to_fp8(block.mlp.down_proj, math.gcd(128, 160))
        model = torch.nn.ModuleList([block])
        assert fp8.quantize_in_producers(model) == 3
        assert (block.input_layernorm.fp8_group, block.mlp.act_fn.fp8_group) == (128, 32)
        x = randn(5, 192, gen=torch.Generator().manual_seed(4), dtype=torch.float32)
        act = block.mlp.act_fn(block.mlp.gate_up_proj(x))
        assert act.q.shape == (5, 160) and act.scale.shape == (5, 5)
        fused = block.mlp(x)
        block.mlp.act_fn.fp8_group = None
        torch.testing.assert_close(fused, block.mlp(x), rtol=1e-4, atol=1e-4 * fused.abs().max().item())


# ---------------------------------------------------------------------------------------------
# GPU
# ---------------------------------------------------------------------------------------------


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [1, 7, 300])
@pytest.mark.parametrize("hidden, inter, group", [(4096, 12288, 128), (4096, 12288, 4096), (576, 768, 128),
                                                  (4096, 6144, 64), (1024, 20000, 1024)])  # per token, two reads
def test_gpu_fused_producers_write_the_unfused_chains_fp8_and_match_float64(num_tokens, hidden, inter, group):
    dtype = torch.bfloat16
    x = activations(num_tokens, hidden, seed=num_tokens, dtype=dtype, device="cuda")
    residual = activations(num_tokens, hidden, seed=num_tokens + 1, dtype=dtype, device="cuda")
    weight = randn(hidden, gen=torch.Generator().manual_seed(0), dtype=dtype, device="cuda")
    qa, summed = fq.rms_norm_quant(x, weight, EPS, group, residual)
    plain, plain_summed = fo.rms_norm(x, weight, EPS, residual)
    assert torch.equal(summed, plain_summed)
    assert_same_quantization(qa, *fp8_gemm.quantize_rows(plain, min(group, hidden)), group)
    assert_quantizes_float64(qa, rms_norm64(x, weight, residual), group, dtype)
    inter_group = inter if group == hidden else group  # a channel down_proj: one scale per token
    gate_up = activations(num_tokens, 2 * inter, seed=num_tokens + 2, dtype=dtype, device="cuda")
    qa = fq.silu_and_mul_quant(gate_up, inter_group)
    assert_same_quantization(qa, *fp8_gemm.quantize_rows(fo.silu_and_mul(gate_up), min(inter_group, inter)),
                             inter_group)
    assert_quantizes_float64(qa, silu_and_mul64(gate_up), inter_group, dtype)


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("group", [128, 4096])
def test_gpu_fused_producers_replayed_from_a_cuda_graph_follow_new_inputs(group):
    dtype, hidden, inter = torch.bfloat16, 4096, 1536
    x, residual = (torch.empty(64, hidden, dtype=dtype, device="cuda") for _ in range(2))
    gate_up = torch.empty(64, 2 * inter, dtype=dtype, device="cuda")
    weight = randn(hidden, gen=torch.Generator().manual_seed(0), dtype=dtype, device="cuda")
    inter_group = min(group, inter)

    def run():
        return fq.rms_norm_quant(x, weight, EPS, group, residual), fq.silu_and_mul_quant(gate_up, inter_group)

    for seed in (1, 2):  # compile outside the graph
        x.copy_(activations(64, hidden, seed=seed, dtype=dtype, device="cuda"))
        run()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        (normed, summed), act = run()
    for seed in (3, 4):
        x.copy_(activations(64, hidden, seed=seed, dtype=dtype, device="cuda"))
        residual.copy_(activations(64, hidden, seed=seed + 10, dtype=dtype, device="cuda"))
        gate_up.copy_(activations(64, 2 * inter, seed=seed + 20, dtype=dtype, device="cuda"))
        graph.replay()
        (eager_normed, eager_summed), eager_act = run()
        assert torch.equal(summed, eager_summed) and torch.equal(normed.scale, eager_normed.scale)
        assert torch.equal(normed.q.view(torch.uint8), eager_normed.q.view(torch.uint8))
        assert torch.equal(act.scale, eager_act.scale)
        assert torch.equal(act.q.view(torch.uint8), eager_act.q.view(torch.uint8))
