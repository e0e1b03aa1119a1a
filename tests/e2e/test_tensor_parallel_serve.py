"""`nanoserve serve -tp 2` on the CPU (gloo, two executor processes), through gRPC, gives the same
greedy tokens as `-tp 1` on the same checkpoint while a small KV pool forces preemption (the issue
"Tensor parallelism on NCCL across 2 GPUs", item 4)."""
from __future__ import annotations

import threading

import pytest

from protos import generation_pb2 as pb
from support.grpc_server import wait_serving
from support.roles import children_of, cmdline, start_serve
from support.tiny_checkpoints import make_tiny_qwen3

# 4 q heads, 2 KV heads and a vocabulary of 256: every tensor-parallel shard divides by 2.
# 12 blocks of 16 tokens hold 192 tokens; 6 streams of 8 + 40 tokens need 288 at once: preemption.
ENGINE_FLAGS = ["--device", "cpu", "--num-gpu-blocks", "12", "--block-size", "16", "--max-model-len", "256"]
PROMPTS = [[7 + 11 * i + j for j in range(8)] for i in range(6)]
MAX_TOKENS = 40
STARTUP_TIMEOUT_S = 240.0


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory) -> str:
    return make_tiny_qwen3(str(tmp_path_factory.mktemp("tp") / "qwen3"))


def greedy_streams(server) -> list[list[int]]:
    """The prompts' greedy completions, streamed concurrently so that they contend for the pool."""
    results: list[list[int] | None] = [None] * len(PROMPTS)

    def run(i: int) -> None:
        tokens = []
        for part in server.stub.GenerateStream(pb.GenerateRequest(
                prompt_token_ids=pb.TokenIds(ids=PROMPTS[i]),
                sampling=pb.SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)), timeout=300):
            for out in part.outputs:
                tokens.extend(out.token_ids)
        results[i] = tokens

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(320)
    assert all(r is not None and len(r) == MAX_TOKENS for r in results), results
    return results


def test_serve_with_two_tensor_parallel_ranks_gives_the_tokens_of_one_under_preemption(tmp_path, qwen3):
    outputs, preemptions = {}, {}
    for tp in (1, 2):
        server = start_serve(str(tmp_path), qwen3, *ENGINE_FLAGS, "--tensor-parallel-size", str(tp))
        try:
            wait_serving(server, STARTUP_TIMEOUT_S)
            executors = [pid for pid in children_of(server.proc.pid) if "executor_svc" in cmdline(pid)]
            assert len(executors) == tp
            info = server.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10)
            assert info.tensor_parallel_size == tp
            outputs[tp] = greedy_streams(server)
            preemptions[tp] = server.stub.GetStats(pb.GetStatsRequest(), timeout=10).num_preemptions
        finally:
            assert server.stop() == 0, server.log()[-3000:]
    assert preemptions[1] > 0 and preemptions[2] > 0, preemptions  # the pool was meant to be too small
    assert outputs[2] == outputs[1]
