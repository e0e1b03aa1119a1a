"""The fused small ops (RMSNorm with the residual add, SiLU-and-mul, RoPE, and the attention prologue
q/k norm + RoPE + KV store in one kernel) match eager torch and float64.

On the CPU the kernels run in Triton's interpreter, which has to be on before they are decorated.
So unless TRITON_INTERPRET=1 is already set, one test re-runs this file in a fresh python with it
set, and the interpreter tests skip in this process. The interpreter rounds fp32 -> bf16 by
truncation where a GPU rounds to nearest, so on the CPU bf16 results may sit an ulp or two from
eager torch. The gpu tests run the compiled kernels at Qwen3-0.6B's shapes and in a CUDA graph.
"""
from __future__ import annotations


import pytest
from support.float64_ops import EPS, rms_norm64, silu_and_mul64
from support.interpreter_child import (INTERPRETING, KERNELS_RUN_HERE, assert_module_passes_under_interpreter,
                               interpreter, needs_cuda)
import torch

pytest.importorskip("triton")

from executor_svc.layers.activation import SiluAndMul  # noqa: E402
from executor_svc.layers.layernorm import RMSNorm  # noqa: E402
from executor_svc.layers.rotary import RotaryEmbedding  # noqa: E402

if KERNELS_RUN_HERE:
    from kernels import fused_ops as fo
    from kernels.attention import triton_backend as ta

DTYPES = [torch.float32, torch.bfloat16]


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref).norm() / ref.norm()).item()


def close_to_eager(out: torch.Tensor, ref: torch.Tensor) -> None:
    """Same dtype and, up to rounding, the same values as the eager torch result."""
    assert out.dtype == ref.dtype and out.shape == ref.shape
    if out.dtype == torch.float32:
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    else:  # a couple of bf16 ulps: the interpreter truncates, and reductions sum in another order
        torch.testing.assert_close(out.float(), ref.float(), rtol=1.6e-2, atol=1.6e-2)


def max_rel(dtype: torch.dtype) -> float:
    return 1e-5 if dtype == torch.float32 else 1e-2


def randn(*shape, gen, dtype, device="cpu") -> torch.Tensor:
    return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)


# float64 references, written from the definitions rather than from the eager layers (support/float64_ops.py)


def rotate64(x, positions, cos, sin):
    """Each pair (x[i], x[i + D/2]) turned by the angle whose cos and sin the cache holds."""
    c, s = cos.double()[positions][:, None], sin.double()[positions][:, None]
    x1, x2 = x.double().chunk(2, dim=-1)
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)


def qkv_views(num_tokens, num_q_heads, num_kv_heads, head_dim, *, gen, dtype, device="cpu"):
    """q, k, v as strided views of one fused projection, the way the model hands them over."""
    qkv = randn(num_tokens, (num_q_heads + 2 * num_kv_heads) * head_dim, gen=gen, dtype=dtype, device=device)
    q, k, v = qkv.split([num_q_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
    return q.unflatten(-1, (num_q_heads, head_dim)), k.unflatten(-1, (num_kv_heads, head_dim)), v


# ---------------------------------------------------------------------------------------------
# CPU: the interpreter
# ---------------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.skipif(INTERPRETING, reason="this is the child process")
def test_fused_ops_pass_under_the_interpreter():
    assert_module_passes_under_interpreter(__file__, "test_fused_ops_pass_under_the_interpreter", timeout=600)


@interpreter
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [576, 40])
def test_rms_norm_matches_eager_and_float64(dtype, hidden):
    gen = torch.Generator().manual_seed(hidden)
    x, weight = randn(5, hidden, gen=gen, dtype=dtype), randn(hidden, gen=gen, dtype=dtype)
    out = fo.rms_norm(x, weight, EPS)
    close_to_eager(out, fo.rms_norm_ref(x, weight, EPS))
    assert rel_error(out, rms_norm64(x, weight)) < max_rel(dtype)


@interpreter
@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_with_residual_returns_the_norm_of_the_sum_and_the_sum(dtype):
    gen = torch.Generator().manual_seed(1)
    x, residual = randn(7, 576, gen=gen, dtype=dtype), randn(7, 576, gen=gen, dtype=dtype)
    weight = randn(576, gen=gen, dtype=dtype)
    x_before, residual_before = x.clone(), residual.clone()
    out, new_residual = fo.rms_norm(x, weight, EPS, residual)
    ref_out, ref_residual = fo.rms_norm_ref(x, weight, EPS, residual)
    close_to_eager(out, ref_out)
    close_to_eager(new_residual, ref_residual)
    assert rel_error(out, rms_norm64(x, weight, residual)) < max_rel(dtype)
    assert rel_error(new_residual, x.double() + residual.double()) < max_rel(dtype) / 2
    assert torch.equal(x, x_before) and torch.equal(residual, residual_before), "inputs are not written"


@interpreter
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 80])
def test_per_head_rms_norm_on_strided_qkv_views_normalises_each_head(dtype, head_dim):
    gen = torch.Generator().manual_seed(head_dim)
    q, k, _ = qkv_views(6, 9, 3, head_dim, gen=gen, dtype=dtype)
    assert not q.is_contiguous()
    weight = randn(head_dim, gen=gen, dtype=dtype)
    for x in (q, k):
        out = fo.rms_norm(x, weight, EPS)
        assert out.shape == x.shape
        close_to_eager(out, fo.rms_norm_ref(x, weight, EPS))
        assert rel_error(out, rms_norm64(x, weight)) < max_rel(dtype)


