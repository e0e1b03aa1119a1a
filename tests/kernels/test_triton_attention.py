"""The Triton attention kernels match a float64 dense attention built from the block tables.

On the CPU the kernels run in Triton's interpreter, which has to be on before they are decorated.
So unless TRITON_INTERPRET=1 is already set, one test re-runs this file in a fresh python with it
set, and the interpreter tests skip in this process (run the file with TRITON_INTERPRET=1 to see
them one by one). The gpu tests run the compiled kernels at realistic shapes.
"""
from __future__ import annotations


import pytest
from support.interpreter_child import (INTERPRETING, KERNELS_RUN_HERE, assert_module_passes_under_interpreter,
                               interpreter, needs_cuda)
import torch

pytest.importorskip("triton")

from support.paged_batches import make_batch, reference_attention, rel_error  # noqa: E402

if KERNELS_RUN_HERE:
    # Not imported otherwise: compiled-mode kernels would stick in sys.modules for this process.
    from kernels.attention import triton_backend as ta
    from kernels.attention import triton_tuning as tuning



# (seqlens_q, seqlens_k, num_q_heads, num_kv_heads, head_dim, block_size)
PREFILL_CASES = {
    "fresh prompts, MHA, D=16, block 4": ([5, 17, 1], [5, 17, 1], 2, 2, 16, 4),
    "prefix hits and chunks, GQA 2, D=24, block 4": ([3, 16, 7], [11, 40, 7], 4, 2, 24, 4),
    "GQA 3, D=48, block 16": ([20, 2], [20, 35], 3, 1, 48, 16),
    "one long chunk over a prefix, GQA 4, D=64": ([33], [38], 4, 1, 64, 16),
}
# (seqlens_k, num_q_heads, num_kv_heads, head_dim, block_size)
DECODE_CASES = {
    "MHA, D=16, block 4": ([9, 1, 30], 2, 2, 16, 4),
    "GQA 2, D=24, block 16": ([40, 17, 3], 4, 2, 24, 16),
    "GQA 3, D=48, block 4": ([33, 16], 6, 2, 48, 4),
}


# ---------------------------------------------------------------------------------------------
# CPU: the interpreter
# ---------------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.skipif(INTERPRETING, reason="this is the child process")
def test_triton_kernels_pass_under_the_interpreter():
    assert_module_passes_under_interpreter(__file__, "test_triton_kernels_pass_under_the_interpreter", timeout=900)


@interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [16, 24])
def test_store_kvcache_writes_each_row_at_its_slot_and_skips_minus_one(dtype, head_dim):
    gen = torch.Generator().manual_seed(head_dim)
    num_blocks, block_size, num_kv_heads, num_tokens = 6, 4, 3, 9
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(dtype)
    k_before, v_before = k_cache.clone(), v_cache.clone()
    # key/value as strided views of one fused projection, the way a model hands them over.
    kv = torch.randn(num_tokens, 2 * num_kv_heads + 1, head_dim, generator=gen).to(dtype)
    key, value = kv[:, :num_kv_heads], kv[:, num_kv_heads:2 * num_kv_heads]
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[[1, 4, 8]] = -1

    ta.store_kvcache(key, value, k_cache, v_cache, slots)

    written = slots >= 0
    k_expected, v_expected = k_before.flatten(0, 1), v_before.flatten(0, 1)
    k_expected[slots[written]] = key[written]
    v_expected[slots[written]] = value[written]
    assert torch.equal(k_cache.flatten(0, 1), k_expected)  # untouched slots keep their old bytes
    assert torch.equal(v_cache.flatten(0, 1), v_expected)


@interpreter
@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("case", list(PREFILL_CASES))
def test_prefill_matches_dense_causal_reference(case, seed):
    seqlens_q, seqlens_k, hq, hkv, d, bs = PREFILL_CASES[case]
    q, k_cache, v_cache, meta = make_batch(seqlens_q, seqlens_k, num_q_heads=hq, num_kv_heads=hkv, head_dim=d,
                                           block_size=bs, seed=seed)
    out = ta.paged_prefill_attention(q, k_cache, v_cache, meta, d ** -0.5)
    assert out.dtype == q.dtype and out.shape == q.shape
    assert rel_error(out, reference_attention(q, k_cache, v_cache, meta, d ** -0.5)) < 1e-3


