"""Preemption by swap, executor side: KV blocks go to the host pool and come back bit for bit, and a
plan's swap-out reads its blocks before the same plan's swap-ins, copies and forward write them."""
import pytest
import torch

from executor_svc.executor import StepLoop, handshake
from executor_svc.kv_cache import KVPool
from executor_svc.model_runner import ModelRunner
from executor_svc.seq_mirror import SequenceMirrors
from protos import engine_pb2
from scheduler_svc.common.config import EngineConfig
from support.tiny_checkpoints import make_tiny_llama

NUM_BLOCKS, NUM_HOST_BLOCKS, BLOCK_SIZE = 10, 6, 4
CUDA = pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")])


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> str:
    return make_tiny_llama(str(tmp_path_factory.mktemp("swap") / "llama"))


def make_runner(model: str, device: str = "cpu", **overrides) -> ModelRunner:
    args = dict(model=model, device=device, dtype="float32", block_size=BLOCK_SIZE, num_gpu_blocks=NUM_BLOCKS,
                num_host_blocks=NUM_HOST_BLOCKS, max_num_seqs=4, enforce_eager=True, attention_backend="torch")
    return ModelRunner(EngineConfig(**{**args, **overrides}))


@pytest.fixture(scope="module")
def runner(tiny_llama) -> ModelRunner:
    return make_runner(tiny_llama)


def fill_random(pool: KVPool) -> torch.Tensor:
    """Fresh random values in every KV block (never zeros); returns a copy of the pool."""
    pool.cache.copy_(torch.randn(pool.cache.shape, dtype=pool.cache.dtype) + 3.0)
    return pool.cache.cpu().clone()


def copies(*pairs: tuple[int, int]) -> list[engine_pb2.BlockCopy]:
    """As a plan carries them; the KV pool takes the (src, dst) pairs themselves."""
    return [engine_pb2.BlockCopy(src_block_id=s, dst_block_id=d) for s, d in pairs]


def block(pool: torch.Tensor, b: int) -> torch.Tensor:
    return pool[:, :, b].cpu()  # every layer, K and V


def host_block(host: torch.Tensor, b: int) -> torch.Tensor:
    return host[b]  # the host pool is block-major


def round_trip(pool: KVPool) -> None:
    before = fill_random(pool)
    pool.swap_out([(1, 4), (7, 0), (3, 5)])
    pool.cache.copy_(torch.randn(pool.cache.shape, dtype=pool.cache.dtype) - 3.0)
    pool.swap_in([(4, 8), (0, 2), (5, 6)])
    for kv_src, kv_dst in ((1, 8), (7, 2), (3, 6)):
        assert torch.equal(block(pool.cache, kv_dst), block(before, kv_src))


def test_swapped_out_blocks_come_back_bit_for_bit_into_other_blocks(runner):
    round_trip(runner.kv_pool)


def test_a_swap_in_touches_only_its_destination_blocks(runner):
    pool = runner.kv_pool
    pool.swap_out([(2, 3)])
    before = fill_random(pool)
    pool.swap_in([(3, 9)])
    after = pool.cache.cpu()
    untouched = [b for b in range(NUM_BLOCKS) if b != 9]
    assert torch.equal(after[:, :, untouched], before[:, :, untouched])


