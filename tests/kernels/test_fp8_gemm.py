"""The FP8 GEMM of FP8 Linear weights (kernels/fp8_gemm.py): the activation quantization kernel writes
exactly kernels/fp8_quant.quantize_rows_ref's bytes and scales, and both GEMMs (Triton with block or
channel scales, torch._scaled_mm with channel scales) match a float64 GEMM over the dequantized operands,
on fresh random inputs with ragged edges (M, N and K not multiples of the tiles or of the scale groups).

On the CPU the Triton kernels run, unchanged, in the interpreter (a child process): Triton 3.6's
interpreter loads and dots float8_e4m3fn operands (in fp32), so the GPU's code is what is checked there,
at tiny shapes (a dot of K 16, which a GPU would also take).
"""
from __future__ import annotations

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st
from support.interpreter_child import (INTERPRETING, KERNELS_RUN_HERE, assert_module_passes_under_interpreter,
                                       interpreter, needs_cuda)

pytest.importorskip("triton")

from kernels.fp8_quant import fp8_gemm_ref, quantize_blocks_on_rows, quantize_rows_ref  # noqa: E402

if KERNELS_RUN_HERE:
    import triton
    import triton.language as tl

    from kernels import fp8_gemm

    @triton.jit
    def _decode_bytes_kernel(b_ptr, out_ptr, BLOCK: tl.constexpr):
        offs = tl.arange(0, BLOCK)
        tl.store(out_ptr + offs, fp8_gemm.e4m3_from_bytes(tl.load(b_ptr + offs)))

    @triton.jit
    def _bytes_as_fp16_kernel(b_ptr, out_ptr, BLOCK: tl.constexpr):
        offs = tl.arange(0, BLOCK)
        tl.store(out_ptr + offs, fp8_gemm.e4m3_as_fp16(tl.load(b_ptr + offs)))


def operands(m, n, k, group, *, seed, device="cpu", outliers=True, x_dtype=None):
    """Activations with a few large channels (as real ones have) and a weight whose blocks differ in scale,
    both quantized as the engine quantizes them: x per token and `group` columns, W per row and group
    (group = k: per token and per channel). x_dtype: x rounded to the dtype the engine holds it in (bf16), so that
    `a` quantizes what a GEMM called on x.to(x_dtype) quantizes; x comes back as float32 either way."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen)
    if outliers:
        x[:, torch.randperm(k, generator=gen)[:3]] *= 30
    if x_dtype is not None:
        x = x.to(x_dtype).float()
    w = torch.randn(n, k, generator=gen) * 2.0 ** torch.randint(-4, 4, (n, 1), generator=gen)
    a, a_scale = quantize_rows_ref(x, group)
    wq, w_scale = quantize_rows_ref(w, group)
    bias = torch.randn(n, generator=gen)
    return [t.to(device) for t in (x, a, a_scale, wq, w_scale, bias)]


FAST_ACCUM_BOUND = 1e-2  # 0.57-0.62% on the H200 (promoted: 0.22-0.28%); see test_fast_accumulation_at_*


def assert_close_to_float64(out, ref, rel, what=""):
    err = (out.double() - ref).abs().max().item()
    assert err <= rel * ref.abs().max().item(), (what, err, ref.abs().max().item())


# ---------------------------------------------------------------------------------------------
# CPU: the interpreter
# ---------------------------------------------------------------------------------------------


@pytest.mark.skipif(INTERPRETING, reason="this is the child process")
def test_fp8_gemm_kernels_pass_under_the_interpreter():
    assert_module_passes_under_interpreter(__file__, "test_fp8_gemm_kernels_pass_under_the_interpreter", timeout=600)


@interpreter
@pytest.mark.parametrize("m, k, group", [(3, 40, 16), (5, 70, 70)])
def test_activation_quantization_kernel_writes_the_reference_bytes_and_scales(m, k, group):
    x, *_ = operands(m, 8, k, group, seed=m)
    x[0] = 0.0  # an all-zero token quantizes to zeros, not NaN
    q, scale = fp8_gemm.quantize_rows(x, group)
    q_ref, scale_ref = quantize_rows_ref(x, group)
    assert torch.equal(scale, scale_ref)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))


@interpreter
def test_activation_quantization_under_a_scale_bound_caps_the_scale_and_saturates_what_lies_past_it():
    """fbgemm_fp8's activation_scale_ub (kernels/fp8_quant.activation_max_scale): a group whose max lies past the bound
    takes the bound's scale and its larger values saturate at +-448; groups under it are quantized as without one."""
    from kernels.fp8_quant import activation_max_scale

    x, *_ = operands(6, 8, 96, 32, seed=4, outliers=False)
    x[1, 40] = 9.0  # past the bound: group 1 of row 1
    x[4, :32] *= 3.0
    bound = activation_max_scale(4.0)
    q, scale = fp8_gemm.quantize_rows(x, 32, max_scale=bound)
    q_ref, scale_ref = quantize_rows_ref(x, 32, max_scale=bound)
    assert torch.equal(scale, scale_ref) and torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))
    past = x.abs().view(6, 3, 32).amax(-1) > 4.0
    assert past.any() and not past.all()
    assert torch.all(scale[past] == bound)
    assert q[1, 40].float() == 448.0, "a value past the bound saturates"
    free_q, free_scale = quantize_rows_ref(x, 32)
    assert torch.equal(scale[~past], free_scale[~past])
    assert not torch.equal(scale, free_scale)
    assert bound == pytest.approx(4.0 / 448, rel=1e-7)


@interpreter
def test_a_linear_layer_with_a_scale_bound_quantizes_its_input_under_it():
    """The layer's fp8_max_scale (set at load for fbgemm_fp8) reaches the quantization fp8_linear runs (fp32 here takes
    the Triton GEMM): its product is the GEMM of the bounded bytes, not of the free ones."""
    from executor_svc.layers import linear
    from kernels.fp8_quant import QuantizedActivations, activation_max_scale

    x, _, _, wq, w_scale, _ = operands(4, 24, 64, 64, seed=9, outliers=False)
    x[2, 5] = 20.0
    layer = torch.nn.Module()
    layer.weight, layer.weight_scale, layer.fp8_group_k = wq, w_scale, 64
    free = linear._matmul(layer, x, None)
    layer.fp8_max_scale = activation_max_scale(6.0)
    bounded = linear._matmul(layer, x, None)
    a, a_scale = quantize_rows_ref(x, 64, max_scale=layer.fp8_max_scale)
    assert torch.equal(bounded, fp8_gemm.triton_fp8_gemm(a, a_scale, wq, w_scale, 64, torch.float32))
    assert torch.equal(bounded[[0, 1, 3]], free[[0, 1, 3]]) and not torch.equal(bounded[2], free[2])
    # activations a producer quantized (unbounded) are refused there rather than multiplied unbounded
    with pytest.raises(ValueError, match="bounds their scales"):
        linear._matmul(layer, QuantizedActivations(a, a_scale, torch.float32), None)


