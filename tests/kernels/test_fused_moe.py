"""The fused MoE kernels (route, group by expert, gate/up + SiLU-and-mul, down + routing weight, sum)
match a float64 reference written from the definition.

On the CPU they run in Triton's interpreter (a child process with TRITON_INTERPRET=1), on tiny shapes
where the M tile is larger than most experts' runs (several experts' pairs would share a tile if the
runs were not padded to it: each tile holds one expert's few pairs and padding rows), where an expert
gets no token, and where the hidden size is not a multiple of the K tile. The gpu tests run
the compiled kernels at Qwen3-30B-A3B's shape, and inside a CUDA graph.
"""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from kernels import moe_reference
from support.interpreter_child import (INTERPRETING, KERNELS_RUN_HERE, assert_module_passes_under_interpreter,
                                       interpreter, needs_cuda)

pytest.importorskip("triton")

if KERNELS_RUN_HERE:
    import triton
    import triton.language as tl

    from kernels import fused_moe as fm
    from kernels.fused_moe import MoeTile, _tile_ids
    from kernels.fused_moe_fp8_activations import fused_moe_fp8_activations, takes_fp8_activations

    @triton.jit
    def _tile_ids_probe(out_ptr, num_tiles_m, num_tiles_n, GROUP_M: tl.constexpr):
        pid_m, pid_n = _tile_ids(num_tiles_m, num_tiles_n, GROUP_M)
        tl.store(out_ptr + 2 * tl.program_id(0), pid_m)
        tl.store(out_ptr + 2 * tl.program_id(0) + 1, pid_n)


def moe64(x, logits, w13, w2, top_k: int, renormalize: bool) -> torch.Tensor:
    """The block in float64, token by token, from the definition."""
    x, logits, w13, w2 = x.double(), logits.double(), w13.double(), w2.double()
    inter = w13.shape[1] // 2
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        probs = torch.softmax(logits[t], dim=-1)
        weights, ids = torch.topk(probs, top_k)
        if renormalize:
            weights = weights / weights.sum()
        for w, e in zip(weights, ids.tolist()):
            gate, up = w13[e, :inter] @ x[t], w13[e, inter:] @ x[t]
            out[t] += w * (w2[e] @ (torch.nn.functional.silu(gate) * up))
    return out


def case(num_tokens: int, num_experts: int, hidden: int, inter: int, dtype, seed: int, device="cpu",
         unused_experts: tuple[int, ...] = ()):
    """Random inputs at the scale of a real layer, drawn on `device` (a GPU draws the 30B layer's experts in
    milliseconds); the router never picks the experts in unused_experts."""
    gen = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(num_tokens, hidden, generator=gen, device=device)
    logits = 2 * torch.randn(num_tokens, num_experts, generator=gen, device=device)
    logits[:, list(unused_experts)] = -1e4
    w13 = torch.randn(num_experts, 2 * inter, hidden, generator=gen, device=device) / hidden**0.5
    w2 = torch.randn(num_experts, hidden, inter, generator=gen, device=device) / inter**0.5
    return [t.to(dtype=dtype) for t in (x, logits, w13, w2)]