@interpreter
@pytest.mark.parametrize("num_splits", [1, 3, 7])
@pytest.mark.parametrize("case", list(DECODE_CASES))
def test_decode_matches_dense_reference_for_any_split_count(case, num_splits):
    seqlens_k, hq, hkv, d, bs = DECODE_CASES[case]
    q, k_cache, v_cache, meta = make_batch([1] * len(seqlens_k), seqlens_k, num_q_heads=hq, num_kv_heads=hkv,
                                           head_dim=d, block_size=bs, seed=num_splits)
    out = ta.paged_decode_attention(q, k_cache, v_cache, meta, d ** -0.5, num_splits=num_splits)
    assert rel_error(out, reference_attention(q, k_cache, v_cache, meta, d ** -0.5)) < 1e-3


@interpreter
@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_visiting_sequences_longest_first_changes_nothing_but_the_order(num_splits):
    seqlens_k, hq, hkv, d, bs = DECODE_CASES[list(DECODE_CASES)[0]]
    q, k_cache, v_cache, meta = make_batch([1] * len(seqlens_k), seqlens_k, num_q_heads=hq, num_kv_heads=hkv,
                                           head_dim=d, block_size=bs, seed=5 + num_splits)
    plain = ta.paged_decode_attention(q, k_cache, v_cache, meta, d ** -0.5, num_splits=num_splits)
    meta.decode_order = torch.argsort(meta.seqlens_k, descending=True, stable=True).to(torch.int32)
    assert meta.decode_order.tolist() != list(range(len(seqlens_k)))  # the case is ragged
    ordered = ta.paged_decode_attention(q, k_cache, v_cache, meta, d ** -0.5, num_splits=num_splits)
    assert torch.equal(ordered, plain)
    assert rel_error(ordered, reference_attention(q, k_cache, v_cache, meta, d ** -0.5)) < 1e-3


@interpreter
def test_bf16_prefill_and_decode_match_the_reference_within_bf16_rounding():
    q, k_cache, v_cache, meta = make_batch([6, 1], [21, 9], num_q_heads=4, num_kv_heads=2, head_dim=16,
                                           block_size=4, dtype=torch.bfloat16, seed=3)
    out = ta.paged_prefill_attention(q, k_cache, v_cache, meta, 0.25)
    assert out.dtype == torch.bfloat16
    assert rel_error(out, reference_attention(q, k_cache, v_cache, meta, 0.25)) < 1e-2

    q, k_cache, v_cache, meta = make_batch([1, 1], [21, 9], num_q_heads=4, num_kv_heads=2, head_dim=16,
                                           block_size=4, dtype=torch.bfloat16, seed=4)
    out = ta.paged_decode_attention(q, k_cache, v_cache, meta, 0.25, num_splits=2)
    assert out.dtype == torch.bfloat16
    assert rel_error(out, reference_attention(q, k_cache, v_cache, meta, 0.25)) < 1e-2


@interpreter
@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_row_with_empty_context_gives_zeros_not_nan(num_splits):
    # A padded batch row (e.g. in a CUDA-graph batch) has no context at all.
    q, k_cache, v_cache, meta = make_batch([1, 1], [13, 1], num_q_heads=2, num_kv_heads=1, head_dim=16,
                                           block_size=4, seed=5)
    meta.seqlens_k[1] = 0
    out = ta.paged_decode_attention(q, k_cache, v_cache, meta, 0.25, num_splits=num_splits)
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    assert rel_error(out[:1], reference_attention(q, k_cache, v_cache, meta, 0.25)[:1]) < 1e-3


def assert_fp8_output_is_the_quantized_output(q, k_cache, v_cache, meta, num_splits, fp8_group, m_major=False):
    """The decode kernels' FP8 output for an FP8 o_proj: the bytes and scales kernels/fp8_gemm.quantize_rows makes
    of the plain output, which they return beside it unchanged; m_major: the scales laid out for the block recipe.
    None where a split step's merge leaves a scale per token to quantize_rows (merge_writes_fp8); False then."""
    from kernels.attention.decode_common import merge_writes_fp8
    from kernels.fp8_gemm import quantize_rows
    from kernels.fp8_quant import block_recipe_rows

    scale = q.shape[-1] ** -0.5
    plain = ta.paged_decode_attention(q, k_cache, v_cache, meta, scale, num_splits=num_splits)
    out, fp8 = ta.triton_decode_attention(q, k_cache, v_cache, meta, scale, num_splits=num_splits,
                                          fp8_group=fp8_group, fp8_m_major=m_major)
    assert torch.equal(out, plain)
    splits = num_splits or 1
    if fp8 is None:
        assert splits > 1 and not merge_writes_fp8(splits, q.shape[1], q.shape[2], fp8_group)
        return False
    want_q, want_scale = quantize_rows(plain.reshape(plain.shape[0], -1), fp8_group)
    assert fp8.q.shape == want_q.shape and fp8.scale.shape == want_scale.shape and fp8.dtype == q.dtype
    if m_major:
        assert fp8.scale.stride() == (1, block_recipe_rows(q.shape[0]))
    assert torch.equal(fp8.scale, want_scale)
    assert torch.equal(fp8.q.view(torch.uint8), want_q.view(torch.uint8))
    return True