@interpreter
@pytest.mark.parametrize("m, n, k, group", [(5, 40, 80, 32), (3, 24, 56, 16), (17, 33, 50, 50)])
def test_triton_fp8_gemm_with_block_or_channel_scales_matches_float64(m, n, k, group):
    _, a, a_scale, w, w_scale, bias = operands(m, n, k, group, seed=n)
    out = fp8_gemm.triton_fp8_gemm(a, a_scale, w, w_scale, group, torch.float32, bias)
    assert_close_to_float64(out, fp8_gemm_ref(a, a_scale, w, w_scale, group, bias), rel=1e-5)


@interpreter
def test_a_block_checkpoints_weight_takes_one_scale_per_tile_and_group():
    """128 x 128 blocks, each scaled by its own factor, laid out as the loader lays them (repeated over their rows):
    every aligned 128 rows share their scales, so each N tile takes one weight scale per K group; the same product.
    A fused layer whose second piece starts inside a block (SmolLM2's k rows at 576 = 4.5 blocks) never does."""
    from kernels.fp8_quant import rows_sharing_scales

    gen = torch.Generator().manual_seed(7)
    x = torch.randn(5, 256, generator=gen)
    w = torch.randn(256, 256, generator=gen) * 2.0 ** torch.randint(-3, 3, (2, 2), generator=gen).repeat_interleave(
        128, 0).repeat_interleave(128, 1)
    wq, w_scale = quantize_blocks_on_rows(w)
    assert rows_sharing_scales(w_scale) == 128
    a, a_scale = quantize_rows_ref(x, 128)
    ref = fp8_gemm_ref(a, a_scale, wq, w_scale, 128)
    for tiles in ((16, 32, 128, 1, 1), (16, 128, 128, 1, 1), (16, 64, 128, 1, 1, 2)):  # split-K too
        out = fp8_gemm.triton_fp8_gemm(a, a_scale, wq, w_scale, 128, torch.float32, tiles=tiles, rows_sharing_scales=128)
        assert_close_to_float64(out, ref, rel=1e-5)
    # the flag chooses the path: told that rows share their scales, the kernel reads each tile's first row's only
    odd_rows_off = w_scale.clone()
    odd_rows_off[1::2] *= 2
    tiles = (16, 32, 128, 1, 1)
    told = fp8_gemm.triton_fp8_gemm(a, a_scale, wq, odd_rows_off, 128, torch.float32, tiles=tiles, rows_sharing_scales=128)
    assert_close_to_float64(told, ref, rel=1e-5)
    not_told = fp8_gemm.triton_fp8_gemm(a, a_scale, wq, odd_rows_off, 128, torch.float32, tiles=tiles)
    assert_close_to_float64(not_told, fp8_gemm_ref(a, a_scale, wq, odd_rows_off, 128), rel=1e-5)
    fused = torch.cat([w_scale[:192], w_scale[64:128] * 3])  # q's 192 rows, then k's 64 from row 192
    assert rows_sharing_scales(fused) == 1
    assert rows_sharing_scales(torch.rand(256, 1)) == 1  # a scale per row: the epilogue applies it


@interpreter
@pytest.mark.parametrize("group", [16, 80])  # block scales (5 K tiles of 16), channel scales (K tiles of 32)
@pytest.mark.parametrize("split_k", [2, 3, 8])  # uneven shares of K's tiles; more splits than tiles
def test_split_k_fp8_gemm_matches_float64_and_leaves_its_counters_at_zero(group, split_k):
    m, n, k = 19, 40, 80
    _, a, a_scale, w, w_scale, bias = operands(m, n, k, group, seed=split_k + group)
    ref = fp8_gemm_ref(a, a_scale, w, w_scale, group, bias)
    block_k = 16 if group == 16 else 32
    for _ in range(2):  # the second call counts from the zeros the first left
        out = fp8_gemm.triton_fp8_gemm(a, a_scale, w, w_scale, group, torch.float32, bias,
                                       tiles=(16, 16, block_k, 1, 1, split_k))
        assert_close_to_float64(out, ref, rel=1e-5)
        assert not fp8_gemm.split_counters(a.device).any()


# ---------------------------------------------------------------------------------------------
# GPU
# ---------------------------------------------------------------------------------------------


@interpreter
@pytest.mark.parametrize("m, rows", [(3, 16), (17, 32), (200, 256)])
@pytest.mark.parametrize("made_by", ["quantize_rows", "a plain tensor"])
def test_scaled_mm_on_padded_rows_gives_the_unpadded_rows(m, rows, made_by):
    """The dispatch can run _scaled_mm on more rows than M (cuBLASLt is faster so at some M): on the spare rows of
    the buffer quantize_rows (as every producer) allocates, whose values are garbage, or on zero rows appended to
    a tensor without spare rows; either way the M rows that come back are the product's, bias included."""
    x, a, a_scale, w, w_scale, bias = operands(m, 48, 64, 64, seed=m)
    if made_by == "quantize_rows":
        a, a_scale = fp8_gemm.quantize_rows(x, 64)
        a.as_strided((rows, 64), (64, 1))[m:].view(torch.uint8).fill_(0x7F)  # NaN in every spare row
    ref = fp8_gemm_ref(a, a_scale, w, w_scale, 64, bias)
    padded = fp8_gemm.scaled_mm_fp8_gemm(a, a_scale, w, w_scale, torch.float32, bias, rows=rows)
    assert padded.shape == (m, 48)
    assert_close_to_float64(padded, ref, rel=1e-5)
    unpadded = fp8_gemm.scaled_mm_fp8_gemm(a, a_scale, w, w_scale, torch.float32, bias)
    torch.testing.assert_close(padded, unpadded, rtol=1e-6, atol=1e-6 * ref.abs().max().item())  # GEMM blocking


@interpreter
@pytest.mark.parametrize("m, rows", [(3, 0), (17, 32), (200, 256)])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_unit_scaled_mm_then_its_scales_matches_float64(m, rows, out_dtype):
    """The tensor-wise _scaled_mm on unit scales, then _scale_product_kernel's per-token x per-channel scales and
    the bias: the row-wise product, in any output dtype (fp16 too: the unscaled product is formed in bf16, where it
    cannot overflow), on padded rows or not."""
    x, _, _, w, w_scale, bias = operands(m, 48, 64, 64, seed=m + 1)
    a, a_scale = fp8_gemm.quantize_rows(x, 64)
    ref = fp8_gemm_ref(a, a_scale, w, w_scale, 64, bias)
    out = fp8_gemm.unit_scaled_mm_fp8_gemm(a, a_scale, w, w_scale, out_dtype, bias.to(out_dtype), rows=rows)
    assert out.shape == (m, 48) and out.dtype == out_dtype
    # fp32: the product stays fp32; bf16/fp16: its bf16 rounding, then the output's (2^-9 each on a GPU; the CPU's
    # bf16 _scaled_mm rounds twice)
    assert_close_to_float64(out, ref, rel=1e-5 if out_dtype == torch.float32 else 1e-2)
    y = torch.randn(m, 48, dtype=torch.bfloat16)
    scaled = fp8_gemm.scale_product(y.clone(), a_scale, w_scale, torch.float32)
    assert_close_to_float64(scaled, y.double() * a_scale.double() * w_scale.double().view(1, -1), rel=1e-6)


