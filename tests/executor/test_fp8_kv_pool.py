"""The executor's quantized KV pools (--kv-cache-dtype fp8 or int8): they hold more blocks in the same
memory, say so in the handshake, move their bytes unchanged through copies and swaps, and fix their scales
at start-up as --kv-cache-scales asks (int8: per KV head and channel), logging them; with
--kv-cache-rotation hadamard every layer rotates K and q by one shared matrix, and the scales are
calibrated on the rotated K."""
from __future__ import annotations

import argparse
import logging

import pytest
import torch

from executor_svc import model_runner
from executor_svc.executor import handshake
from executor_svc.kv_calibration import CALIBRATION_TEXTS, calibration_chunks
from executor_svc.model_runner import ModelRunner
from kernels.kv_quant import FP8_DTYPE, INT8_DTYPE, as_bytes, scales_from_amax
from kernels.kv_rotation import hadamard_matrix
from scheduler_svc.common.config import EngineConfig, add_engine_args, engine_config_from_args
from support.tiny_checkpoints import make_tiny_llama

BLOCK_SIZE = 4


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> str:
    return make_tiny_llama(str(tmp_path_factory.mktemp("fp8") / "llama"))


def make_runner(model: str, **overrides) -> ModelRunner:
    args = dict(model=model, device="cpu", dtype="float32", block_size=BLOCK_SIZE, num_gpu_blocks=10,
                num_host_blocks=6, max_num_seqs=4, enforce_eager=True, attention_backend="torch",
                kv_cache_dtype="fp8")
    return ModelRunner(EngineConfig(**{**args, **overrides}))


@pytest.fixture(scope="module")
def runner(tiny_llama) -> ModelRunner:
    return make_runner(tiny_llama)


def test_the_same_memory_holds_four_times_the_fp32_blocks_and_the_handshake_says_fp8(tiny_llama):
    sizes = dict(num_gpu_blocks=None, cpu_kv_cache_gb=2 ** -10)  # 1 MiB, a whole number of blocks either way
    fp32, fp8 = make_runner(tiny_llama, kv_cache_dtype="auto", **sizes), make_runner(tiny_llama, **sizes)
    assert fp8.kv_pool.cache.dtype == FP8_DTYPE and fp32.kv_pool.cache.dtype == torch.float32
    assert fp8.kv_pool.num_blocks == 4 * fp32.kv_pool.num_blocks  # 1 byte a value instead of 4 (bf16: 2)
    assert fp8.kv_pool.cache.nbytes == fp32.kv_pool.cache.nbytes
    hs, hs32 = handshake(fp8), handshake(fp32)
    assert (hs.kv_cache_dtype, hs.dtype, hs.num_blocks) == ("float8_e4m3fn", "float32", fp8.kv_pool.num_blocks)
    assert hs32.kv_cache_dtype == "float32"
    assert fp8.kv_pool.host_cache.dtype == FP8_DTYPE


def test_an_int8_pool_holds_fp8s_blocks_with_a_scale_per_head_and_channel_and_the_handshake_says_int8(
        tiny_llama, caplog):
    sizes = dict(num_gpu_blocks=None, cpu_kv_cache_gb=2 ** -10)
    with caplog.at_level(logging.INFO, logger="nanoserve.executor"):
        int8 = make_runner(tiny_llama, kv_cache_dtype="int8", **sizes)
    fp8 = make_runner(tiny_llama, **sizes)
    assert int8.kv_pool.cache.dtype == INT8_DTYPE and int8.kv_pool.num_blocks == fp8.kv_pool.num_blocks
    assert handshake(int8).kv_cache_dtype == "int8" and int8.kv_pool.host_cache.dtype == INT8_DTYPE
    amax = int8.calibration_amax()
    torch.testing.assert_close(int8.kv_pool.scales, scales_from_amax(amax, INT8_DTYPE))  # auto: per channel
    assert int8.kv_pool.scales.shape == (2, 2, 2, 16) and int8.kv_pool.layers[1].kv_scales.k.shape == (2, 16)
    assert "KV cache int8, calibrated-per-channel scales" in caplog.text
    per_head = make_runner(tiny_llama, kv_cache_dtype="int8", kv_cache_scales="calibrated-per-head").kv_pool.scales
    torch.testing.assert_close(per_head, scales_from_amax(amax.amax(3, keepdim=True).expand(2, 2, 2, 16), INT8_DTYPE))


def test_int8_refuses_static_scales_which_would_round_k_and_v_to_integers(tiny_llama):
    with pytest.raises(ValueError, match="static is for fp8"):
        make_runner(tiny_llama, kv_cache_dtype="int8", kv_cache_scales="static")