@interpreter
@pytest.mark.parametrize("num_splits, row_merge", [(1, 4), (3, 4), (3, 0), (5, 4)])
@pytest.mark.parametrize("per", ["token", "head", "head, M-major"])
def test_decode_writes_o_projs_fp8_input_as_the_quantization_of_its_output(monkeypatch, num_splits, row_merge, per):
    """Per token (channel weights: unsplit, the last of a token's programs quantizes its row; split into at most
    ROW_MERGE_MAX_SPLITS, one merge program a token; into more, none: quantize_rows after the merge) or per head
    (block weights whose groups are head_dim wide; M-major for the block recipe), unsplit (a token's H_kv programs)
    and split (its H_q merge programs); ragged contexts, one of them empty (a padded graph row), bf16 as the engine
    runs it, and, per token, every program counted back to zero (the counters are shared with the split-K GEMMs)."""
    from kernels.attention import decode_common
    from kernels.fp8_gemm import split_counters

    monkeypatch.setattr(decode_common, "ROW_MERGE_MAX_SPLITS", row_merge)

    seqlens_k, hq, hkv, d, bs = [9, 1, 30, 17], 4, 2, 16, 4
    q, k_cache, v_cache, meta = make_batch([1] * len(seqlens_k), seqlens_k, num_q_heads=hq, num_kv_heads=hkv,
                                           head_dim=d, block_size=bs, dtype=torch.bfloat16, seed=21 + num_splits)
    meta.seqlens_k[1] = 0
    group = hq * d if per == "token" else d
    written = assert_fp8_output_is_the_quantized_output(q, k_cache, v_cache, meta, num_splits, group,
                                                        m_major=per.endswith("M-major"))
    assert written == (per != "token" or num_splits == 1 or (num_splits, row_merge) == (3, 4))
    assert not split_counters(q.device).any()
    with pytest.raises(ValueError, match="per token or per head"):
        ta.triton_decode_attention(q, k_cache, v_cache, meta, 0.25, num_splits=num_splits, fp8_group=8)


def test_a_split_merge_writes_a_scale_per_token_only_where_the_tokens_row_fits_one_program():
    from kernels.attention.decode_common import merge_writes_fp8

    assert [merge_writes_fp8(s, 32, 128, 32 * 128) for s in (2, 3, 4, 5, 23)] == [True, True, True, False, False]
    assert merge_writes_fp8(2, 64, 128, 64 * 128) and not merge_writes_fp8(2, 128, 128, 128 * 128)  # 8,192 columns
    assert merge_writes_fp8(23, 32, 128, 128), "a scale per head: the merge writes it at any split count"


@interpreter
@pytest.mark.parametrize("num_splits", [2, 4])
def test_the_merge_a_program_a_token_masks_heads_past_a_count_that_is_not_a_power_of_two(num_splits):
    """Six query heads (the program's tile holds eight) over three KV heads, split 2 and 4 ways, a context shorter
    than its splits among them: the row's max and bytes come from the six heads only."""
    q, k_cache, v_cache, meta = make_batch([1] * 3, [5, 40, 23], num_q_heads=6, num_kv_heads=3, head_dim=16,
                                           block_size=4, dtype=torch.bfloat16, seed=40 + num_splits)
    assert assert_fp8_output_is_the_quantized_output(q, k_cache, v_cache, meta, num_splits, 6 * 16)