@interpreter
@pytest.mark.parametrize("m", [3, 130])
def test_scales_written_m_major_are_the_row_major_ones_and_the_triton_gemm_reads_them(m):
    """The block recipe's layout (kernels/fp8_quant.empty_quantized's m_major: scales [M, G], strides (1, M rounded up
    to 128)): quantize_rows writes the same scales and bytes there, m_major_in_place hands them to the block recipe
    without a copy, and the Triton GEMM (the block dispatch's backend at few tokens) reads them to the same product,
    split-K too."""
    from kernels.fp8_quant import block_recipe_rows, m_major_in_place

    x, _, _, w, w_scale, bias = operands(m, 40, 80, 16, seed=m)
    q, scale = fp8_gemm.quantize_rows(x, 16)
    q_mm, scale_mm = fp8_gemm.quantize_rows(x, 16, m_major=True)
    leading = block_recipe_rows(m)
    assert scale_mm.stride() == (1, leading) and torch.equal(scale_mm, scale)
    assert torch.equal(q_mm.view(torch.uint8), q.view(torch.uint8))
    assert m_major_in_place(scale_mm, leading).data_ptr() == scale_mm.data_ptr()
    ref = fp8_gemm_ref(q, scale, w, w_scale, 16, bias)
    for tiles in ((16, 16, 16, 1, 1), (16, 16, 16, 1, 1, 2)):
        out = fp8_gemm.triton_fp8_gemm(q_mm, scale_mm, w, w_scale, 16, torch.float32, bias, tiles=tiles)
        assert_close_to_float64(out, ref, rel=1e-5)


def test_m_major_scales_are_laid_out_as_the_block_recipe_reads_them():
    from kernels.fp8_quant import block_recipe_rows, empty_quantized, m_major_in_place

    assert [block_recipe_rows(m) for m in (0, 1, 128, 129, 256, 4000)] == [0, 128, 128, 256, 256, 4096]
    _, scale = empty_quantized(130, 512, 4, "cpu", m_major=True)
    assert scale.shape == (130, 4) and scale.stride() == (1, 256)
    full = m_major_in_place(scale, 256)
    assert full.shape == (256, 4) and full.stride() == (1, 256) and full.data_ptr() == scale.data_ptr()
    assert m_major_in_place(scale, 132) is None  # the block recipe reads a leading dimension of its rows
    assert m_major_in_place(scale, 100) is None  # fewer rows than the tokens
    assert m_major_in_place(empty_quantized(130, 512, 4, "cpu")[1], 256) is None  # row-major
    one_group = empty_quantized(5, 128, 1, "cpu")[1]  # one group: a column either way
    assert m_major_in_place(one_group, 8).stride() == (1, 8)
    assert m_major_in_place(torch.zeros(5, 1), 8) is None  # no spare rows to read


@settings(max_examples=60, deadline=None)
@given(m=st.integers(1, 600), groups=st.integers(1, 9))
def test_m_major_scales_read_in_place_are_the_tokens_scales(m, groups):
    """Whatever M and group count, the [rows, G] tensor the block recipe is handed begins with the tokens' scales
    as written through the [M, G] view, and is one contiguous [G, rows] buffer (what cuBLASLt reads)."""
    from kernels.fp8_quant import block_recipe_rows, empty_quantized, m_major_in_place

    _, scale = empty_quantized(m, 128 * groups, groups, "cpu", m_major=True)
    values = torch.rand(m, groups)
    scale.copy_(values)
    rows = block_recipe_rows(m)
    full = m_major_in_place(scale, rows)
    assert full.shape == (rows, groups) and full.t().is_contiguous()
    assert torch.equal(full[:m], values)


@interpreter
def test_fp8_bytes_decode_to_every_e4m3_value_exactly():
    """The weight-only GEMM reads FP8 weights as bytes (no e4m3 type in Triton before sm_89): all 256 of them, normal,
    subnormal, both zeros and NaN, decode to torch's float8_e4m3fn values."""
    every = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    out = torch.empty(256, dtype=torch.float32)
    _decode_bytes_kernel[(1,)](every, out, BLOCK=256)
    want = every.view(torch.float8_e4m3fn).float()
    assert torch.equal(torch.isnan(out), torch.isnan(want)) and int(torch.isnan(want).sum()) == 2
    finite = ~torch.isnan(want)
    assert torch.equal(out[finite], want[finite])
    assert torch.equal(torch.signbit(out[finite]), torch.signbit(want[finite]))  # -0.0 and the negative subnormals


@interpreter
def test_fp8_bytes_read_as_fp16_are_every_finite_e4m3_value_over_256_exactly():
    """The weight-only GEMM's decode (e4m3_as_fp16): every finite byte, normal, subnormal and both zeros, is its
    float8_e4m3fn value / 2^8 in fp16, sign included; the NaN bytes (refused at load) read as +-480 / 2^8."""
    every = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    out = torch.empty(256, dtype=torch.float16)
    _bytes_as_fp16_kernel[(1,)](every, out, BLOCK=256)
    want = every.view(torch.float8_e4m3fn).float()
    finite = ~torch.isnan(want)
    assert int(finite.sum()) == 254
    assert torch.equal(out[finite].float() * fp8_gemm.E4M3_AS_FP16_UNSCALE.value, want[finite])
    assert torch.equal(torch.signbit(out[finite]), torch.signbit(want[finite]))
    assert (torch.count_nonzero(out[finite].float() == 0) == 2  # only the two zeros: no subnormal flushed
            and torch.equal(out[~finite].float() * fp8_gemm.E4M3_AS_FP16_UNSCALE.value, torch.tensor([480.0, -480.0])))