@interpreter
@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_kernel_matches_the_torch_layer(dtype):
    gen = torch.Generator().manual_seed(2)
    norm = RMSNorm(576, EPS).to(dtype)
    norm.weight.data.copy_(randn(576, gen=gen, dtype=dtype))
    x, residual = randn(5, 576, gen=gen, dtype=dtype), randn(5, 576, gen=gen, dtype=dtype)
    close_to_eager(fo.rms_norm(x, norm.weight, EPS), norm(x))
    for out, ref in zip(fo.rms_norm(x, norm.weight, EPS, residual), norm(x, residual)):
        close_to_eager(out, ref)


@interpreter
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("inter", [200, 1536])
def test_silu_and_mul_matches_eager_the_layer_and_float64(dtype, inter):
    gen = torch.Generator().manual_seed(inter)
    x = randn(3, 2 * inter, gen=gen, dtype=dtype)
    out = fo.silu_and_mul(x)
    assert out.shape == (3, inter)
    close_to_eager(out, fo.silu_and_mul_ref(x))
    close_to_eager(out, SiluAndMul()(x))
    assert rel_error(out, silu_and_mul64(x)) < max_rel(dtype)


@interpreter
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "head_dim, num_q_heads, num_kv_heads, scaling",
    [
        (64, 9, 3, None),
        (48, 4, 4, None),  # D/2 = 24: the half is masked
        (64, 3, 8, {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 64}),  # more kv heads than q heads still works
    ],
)
def test_rotary_embedding_rotates_q_and_k_in_place_like_the_layer(dtype, head_dim, num_q_heads, num_kv_heads, scaling):
    gen = torch.Generator().manual_seed(head_dim + num_q_heads)
    rope = RotaryEmbedding(head_dim, 512, 10000.0, scaling)
    q, k, v = qkv_views(5, num_q_heads, num_kv_heads, head_dim, gen=gen, dtype=dtype)
    positions = torch.randint(0, 512, (5,), generator=gen)
    q_before, k_before, v_before = q.clone(), k.clone(), v.clone()
    ref_q, ref_k = rope(positions, q_before, k_before)  # CPU: the torch path, out of place
    out_q, out_k = fo.rotary_embedding(positions, q, k, rope.cos, rope.sin)
    assert out_q.data_ptr() == q.data_ptr() and out_k.data_ptr() == k.data_ptr()
    close_to_eager(q, ref_q)
    close_to_eager(k, ref_k)
    close_to_eager(q, fo.rotary_embedding_ref(positions, q_before, k_before, rope.cos, rope.sin)[0])
    assert rel_error(q, rotate64(q_before, positions, rope.cos, rope.sin)) < max_rel(dtype)
    assert rel_error(k, rotate64(k_before, positions, rope.cos, rope.sin)) < max_rel(dtype)
    assert torch.equal(v, v_before), "v, beside q and k in the fused projection, is untouched"