@interpreter
def test_an_attention_layer_before_an_fp8_o_proj_hands_it_fp8_on_decode_steps_only():
    """executor_svc/layers/attention.Attention with fp8_group set (the loader's, before an FP8 o_proj): a decode
    step, after RoPE and the K/V store, comes out as QuantizedActivations, the quantization of the plain layer's
    output; a step with a prefill chunk comes out plain (fp8_linear quantizes it)."""
    from executor_svc.layers.attention import Attention
    from executor_svc.layers.rotary import RotaryEmbedding
    from kernels.fp8_gemm import quantize_rows
    from kernels.fp8_quant import QuantizedActivations

    hq, hkv, d, bs = 4, 2, 16, 4
    rope = RotaryEmbedding(d, 64, 10000.0)

    def run(seqlens_q, fp8_group):
        seqlens_k = [9, 30, 17][:len(seqlens_q)]
        q, k_cache, v_cache, meta = make_batch(seqlens_q, seqlens_k, num_q_heads=hq, num_kv_heads=hkv, head_dim=d,
                                               block_size=bs, dtype=torch.bfloat16, seed=40)
        gen = torch.Generator().manual_seed(41)
        k, v = (torch.randn(q.shape[0], hkv, d, generator=gen).to(torch.bfloat16) for _ in range(2))
        positions = torch.cat([torch.arange(n - m, n) for m, n in zip(seqlens_q, seqlens_k)])
        layer = Attention(hq, d, d ** -0.5, hkv)
        layer.backend, layer.k_cache, layer.v_cache, layer.fp8_group = ta.TritonAttentionBackend(), k_cache, v_cache, \
            fp8_group
        return layer.forward(positions, q, k, v.flatten(1), meta, rope)

    plain = run([1, 1, 1], None)
    quantized = run([1, 1, 1], hq * d)
    assert isinstance(quantized, QuantizedActivations) and quantized.dtype == torch.bfloat16
    want_q, want_scale = quantize_rows(plain, hq * d)
    assert torch.equal(quantized.scale, want_scale) and torch.equal(quantized.q.view(torch.uint8),
                                                                    want_q.view(torch.uint8))
    assert torch.equal(run([3, 1], hq * d), run([3, 1], None))  # a prefill chunk: plain


@interpreter
def test_backend_stores_new_tokens_then_attends_over_prefix_and_new_tokens():
    backend = ta.TritonAttentionBackend()
    assert backend.name == "triton"
    hq, hkv, d = 4, 2, 24
    # A mixed step: a chunk after a cached prefix, a fresh prompt, and a decode row.
    q, k_cache, v_cache, meta = make_batch([4, 6, 1], [10, 6, 19], num_q_heads=hq, num_kv_heads=hkv, head_dim=d,
                                           block_size=4, seed=6)
    key = torch.randn(q.shape[0], hkv, d)
    value = torch.randn(q.shape[0], hkv, d)
    backend.store_kvcache(key, value, k_cache, v_cache, meta.slot_mapping)
    assert torch.equal(k_cache.flatten(0, 1)[meta.slot_mapping], key)
    out = backend.forward(q, k_cache, v_cache, meta, d ** -0.5)
    assert rel_error(out, reference_attention(q, k_cache, v_cache, meta, d ** -0.5)) < 1e-3

    q, k_cache, v_cache, meta = make_batch([1, 1, 1], [10, 6, 19], num_q_heads=hq, num_kv_heads=hkv, head_dim=d,
                                           block_size=4, seed=7)
    assert meta.is_decode
    out = backend.forward(q, k_cache, v_cache, meta, d ** -0.5)
    assert rel_error(out, reference_attention(q, k_cache, v_cache, meta, d ** -0.5)) < 1e-3


@interpreter
def test_decode_splits_the_context_only_when_seqs_times_kv_heads_leave_sms_idle():
    # H200: 132 SMs; Qwen3-0.6B has 8 KV heads; decode tiles of 64 tokens.
    assert tuning.decode_num_splits(256, 8, 1024, 132, 64) == 1
    assert tuning.decode_num_splits(64, 8, 4096, 132, 64) == 1  # two programs per SM are enough
    assert tuning.decode_num_splits(8, 8, 4096, 132, 64) == 9
    assert tuning.decode_num_splits(1, 8, 4096, 132, 64) == 32  # capped at MAX_SPLITS
    assert tuning.decode_num_splits(1, 8, 4096, 132, 64) <= tuning.MAX_SPLITS
    assert tuning.decode_num_splits(4, 8, 256, 132, 64) == 2  # each split keeps >= 2 tiles
    assert tuning.decode_num_splits(4, 8, 64, 132, 64) == 1


# ---------------------------------------------------------------------------------------------
# GPU: compiled kernels, realistic shapes, bf16
# ---------------------------------------------------------------------------------------------

# (num_q_heads, num_kv_heads, head_dim): Qwen3-0.6B, SmolLM2-135M, a padded non-power-of-two D.
GPU_HEADS = [(16, 8, 128), (9, 3, 64), (4, 2, 192)]