@interpreter
@pytest.mark.parametrize("m, n, k, group", [(5, 40, 80, 16), (3, 24, 56, 56), (17, 33, 50, 50)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_weight_only_fp8_gemm_matches_float64_on_the_dequantized_weights(m, n, k, group, dtype):
    """Plain activations through FP8 weights widened in the kernel (GPUs before sm_89): block scales (per 16 columns)
    and channel scales, ragged sizes, a bias, split-K too; against float64 on the dequantized weights."""
    from kernels.fp8_quant import dequantize_rows

    x, _, _, w, w_scale, bias = operands(m, n, k, group, seed=m + k)
    x = x.to(dtype)
    ref = x.double() @ dequantize_rows(w, w_scale, group, torch.float64).T + bias.double()
    out = fp8_gemm.weight_only_fp8_gemm(x, w, w_scale, group, bias.to(dtype))
    assert out.dtype == dtype and out.shape == (m, n)
    assert_close_to_float64(out, ref, rel=1e-5 if dtype == torch.float32 else 1e-2)
    split = fp8_gemm.triton_fp8_gemm(x, None, w, w_scale, group, dtype, bias.to(dtype),
                                     tiles=(16, 16, 16 if group < k else 32, 1, 1, 2))
    assert_close_to_float64(split, ref, rel=1e-5 if dtype == torch.float32 else 1e-2)


@interpreter
@pytest.mark.parametrize("n, k, group", [(40, 80, 16), (33, 50, 50)])  # block scales (ragged), a scale per row
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_weights_dequantized_on_the_gpu_are_the_cpus_dequantized_weights(n, k, group, dtype, monkeypatch):
    """The weight-only GEMM from WEIGHT_ONLY_DEQUANTIZE_FROM tokens: W dequantized in one kernel (read as bytes) is
    kernels/fp8_quant.dequantize_rows' weight (to the bit in fp32; in bf16 the interpreter truncates where a GPU rounds
    to nearest: the GPU test checks the bits), and the product is torch's on it."""
    from kernels.fp8_quant import dequantize_rows

    x, _, _, w, w_scale, bias = operands(7, n, k, group, seed=n)
    ours, want = fp8_gemm.dequantize_fp8_weight(w, w_scale, group, dtype), dequantize_rows(w, w_scale, group)
    assert ours.dtype == dtype
    if dtype == torch.float32:
        assert torch.equal(ours, want)
    else:
        assert ((ours.float() - want).abs() <= 2.0**-7 * want.abs()).all()
    monkeypatch.setattr(fp8_gemm, "WEIGHT_ONLY_DEQUANTIZE_FROM", 7)
    out = fp8_gemm.weight_only_fp8_gemm(x.to(dtype), w, w_scale, group, bias.to(dtype))
    assert torch.equal(out, torch.nn.functional.linear(x.to(dtype), ours, bias.to(dtype)))
    ref = x.to(dtype).double() @ want.double().T + bias.to(dtype).double()
    assert_close_to_float64(out, ref, rel=1e-5 if dtype == torch.float32 else 2e-2)


@interpreter
def test_a_checkpoint_loaded_for_the_weight_only_gemm_gives_its_dequantized_models_products(tmp_path, monkeypatch):
    """A block and a channel FP8 checkpoint loaded as a GPU without FP8 tensor cores loads them (the weight-only GEMM
    forced for this CPU load): every converted Linear layer keeps its FP8 weight and gives the products of the same
    layer of the dequantized checkpoint, fused pieces (q/k/v, gate/up) and row-parallel layers alike."""
    import os

    from executor_svc.layers import fp8
    from executor_svc.model_loader import load_model
    from kernels.attention.torch_backend import TorchAttentionBackend
    from support.fp8_checkpoints import tiny_fp8_checkpoints

    root = tiny_fp8_checkpoints(str(tmp_path))
    monkeypatch.setattr(fp8, "runs_weight_only_fp8_gemms", lambda device: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    gen = torch.Generator().manual_seed(9)
    for scheme in ("block", "channel"):
        model, _ = load_model(os.path.join(root, scheme), torch.float32, torch.device("cpu"), TorchAttentionBackend())
        reference, _ = load_model(os.path.join(root, f"{scheme}_dequantized"), torch.float32, torch.device("cpu"),
                                  TorchAttentionBackend())
        ours, theirs = model.model.layers[0], reference.model.layers[0]
        for layer, plain in ((ours.self_attn.qkv_proj, theirs.self_attn.qkv_proj),
                             (ours.self_attn.o_proj, theirs.self_attn.o_proj),
                             (ours.mlp.gate_up_proj, theirs.mlp.gate_up_proj),
                             (ours.mlp.down_proj, theirs.mlp.down_proj)):
            assert layer.weight.dtype == torch.float8_e4m3fn and layer.fp8_weight_only
            x = torch.randn(6, layer.weight.shape[1], generator=gen)
            want = plain(x)
            torch.testing.assert_close(layer(x), want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


def test_quantized_activations_have_spare_rows_that_a_gemm_can_read_in_place():
    from kernels.fp8_quant import ROW_CAPACITY, empty_quantized, rows_in_place

    q, scale = empty_quantized(5, 32, 2, "cpu")
    assert q.shape == (5, 32) and scale.shape == (5, 2) and q.is_contiguous()
    wide = rows_in_place(q, ROW_CAPACITY)
    assert wide.shape == (ROW_CAPACITY, 32) and wide.data_ptr() == q.data_ptr()
    assert rows_in_place(q, ROW_CAPACITY + 1) is None  # past the buffer
    assert rows_in_place(torch.zeros(5, 32), 6) is None  # a tensor of its own size
    assert rows_in_place(torch.zeros(8, 32)[::2], 6) is None  # not row-major contiguous
    assert rows_in_place(torch.zeros(8, 32)[2:4], 8) is None  # a slice whose buffer ends 4 rows on
    assert rows_in_place(torch.zeros(8, 32)[2:4], 6).shape == (6, 32)
    assert empty_quantized(0, 32, 1, "cpu")[0].shape == (0, 32)


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 7, 133, 300])
@pytest.mark.parametrize("n, k, group", [(200, 320, 128), (4096, 4096, 128), (96, 200, 200), (1024, 2048, 16)])
def test_the_weight_only_fp8_gemm_on_a_gpu_matches_float64(m, n, k, group):
    """The weight-only GEMM of GPUs before sm_89 (W read as bytes, widened in the tile), run on this GPU: bf16
    activations through block (groups of 128, and of 16: a 16-bit dot's K) and channel scales, against float64 on
    the dequantized weights."""
    from kernels.fp8_quant import dequantize_rows

    x, _, _, w, w_scale, bias = operands(m, n, k, group, seed=m + n)
    x = x.bfloat16()
    ref = x.double() @ dequantize_rows(w, w_scale, group, torch.float64).T + bias.double()
    out = fp8_gemm.weight_only_fp8_gemm(x.cuda(), w.cuda(), w_scale.cuda(), group, bias.bfloat16().cuda())
    assert out.dtype == torch.bfloat16
    assert_close_to_float64(out.cpu(), ref, rel=1e-2)  # bf16's rounding of the output
    dequantized = fp8_gemm.dequantize_fp8_weight(w.cuda(), w_scale.cuda(), group, torch.bfloat16)  # from 256 tokens
    assert torch.equal(dequantized.cpu(), dequantize_rows(w, w_scale, group).bfloat16())  # the CPU's weights


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 7, 64, 300])
@pytest.mark.parametrize("n, k, group", [(200, 320, 128), (4096, 4096, 128), (96, 200, 200), (1024, 2048, 2048)])
def test_fp8_gemms_on_the_gpu_match_float64(m, n, k, group):
    x, a, a_scale, w, w_scale, bias = operands(m, n, k, group, seed=m + n, device="cuda")
    q, s = fp8_gemm.quantize_rows(x.bfloat16(), group)
    q_ref, s_ref = quantize_rows_ref(x.bfloat16(), group)
    assert torch.equal(s, s_ref) and torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))
    ref = fp8_gemm_ref(a, a_scale, w, w_scale, group, bias)
    out = fp8_gemm.triton_fp8_gemm(a, a_scale, w, w_scale, group, torch.bfloat16, bias.bfloat16())
    assert_close_to_float64(out, ref, rel=1e-2)  # bf16's rounding of the output
    # fp32 out: the accumulation alone. Hopper's fp8 tensor cores accumulate with fewer bits than fp32 within a
    # wgmma chain; with an fp32 add every 128-deep K tile, 1.3e-4 to 4.6e-4 of max |y| at M >= 64 (H200,
    # 2026-12-03; 2.5e-3 at K = 2048 before the channel path promoted too); under bf16's own rounding of the
    # output (2^-9), while a wrong scale or tile is off by O(1)
    assert_close_to_float64(fp8_gemm.triton_fp8_gemm(a, a_scale, w, w_scale, group, torch.float32, bias), ref,
                            rel=1e-3)
    for split_k in (2, 5):  # split-K: the partials of K's slices added up by the tile's last program
        tiles = (16 if m < 64 else 64, 64, group if group < k else 128, 4, 3, split_k)
        out = fp8_gemm.triton_fp8_gemm(a, a_scale, w, w_scale, group, torch.float32, bias, tiles=tiles)
        assert_close_to_float64(out, ref, rel=1e-3)
        assert not fp8_gemm.split_counters(out.device).any()
    if group == k and n % 16 == 0 and k % 16 == 0:  # _scaled_mm's row-wise and tensor-wise GEMMs: channel weights
        for gemm in (fp8_gemm.scaled_mm_fp8_gemm, fp8_gemm.unit_scaled_mm_fp8_gemm):
            out = gemm(a, a_scale, w, w_scale, torch.bfloat16, bias.bfloat16())
            assert_close_to_float64(out, ref, rel=1e-2)
            padded = gemm(a, a_scale, w, w_scale, torch.bfloat16, bias.bfloat16(), rows=m + 57)
            assert_close_to_float64(padded, ref, rel=1e-2)
        # fp32 out: the product stays fp32, so cuBLASLt's accumulation alone (bound as Triton's above)
        out = fp8_gemm.unit_scaled_mm_fp8_gemm(a, a_scale, w, w_scale, torch.float32, bias)
        assert_close_to_float64(out, ref, rel=1e-3)


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("n, k", [(1024, 4096), (512, 12288)])  # down_proj's K: the longest unpromoted chain
def test_fast_accumulation_at_prefills_token_counts_matches_float64(monkeypatch, n, k):
    from kernels import fp8_gemm_dispatch as dispatch

    x, a, a_scale, w, w_scale, _ = operands(1024, n, k, k, seed=n, device="cuda", x_dtype=torch.bfloat16)
    ref = fp8_gemm_ref(a, a_scale, w, w_scale, k)
    monkeypatch.setattr(dispatch, "FAST_ACCUM_FROM", dispatch.ANY_M)
    promoted = fp8_gemm.fp8_linear(x.bfloat16(), w, w_scale, k)
    assert_close_to_float64(promoted, ref, rel=5e-3)
    monkeypatch.setattr(dispatch, "FAST_ACCUM_FROM", 1024)
    fast = fp8_gemm.fp8_linear(x.bfloat16(), w, w_scale, k)
    # the tensor cores' own accumulation over all of K: FAST_ACCUM_BOUND of max |y| (H200), where a wrong scale or
    # row is off by O(1); and it is a different kernel from the promoted one, or the switch did nothing
    assert_close_to_float64(fast, ref, rel=FAST_ACCUM_BOUND)
    assert not torch.equal(fast, promoted)
    # block weights stay promoted there (torch refuses fast accumulation with block scales)
    from kernels.fp8_quant import block_scales_of, rows_sharing_scales

    wb, wb_rows = quantize_blocks_on_rows(w.float() * w_scale)
    blocks = block_scales_of(wb_rows, 128, rows_sharing_scales(wb_rows))
    ab, ab_scale = quantize_rows_ref(x, 128)
    out = fp8_gemm.fp8_linear(x.bfloat16(), wb, wb_rows, 128, block_scales=blocks)
    assert_close_to_float64(out, fp8_gemm_ref(ab, ab_scale, wb, wb_rows, 128), rel=1e-2)