def random_bytes(pool) -> torch.Tensor:
    """Every byte pattern, NaN codes included, in the device pool; returns a copy of its bytes."""
    pool.cache.view(torch.uint8).copy_(torch.randint(0, 256, pool.cache.shape, dtype=torch.uint8))
    return pool.cache.view(torch.uint8).clone()


@pytest.mark.parametrize("kv_cache_dtype", ["fp8", "int8"])
def test_block_copies_and_swaps_move_the_pools_bytes_unchanged(tiny_llama, kv_cache_dtype):
    pool = make_runner(tiny_llama, kv_cache_dtype=kv_cache_dtype).kv_pool
    as_bytes = lambda t: t.view(torch.uint8)  # noqa: E731  (both dtypes, byte for byte)
    before = random_bytes(pool)
    pool.copy_blocks([(2, 9), (5, 0)])
    assert torch.equal(as_bytes(pool.cache)[:, :, 9], before[:, :, 2])
    assert torch.equal(as_bytes(pool.cache)[:, :, 0], before[:, :, 5])
    before = random_bytes(pool)
    pool.swap_out([(1, 4), (7, 0), (3, 5)])
    as_bytes(pool.cache).zero_()
    pool.swap_in([(4, 8), (0, 2), (5, 6)])
    for src, dst in ((1, 8), (7, 2), (3, 6)):
        assert torch.equal(as_bytes(pool.cache)[:, :, dst], before[:, :, src])
    assert torch.equal(as_bytes(pool.host_cache)[0], before[:, :, 7])  # the host pool holds the same bytes


def test_static_scales_are_one_and_every_layer_reads_its_own_row(tiny_llama):
    runner = make_runner(tiny_llama, kv_cache_scales="static")
    assert torch.equal(runner.kv_pool.scales, torch.ones(2, 2, 2))  # [K/V, layers, KV heads]
    for i, attn in enumerate(runner.kv_pool.layers):
        assert attn.kv_scales.k.data_ptr() == runner.kv_pool.scales[0, i].data_ptr()
        assert attn.kv_scales.v.data_ptr() == runner.kv_pool.scales[1, i].data_ptr()


def test_calibrated_scales_come_from_the_calibration_forward_per_layer_or_per_head(tiny_llama, caplog):
    with caplog.at_level(logging.INFO, logger="nanoserve.executor"):
        per_layer = make_runner(tiny_llama, kv_cache_scales="calibrated")
    per_head = make_runner(tiny_llama, kv_cache_scales="calibrated-per-head")
    amax = per_head.calibration_amax()
    assert (amax > 0).all() and amax.shape == (2, 2, 2, 16)  # [K/V, layers, KV heads, channels]
    torch.testing.assert_close(per_head.kv_pool.scales, scales_from_amax(amax.amax(3)))
    torch.testing.assert_close(per_layer.kv_pool.scales,
                               scales_from_amax(amax.amax((2, 3), keepdim=True)[..., 0].expand(2, 2, 2)))
    assert not torch.equal(per_head.kv_pool.scales, per_layer.kv_pool.scales), "heads should differ"
    logged = caplog.text
    assert "calibrated scales" in logged and "random token ids" in logged  # the tiny model has no tokenizer
    assert f"{per_layer.kv_pool.scales[0, 0, 0].item():.3g}" in logged