def _mixed_step(device: str, dtype, seed: int, decode_k, prefill_q, prefill_k, heads, block_size):
    """One-token sequences first (num_decodes of them, visited longest first), then prefill chunks."""
    hq, hkv, d = heads
    q, k_cache, v_cache, meta = make_batch([1] * len(decode_k) + prefill_q, decode_k + prefill_k, num_q_heads=hq,
                                           num_kv_heads=hkv, head_dim=d, block_size=block_size, dtype=dtype,
                                           device=device, seed=seed)
    meta.num_decodes = len(decode_k)
    meta.decode_order = torch.argsort(meta.seqlens_k[:len(decode_k)], descending=True, stable=True).to(torch.int32)
    return q, k_cache, v_cache, meta


@interpreter
def test_mixed_step_runs_its_one_token_rows_in_the_decode_kernel_and_matches_the_reference():
    q, k_cache, v_cache, meta = _mixed_step("cpu", torch.float32, 8, [5, 23, 1], [4, 7], [10, 7], (4, 2, 16), 4)
    assert meta.is_mixed and not meta.is_decode
    part = meta.prefill_part
    assert part.num_seqs == 2 and part.cu_seqlens_q.tolist() == [3, 7, 14]  # offsets into the step's tokens
    out = ta.TritonAttentionBackend().forward(q, k_cache, v_cache, meta, 0.25)
    assert rel_error(out, reference_attention(q, k_cache, v_cache, meta, 0.25)) < 1e-3
    meta.num_decodes, meta.decode_order = 0, None  # the same step all through the prefill kernel
    unsplit = ta.TritonAttentionBackend().forward(q, k_cache, v_cache, meta, 0.25)
    assert rel_error(out, unsplit) < 1e-3


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("heads", GPU_HEADS)
@pytest.mark.parametrize("block_size", [16, 32])
def test_gpu_prefill_matches_reference_with_prefixes_chunks_and_decode_rows(heads, block_size):
    hq, hkv, d = heads
    seqlens_q = [1024, 300, 1, 17, 700]
    seqlens_k = [1024, 2100, 4096, 17, 3000]
    q, k_cache, v_cache, meta = make_batch(seqlens_q, seqlens_k, num_q_heads=hq, num_kv_heads=hkv, head_dim=d,
                                           block_size=block_size, dtype=torch.bfloat16, device="cuda", seed=10)
    out = ta.paged_prefill_attention(q, k_cache, v_cache, meta, d ** -0.5)
    assert rel_error(out, reference_attention(q, k_cache, v_cache, meta, d ** -0.5)) < 1e-2


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("heads", GPU_HEADS)
def test_gpu_mixed_step_matches_reference(heads):
    lens = torch.randint(1, 3000, (37,), generator=torch.Generator().manual_seed(13)).tolist()
    q, k_cache, v_cache, meta = _mixed_step("cuda", torch.bfloat16, 14, lens, [700, 1, 129], [700, 1500, 4000],
                                            heads, 16)
    meta.num_decodes = len(lens)  # the prefill part's one-token chunk (q 1 of 1500) stays in the prefill kernel
    out = ta.TritonAttentionBackend().forward(q, k_cache, v_cache, meta, heads[2] ** -0.5)
    assert rel_error(out, reference_attention(q, k_cache, v_cache, meta, heads[2] ** -0.5)) < 1e-2


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("heads", GPU_HEADS)
@pytest.mark.parametrize("num_splits", [None, 1, 4, 16])
def test_gpu_decode_matches_reference_for_any_split_count(heads, num_splits):
    hq, hkv, d = heads
    seqlens_k = torch.randint(1, 4097, (40,), generator=torch.Generator().manual_seed(11)).tolist()
    seqlens_k[:3] = [1, 4096, 16]
    q, k_cache, v_cache, meta = make_batch([1] * len(seqlens_k), seqlens_k, num_q_heads=hq, num_kv_heads=hkv,
                                           head_dim=d, block_size=16, dtype=torch.bfloat16, device="cuda", seed=12)
    out = ta.paged_decode_attention(q, k_cache, v_cache, meta, d ** -0.5, num_splits=num_splits)
    assert rel_error(out, reference_attention(q, k_cache, v_cache, meta, d ** -0.5)) < 1e-2


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("num_splits", [None, 1, 4])
@pytest.mark.parametrize("per", ["token", "head", "head, M-major"])
def test_gpu_decode_writes_o_projs_fp8_input_as_the_quantization_of_its_output(num_splits, per):
    """As on the CPU, at the 8B shape's heads (32 / 8, D = 128) and 150 ragged contexts, five times over fresh
    inputs: a token's last program must see every other program's stores (the counters' release and acquire)."""
    from kernels.fp8_gemm import split_counters

    for seed in range(5):
        seqlens_k = torch.randint(1, 2049, (150,), generator=torch.Generator().manual_seed(seed)).tolist()
        q, k_cache, v_cache, meta = make_batch([1] * len(seqlens_k), seqlens_k, num_q_heads=32, num_kv_heads=8,
                                               head_dim=128, block_size=16, dtype=torch.bfloat16, device="cuda",
                                               seed=30 + seed)
        assert_fp8_output_is_the_quantized_output(q, k_cache, v_cache, meta, num_splits,
                                                  32 * 128 if per == "token" else 128, m_major=per.endswith("M-major"))
        assert not split_counters(q.device).any()