@needs_cuda
@pytest.mark.gpu
def test_fp8_linear_on_block_checkpoint_weights_matches_float64():
    # the checkpoint's 128 x 128 blocks, repeated over their rows as the loader stores them
    gen = torch.Generator().manual_seed(9)
    w = torch.randn(300, 400, generator=gen)
    wq, w_scale = quantize_blocks_on_rows(w)
    x = torch.randn(37, 400, generator=gen).bfloat16()
    a, a_scale = quantize_rows_ref(x, 128)
    ref = fp8_gemm_ref(a, a_scale, wq, w_scale, 128)
    out = fp8_gemm.fp8_linear(x.cuda(), wq.cuda(), w_scale.cuda(), 128)
    assert out.dtype == torch.bfloat16
    assert_close_to_float64(out.cpu(), ref, rel=1e-2)


@interpreter
def test_the_block_recipe_is_taken_only_where_torch_cuda_and_the_gpu_have_it(monkeypatch):
    import torch.nn.functional as F

    gpu = torch.device("cuda")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    for cuda, capability, runs in (("13.0", (9, 0), True), ("12.9", (10, 0), True), ("12.8", (9, 0), False),
                                   ("12.9", (8, 9), False), (None, (9, 0), False)):
        monkeypatch.setattr(torch.version, "cuda", cuda)
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None, c=capability: c)
        assert fp8_gemm.block_recipe_runs(gpu) is runs, (cuda, capability)
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    assert not fp8_gemm.block_recipe_runs(torch.device("cpu"))
    monkeypatch.delattr(F, "scaled_mm")  # a torch without the block recipe's API
    assert not fp8_gemm.block_recipe_runs(gpu)


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 7, 64, 133, 300])
@pytest.mark.parametrize("n, k", [(384, 512), (4096, 4096)])
def test_torchs_block_recipe_on_whole_block_scales_matches_float64(m, n, k):
    """block_scaled_mm_fp8_gemm (cuBLASLt's block-scaled kernels through torch.nn.functional.scaled_mm) on a
    block checkpoint's weight: activations per token and 128 columns, weights per 128 x 128 block; on M rows, on
    padded rows, and through fp8_linear where the dispatch picks it (a CUDA graph replayed on fresh inputs)."""
    from kernels import fp8_gemm_dispatch as dispatch
    from kernels.fp8_quant import block_scales_of, rows_sharing_scales

    gen = torch.Generator().manual_seed(m + n)
    w = torch.randn(n, k, generator=gen) * 2.0 ** torch.randint(-4, 4, (n // 128, 1), generator=gen).repeat_interleave(
        128, 0)
    wq, w_scale = quantize_blocks_on_rows(w)
    blocks = block_scales_of(w_scale, 128, rows_sharing_scales(w_scale))
    x = torch.randn(m, k, generator=gen)
    x[:, torch.randperm(k, generator=gen)[:3]] *= 30
    a, a_scale = quantize_rows_ref(x, 128)
    bias = torch.randn(n, generator=gen)
    ref = fp8_gemm_ref(a, a_scale, wq, w_scale, 128, bias)
    wq, w_scale, blocks = wq.cuda(), w_scale.cuda(), blocks.cuda()
    for rows in (0, m + 57, 256):  # M rows (rounded up to 128), more, the table's pad
        out = fp8_gemm.block_scaled_mm_fp8_gemm(a.cuda(), a_scale.cuda(), wq, blocks, torch.bfloat16,
                                                bias.bfloat16().cuda(), rows=rows)
        assert out.shape == (m, n)
        assert_close_to_float64(out.cpu(), ref, rel=1e-2)
    # the activations as the engine's producers write them for it: their scales M-major, read in place
    a_mm, scale_mm = fp8_gemm.quantize_rows(x.bfloat16().cuda(), 128, m_major=True)
    out = fp8_gemm.block_scaled_mm_fp8_gemm(a_mm, scale_mm, wq, blocks, torch.bfloat16)
    a, a_scale = quantize_rows_ref(x.bfloat16(), 128)
    assert_close_to_float64(out.cpu(), fp8_gemm_ref(a, a_scale, wq.cpu(), w_scale.cpu(), 128), rel=1e-2)
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(dispatch.BLOCK_TABLE, (n, k), [(1 << 62, "block_scaled_mm")])
        static_x = torch.zeros(m, k, dtype=torch.bfloat16, device="cuda")
        fp8_gemm.fp8_linear(static_x, wq, w_scale, 128, block_scales=blocks)  # warm-up outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_out = fp8_gemm.fp8_linear(static_x, wq, w_scale, 128, block_scales=blocks)
        for seed in (1, 2):
            x = torch.randn(m, k, generator=torch.Generator().manual_seed(seed)).bfloat16()
            static_x.copy_(x.cuda())
            graph.replay()
            a, a_scale = quantize_rows_ref(x, 128)
            assert_close_to_float64(static_out.cpu(), fp8_gemm_ref(a, a_scale, wq.cpu(), w_scale.cpu(), 128), rel=1e-2)


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["scaled_mm", "unit_scaled_mm"])
def test_a_padded_scaled_mm_row_replayed_in_a_cuda_graph_gives_the_product(monkeypatch, backend):
    """fp8_linear on a TABLE row that pads M = 132 to 256 rows, its activations quantized in the call (spare rows
    unwritten), captured in a CUDA graph and replayed on new inputs: the product of those inputs."""
    from kernels import fp8_gemm_dispatch as dispatch

    n, k = 512, 1024
    monkeypatch.setitem(dispatch.TABLE, (n, k), [(64, "scaled_mm"), (160, backend, 256)])
    assert dispatch.choose_gemm("channel", 132, n, k) == (backend, 256)
    _, _, _, w, w_scale, _ = operands(1, n, k, k, seed=5)
    w, w_scale = w.cuda(), w_scale.cuda()
    static_x = torch.zeros(132, k, dtype=torch.bfloat16, device="cuda")
    fp8_gemm.fp8_linear(static_x, w, w_scale, k)  # warm-up outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = fp8_gemm.fp8_linear(static_x, w, w_scale, k)
    for seed in (6, 7):
        x = operands(132, n, k, k, seed=seed)[0].bfloat16()
        static_x.copy_(x.cuda())
        graph.replay()
        a, a_scale = quantize_rows_ref(x, k)
        assert_close_to_float64(static_out.cpu(), fp8_gemm_ref(a, a_scale, w.cpu(), w_scale.cpu(), k), rel=1e-2)