def fp8_case(w13: torch.Tensor, w2: torch.Tensor, group13: int | None, group2: int | None, seed: int):
    """w13 and w2 as FP8 experts with a scale per row and group of input columns (None: per row), each group first
    scaled by its own factor in [0.5, 2] so that a scale applied to the wrong group shows: (fp8 w13, fp8 w2, their
    Fp8Experts, the dequantized w13 and w2 in float32, all on w13's device)."""
    from kernels.fp8_quant import dequantize_rows, quantize_rows_ref

    gen = torch.Generator().manual_seed(seed)
    out = []
    for w, group in ((w13, group13), (w2, group2)):
        rows, k = w.shape[0] * w.shape[1], w.shape[2]
        group = group or k
        factors = (2.0 ** (2 * torch.rand(rows, -(-k // group), generator=gen) - 1)).to(w.device)
        flat = w.reshape(rows, k).float() * factors.repeat_interleave(group, 1)[:, :k]
        q, scale = quantize_rows_ref(flat, group)  # on w's device: the 30B layer's experts quantize on the GPU
        out.append((q.view(w.shape), scale.view(*w.shape[:2], -1), group,
                    dequantize_rows(q, scale, group).view(w.shape)))
    (q13, s13, g13, d13), (q2, s2, g2, d2) = out
    return q13, q2, fm.Fp8Experts(s13, s2, g13, g2), d13, d2


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref).norm() / ref.norm()).item()


def max_rel(dtype) -> float:
    return 2e-5 if dtype == torch.float32 else 2e-2


# ---------------------------------------------------------------------------------------------
# CPU: the interpreter
# ---------------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.skipif(INTERPRETING, reason="this is the child process")
def test_fused_moe_passes_under_the_interpreter():
    assert_module_passes_under_interpreter(__file__, "test_fused_moe_passes_under_the_interpreter", timeout=600)


@interpreter
@pytest.mark.parametrize("renormalize", [True, False])
def test_routing_matches_softmax_top_k(renormalize):
    _, logits, _, _ = case(37, 12, 8, 8, torch.float32, seed=1)
    counts = torch.zeros(12, dtype=torch.int32)
    weights, ids = fm.route(logits, 3, renormalize, counts)
    ref_w, ref_ids = moe_reference.route_ref(logits, 3, renormalize)
    assert torch.equal(ids.long(), ref_ids)
    assert torch.equal(counts.long(), torch.bincount(ref_ids.flatten(), minlength=12)), "each expert's picks counted"
    torch.testing.assert_close(weights, ref_w, rtol=1e-6, atol=1e-7)
    assert not renormalize or torch.allclose(weights.sum(-1), torch.ones(37))


@interpreter
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # the interpreter's NaN arithmetic
def test_routing_a_row_of_nan_logits_names_real_experts():
    _, logits, _, _ = case(5, 12, 8, 8, torch.float32, seed=2)
    logits[2] = float("nan")
    counts = torch.zeros(12, dtype=torch.int32)
    _, ids = fm.route(logits, 3, True, counts)
    assert 0 <= int(ids.min()) and int(ids.max()) < 12, ids[2]
    assert int(counts.sum()) == 15
    assert torch.equal(ids[[0, 1, 3, 4]].long(), moe_reference.route_ref(logits[[0, 1, 3, 4]], 3, True)[1])


@interpreter
@settings(max_examples=12, deadline=None)
@given(num_experts=st.integers(1, 12), top_k=st.integers(1, 3), num_tokens=st.integers(1, 40),
       block_m=st.sampled_from([1, 4, 16]), seed=st.integers(0, 2**16), one_program=st.booleans(),
       counted_by_route=st.booleans())
def test_grouping_puts_each_pair_once_in_a_tile_of_its_expert(num_experts, top_k, num_tokens, block_m, seed,
                                                               one_program, counted_by_route):
    """Whatever the routing (experts with no token included), the pairs scattered by the planning program or by a
    grid, counted by route or by group_by_expert: every (token, slot) pair sits exactly once in the sorted list up
    to the padded end, inside a tile of its own expert; each expert's run is padded to the tile with the padding
    id; every tile past the padded end is marked empty (its rows are never read)."""
    top_k = min(top_k, num_experts)
    gen = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(num_experts, generator=gen)[:top_k] for _ in range(num_tokens)])
    ids = torch.where(ids == num_experts // 2, 0, ids).to(torch.int32)  # often leave one expert without a token
    num_pairs = num_tokens * top_k
    counts = torch.bincount(ids.flatten().long(), minlength=num_experts)
    threshold = fm.SINGLE_PROGRAM_PAIRS
    fm.SINGLE_PROGRAM_PAIRS = num_pairs if one_program else num_pairs - 1
    try:
        groups = fm.group_by_expert(ids, num_experts, block_m, counts.int() if counted_by_route else None)
    finally:
        fm.SINGLE_PROGRAM_PAIRS = threshold
    pairs, end = groups.sorted_pairs.tolist(), int(groups.num_padded)
    assert end == int(((counts + block_m - 1) // block_m * block_m).sum())
    assert len(pairs) >= end and groups.block_expert.numel() * block_m == len(pairs)
    real = [(i, p) for i, p in enumerate(pairs[:end]) if p != num_pairs]
    assert sorted(p for _, p in real) == list(range(num_pairs)), "each pair exactly once, the rest padding"
    for i, p in real:
        assert groups.block_expert[i // block_m] == ids.flatten()[p], f"pair {p} in a tile of another expert"
    starts = torch.cumsum((counts + block_m - 1) // block_m * block_m, 0) - (counts + block_m - 1) // block_m * block_m
    for e in range(num_experts):  # each run: its pairs first, then padding up to the tile
        run = pairs[int(starts[e]): int(starts[e]) + int(counts[e])]
        assert all(p != num_pairs and ids.flatten()[p] == e for p in run)


@interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_tokens, num_experts, top_k, hidden, inter, renormalize, unused", [
    (5, 8, 2, 64, 32, True, (3, 6)),      # 10 pairs over 8 experts: most runs a few rows of a 16-row tile
    (19, 4, 3, 40, 48, False, (1,)),      # hidden 40: a partial K tile; inter 48: a partial N tile
    (1, 16, 4, 32, 16, True, ()),         # decode of one token
])
def test_fused_moe_matches_float64(dtype, num_tokens, num_experts, top_k, hidden, inter, renormalize, unused):
    x, logits, w13, w2 = case(num_tokens, num_experts, hidden, inter, dtype, seed=num_tokens, unused_experts=unused)
    _, ids = fm.route(logits, top_k, renormalize)
    assert not set(unused) & set(ids.flatten().tolist()), "the unused experts get no token"
    out = fm.fused_moe(x, logits, w13, w2, top_k, renormalize, tiles=(MoeTile(16, 16, 16, 1, 1),) * 2)
    assert out.shape == x.shape and out.dtype == dtype
    ref = moe64(x, logits, w13, w2, top_k, renormalize)
    assert rel_error(out, ref) < max_rel(dtype)
    assert rel_error(moe_reference.fused_moe_ref(x, logits, w13, w2, top_k, renormalize), ref) < max_rel(dtype)


@interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group13, group2", [
    (32, 16),      # block scales: hidden 80 in groups of 32 (the last ragged), inter 48 in groups of 16 (the K tile
                   # of 32 shrinks to 16 so that each tile lies in one group)
    (None, None),  # a scale per row (--quantization fp8), applied in the epilogue
])
@pytest.mark.parametrize("weight_bytes", [False, True])  # True: read as bytes, as on a GPU before sm_89
def test_fp8_experts_match_float64_on_their_dequantized_weights(dtype, group13, group2, weight_bytes):
    from dataclasses import replace

    x, logits, w13, w2 = case(19, 4, 80, 48, dtype, seed=3, unused_experts=(2,))
    q13, q2, scales, d13, d2 = fp8_case(w13, w2, group13, group2, seed=4)
    scales = replace(scales, weight_bytes=weight_bytes)
    out = fm.fused_moe(x, logits, q13, q2, 3, True, tiles=(MoeTile(16, 16, 32, 1, 1),) * 2, fp8=scales)
    assert out.shape == x.shape and out.dtype == dtype
    ref = moe64(x, logits, d13, d2, 3, True)
    assert rel_error(out, ref) < max_rel(dtype)
    # the scales matter: the same FP8 bytes read as if every scale were the first row's are far off
    flat = fm.Fp8Experts(scales.w13_scale[:1, :1].expand_as(scales.w13_scale).contiguous(),
                         scales.w2_scale[:1, :1].expand_as(scales.w2_scale).contiguous(), scales.group_k13,
                         scales.group_k2)
    wrong = fm.fused_moe(x, logits, q13, q2, 3, True, tiles=(MoeTile(16, 16, 32, 1, 1),) * 2, fp8=flat)
    assert rel_error(wrong, ref) > 10 * max_rel(torch.bfloat16)


@interpreter
@pytest.mark.parametrize("group", [128, None])  # Qwen3-30B-A3B-FP8's blocks; a scale per row
def test_fp8_experts_with_fp8_activations_quantize_x_and_h_per_128_columns(group):
    """fused_moe_fp8_activations (Fp8Experts.activations "fp8"): against float64 on the same quantized weights with
    x and h quantized as the kernels do, the same values (but for a rare one rounded across a quantization step);
    against unquantized activations, FP8's own error. Hidden 200 and inter 160: a partial last group and N tile;
    expert 3 gets no token."""
    x, logits, w13, w2 = case(13, 4, 200, 160, torch.float32, seed=1, unused_experts=(3,))
    q13, q2, scales, d13, d2 = fp8_case(w13, w2, group, group, seed=2)
    scales = replace(scales, activations="fp8")
    out = fused_moe_fp8_activations(x, logits, q13, q2, 2, True, fp8=scales)
    assert rel_error(out, moe_reference.fp8_activations_ref64(x, logits, d13, d2, 2)) < 2e-3
    assert 1e-3 < rel_error(out, moe64(x, logits, d13, d2, 2, True)) < 8e-2
    assert takes_fp8_activations(scales)
    assert not takes_fp8_activations(fm.Fp8Experts(scales.w13_scale[..., :1].expand(-1, -1, 3), scales.w2_scale, 64,
                                                   scales.group_k2))


def block_case(w13: torch.Tensor, w2: torch.Tensor) -> tuple:
    """w13 and w2 as a 128 x 128 block checkpoint's experts, laid out as the loader lays them (fp8 w13, fp8 w2, their
    Fp8Experts, the dequantized w13 and w2)."""
    (q13, s13, d13), (q2, s2, d2) = (moe_reference.block_quantized_experts(w) for w in (w13, w2))
    return q13, q2, fm.Fp8Experts(s13, s2, 128, 128), d13, d2


@interpreter
def test_block_checkpoint_experts_take_one_weight_scale_per_tile_and_group():
    """A 128 x 128 block checkpoint (hidden and inter 256: whole blocks) runs the w8a8 kernels, and the weight-only
    ones, with one weight scale per N tile and K group (the tile's first row's), which they may since every aligned
    128 rows share their scales; the same values as the emulation and as float64 on the dequantized weights. Scales per row and group, or per row, or cut blocks, never do."""
    from kernels.fused_moe_fp8_activations import _fp8_tiles

    x, logits, w13, w2 = case(13, 4, 256, 256, torch.float32, seed=5, unused_experts=(3,))
    q13, q2, scales, d13, d2 = block_case(w13, w2)
    assert scales.rows_sharing_scales == 128
    up, down = _fp8_tiles(*fm.tiles_for(13, 4, 256, 256, 2))
    assert fm.per_tile(scales, scales.w13_scale, up, 256) and fm.per_tile(scales, scales.w2_scale, down)
    out = fused_moe_fp8_activations(x, logits, q13, q2, 2, True, fp8=replace(scales, activations="fp8"))
    assert rel_error(out, moe_reference.fp8_activations_ref64(x, logits, d13, d2, 2)) < 2e-3
    # the weight-only path too (the bf16 activations' kernels), with tiles of 16 rows: 8 share a block's scales
    tiles = (MoeTile(16, 16, 32, 1, 1),) * 2
    assert fm.per_tile(scales, scales.w13_scale, tiles[0], 256) and fm.per_tile(scales, scales.w2_scale, tiles[1])
    weight_only = fm.fused_moe(x, logits, q13, q2, 2, True, tiles=tiles, fp8=scales)
    assert rel_error(weight_only, moe64(x, logits, d13, d2, 2, True)) < max_rel(torch.float32)
    # a scale that differs inside a block, or scales per row and group, or per row: the flag is off
    uneven = scales.w13_scale.clone()
    uneven[1, 5] *= 2
    assert fm.Fp8Experts(uneven, scales.w2_scale, 128, 128).rows_sharing_scales == 1
    assert fp8_case(w13, w2, 128, 128, seed=6)[2].rows_sharing_scales == 1  # a scale per row and group
    assert fp8_case(w13, w2, None, None, seed=6)[2].rows_sharing_scales == 1  # a scale per row
    assert not fm.per_tile(scales, scales.w13_scale, up, 192)  # w13's up rows would start inside a tile


@interpreter
@settings(max_examples=20, deadline=None)
@given(num_tiles_m=st.integers(1, 20), num_tiles_n=st.integers(1, 5), group_m=st.integers(0, 6))
def test_each_program_gets_its_own_tile_in_every_order(num_tiles_m, num_tiles_n, group_m):
    """M tiles fastest (group_m 0), or the N tiles of group_m M tiles together with a shorter last group: the
    programs of the 1-D grid map onto the (M, N) tiles one to one, and a group's programs share its M tiles."""
    out = torch.full((num_tiles_m * num_tiles_n, 2), -1, dtype=torch.int32)
    _tile_ids_probe[(num_tiles_m * num_tiles_n,)](out, num_tiles_m, num_tiles_n, GROUP_M=group_m)
    tiles = [tuple(t) for t in out.tolist()]
    assert sorted(tiles) == [(m, n) for m in range(num_tiles_m) for n in range(num_tiles_n)]
    if group_m:
        per_group = group_m * num_tiles_n
        for start in range(0, len(tiles), per_group):
            assert {m for m, _ in tiles[start: start + per_group]} == set(
                range(start // num_tiles_n, min(num_tiles_m, start // num_tiles_n + group_m)))


@interpreter
@pytest.mark.parametrize("group_m", [1, 3])
def test_grouped_tile_orders_match_float64(group_m):
    """The layer with grouped tile orders (19 tokens top-3 over 4 experts: 8 M tiles of 16; inter 48 and hidden 40:
    3 N tiles of 16)."""
    x, logits, w13, w2 = case(19, 4, 40, 48, torch.float32, seed=4)
    out = fm.fused_moe(x, logits, w13, w2, 3, True, tiles=(MoeTile(16, 16, 16, 1, 1, group_m),) * 2)
    assert rel_error(out, moe64(x, logits, w13, w2, 3, True)) < max_rel(torch.float32)


@interpreter
def test_fp32_operands_halve_the_k_tile_so_that_each_stage_keeps_its_bytes():
    tile = MoeTile(32, 64, 128, 4, 4, 8)
    assert fm.for_element_size(tile, 2) == tile
    assert fm.for_element_size(tile, 4) == MoeTile(32, 64, 64, 4, 4, 8)
    assert fm.for_element_size(MoeTile(16, 16, 16, 1, 1), 4).block_k == 16  # tl.dot's least K


@interpreter
def test_each_tile_table_row_groups_the_pairs_once():
    """Both GEMMs of a MOE_TILES row share their M tile (else fused_moe groups the pairs a second time), rows
    ascend, and every tile is one the kernels take (powers of two, tl.dot's least 16)."""
    for shape, rows in fm.MOE_TILES.items():
        assert [most for most, _, _ in rows] == sorted({most for most, _, _ in rows}), shape
        for most, up, down in rows:
            assert up.block_m == down.block_m, (shape, most)
            for t in (up, down):
                assert all(v >= 16 and v & (v - 1) == 0 for v in (t.block_m, t.block_n, t.block_k)), (shape, t)


@interpreter
@pytest.mark.parametrize("single_program_pairs", [4096, 4])
def test_the_prefill_grouping_path_matches_float64(single_program_pairs):
    """Past SINGLE_PROGRAM_PAIRS (lowered to 4 here: 9 tokens top-2) route counts as it picks and a grid scatters;
    with both GEMMs on different M tiles, the regrouping reuses route's counts."""
    x, logits, w13, w2 = case(9, 6, 32, 32, torch.float32, seed=5)
    threshold, fm.SINGLE_PROGRAM_PAIRS = fm.SINGLE_PROGRAM_PAIRS, single_program_pairs
    try:
        out = fm.fused_moe(x, logits, w13, w2, 2, True, tiles=(MoeTile(16, 16, 16, 1, 1), MoeTile(32, 32, 32, 1, 1)))
    finally:
        fm.SINGLE_PROGRAM_PAIRS = threshold
    assert rel_error(out, moe64(x, logits, w13, w2, 2, True)) < max_rel(torch.float32)


@interpreter
def test_gate_up_and_down_may_use_different_m_tiles():
    x, logits, w13, w2 = case(9, 6, 32, 32, torch.float32, seed=3)
    out = fm.fused_moe(x, logits, w13, w2, 2, True, tiles=(MoeTile(16, 16, 16, 1, 1), MoeTile(32, 32, 32, 1, 1)))
    assert rel_error(out, moe64(x, logits, w13, w2, 2, True)) < max_rel(torch.float32)


@interpreter
def test_a_sweeps_tile_rows_replace_the_tables_through_nanoserve_moe_tiles(tmp_path):
    """The rows the sweep writes (tiles_json, as bench/kernels.py --moe-tiles-out) reach MOE_TILES in a process
    started with NANOSERVE_MOE_TILES naming them, and replace that shape's rows only."""
    import json
    import os
    import subprocess
    import sys

    script = """
import json, sys
from kernels import fused_moe as fm
rows = [(4, fm.MoeTile(16, 32, 128, 4, 4), fm.MoeTile(16, 64, 256, 4, 3)),
        (4096, fm.MoeTile(128, 128, 64, 8, 3, 8), fm.MoeTile(128, 256, 64, 8, 3, 8))]
if sys.argv[1] == "write":
    print(json.dumps({**fm.tiles_json((128, 2048, 384, 8), rows), **fm.tiles_json((128, 2048, 768, 8), rows[:1])}))
else:
    assert fm.MOE_TILES[(128, 2048, 384, 8)] == rows and fm.MOE_TILES[(128, 2048, 768, 8)] == rows[:1]
    assert fm.tiles_for(9, 128, 2048, 384, 8) == (rows[1][1], rows[1][2])
    print("applied")
"""
    # compiled-mode imports in processes of their own (the interpreter would take default_tiles)
    env = {k: v for k, v in os.environ.items() if k not in ("NANOSERVE_MOE_TILES", "TRITON_INTERPRET")}
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    written = subprocess.run([sys.executable, "-c", script, "write"], capture_output=True, text=True, env=env,
                             cwd=repo, check=True).stdout
    (tmp_path / "tiles.json").write_text(written)
    assert json.loads(written)["128 2048 384 8"][1] == [4096, [128, 128, 64, 8, 3, 8], [128, 256, 64, 8, 3, 8]]
    env["NANOSERVE_MOE_TILES"] = str(tmp_path / "tiles.json")
    applied = subprocess.run([sys.executable, "-c", script, "read"], capture_output=True, text=True, env=env, cwd=repo)
    assert applied.returncode == 0 and applied.stdout.strip() == "applied", applied.stderr[-2000:]


# ---------------------------------------------------------------------------------------------
# GPU: compiled, at the Qwen3-30B-A3B layer's shape (128 experts, top-8, hidden 2048, inter 768)
# ---------------------------------------------------------------------------------------------


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("num_tokens", [1, 16, 256, 2048])
def test_gpu_fused_moe_matches_float64_at_the_qwen3_30b_shape(num_tokens):
    x, logits, w13, w2 = case(num_tokens, 128, 2048, 768, torch.bfloat16, seed=num_tokens, device="cuda")
    out = fm.fused_moe(x, logits, w13, w2, 8, True)
    rows = slice(0, min(num_tokens, 16))  # the float64 reference (on the GPU) goes token by token: some rows
    assert rel_error(out[rows], moe64(x[rows], logits[rows], w13, w2, 8, True)) < 2e-2


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("num_tokens", [1, 16, 256, 2048])
@pytest.mark.parametrize("group13, group2", [(128, 128), (None, None)])  # Qwen3-30B-A3B-FP8's blocks; per row
def test_gpu_fp8_experts_match_float64_at_the_qwen3_30b_shape(num_tokens, group13, group2):
    """Weight-only FP8 experts, their weights read as FP8 (sm_89 and up) and as bytes (Fp8Experts.weight_bytes, GPUs
    before sm_89): the same products."""
    from dataclasses import replace

    x, logits, w13, w2 = case(num_tokens, 128, 2048, 768, torch.bfloat16, seed=num_tokens, device="cuda")
    q13, q2, scales, d13, d2 = fp8_case(w13, w2, group13, group2, seed=num_tokens)
    out = fm.fused_moe(x, logits, q13, q2, 8, True, fp8=scales)
    rows = slice(0, min(num_tokens, 16))
    assert rel_error(out[rows], moe64(x[rows], logits[rows], d13, d2, 8, True)) < 2e-2
    as_bytes = fm.fused_moe(x, logits, q13, q2, 8, True, fp8=replace(scales, weight_bytes=True))
    torch.testing.assert_close(as_bytes, out, rtol=0, atol=0)  # the same widened values, the same sums


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("num_tokens", [1, 16, 256, 2048])
@pytest.mark.parametrize("group", [128, None, "blocks"])
def test_gpu_fp8_activations_match_their_float64_emulation_at_the_qwen3_30b_shape(num_tokens, group):
    """The w8a8 experts at the 30B layer's shape, on 16 rows whose router has no exact tie at the top-8 boundary
    (the route kernel and the reference may break one differently): x and h quantized as the kernels do, the rest in
    float64; bf16's roundings of gate, up and h are the error left. Scales per row and 128 columns, per row, and a
    128 x 128 block checkpoint's (one weight scale per tile and group)."""
    x, logits, w13, w2 = case(num_tokens, 128, 2048, 768, torch.bfloat16, seed=num_tokens, device="cuda")
    if group == "blocks":
        q13, q2, scales, d13, d2 = block_case(w13, w2)
        assert scales.rows_sharing_scales == 128
    else:
        q13, q2, scales, d13, d2 = fp8_case(w13, w2, group, group, seed=num_tokens)
    out = fused_moe_fp8_activations(x, logits, q13, q2, 8, True, fp8=replace(scales, activations="fp8"))
    rows = moe_reference.untied_tokens(logits, 8, 16)
    ref = moe_reference.fp8_activations_ref64(x[rows], logits[rows], d13, d2, 8)
    assert rel_error(out[rows], ref) < 1e-2


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("num_tokens", [16, 1024])
def test_gpu_fused_moe_in_fp32_matches_float64(num_tokens):
    """An fp32 model (the equivalence tests' dtype): its tiles halve BLOCK_K to fit the shared memory; 16 tokens
    (one program groups them) and 1,024 (route counts, a grid scatters), at the 30B layer's shape."""
    x, logits, w13, w2 = case(num_tokens, 128, 2048, 768, torch.float32, seed=num_tokens, device="cuda")
    out = fm.fused_moe(x, logits, w13, w2, 8, True)
    rows = slice(0, 16)
    ref = moe64(x[rows], logits[rows], w13, w2, 8, True)
    assert rel_error(out[rows], ref) < 1e-4


@pytest.mark.gpu
@needs_cuda
def test_gpu_fused_moe_replays_in_a_cuda_graph_with_new_inputs():
    x, logits, w13, w2 = case(64, 128, 2048, 768, torch.bfloat16, seed=7, device="cuda")
    fm.fused_moe(x, logits, w13, w2, 8, True)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fm.fused_moe(x, logits, w13, w2, 8, True)
    x2, logits2, _, _ = case(64, 128, 2048, 768, torch.bfloat16, seed=8, device="cuda")
    x.copy_(x2)
    logits.copy_(logits2)
    graph.replay()
    torch.cuda.synchronize()
    ref = moe64(x2[:16], logits2[:16], w13, w2, 8, True)
    assert rel_error(out[:16], ref) < 2e-2