@interpreter
def test_rotary_embedding_accepts_flat_q_and_k_and_int32_positions():
    gen = torch.Generator().manual_seed(3)
    rope = RotaryEmbedding(32, 64, 10000.0)
    q, k = randn(4, 2 * 32, gen=gen, dtype=torch.float32), randn(4, 32, gen=gen, dtype=torch.float32)
    positions = torch.randint(0, 64, (4,), generator=gen, dtype=torch.int32)
    ref_q, ref_k = rope(positions.long(), q.unflatten(-1, (2, 32)), k.unflatten(-1, (1, 32)))
    fo.rotary_embedding(positions, q, k, rope.cos, rope.sin)
    close_to_eager(q.unflatten(-1, (2, 32)), ref_q)
    close_to_eager(k.unflatten(-1, (1, 32)), ref_k)


@interpreter
def test_empty_batches_give_empty_outputs():
    x, weight = torch.randn(0, 40), torch.randn(40)
    assert fo.rms_norm(x, weight, EPS).shape == (0, 40)
    assert [t.shape for t in fo.rms_norm(x, weight, EPS, torch.randn(0, 40))] == [(0, 40), (0, 40)]
    assert fo.silu_and_mul(torch.randn(0, 80)).shape == (0, 40)
    rope = RotaryEmbedding(16, 8, 10000.0)
    q, k = fo.rotary_embedding(torch.zeros(0, dtype=torch.int64), torch.randn(0, 2, 16), torch.randn(0, 1, 16),
                               rope.cos, rope.sin)
    assert q.shape == (0, 2, 16) and k.shape == (0, 1, 16)


# The attention prologue: qk_norm_rope_store against the four kernels it replaces


def prologue_inputs(num_tokens, num_q_heads, num_kv_heads, head_dim, *, gen, dtype, device="cpu", block_size=4):
    """A fused qkv output, RoPE caches, q/k norm weights, a pool of random contents (never zeros)
    with room to spare, and a slot mapping in which every third token is -1."""
    num_blocks = (2 * num_tokens) // block_size + 2
    rope = RotaryEmbedding(head_dim, 40960, 1000000.0)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[1::3] = -1
    pool = [randn(num_blocks, block_size, num_kv_heads, head_dim, gen=gen, dtype=dtype) for _ in range(2)]
    inputs = {
        "qkv": randn(num_tokens, (num_q_heads + 2 * num_kv_heads) * head_dim, gen=gen, dtype=dtype),
        "positions": torch.randint(0, 40960, (num_tokens,), generator=gen),
        "cos": rope.cos, "sin": rope.sin, "k_cache": pool[0], "v_cache": pool[1], "slot_mapping": slots,
        "q_norm_weight": randn(head_dim, gen=gen, dtype=dtype), "k_norm_weight": randn(head_dim, gen=gen, dtype=dtype),
    }
    return {name: tensor.to(device) for name, tensor in inputs.items()}