# ---------------------------------------------------------------------------------------------
# The dispatch table (no kernels)
# ---------------------------------------------------------------------------------------------


def test_the_dispatch_takes_each_m_to_the_row_above_it_and_block_weights_to_triton(monkeypatch):
    """Channel rows; block weights whose scales are not whole blocks take Triton, the one kernel that applies them."""
    from kernels import fp8_gemm_dispatch as dispatch

    monkeypatch.setattr(dispatch, "TABLE", {})
    monkeypatch.setattr(dispatch, "TILES", {})
    dispatch.apply_table({"backends": {"96x64": [[1, "triton"], [64, "scaled_mm"], [256, "triton"]],
                                       "96x128": [[64, "scaled_mm"], [160, "scaled_mm", 256], [512, "scaled_mm"]]},
                          "tiles": {"channel 96x64": [[16, [16, 32, 256, 4, 4]], [256, [64, 64, 128, 4, 4, 2]]]}})
    picks = [dispatch.choose_gemm("channel", m, 96, 64)[0] for m in (1, 2, 64, 65, 256, 257)]
    assert picks == ["triton", "scaled_mm", "scaled_mm", "triton", "triton", dispatch.DEFAULT]
    assert dispatch.choose_gemm("block", 2, 96, 64) == ("triton", 2)  # only Triton applies per-row block scales
    # a shape not measured: the tensor-wise GEMM up to decode's M, the row-wise one above
    assert dispatch.choose_gemm("channel", 256, 96, 80) == ("unit_scaled_mm", 256)
    assert dispatch.choose_gemm("channel", 257, 96, 80) == (dispatch.DEFAULT, 257)
    assert dispatch.choose_gemm("channel", 2, 90, 64) == ("triton", 2)  # _scaled_mm needs multiples of 16
    # a padded row: _scaled_mm on 256 rows for M from 65 to 160, on M rows elsewhere
    assert [dispatch.choose_gemm("channel", m, 96, 128)[1] for m in (64, 65, 160, 161, 600)] == [64, 256, 256, 161, 600]
    assert dispatch.choose_gemm("channel", 100, 96, 128)[0] == "scaled_mm"
    assert dispatch.choose_gemm("channel", 100, 96, 64)[1] == 100  # a row without padding
    assert dispatch.measured_tiles("channel", 16, 96, 64) == (16, 32, 256, 4, 4)
    assert dispatch.measured_tiles("channel", 17, 96, 64) == (64, 64, 128, 4, 4, 2)  # split-K in two
    assert dispatch.measured_tiles("channel", 257, 96, 64) is None
    assert dispatch.measured_tiles("block", 1, 96, 64) is None


def test_block_weights_go_to_torchs_block_recipe_only_where_their_scales_are_whole_blocks(monkeypatch):
    from kernels import fp8_gemm_dispatch as dispatch

    monkeypatch.setattr(dispatch, "BLOCK_TABLE", {})
    dispatch.apply_table({"block_backends": {"256x512": [[64, "triton"], [128, "block_scaled_mm", 256],
                                                         [4096, "block_scaled_mm"]]}})
    picks = [dispatch.choose_gemm("block", m, 256, 512, whole_blocks=True) for m in (64, 65, 128, 129, 5000)]
    assert picks == [("triton", 64), ("block_scaled_mm", 256), ("block_scaled_mm", 256), ("block_scaled_mm", 129),
                     ("triton", 5000)]  # past the last row: Triton, as BLOCK_DEFAULT's last row
    assert dispatch.choose_gemm("block", 100, 256, 512) == ("triton", 100)  # scales not whole blocks
    assert dispatch.choose_gemm("block", 100, 200, 512, whole_blocks=True) == ("triton", 100)  # N not in 128s
    assert dispatch.choose_gemm("block", 100, 256, 320, whole_blocks=True) == ("triton", 100)  # nor K
    assert dispatch.choose_gemm("block", 100, 1024, 256, whole_blocks=True) == ("triton", 100)  # K not in 4 blocks
    # a shape not measured: BLOCK_DEFAULT (Triton at few tokens, cuBLASLt's block kernels from 65 on)
    assert [dispatch.choose_gemm("block", m, 384, 512, whole_blocks=True)[0] for m in (64, 65, 256, 5000)] == [
        "triton", "block_scaled_mm", "block_scaled_mm", "block_scaled_mm"]
    with pytest.raises(ValueError, match="scaled_mm"):  # a channel backend named for block weights
        dispatch.apply_table({"block_backends": {"256x512": [[16, "scaled_mm"]]}})


