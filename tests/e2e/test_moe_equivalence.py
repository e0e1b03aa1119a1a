"""Mixture-of-experts models end to end through the real scheduler and executor processes: greedy tokens
of tiny random Qwen3-MoE (a dense layer mixed in) and Mixtral checkpoints equal HF transformers (fp32, same
weights), plainly, under forced preemption (recompute, with chunked prefill; swap), with prefix cache hits,
and at -tp 2 on gloo through gRPC. The routers spread the tokens over every expert (checked on HF's own
routing), so a wrong expert index cannot pass."""
from __future__ import annotations

import random
import threading
from types import SimpleNamespace

import pytest
import torch

from protos import generation_pb2 as pb
from support.grpc_server import wait_serving
from support.hf_reference import _load, assert_greedy_matches, hf_greedy
from support.roles import start_serve
from support.tiny_checkpoints import tiny_checkpoint
from scheduler_svc.entrypoints.llm import LLM
from test_engine_equivalence import GREEDY, NEW_TOKENS, run_engine

KINDS = ["qwen3_moe", "mixtral"]
TP_NEW_TOKENS = 40


def moe_prompts() -> list[list[int]]:
    rng = random.Random(29)
    return [[rng.randrange(256) for _ in range(rng.randint(1, 90))] for _ in range(8)]


@pytest.fixture(scope="module", params=KINDS)
def moe_case(request, tmp_path_factory):
    path = tiny_checkpoint(request.param, tmp_path_factory)
    prompts = moe_prompts()
    return path, prompts, hf_greedy(path, prompts, NEW_TOKENS)


def expert_loads(model_dir: str, prompts: list[list[int]]) -> list[torch.Tensor]:
    """Per MoE layer, the share of (token, slot) picks that each expert gets under HF's routing."""
    model = _load(model_dir)
    config = model.config
    top_k = config.num_experts_per_tok
    counts = None
    with torch.inference_mode():
        for ids in prompts:
            out = model(torch.tensor([ids]), output_router_logits=True)
            picks = [torch.topk(logits.float(), top_k, dim=-1).indices.flatten() for logits in out.router_logits]
            num_experts = out.router_logits[0].shape[-1]
            layer_counts = [torch.bincount(p, minlength=num_experts) for p in picks]
            counts = layer_counts if counts is None else [c + n for c, n in zip(counts, layer_counts)]
    return [c.double() / c.sum() for c in counts]


def test_the_routers_spread_tokens_over_every_expert(moe_case):
    path, prompts, _ = moe_case
    loads = expert_loads(path, prompts)
    assert loads, "the checkpoint should have MoE layers"
    for share in loads:
        uniform = 1.0 / share.numel()
        assert share.min() > 0.25 * uniform, f"an expert is (nearly) never chosen: {share.tolist()}"
        assert share.max() < 3.0 * uniform, f"one expert takes most tokens: {share.tolist()}"


def test_moe_greedy_equals_transformers(moe_case):
    path, prompts, ref = moe_case
    outs, stats = run_engine(path, prompts)
    assert_greedy_matches(outs, ref)
    assert stats.free_kv_blocks == stats.total_kv_blocks


def test_moe_equals_transformers_under_recompute_preemption_with_chunked_prefill(moe_case):
    path, prompts, ref = moe_case
    outs, stats = run_engine(path, prompts, num_gpu_blocks=10, max_num_batched_tokens=32, preemption_mode="recompute")
    assert stats.num_preemptions > 0 and stats.num_recomputed_tokens > 0 and stats.num_swap_outs == 0
    assert stats.num_partial_prefill_chunks > 0 and stats.num_mixed_steps > 0
    assert_greedy_matches(outs, ref)
    assert stats.free_kv_blocks == stats.total_kv_blocks


def test_moe_equals_transformers_when_preempted_sequences_swap_to_host(moe_case):
    path, prompts, ref = moe_case
    outs, stats = run_engine(path, prompts, num_gpu_blocks=10, num_host_blocks=64, preemption_mode="swap")
    assert stats.num_swap_outs > 0, "the pool was meant to be too small for the batch"
    assert_greedy_matches(outs, ref)
    assert stats.free_kv_blocks == stats.total_kv_blocks and stats.num_swapped == 0


def grpc_greedy(server, prompts: list[list[int]], max_tokens: int) -> list[SimpleNamespace]:
    """Greedy completions with top-5 logprobs, streamed concurrently (so that they contend for the pool)."""
    results: list[SimpleNamespace | None] = [None] * len(prompts)

    def run(i: int) -> None:
        tokens, top = [], []
        for part in server.stub.GenerateStream(pb.GenerateRequest(
                prompt_token_ids=pb.TokenIds(ids=prompts[i]),
                sampling=pb.SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=5)),
                timeout=300):
            for out in part.outputs:
                tokens.extend(out.token_ids)
                top.extend(SimpleNamespace(top_token_ids=[t.token_id for t in lp.top_logprobs]) for lp in out.logprobs)
        results[i] = SimpleNamespace(token_ids=tokens, logprobs=top)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(320)
    assert all(r is not None for r in results)
    return results


def test_moe_at_two_tensor_parallel_ranks_through_grpc_equals_transformers(tmp_path, tmp_path_factory):
    """`serve -tp 2` on gloo: every expert's intermediate dimension split over the ranks, one all-reduce after
    the block; a small pool forces preemption too."""
    path = tiny_checkpoint("qwen3_moe", tmp_path_factory)
    rng = random.Random(2)
    # 6 streams of 8 + 40 tokens need 18 blocks at once; the pool holds 12
    prompts = [[rng.randrange(256) for _ in range(8)] for _ in range(6)]
    ref = hf_greedy(path, prompts, TP_NEW_TOKENS)
    server = start_serve(str(tmp_path), path, "--device", "cpu", "--num-gpu-blocks", "12", "--block-size", "16",
                         "--max-model-len", "256", "--tensor-parallel-size", "2")
    try:
        wait_serving(server, 240.0)
        assert server.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10).tensor_parallel_size == 2
        outs = grpc_greedy(server, prompts, TP_NEW_TOKENS)
        preemptions = server.stub.GetStats(pb.GetStatsRequest(), timeout=10).num_preemptions
    finally:
        assert server.stop() == 0, server.log()[-3000:]
    assert_greedy_matches(outs, ref)
    assert preemptions > 0, "the pool was meant to be too small"


def test_moe_equals_transformers_with_prefix_cache_hits(tmp_path_factory):
    path = tiny_checkpoint("qwen3_moe", tmp_path_factory)
    rng = random.Random(5)
    shared = [rng.randrange(256) for _ in range(40)]  # two full blocks of 16 shared
    prompts = [shared + [rng.randrange(256) for _ in range(rng.randint(1, 20))] for _ in range(4)]
    ref = hf_greedy(path, prompts, NEW_TOKENS)
    with LLM(path) as llm:
        first = llm.generate(prompts[:1], GREEDY, use_tqdm=False)
        rest = llm.generate(prompts[1:], GREEDY, use_tqdm=False)
    assert all(r.num_cached_tokens == 32 for r in rest), [r.num_cached_tokens for r in rest]
    assert_greedy_matches([r.outputs[0] for r in first + rest], ref)