def split_heads(qkv, num_q_heads, num_kv_heads, head_dim):
    q, k, v = qkv.split([num_q_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
    return (q.unflatten(-1, (num_q_heads, head_dim)), k.unflatten(-1, (num_kv_heads, head_dim)),
            v.unflatten(-1, (num_kv_heads, head_dim)))


def run_prologue(fn, inputs, heads, norm):
    """fn(positions, q, k, v, cos, sin, k_cache, v_cache, slot_mapping, q_w, k_w) on copies of the
    inputs; returns (q, k) as fn leaves them, the whole qkv buffer, and the two caches."""
    x = {name: tensor.clone() for name, tensor in inputs.items()}
    q, k, v = split_heads(x["qkv"], *heads)
    weights = (x["q_norm_weight"], x["k_norm_weight"]) if norm else (None, None)
    q, k = fn(x["positions"], q, k, v, x["cos"], x["sin"], x["k_cache"], x["v_cache"], x["slot_mapping"], *weights)
    return q, k, x["qkv"], x["k_cache"], x["v_cache"]


def fused_prologue(positions, q, k, v, cos, sin, k_cache, v_cache, slot_mapping, q_w, k_w):
    return fo.qk_norm_rope_store(positions, q, k, v, cos, sin, k_cache, v_cache, slot_mapping, q_w, k_w, EPS)


def unfused_prologue(positions, q, k, v, cos, sin, k_cache, v_cache, slot_mapping, q_w, k_w, kv_scales=None):
    """The launches the fused kernel replaces, as the model ran them: rms_norm's kernel (each row added in the same
    order), RoPE, the pool store. RoPE as the fused kernel rounds it: on a GPU eager torch's (each product rounded to
    the activation dtype, then their sum; there the rotary_embedding kernel is an ulp off it, as sm_90 fuses one
    product of each pair into a bf16 FMA), under the interpreter the rotary kernel's (which truncates as the fused
    kernel does, where torch rounds)."""
    if q_w is not None:
        q, k = fo.rms_norm(q, q_w, EPS), fo.rms_norm(k, k_w, EPS)
    if q.is_cuda:
        rotated_q, rotated_k = fo.rotary_embedding_ref(positions, q, k, cos, sin)
        q.copy_(rotated_q)
        k.copy_(rotated_k)
    else:
        fo.rotary_embedding(positions, q, k, cos, sin)
    ta.store_kvcache(k, v, k_cache, v_cache, slot_mapping, kv_scales)
    return q, k


def eager_prologue(positions, q, k, v, cos, sin, k_cache, v_cache, slot_mapping, q_w, k_w):
    return fo.qk_norm_rope_store_ref(positions, q, k, v, cos, sin, k_cache, v_cache, slot_mapping, q_w, k_w, EPS)


def expected_pool(pool_before, rows, slot_mapping):
    """The pool with each stored token's row at its slot, every other slot as it was."""
    written = slot_mapping >= 0
    pool = pool_before.clone().flatten(0, 1)
    pool[slot_mapping[written]] = rows[written].to(pool.dtype)
    return pool.view_as(pool_before)


def prologue_max_rel(dtype: torch.dtype) -> float:
    """bf16 is rounded five times in a row (norm, weight, two products, their sum). The interpreter
    truncates each time, a bias that adds up, so it gets twice the bound a GPU meets."""
    return max_rel(dtype) * (2 if INTERPRETING and dtype == torch.bfloat16 else 1)


PROLOGUE_SHAPES = [(5, 4, 2, 64), (5, 4, 2, 48)]  # (T, H_q, H_kv, D); D=48 masks the head and its halves
PROLOGUE_CASES = [(dtype, norm, shape) for dtype in DTYPES for norm in (True, False) for shape in PROLOGUE_SHAPES]


def prologue_id(value) -> str:
    if isinstance(value, torch.dtype):
        return str(value).removeprefix("torch.")
    if isinstance(value, bool):
        return "qk_norm" if value else "no_norm"
    return "T{}-Hq{}-Hkv{}-D{}".format(*value)


@interpreter
@pytest.mark.parametrize(
    "dtype, norm, shape",
    PROLOGUE_CASES + [(torch.bfloat16, True, (3, 20, 5, 256))],  # 20 heads of 256: several head blocks per token
    ids=prologue_id,
)
def test_fused_prologue_equals_the_unfused_norm_rope_and_store_chain(dtype, norm, shape):
    num_tokens, *heads = shape
    inputs = prologue_inputs(num_tokens, *heads, gen=torch.Generator().manual_seed(sum(shape)), dtype=dtype)
    q, k, qkv, k_cache, v_cache = run_prologue(fused_prologue, inputs, heads, norm)
    chain_q, chain_k, _, chain_k_cache, chain_v_cache = run_prologue(unfused_prologue, inputs, heads, norm)
    q_view, k_view, v_view = split_heads(qkv, *heads)
    assert q.data_ptr() == q_view.data_ptr() and k.data_ptr() == k_view.data_ptr(), "q and k are done in place"
    assert torch.equal(q, chain_q) and torch.equal(k, chain_k)
    assert torch.equal(v_view, split_heads(inputs["qkv"], *heads)[2]), "v is read, not written"
    # The pool holds the rotated k and the untouched v at the stored slots; slot -1 rows and every
    # other slot keep what they had.
    assert torch.equal(k_cache, expected_pool(inputs["k_cache"], chain_k, inputs["slot_mapping"]))
    assert torch.equal(v_cache, expected_pool(inputs["v_cache"], v_view, inputs["slot_mapping"]))
    assert torch.equal(k_cache, chain_k_cache) and torch.equal(v_cache, chain_v_cache)
    # Eager torch rounds to nearest where the interpreter truncates: compare head-wide, not elementwise
    # (the sum of two rounded products can cancel to a value much smaller than its error).
    eager_q, eager_k, _, eager_k_cache, _ = run_prologue(eager_prologue, inputs, heads, norm)
    for got, want in ((q, eager_q), (k, eager_k), (k_cache, eager_k_cache)):
        assert got.dtype == want.dtype and rel_error(got, want.double()) < prologue_max_rel(dtype)


@interpreter
@pytest.mark.parametrize("dtype, norm, shape", PROLOGUE_CASES, ids=prologue_id)
def test_fused_prologue_matches_float64(dtype, norm, shape):
    num_tokens, *heads = shape
    inputs = prologue_inputs(num_tokens, *heads, gen=torch.Generator().manual_seed(7 + sum(shape)), dtype=dtype)
    q, k, _, k_cache, v_cache = run_prologue(fused_prologue, inputs, heads, norm)
    q0, k0, v0 = split_heads(inputs["qkv"], *heads)
    if norm:
        q0, k0 = rms_norm64(q0, inputs["q_norm_weight"]), rms_norm64(k0, inputs["k_norm_weight"])
    q64 = rotate64(q0, inputs["positions"], inputs["cos"], inputs["sin"])
    k64 = rotate64(k0, inputs["positions"], inputs["cos"], inputs["sin"])
    assert rel_error(q, q64) < prologue_max_rel(dtype)
    assert rel_error(k, k64) < prologue_max_rel(dtype)
    slots = inputs["slot_mapping"]
    written = slots >= 0
    assert rel_error(k_cache.flatten(0, 1)[slots[written]], k64[written]) < prologue_max_rel(dtype)
    assert torch.equal(v_cache.flatten(0, 1)[slots[written]], v0[written]), "v is copied exactly"


@interpreter
@pytest.mark.parametrize("norm", [True, False], ids=["qk_norm", "no_norm"])  # scaled by the norm, or by RoPE
@pytest.mark.parametrize("fp8_pool", [False, True], ids=["bf16_pool", "fp8_pool"])
def test_fused_prologue_scales_an_unscaled_fp8_product_as_it_reads_it_to_the_same_bytes(norm, fp8_pool):
    """An FP8 qkv_proj's tensor-wise product handed over unscaled (kernels/fp8_quant.UnscaledProduct): the prologue,
    given its token and column scales, leaves q, k and the pool exactly as it does on scale_product's output; v stays
    unscaled in the product. bf16, as the product is only handed over in bf16; D = 48 masks each head's halves."""
    from kernels.fp8_gemm import scale_product
    from kernels.kv_quant import KVScales

    num_tokens, hq, hkv, d = 7, 4, 2, 48
    gen = torch.Generator().manual_seed(11 + norm + 2 * fp8_pool)
    inputs = prologue_inputs(num_tokens, hq, hkv, d, gen=gen, dtype=torch.bfloat16)
    # |x_q . w_q| reaches 448^2 * K; the scales bring it back to activations' size
    inputs["qkv"] = (inputs["qkv"].float() * 2e4).to(torch.bfloat16)
    n = inputs["qkv"].shape[1]
    row_scale = torch.rand(num_tokens, 1, generator=gen) * 4e-5 + 1e-5
    col_scale = torch.rand(n, 1, generator=gen) * 4e-3 + 1e-3
    kv_scales = None
    if fp8_pool:
        kv_scales = KVScales(torch.rand(hkv, generator=gen) * 0.02 + 0.01, torch.rand(hkv, generator=gen) * 0.02 + 0.01)
        for name in ("k_cache", "v_cache"):
            inputs[name] = inputs[name].to(torch.float8_e4m3fn)
    weights = (inputs["q_norm_weight"], inputs["k_norm_weight"]) if norm else (None, None)

    def prologue(qkv, product_scales):
        x = {name: t.clone() for name, t in inputs.items() if name != "qkv"}
        q, k, v = split_heads(qkv, hq, hkv, d)
        q, k = fo.qk_norm_rope_store(x["positions"], q, k, v, x["cos"], x["sin"], x["k_cache"], x["v_cache"],
                                     x["slot_mapping"], *weights, EPS, kv_scales, product_scales)
        return q, k, x["k_cache"], x["v_cache"]

    scaled = scale_product(inputs["qkv"].clone(), row_scale, col_scale, torch.bfloat16)
    plain = prologue(scaled, None)
    product = inputs["qkv"].clone()
    q_cols, k_cols, v_cols = col_scale.split([hq * d, hkv * d, hkv * d])
    handed = prologue(product, (row_scale, q_cols, k_cols, v_cols))
    for ours, theirs in zip(handed, plain):
        assert ours.dtype == theirs.dtype and torch.equal(ours.view(torch.uint8), theirs.view(torch.uint8))
    assert torch.equal(split_heads(product, hq, hkv, d)[2], split_heads(inputs["qkv"], hq, hkv, d)[2])
    assert not torch.equal(split_heads(product, hq, hkv, d)[0], split_heads(inputs["qkv"], hq, hkv, d)[0])
    # the scales matter: read as if each column's scale were another's, the pool differs
    wrong = prologue(inputs["qkv"].clone(), (row_scale, q_cols, v_cols, k_cols.flip(0)))
    assert not torch.equal(wrong[3].view(torch.uint8), plain[3].view(torch.uint8))


@interpreter
def test_fused_prologue_refuses_one_norm_weight_without_the_other_and_accepts_an_empty_batch():
    gen = torch.Generator().manual_seed(8)
    inputs = prologue_inputs(2, 2, 1, 16, gen=gen, dtype=torch.float32)
    q, k, v = split_heads(inputs["qkv"], 2, 1, 16)
    pool = inputs["cos"], inputs["sin"], inputs["k_cache"], inputs["v_cache"], inputs["slot_mapping"]
    with pytest.raises(ValueError, match="both"):
        fo.qk_norm_rope_store(inputs["positions"], q, k, v, *pool, inputs["q_norm_weight"], None)
    before = [t.clone() for t in (inputs["k_cache"], inputs["v_cache"])]
    out_q, out_k = fo.qk_norm_rope_store(inputs["positions"][:0], q[:0], k[:0], v[:0], *pool[:4],
                                         inputs["slot_mapping"][:0])
    assert out_q.shape == (0, 2, 16) and out_k.shape == (0, 1, 16)
    assert torch.equal(inputs["k_cache"], before[0]) and torch.equal(inputs["v_cache"], before[1])


# ---------------------------------------------------------------------------------------------
# GPU: compiled kernels at Qwen3-0.6B's shapes (hidden 1024, 16 q / 8 kv heads, D=128, I=3072)
# ---------------------------------------------------------------------------------------------

HIDDEN, Q_HEADS, KV_HEADS, HEAD_DIM, INTER = 1024, 16, 8, 128, 3072


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("num_tokens", [1, 256, 4096])
def test_gpu_rms_norm_with_and_without_residual_matches_float64(num_tokens):
    gen = torch.Generator().manual_seed(num_tokens)
    x, residual = (randn(num_tokens, HIDDEN, gen=gen, dtype=torch.bfloat16, device="cuda") for _ in range(2))
    weight = randn(HIDDEN, gen=gen, dtype=torch.bfloat16, device="cuda")
    out = fo.rms_norm(x, weight, EPS)
    assert rel_error(out, rms_norm64(x, weight)) < 1e-2
    close_to_eager(out, fo.rms_norm_ref(x, weight, EPS))
    out, new_residual = fo.rms_norm(x, weight, EPS, residual)
    assert rel_error(out, rms_norm64(x, weight, residual)) < 1e-2
    assert torch.equal(new_residual, x + residual), "the sum is rounded exactly as eager adds it"
    close_to_eager(out, fo.rms_norm_ref(x, weight, EPS, residual)[0])


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("num_tokens", [1, 256, 4096])
def test_gpu_per_head_q_k_norm_matches_float64(num_tokens):
    gen = torch.Generator().manual_seed(num_tokens)
    q, k, _ = qkv_views(num_tokens, Q_HEADS, KV_HEADS, HEAD_DIM, gen=gen, dtype=torch.bfloat16, device="cuda")
    weight = randn(HEAD_DIM, gen=gen, dtype=torch.bfloat16, device="cuda")
    for x in (q, k):
        out = fo.rms_norm(x, weight, EPS)
        assert rel_error(out, rms_norm64(x, weight)) < 1e-2
        close_to_eager(out, fo.rms_norm_ref(x, weight, EPS))


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("num_tokens", [1, 256, 4096])
def test_gpu_silu_and_mul_matches_float64(num_tokens):
    gen = torch.Generator().manual_seed(num_tokens)
    x = randn(num_tokens, 2 * INTER, gen=gen, dtype=torch.bfloat16, device="cuda")
    out = fo.silu_and_mul(x)
    assert rel_error(out, silu_and_mul64(x)) < 1e-2
    close_to_eager(out, fo.silu_and_mul_ref(x))


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("num_tokens", [1, 256, 4096])
def test_gpu_rotary_embedding_matches_float64(num_tokens):
    gen = torch.Generator().manual_seed(num_tokens)
    rope = RotaryEmbedding(HEAD_DIM, 40960, 1000000.0).cuda()
    q, k, v = qkv_views(num_tokens, Q_HEADS, KV_HEADS, HEAD_DIM, gen=gen, dtype=torch.bfloat16, device="cuda")
    positions = torch.randint(0, 40960, (num_tokens,), generator=gen).cuda()
    q_before, k_before, v_before = q.clone(), k.clone(), v.clone()
    fo.rotary_embedding(positions, q, k, rope.cos, rope.sin)
    assert rel_error(q, rotate64(q_before, positions, rope.cos, rope.sin)) < 1e-2
    assert rel_error(k, rotate64(k_before, positions, rope.cos, rope.sin)) < 1e-2
    ref_q, ref_k = fo.rotary_embedding_ref(positions, q_before, k_before, rope.cos, rope.sin)
    close_to_eager(q, ref_q)
    close_to_eager(k, ref_k)
    assert torch.equal(v, v_before)


@pytest.mark.gpu
@needs_cuda
def test_gpu_layers_take_the_fused_path_and_agree_with_their_cpu_path():
    gen = torch.Generator().manual_seed(4)
    norm = RMSNorm(HIDDEN, EPS).to(torch.bfloat16)
    norm.weight.data.copy_(randn(HIDDEN, gen=gen, dtype=torch.bfloat16))
    x, residual = (randn(33, HIDDEN, gen=gen, dtype=torch.bfloat16) for _ in range(2))
    cpu_out, cpu_residual = norm(x, residual)
    gpu_out, gpu_residual = norm.cuda()(x.cuda(), residual.cuda())
    close_to_eager(gpu_out.cpu(), cpu_out)
    assert torch.equal(gpu_residual.cpu(), cpu_residual)
    gate_up = randn(33, 2 * INTER, gen=gen, dtype=torch.bfloat16)
    close_to_eager(SiluAndMul()(gate_up.cuda()).cpu(), SiluAndMul()(gate_up))
    rope = RotaryEmbedding(HEAD_DIM, 4096, 1000000.0)
    q, k, _ = qkv_views(33, Q_HEADS, KV_HEADS, HEAD_DIM, gen=gen, dtype=torch.bfloat16)
    positions = torch.randint(0, 4096, (33,), generator=gen)
    cpu_q, cpu_k = rope(positions, q, k)
    gpu_q, gpu_k = rope.cuda()(positions.cuda(), q.cuda(), k.cuda())
    close_to_eager(gpu_q.cpu(), cpu_q)
    close_to_eager(gpu_k.cpu(), cpu_k)


@pytest.mark.gpu
@needs_cuda
def test_gpu_fused_ops_replayed_from_a_cuda_graph_follow_new_inputs():
    gen = torch.Generator().manual_seed(5)
    num_tokens = 64
    dt = torch.bfloat16

    def fresh():
        return {
            "x": randn(num_tokens, HIDDEN, gen=gen, dtype=dt, device="cuda"),
            "residual": randn(num_tokens, HIDDEN, gen=gen, dtype=dt, device="cuda"),
            "qkv": randn(num_tokens, (Q_HEADS + 2 * KV_HEADS) * HEAD_DIM, gen=gen, dtype=dt, device="cuda"),
            "gate_up": randn(num_tokens, 2 * INTER, gen=gen, dtype=dt, device="cuda"),
            "positions": torch.randint(0, 4096, (num_tokens,), generator=gen).cuda(),
        }

    rope = RotaryEmbedding(HEAD_DIM, 4096, 1000000.0).cuda()
    weight = randn(HIDDEN, gen=gen, dtype=dt, device="cuda")
    head_weight = randn(HEAD_DIM, gen=gen, dtype=dt, device="cuda")
    static = fresh()

    def step(inputs):
        out, new_residual = fo.rms_norm(inputs["x"], weight, EPS, inputs["residual"])
        q, k, _ = inputs["qkv"].split([Q_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM], dim=-1)
        q = fo.rms_norm(q.unflatten(-1, (Q_HEADS, HEAD_DIM)), head_weight, EPS)
        k = fo.rms_norm(k.unflatten(-1, (KV_HEADS, HEAD_DIM)), head_weight, EPS)
        fo.rotary_embedding(inputs["positions"], q, k, rope.cos, rope.sin)
        return out, new_residual, q, k, fo.silu_and_mul(inputs["gate_up"])

    step(static)  # compile outside the graph
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = step(static)
    for _ in range(2):
        new = fresh()
        for name, tensor in new.items():
            static[name].copy_(tensor)
        graph.replay()
        torch.cuda.synchronize()
        for got, want in zip(outputs, step(new)):  # eager launches of the same kernels on the new inputs
            assert torch.equal(got, want)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("norm", [True, False], ids=["qk_norm", "no_norm"])
@pytest.mark.parametrize("num_tokens", [1, 256, 3000])
@pytest.mark.parametrize("heads", [(Q_HEADS, KV_HEADS, HEAD_DIM), (32, 8, HEAD_DIM)], ids=["0.6b", "8b"])
def test_gpu_fused_prologue_is_bit_equal_to_the_unfused_chain(dtype, norm, num_tokens, heads):
    gen = torch.Generator().manual_seed(num_tokens)
    inputs = prologue_inputs(num_tokens, *heads, gen=gen, dtype=dtype, device="cuda", block_size=16)
    fused = run_prologue(fused_prologue, inputs, heads, norm)
    chain = run_prologue(unfused_prologue, inputs, heads, norm)
    q, k, qkv, k_cache, v_cache = fused
    chain_q, chain_k, _, chain_k_cache, chain_v_cache = chain
    if dtype == torch.bfloat16:  # the same roundings and the same reduction order: the same bits
        assert torch.equal(q, chain_q) and torch.equal(k, chain_k)
        assert torch.equal(k_cache, chain_k_cache) and torch.equal(v_cache, chain_v_cache)
    else:
        for got, want in zip((q, k, k_cache, v_cache), (chain_q, chain_k, chain_k_cache, chain_v_cache)):
            close_to_eager(got, want)
    assert torch.equal(split_heads(qkv, *heads)[2], split_heads(inputs["qkv"], *heads)[2])
    assert torch.equal(v_cache, expected_pool(inputs["v_cache"], split_heads(inputs["qkv"], *heads)[2],
                                              inputs["slot_mapping"]))
    q0, k0, _ = split_heads(inputs["qkv"], *heads)
    if norm:
        q0 = rms_norm64(q0, inputs["q_norm_weight"])
    assert rel_error(q, rotate64(q0, inputs["positions"], inputs["cos"], inputs["sin"])) < prologue_max_rel(dtype)


@pytest.mark.gpu
@needs_cuda
def test_gpu_fused_prologue_replayed_from_a_cuda_graph_equals_the_unfused_chain_on_new_inputs():
    gen = torch.Generator().manual_seed(9)
    heads, num_tokens = (Q_HEADS, KV_HEADS, HEAD_DIM), 256
    static = prologue_inputs(num_tokens, *heads, gen=gen, dtype=torch.bfloat16, device="cuda", block_size=16)
    q, k, v = split_heads(static["qkv"], *heads)
    args = (static["positions"], q, k, v, static["cos"], static["sin"], static["k_cache"], static["v_cache"],
            static["slot_mapping"], static["q_norm_weight"], static["k_norm_weight"])
    fused_prologue(*args)  # compile outside the graph
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fused_prologue(*args)
    for _ in range(2):
        new = prologue_inputs(num_tokens, *heads, gen=gen, dtype=torch.bfloat16, device="cuda", block_size=16)
        new["slot_mapping"][0] = -1  # a padded decode slot
        for name in ("qkv", "positions", "slot_mapping", "k_cache", "v_cache"):
            static[name].copy_(new[name])
        graph.replay()
        torch.cuda.synchronize()
        new["q_norm_weight"], new["k_norm_weight"] = static["q_norm_weight"], static["k_norm_weight"]
        chain_q, chain_k, _, chain_k_cache, chain_v_cache = run_prologue(unfused_prologue, new, heads, norm=True)
        assert torch.equal(q, chain_q) and torch.equal(k, chain_k)
        assert torch.equal(static["k_cache"], chain_k_cache) and torch.equal(static["v_cache"], chain_v_cache)