def test_whole_block_scales_are_found_only_where_every_128_rows_share_them():
    from kernels.fp8_quant import block_scales_of, quantize_blocks_ref, rows_sharing_scales

    w = torch.randn(384, 300) * torch.rand(384, 1)
    q, blocks = quantize_blocks_ref(w, (128, 128))
    per_row = blocks.repeat_interleave(128, 0)  # the loader's layout
    assert torch.equal(block_scales_of(per_row, 128, rows_sharing_scales(per_row)), blocks)
    assert block_scales_of(per_row, 64, 128) is None  # K groups of a rank's slice, not the checkpoint's
    assert block_scales_of(per_row, 128, 1) is None  # a fused piece starting inside a block
    assert block_scales_of(per_row[:200], 128, 128) is None  # N not a multiple of 128
    assert block_scales_of(torch.rand(384, 1), 300, 1) is None  # channel scales


def test_the_sweep_pads_a_scaled_mm_row_only_where_more_rows_were_measured_faster():
    from bench.fp8_gemm_table import choose_backends

    def row(m, scaled, triton):
        return {"scheme": "channel", "n": 96, "k": 64, "m": m, "scaled_mm_us": scaled, "best_us": triton}

    rows = [row(16, 20.0, 10.0), row(128, 40.0, 45.0), row(144, 70.0, 65.0), row(192, 60.0, 66.0),
            row(256, 48.0, 70.0), row(4096, 600.0, 900.0)]
    assert choose_backends(rows) == {"96x64": [
        [16, "triton"],               # Triton faster
        [128, "scaled_mm"],           # 256 rows (48 us) slower than 128 (40 us)
        [144, "scaled_mm", 256],      # 48 us on 256 rows beats 70 on 144, and Triton's 65
        [192, "scaled_mm", 256],      # 48 beats 60 by more than PAD_GAIN
        [256, "scaled_mm"],
        [4096, "scaled_mm"],          # no swept M up to 2 x 4096 above it
    ]}
    # a gain under 5% is not worth the copy
    assert choose_backends([row(144, 50.0, 90.0), row(256, 48.0, 90.0)])["96x64"][0] == [144, "scaled_mm"]
    # the tensor-wise GEMM on unit scales where it is the fastest, padded by the same rule
    unit = [dict(row(128, 40.0, 45.0), unit_scaled_mm_us=30.0), dict(row(144, 70.0, 65.0), unit_scaled_mm_us=50.0),
            dict(row(256, 48.0, 70.0), unit_scaled_mm_us=45.0), dict(row(4096, 600.0, 900.0), unit_scaled_mm_us=650.0)]
    assert choose_backends(unit)["96x64"] == [[128, "unit_scaled_mm"], [144, "unit_scaled_mm", 256],
                                               [256, "unit_scaled_mm"], [4096, "scaled_mm"]]


def test_the_sweep_chooses_block_weights_backends_from_their_own_rows():
    from bench.fp8_gemm_table import choose_backends, merge_tables

    def row(scheme, m, triton, cublas):
        key = "block_scaled_mm_us" if scheme == "block" else "scaled_mm_us"
        return {"scheme": scheme, "n": 96, "k": 128, "m": m, "best_us": triton, key: cublas}

    rows = [row("block", 64, 30.0, 36.0), row("block", 144, 75.0, 60.0), row("block", 256, 88.0, 47.0),
            row("block", 4096, 700.0, 650.0), row("channel", 64, 10.0, 1.0)]
    assert choose_backends(rows, "block") == {"96x128": [
        [64, "triton"], [144, "block_scaled_mm", 256], [256, "block_scaled_mm"], [4096, "block_scaled_mm"]]}
    assert choose_backends(rows) == {"96x128": [[64, "scaled_mm"]]}  # channel rows alone
    merged = merge_tables({"block_backends": {"96x128": [[64, "triton"], [128, "triton"]]}},
                          {"block_backends": {"96x128": [[128, "block_scaled_mm"]]}})
    assert merged["block_backends"] == {"96x128": [[64, "triton"], [128, "block_scaled_mm"]]}


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.floats(1, 100), st.floats(1, 100), st.floats(1, 100) | st.none()), min_size=1,
                max_size=6), st.lists(st.integers(1, 4096), min_size=6, max_size=6, unique=True))
@example([(10.0, 10.2, 9.95)], [64, 1, 2, 3, 4, 5])  # the candidate within the margin: torch's call, slower than Triton
def test_the_cublaslt_study_names_an_algorithm_only_where_it_beat_torch_and_cublaslt_only_where_it_beat_triton(
        times, tokens):
    """bench/studies/fp8_cublaslt_algos.py's table, read back through the dispatch as the engine reads it."""
    from bench.studies.fp8_cublaslt_algos import block_backends, cublaslt_table
    from kernels import fp8_gemm_dispatch as dispatch

    margin, ms = 1.03, sorted(tokens[:len(times)])
    rows = []
    for m, (triton, torch_us, best_us) in zip(ms, times):
        best = None if best_us is None else {"us": best_us, "table_entry": {"id": m, "raw": "00" * 64, "version": 1}}
        rows += [{"recipe": recipe, "n": 256, "k": 512, "m": m, "triton_us": triton, "torch_us": torch_us,
                  "best": best} for recipe in ("tensor", "block")]
    table = {"cublaslt_algos": cublaslt_table(rows, margin), "block_backends": block_backends(rows, margin)}
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(dispatch, "CUBLASLT_ALGOS", {})
        mp.setattr(dispatch, "BLOCK_TABLE", {})
        dispatch.apply_table(table)
        for m, (triton, torch_us, best_us) in zip(ms, times):
            wins = best_us is not None and torch_us >= margin * best_us
            for recipe in ("tensor", "block"):
                named = dispatch.cublaslt_algorithm(recipe, m, 256, 512)
                assert (named is not None) is wins and (not wins or named["id"] == m)
            backend, _ = dispatch.choose_gemm("block", m, 256, 512, whole_blocks=True)
            assert (backend == "block_scaled_mm") is ((best_us if wins else torch_us) < triton)
        assert dispatch.cublaslt_algorithm("tensor", ms[-1] + 1, 256, 512) is None  # past the last row: torch's
        assert dispatch.choose_gemm("block", 1 << 20, 256, 512, whole_blocks=True)[0] == "block_scaled_mm"


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.floats(1, 100), st.floats(1, 100), st.floats(1, 100)), min_size=1, max_size=8),
       st.lists(st.integers(1, 4096), min_size=8, max_size=8, unique=True))
def test_each_swept_m_gets_the_fastest_backend_and_pads_only_to_a_faster_measured_m_within_2m(times, tokens):
    from bench.fp8_gemm_table import PAD_GAIN, choose_backends

    ms = sorted(tokens[:len(times)])
    us = {m: {"triton": t, "scaled_mm": r, "unit_scaled_mm": u} for m, (t, r, u) in zip(ms, times)}
    rows = [{"scheme": "channel", "n": 96, "k": 64, "m": m, "best_us": u["triton"], "scaled_mm_us": u["scaled_mm"],
             "unit_scaled_mm_us": u["unit_scaled_mm"]} for m, u in us.items()]
    rows.append({"scheme": "block", "n": 96, "k": 64, "m": 1, "best_us": 0.0})  # block rows choose nothing
    entries = choose_backends(rows)["96x64"]
    assert [e[0] for e in entries] == ms  # one entry per swept M, in order
    for m, backend, *pad in entries:
        rows_run = pad[0] if pad else m
        if pad:  # padded only to a swept M within 2M that was faster by PAD_GAIN
            assert backend != "triton" and m < rows_run <= 2 * m and rows_run in us
            assert us[rows_run][backend] <= PAD_GAIN * us[m][backend]
        chosen = us[rows_run][backend]
        assert all(chosen <= t for t in us[m].values())  # never slower than any backend on M rows