def test_a_plan_swaps_out_before_it_swaps_in_copies_or_runs_its_forward(runner):
    """Block 2 is swapped out and receives a swap-in; block 5 is swapped out and receives a copy;
    block 6 is swapped out and a new sequence's forward writes its K/V there, all in one plan."""
    sent = []
    loop = StepLoop(runner, SequenceMirrors(), type("Sock", (), {"send": lambda self, m: sent.append(m)})(), rank=0)
    before = fill_random(runner.kv_pool)
    loop.run_plan(engine_pb2.StepPlan(step_id=0, swap_out=copies((1, 0))))  # host block 0 holds block 1
    loop.run_plan(engine_pb2.StepPlan(
        step_id=1,
        swap_out=copies((2, 3), (5, 4), (6, 1)),
        swap_in=copies((0, 2)),
        block_copies=copies((2, 8), (7, 5)),  # 2 -> 8 sees the swapped-in block
        new_seqs=[engine_pb2.NewSequence(seq_id=1, token_ids=[5, 6, 7], num_prompt_tokens=3, block_ids=[6],
                                         num_scheduled_tokens=3, sampling=engine_pb2.SamplingOptions())],
    ))
    loop.reply_pending()
    results = [engine_pb2.ExecutorToScheduler.FromString(m).result for m in sent]
    assert [r.error for r in results] == [""] * len(results) and results[-1].sampled[0].seq_id == 1
    host, kv = runner.kv_pool.host_cache, runner.kv_pool.cache
    for kv_src, host_dst in ((1, 0), (2, 3), (5, 4), (6, 1)):
        assert torch.equal(host_block(host, host_dst), block(before, kv_src))
    assert torch.equal(block(kv, 2), block(before, 1))
    assert torch.equal(block(kv, 8), block(before, 1))
    assert torch.equal(block(kv, 5), block(before, 7))
    written, kept = kv[:, :, 6, :3], kv[:, :, 6, 3:]  # the forward wrote 3 tokens' K/V into block 6
    assert not torch.equal(written, before[:, :, 6, :3]) and torch.equal(kept, before[:, :, 6, 3:])


def test_a_plan_naming_a_block_outside_a_pool_fails_on_the_host(runner):
    with pytest.raises(RuntimeError, match="swap_out"):
        runner.kv_pool.swap_out([(0, NUM_HOST_BLOCKS)])
    with pytest.raises(RuntimeError, match="swap_in"):
        runner.kv_pool.swap_in([(0, NUM_BLOCKS)])


def block_bytes(runner: ModelRunner) -> int:
    f = runner.facts  # the tiny Llama: 2 layers, 2 KV heads of 16, fp32
    assert (f.num_layers, f.num_kv_heads, f.head_dim) == (2, 2, 16)
    return 2 * 2 * BLOCK_SIZE * 2 * 16 * 4