@pytest.mark.gpu
@needs_cuda
def test_gpu_fp32_inputs_use_exact_dots_not_tf32():
    q, k_cache, v_cache, meta = make_batch([300, 1], [700, 2000], num_q_heads=9, num_kv_heads=3, head_dim=64,
                                           block_size=16, device="cuda", seed=16)
    out = ta.paged_prefill_attention(q, k_cache, v_cache, meta, 0.125)
    assert rel_error(out, reference_attention(q, k_cache, v_cache, meta, 0.125)) < 1e-4
    q, k_cache, v_cache, meta = make_batch([1, 1], [700, 2000], num_q_heads=9, num_kv_heads=3, head_dim=64,
                                           block_size=16, device="cuda", seed=17)
    out = ta.paged_decode_attention(q, k_cache, v_cache, meta, 0.125, num_splits=3)
    assert rel_error(out, reference_attention(q, k_cache, v_cache, meta, 0.125)) < 1e-4


@pytest.mark.gpu
@needs_cuda
def test_gpu_store_kvcache_writes_each_row_at_its_slot_and_skips_minus_one():
    gen = torch.Generator().manual_seed(13)
    num_blocks, block_size, hkv, d, num_tokens = 600, 16, 8, 128, 4096
    k_cache = torch.randn(num_blocks, block_size, hkv, d, generator=gen).bfloat16().cuda()
    v_cache = torch.randn(num_blocks, block_size, hkv, d, generator=gen).bfloat16().cuda()
    k_before, v_before = k_cache.clone(), v_cache.clone()
    key = torch.randn(num_tokens, hkv, d, generator=gen).bfloat16().cuda()
    value = torch.randn(num_tokens, hkv, d, generator=gen).bfloat16().cuda()
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[::7] = -1
    slots = slots.cuda()
    ta.store_kvcache(key, value, k_cache, v_cache, slots)
    written = slots >= 0
    k_expected, v_expected = k_before.flatten(0, 1), v_before.flatten(0, 1)
    k_expected[slots[written]] = key[written]
    v_expected[slots[written]] = value[written]
    assert torch.equal(k_cache.flatten(0, 1), k_expected)
    assert torch.equal(v_cache.flatten(0, 1), v_expected)


@pytest.mark.gpu
@needs_cuda
def test_gpu_decode_replayed_from_a_cuda_graph_follows_new_lengths_and_tables():
    # The runner captures decode once at a fixed batch size and replays it with new metadata.
    hq, hkv, d, bs = 16, 8, 128, 16
    q, k_cache, v_cache, meta = make_batch([1] * 8, [4096] * 8, num_q_heads=hq, num_kv_heads=hkv, head_dim=d,
                                           block_size=bs, dtype=torch.bfloat16, device="cuda", seed=14)
    backend = ta.TritonAttentionBackend()
    backend.forward(q, k_cache, v_cache, meta, d ** -0.5)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = backend.forward(q, k_cache, v_cache, meta, d ** -0.5)

    gen = torch.Generator().manual_seed(15)
    new_lengths = torch.randint(1, 4097, (8,), generator=gen, dtype=torch.int32)
    meta.seqlens_k.copy_(new_lengths)
    flipped = meta.block_tables.flip(1)  # different, still valid, block ids
    meta.block_tables.copy_(flipped)
    q.copy_(torch.randn(q.shape, generator=gen).bfloat16())
    graph.replay()
    torch.cuda.synchronize()
    assert rel_error(out, reference_attention(q, k_cache, v_cache, meta, d ** -0.5)) < 1e-2