def test_calibration_reads_text_through_the_tokenizer_when_the_checkpoint_has_one(embedded_model):
    from tokenizers import Tokenizer

    chunks, num_blocks = calibration_chunks(embedded_model, 49152, 16, 512, seed=0)
    tokenizer = Tokenizer.from_file(f"{embedded_model}/tokenizer.json")
    texts = [tokenizer.encode(t).ids for t in CALIBRATION_TEXTS]
    got = [c.seq.token_ids for c in chunks]
    assert sum(map(len, got)) <= 512 and got[0] == texts[0] and all(g == t[:len(g)] for g, t in zip(got, texts))
    assert num_blocks == sum(-(-len(g) // 16) for g in got)
    blocks = [b for c in chunks for b in c.seq.block_table]
    assert blocks == list(range(num_blocks)), "fresh sequences on blocks 0.. in order"


def test_calibration_without_a_tokenizer_draws_random_ids_from_the_seed(tiny_llama):
    ids = lambda seed: [c.seq.token_ids for c in calibration_chunks(tiny_llama, 256, 4, 64, seed)[0]]  # noqa: E731
    assert ids(0) == ids(0) != ids(1)
    assert sum(map(len, ids(0))) == 64 and all(0 <= t < 256 for seq in ids(0) for t in seq)


def test_a_hadamard_rotation_is_shared_by_every_layer_of_an_fp8_pool_and_never_set_on_another(tiny_llama):
    rotated = make_runner(tiny_llama, kv_cache_rotation="hadamard", kv_cache_scales="static")
    h = rotated.kv_pool.layers[0].kv_rotation
    torch.testing.assert_close(h, hadamard_matrix(16))  # the tiny model's head_dim, in its dtype
    assert all(attn.kv_rotation is h for attn in rotated.kv_pool.layers)
    plain = make_runner(tiny_llama, kv_cache_dtype="auto", kv_cache_rotation="hadamard")
    assert all(attn.kv_rotation is None for attn in plain.kv_pool.layers), "only an fp8 pool is rotated"
    assert all(attn.kv_rotation is None for attn in make_runner(tiny_llama).kv_pool.layers)


def test_rotated_calibration_gives_the_scales_of_the_rotated_keys(tiny_llama, monkeypatch):
    rotated = make_runner(tiny_llama, kv_cache_rotation="hadamard")
    unrotated_scales = make_runner(tiny_llama).kv_pool.scales
    plain = make_runner(tiny_llama, kv_cache_dtype="auto")
    h = hadamard_matrix(16)

    def amax_after_rotating_the_stored_keys(pool):  # the unrotated engine's K, rotated after the fact
        k, v = pool.cache.float()
        return torch.stack([(k @ h).abs().amax(dim=(1, 2)), v.abs().amax(dim=(1, 2))])

    monkeypatch.setattr(model_runner, "pool_amax", amax_after_rotating_the_stored_keys)
    amax = plain.calibration_amax()
    torch.testing.assert_close(rotated.kv_pool.scales, scales_from_amax(amax.amax(3)))
    assert not torch.allclose(rotated.kv_pool.scales[0], unrotated_scales[0])
    torch.testing.assert_close(rotated.kv_pool.scales[1], unrotated_scales[1])  # V is stored as it comes


def test_the_rotation_flag_reaches_another_process_role_and_an_unknown_rotation_is_refused(tiny_llama):
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    config = EngineConfig(model=tiny_llama, kv_cache_dtype="fp8", kv_cache_rotation="hadamard")
    assert engine_config_from_args(parser.parse_args(config.to_argv())).kv_cache_rotation == "hadamard"
    assert EngineConfig(model=tiny_llama).kv_cache_rotation == "none"
    with pytest.raises(ValueError, match="--kv-cache-rotation"):
        EngineConfig(model=tiny_llama, kv_cache_rotation="random")


# ---------------------------------------------------------------------------------------------
# --kv-cache-scales checkpoint: the checkpoint's own calibrated k_scale and v_scale
# ---------------------------------------------------------------------------------------------


def with_kv_scales(model_dir: str, out_dir, tensors: dict[str, torch.Tensor]) -> str:
    """A copy of the checkpoint in model_dir with KV cache scale tensors beside its weights, in a file of their own as
    an exporter may shard them."""
    import shutil

    from safetensors.torch import save_file

    shutil.copytree(model_dir, out_dir)
    save_file({name: t.contiguous() for name, t in tensors.items()}, str(out_dir / "kv_scales.safetensors"))
    return str(out_dir)


# every exporter's names for layer 0's and layer 1's scales (scheduler_svc/common/checkpoint_kv_scales.py)
NAMINGS = {
    "compressed-tensors": ("model.layers.{}.self_attn.k_scale", "model.layers.{}.self_attn.v_scale"),
    "modelopt": ("model.layers.{}.self_attn.k_proj.k_scale", "model.layers.{}.self_attn.v_proj.v_scale"),
    "output_scale": ("model.layers.{}.self_attn.k_proj.output_scale", "model.layers.{}.self_attn.v_proj.output_scale"),
}


@pytest.mark.parametrize("naming", sorted(NAMINGS))
def test_checkpoint_scales_are_the_pools_each_layers_own_per_tensor_or_per_head(tiny_llama, tmp_path, naming, caplog):
    """A scale per tensor is repeated over the layer's KV heads; one per KV head keeps each head's. Every layer reads
    its own row, and the log says where the scales came from."""
    k_name, v_name = NAMINGS[naming]
    per_head = naming == "modelopt"
    values = {}
    for layer in range(2):
        k = torch.tensor([0.03 + layer, 0.05 + layer]) if per_head else torch.tensor(0.02 + layer)
        values[k_name.format(layer)], values[v_name.format(layer)] = k, k * 7
    model = with_kv_scales(tiny_llama, tmp_path / "ckpt", values)
    with caplog.at_level(logging.INFO, logger="nanoserve.executor"):
        runner = make_runner(model, kv_cache_scales="checkpoint")
    want = torch.stack([torch.stack([values[name.format(layer)].expand(2) for layer in range(2)])
                        for name in (k_name, v_name)])
    torch.testing.assert_close(runner.kv_pool.scales, want, rtol=0, atol=0)
    for i, attn in enumerate(runner.kv_pool.layers):
        assert attn.kv_scales.k.data_ptr() == runner.kv_pool.scales[0, i].data_ptr()
    assert "checkpoint scales" in caplog.text and "read by an fp8 KV pool" in caplog.text
    # under any other method the same checkpoint loads, its scales skipped
    assert not torch.equal(make_runner(model, kv_cache_scales="static").kv_pool.scales, want)


def test_one_kv_scale_serves_k_and_v_and_each_rank_takes_its_own_heads(tiny_llama, tmp_path):
    from executor_svc.kv_cache import KVLayout
    from executor_svc.kv_calibration import checkpoint_kv_scales

    model = with_kv_scales(tiny_llama, tmp_path / "ckpt", {
        "model.layers.0.self_attn.kv_scale": torch.tensor([0.5]),  # an older export's one scale for K and V
        "model.layers.1.self_attn.k_scale": torch.tensor([1.0, 2.0]),  # per KV head
        "model.layers.1.self_attn.v_scale": torch.tensor([3.0, 4.0]),
    })
    layout = KVLayout(2, BLOCK_SIZE, 1, 16, FP8_DTYPE, torch.device("cpu"))  # one KV head a rank, two ranks
    rank0, rank1 = (checkpoint_kv_scales(model, layout, rank, 2) for rank in (0, 1))
    assert rank0.tolist() == [[[0.5], [1.0]], [[0.5], [3.0]]] and rank1.tolist() == [[[0.5], [2.0]], [[0.5], [4.0]]]


def test_a_checkpoint_scale_of_the_wrong_size_or_value_is_refused_by_name(tiny_llama, tmp_path):
    names = [NAMINGS["compressed-tensors"][i].format(layer) for layer in range(2) for i in range(2)]
    for case, bad in (("size", torch.ones(3)), ("value", torch.tensor(0.0)), ("nan", torch.tensor(float("nan")))):
        model = with_kv_scales(tiny_llama, tmp_path / case, {**{n: torch.tensor(1.0) for n in names},
                                                             names[2]: bad})
        with pytest.raises(ValueError, match=r"model\.layers\.1\.self_attn\.k_scale"):
            make_runner(model, kv_cache_scales="checkpoint")


def test_checkpoint_scales_are_refused_at_start_up_where_they_cannot_serve(tiny_llama, tmp_path):
    with pytest.raises(ValueError, match=r"lacks KV cache scales for 4 of 4 .*calibrated-per-head"):
        EngineConfig(model=tiny_llama, kv_cache_dtype="fp8", kv_cache_scales="checkpoint")
    half = with_kv_scales(tiny_llama, tmp_path / "half", {"model.layers.0.self_attn.k_scale": torch.tensor(1.0),
                                                          "model.layers.0.self_attn.v_scale": torch.tensor(1.0),
                                                          "model.layers.1.self_attn.k_scale": torch.tensor(1.0)})
    with pytest.raises(ValueError, match=r"for 1 of 4 layer K/V pairs \(layer.k or .v: 1.v\)"):
        EngineConfig(model=half, kv_cache_dtype="fp8", kv_cache_scales="checkpoint")
    with pytest.raises(ValueError, match="is for --kv-cache-dtype fp8"):
        EngineConfig(model=half, kv_cache_dtype="int8", kv_cache_scales="checkpoint")
    with pytest.raises(ValueError, match="of K unrotated"):
        EngineConfig(model=half, kv_cache_dtype="fp8", kv_cache_scales="checkpoint", kv_cache_rotation="hadamard")
    with pytest.raises(ValueError, match="needs the checkpoint"):
        EngineConfig(model=half, kv_cache_dtype="fp8", kv_cache_scales="checkpoint", load_format="dummy")
    full = with_kv_scales(tiny_llama, tmp_path / "full", {name.format(layer): torch.tensor(1.0) for layer in range(2)
                                                          for name in NAMINGS["compressed-tensors"]})
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    config = engine_config_from_args(parser.parse_args(["--model", full, "--kv-cache-dtype", "fp8",
                                                        "--kv-cache-scales", "checkpoint"]))
    assert config.kv_scales_method() == "checkpoint"


def test_kv_scale_names_are_told_apart_from_weight_and_activation_scales():
    from scheduler_svc.common.checkpoint_kv_scales import is_kv_scale

    assert all(is_kv_scale(name.format(3)) for pair in NAMINGS.values() for name in pair)
    assert is_kv_scale("model.layers.3.self_attn.kv_scale") and is_kv_scale("layers.0.self_attn.k_scale")
    assert not any(is_kv_scale(name) for name in (
        "model.layers.3.self_attn.k_proj.weight_scale", "model.layers.3.self_attn.k_proj.input_scale",
        "model.layers.3.self_attn.q_proj.output_scale", "model.layers.3.mlp.k_scale",
        "model.layers.3.self_attn.k_norm.weight", "model.layers.3.self_attn.k_scale.extra"))