@pytest.mark.parametrize("swap_args, expected", [
    (dict(num_host_blocks=None, swap_space_gb=0.001), lambda b: int(0.001 * 2**30) // b),
    (dict(num_host_blocks=3, swap_space_gb=1.0), lambda b: 3),  # the block count overrides the budget
])
def test_the_handshake_reports_the_host_pool_size(tiny_llama, swap_args, expected):
    r = make_runner(tiny_llama, **swap_args)
    n = expected(block_bytes(r))
    assert handshake(r).num_host_blocks == n > 0
    host = r.kv_pool.host_cache
    assert host.shape == (n, 2, 2, BLOCK_SIZE, 2, 16) and host.dtype == r.kv_pool.cache.dtype


@pytest.mark.parametrize("swap_args", [dict(num_host_blocks=None), dict(num_host_blocks=0, swap_space_gb=1.0)])
def test_no_swap_space_means_no_host_pool(tiny_llama, swap_args):
    r = make_runner(tiny_llama, **swap_args)
    assert handshake(r).num_host_blocks == 0 and r.kv_pool.host_cache is None
    r.kv_pool.swap_out([])  # an empty swap is no swap
    with pytest.raises(RuntimeError, match="no host pool"):
        r.kv_pool.swap_out([(0, 0)])


@pytest.mark.parametrize("device", [CUDA])
def test_swap_round_trip_on_cuda_through_pinned_memory(tiny_llama, device):
    r = make_runner(tiny_llama, device=device, dtype="bfloat16")
    assert r.kv_pool.host_cache.is_pinned() and r.kv_pool.host_cache.dtype == torch.bfloat16
    round_trip(r.kv_pool)


@pytest.mark.parametrize("device", [CUDA])
def test_a_cuda_swap_out_sees_writes_still_queued_on_the_stream(tiny_llama, device):
    pool = make_runner(tiny_llama, device=device).kv_pool
    fill_random(pool)
    x = torch.randn(2048, 2048, device=device)
    for _ in range(20):  # keep the stream busy so the write below is still queued
        x = torch.tanh(x @ x / 2048**0.5)  # bounded: no inf or nan
    pool.cache[:, :, 4] = x.flatten()[: pool.cache[:, :, 4].numel()].view_as(pool.cache[:, :, 4]) + 1.0
    expected = pool.cache[:, :, 4].clone()
    pool.swap_out([(4, 2)])
    torch.cuda.synchronize()  # the copy is queued, not waited for: only later copies read the host block
    assert torch.equal(pool.host_cache[2], expected.cpu())


def test_each_result_reports_how_long_its_plans_swaps_took(runner):
    sent = []
    loop = StepLoop(runner, SequenceMirrors(), type("Sock", (), {"send": lambda self, m: sent.append(m)})(), rank=0)
    loop.run_plan(engine_pb2.StepPlan(step_id=0, swap_out=copies((1, 0), (2, 1))))
    loop.run_plan(engine_pb2.StepPlan(step_id=1, swap_in=copies((0, 3))))
    loop.run_plan(engine_pb2.StepPlan(step_id=2, block_copies=copies((3, 4))))  # a copy is no swap
    loop.reply_pending()
    results = [engine_pb2.ExecutorToScheduler.FromString(m).result for m in sent]
    assert [r.step_id for r in results] == [0, 1, 2]
    assert results[0].swap_seconds > 0 and results[1].swap_seconds > 0 and results[2].swap_seconds == 0


@pytest.mark.parametrize("device", ["cpu", CUDA])
def test_the_handshake_reports_the_measured_copy_costs_and_in_auto_mode_the_prefill_rate(tiny_llama, device):
    r = make_runner(tiny_llama, device, preemption_mode="auto")
    hs = handshake(r)
    assert hs.kv_block_bytes == block_bytes(r)
    assert hs.host_link_bytes_per_s > 0 and hs.copy_fixed_seconds >= 0 and hs.prefill_tokens_per_s > 0
    assert not r.kv_pool.cache.any(), "the timed swaps and forward leave the pool as it starts: zeros"


def test_the_timed_prefill_runs_as_a_step_does_after_the_graphs_are_made(tiny_llama, monkeypatch):
    """The prefill rate is measured through ModelRunner._forward, the path a recomputed prefill takes (the piecewise
    graphs on a GPU when a bucket holds it), and only once the runner has decided its graphs: timed before their
    capture, it measured the eager forward that no step of that size runs."""
    calls = []
    forward = ModelRunner._forward

    def recording(self, inputs):
        calls.append((inputs.input_ids.shape[0], hasattr(self, "graphs") and hasattr(self, "piecewise")))
        return forward(self, inputs)

    monkeypatch.setattr(ModelRunner, "_forward", recording)
    r = make_runner(tiny_llama, preemption_mode="auto")
    assert handshake(r).prefill_tokens_per_s > 0
    assert len(calls) == 2, calls  # the warm-up and the timed forward
    assert all(graphs_decided for _, graphs_decided in calls), calls
    assert len({n for n, _ in calls}) == 1 and calls[0][0] > 0


def test_on_the_cpu_without_a_host_pool_or_auto_mode_nothing_is_timed(tiny_llama):
    r = make_runner(tiny_llama, num_host_blocks=None)  # the CPU's default mode: recompute, no host pool
    hs = handshake(r)
    assert hs.kv_block_bytes == block_bytes(r) and hs.num_host_blocks == 0
    assert hs.host_link_bytes_per_s == hs.copy_fixed_seconds == hs.prefill_tokens_per_s == 0