def test_fast_accumulation_starts_at_the_tables_token_count(monkeypatch):
    from kernels import fp8_gemm_dispatch as dispatch

    monkeypatch.setattr(dispatch, "FAST_ACCUM_FROM", dispatch.FAST_ACCUM_FROM)  # restored after the test
    dispatch.apply_table({"fast_accum_from": 512})
    assert [dispatch.fast_accumulation(m) for m in (1, 511, 512, 4096)] == [False, False, True, True]


def test_cublaslt_algorithms_are_named_per_recipe_shape_and_token_count(monkeypatch):
    from kernels import fp8_gemm_dispatch as dispatch

    monkeypatch.setattr(dispatch, "CUBLASLT_ALGOS", {})
    assert not dispatch.cublaslt_named()  # nothing named: the loader leaves cuBLASLt's C API alone
    split = {"id": 66, "tile": 20, "split_k": 2, "reduction": 4}
    dispatch.apply_table({"cublaslt_algos": {"tensor 96x128": [[64, None], [144, split]],
                                             "block 256x512": [[128, {"id": 7}]]}})
    assert [dispatch.cublaslt_algorithm("tensor", m, 96, 128) for m in (1, 64, 65, 144, 145)] == [
        None, None, split, split, None]  # past the last row: torch's call
    assert dispatch.cublaslt_algorithm("block", 100, 256, 512) == {"id": 7}
    assert dispatch.cublaslt_algorithm("tensor", 100, 256, 512) is None  # another recipe's row
    assert dispatch.cublaslt_named()
    with pytest.raises(ValueError, match="recipes"):
        dispatch.apply_table({"cublaslt_algos": {"rowwise 96x128": [[64, {"id": 1}]]}})
    with pytest.raises(ValueError, match="id"):
        dispatch.apply_table({"cublaslt_algos": {"tensor 96x128": [[64, {"tile": 1}]]}})


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("m", [7, 64, 133])
def test_products_on_a_named_cublaslt_algorithm_match_float64(monkeypatch, m):
    """The row-wise product, the tensor-wise one (its reader's UnscaledProduct and the scaled output) and the block
    recipe on every algorithm cuBLASLt offers for them (split-K variants included), named through the dispatch as a
    table would, and in a CUDA graph replayed on fresh inputs; an algorithm cuBLASLt refuses falls back to torch's."""
    from kernels import cublaslt
    from kernels import fp8_gemm_dispatch as dispatch
    from kernels.fp8_quant import block_scales_of, rows_sharing_scales

    n, k = 384, 1024
    monkeypatch.setattr(dispatch, "CUBLASLT_ALGOS", {})
    monkeypatch.setitem(dispatch.BLOCK_TABLE, (n, k), [(1 << 62, "block_scaled_mm")])
    x, a, a_scale, w, w_scale, _ = operands(m, n, k, k, seed=m, device="cuda", x_dtype=torch.bfloat16)
    ref = fp8_gemm_ref(a, a_scale, w, w_scale, k)
    wb, wb_rows = (t.cuda() for t in quantize_blocks_on_rows(w.float().cpu() * w_scale.cpu()))
    blocks = block_scales_of(wb_rows, 128, rows_sharing_scales(wb_rows))
    ab, ab_scale = quantize_rows_ref(x, 128)
    ref_b = fp8_gemm_ref(ab, ab_scale, wb, wb_rows, 128)
    cublaslt.prepare(torch.device("cuda"))
    monkeypatch.setattr(fp8_gemm, "_cublaslt_plans", {})
    static_x = x.bfloat16().clone()

    def call(recipe, x):
        if recipe == "block":
            return fp8_gemm.fp8_linear(x, wb, wb_rows, 128, block_scales=blocks)
        return fp8_gemm.fp8_linear(x, w, w_scale, k)

    # the rows the engine runs each on (the block recipe's in 4s)
    for recipe, rows, backend in (("tensor", m, "unit_scaled_mm"), ("block", -(-m // 4) * 4, None),
                                  ("outer", m, "scaled_mm")):
        if backend:
            monkeypatch.setitem(dispatch.TABLE, (n, k), [(1 << 62, backend)])
        plan = cublaslt.Fp8Matmul(n, k, rows, torch.bfloat16, recipe, device="cuda")
        for algo in plan.candidates(count=4, splits=(2, 4)):
            dispatch.CUBLASLT_ALGOS[(recipe, n, k)] = [(1 << 62, algo.entry())]  # as a table names it
            assert_close_to_float64(call(recipe, x.bfloat16()), ref_b if recipe == "block" else ref, rel=1e-2,
                                    what=f"{recipe} on {algo}")
            if recipe == "tensor":
                product = fp8_gemm.fp8_linear(x.bfloat16(), w, w_scale, k, unscaled=True)
                assert_close_to_float64(fp8_gemm.scaled(product), ref, rel=1e-2)
        # the graph on the heuristic's first (an in-place split-K reduction would add by atomics: not bit for bit)
        dispatch.CUBLASLT_ALGOS[(recipe, n, k)] = [(1 << 62, plan.heuristic(1)[0].entry())]
        call(recipe, static_x)  # warm-up (the plan is made) outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_out = call(recipe, static_x)
        for seed in (1, 2):
            static_x.copy_(torch.randn(m, k, generator=torch.Generator().manual_seed(seed)).bfloat16().cuda())
            graph.replay()
            assert torch.equal(static_out, call(recipe, static_x))
    plans = fp8_gemm._cublaslt_plans.values()
    assert {plan.scaling for plan, _ in plans} == {"outer", "tensor", "block"}
    assert all(algo is not None for _, algo in plans)  # each ran on its algorithm, none fell back
    dispatch.CUBLASLT_ALGOS[("tensor", n, k)] = [(1 << 62, {"id": 1 << 30})]  # no such algorithm: torch's call
    monkeypatch.setitem(dispatch.TABLE, (n, k), [(1 << 62, "unit_scaled_mm")])
    assert torch.equal(fp8_gemm.fp8_linear(x.bfloat16(), w, w_scale, k),
                       fp8_gemm.unit_scaled_mm_fp8_gemm(*fp8_gemm.quantize_rows(x.bfloat16(), k), w, w_scale,
                                                        torch.bfloat16, fast_accum=dispatch.fast_accumulation(m)))


def test_a_table_naming_an_unknown_backend_is_refused(monkeypatch):
    from kernels import fp8_gemm_dispatch as dispatch

    monkeypatch.setattr(dispatch, "TABLE", {})
    with pytest.raises(ValueError, match="cutlass"):
        dispatch.apply_table({"backends": {"96x64": [[16, "cutlass"]]}, "tiles": {}})
