"""200 concurrent streams against `nanoserve serve`, with random client cancels and deadlines:
every call ends with exactly one terminal status, and afterwards the engine is idle with its whole
KV pool free."""
from __future__ import annotations

import asyncio
import random
import time

import grpc
import pytest

from support.grpc_server import start_server
from protos import generation_pb2 as pb
from protos import generation_pb2_grpc

NUM_STREAMS = 200


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = start_server(tmp_path_factory.mktemp("grpc_concurrency"))
    yield s
    assert s.stop() == 0


async def one_stream(stub, i: int, rng: random.Random) -> tuple[str, str]:
    """Returns (plan, outcome): the plan is what the client does; the outcome is how the call ended."""
    n = 2 if i % 10 == 0 else 1
    request = pb.GenerateRequest(
        request_id=f"req-{i}", prompt=f"Story number {i}: once upon a time",
        sampling=pb.SamplingParams(max_tokens=rng.randint(2, 8), ignore_eos=True, n=n, temperature=0.8, seed=i))
    plan = rng.choice(["finish", "finish", "cancel", "deadline"])
    timeout = rng.uniform(0.3, 4.0) if plan == "deadline" else 300
    call = stub.GenerateStream(request, timeout=timeout)
    finished, usage_seen, messages = {}, 0, 0
    cancel_after = rng.randint(0, 3)
    try:
        async for response in call:
            messages += 1
            assert response.request_id == f"req-{i}"
            assert usage_seen == 0, "a message after the one carrying usage"
            usage_seen += response.HasField("usage")
            for out in response.outputs:
                if out.finish_reason:
                    assert out.index not in finished, "a completion finished twice"
                    finished[out.index] = out.finish_reason
            if plan == "cancel" and messages > cancel_after:
                call.cancel()
                break
    except grpc.aio.AioRpcError:
        pass
    code = await call.code()
    if code == grpc.StatusCode.OK:
        assert usage_seen == 1 and set(finished) == set(range(n))
        assert set(finished.values()) == {pb.FINISH_REASON_LENGTH}
    return plan, code.name


async def run_all(addr: str) -> list[tuple[str, str]]:
    rng = random.Random(0)
    async with grpc.aio.insecure_channel(addr) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        tasks = [one_stream(stub, i, random.Random(rng.random())) for i in range(NUM_STREAMS)]
        return await asyncio.gather(*tasks)


def test_200_streams_with_cancels_and_deadlines_each_end_once_and_free_every_block(server):
    before = server.stub.GetStats(pb.GetStatsRequest(), timeout=10)
    results = asyncio.run(run_all(server.addr))
    allowed = {"finish": {"OK"}, "cancel": {"CANCELLED", "OK"}, "deadline": {"DEADLINE_EXCEEDED", "OK"}}
    for plan, outcome in results:
        assert outcome in allowed[plan], (plan, outcome)
    outcomes = [o for _, o in results]
    assert outcomes.count("CANCELLED") > 10 and outcomes.count("OK") > 50

    deadline = time.monotonic() + 60
    while True:
        stats = server.stub.GetStats(pb.GetStatsRequest(), timeout=10)
        if stats.num_running == 0 and stats.num_waiting == 0:
            break
        assert time.monotonic() < deadline, stats
        time.sleep(0.2)
    assert stats.free_kv_blocks == stats.total_kv_blocks
    # every engine request ended once in the scheduler; a deadline may pass before a request reaches it
    engine_requests = NUM_STREAMS + NUM_STREAMS // 10  # every tenth stream has n = 2
    ended = (stats.num_finished + stats.num_aborted) - (before.num_finished + before.num_aborted)
    assert engine_requests - 2 * outcomes.count("DEADLINE_EXCEEDED") <= ended <= engine_requests
    assert server.stub.Generate(pb.GenerateRequest(prompt="Still there?", sampling=pb.SamplingParams(max_tokens=2)),
                                timeout=60).outputs[0].token_ids
