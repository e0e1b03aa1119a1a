"""SMG (the pinned `smg` from PyPI) in front of two `nanoserve serve` replicas on the embedded model, speaking
vLLM's worker protocol to them: the OpenAI API through SMG answers what nanoserve.v1 answers, cache-aware
routing keeps a shared prefix on one replica, loads follow the work, a dropped stream frees its blocks and a
killed replica leaves SMG serving through the other.

One module-scoped gateway: CI pays the start-up once. The replica-killing test runs last.
"""
from __future__ import annotations

import json
import os
import threading
import time

import grpc
import jsonschema
import pytest
from smg_grpc_proto import vllm_engine_pb2 as vllm
from smg_grpc_proto import vllm_engine_pb2_grpc
from smg_grpc_proto.generated import common_pb2 as smg_common

from protos import generation_pb2 as pb
from support.grpc_server import REPO, smol_dir, start_server, wait_for, wait_serving
from support.smg_gateway import start_gateway

MODEL = "SmolLM2-135M-Instruct"
# 4,096 tokens each: two replicas stay small. The model by a path relative to the repository, where the
# replicas run: SMG, running elsewhere, cannot find it and takes the tokenizer from GetTokenizer's stream,
# as it does in compose (no copy of the model beside SMG).
REPLICA_FLAGS = ["--num-gpu-blocks", "256", "--model", os.path.relpath(smol_dir(), REPO)]
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
SYSTEM_PROMPT = ("You are a meticulous assistant for a public library. " * 3 + "Answer questions about opening hours, "
                 "membership, borrowing rules, late fees, room bookings, events for children and adults, printing "
                 "and scanning, accessibility, donations and the catalogue. Be brief, friendly and exact; when you do "
                 "not know, say so and suggest asking at the front desk. ") * 2


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("gateway")
    replicas = []
    try:
        replicas = [start_server(log_dir, *REPLICA_FLAGS, wait=False) for _ in range(2)]
        for replica in replicas:
            wait_serving(replica, 180)
        gateway = start_gateway(log_dir, [r.addr for r in replicas], MODEL, "--policy", "cache_aware")
        try:
            yield gateway, replicas
        finally:
            gateway.stop()
    finally:
        for replica in replicas:
            replica.stop()


def stats(replica) -> pb.Stats:
    return replica.stub.GetStats(pb.GetStatsRequest(), timeout=10)


def vllm_stub(replica) -> vllm_engine_pb2_grpc.VllmEngineStub:
    return vllm_engine_pb2_grpc.VllmEngineStub(replica.channel)


def nanoserve_chat(replica, messages, max_tokens: int) -> str:
    response = replica.stub.Generate(pb.GenerateRequest(
        messages=pb.ChatMessages(messages=[pb.ChatMessage(**m) for m in messages]),
        sampling=pb.SamplingParams(temperature=0, max_tokens=max_tokens)), timeout=120)
    return response.outputs[0].text


def test_chat_completions_with_and_without_streaming_match_nanoserve_generate(cluster):
    gateway, replicas = cluster
    assert "Fetching tokenizer from worker" in gateway.log()  # GetTokenizer: SMG has no copy of the model
    expected = nanoserve_chat(replicas[0], QUESTION, 24)
    assert "Paris" in expected
    body = {"model": MODEL, "messages": QUESTION, "temperature": 0, "max_tokens": 24}
    answer = gateway.post("/v1/chat/completions", body)
    assert answer["choices"][0]["message"]["content"] == expected
    assert answer["choices"][0]["finish_reason"] == "stop"  # the model's EOS, which SMG never sent
    usage = answer["usage"]
    assert usage["prompt_tokens"] > 0 and usage["completion_tokens"] > 0

    chunks = gateway.stream("/v1/chat/completions", {**body, "stream_options": {"include_usage": True}})
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert text == expected
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "stop"
    streamed_usage = [c["usage"] for c in chunks if c.get("usage")][-1]
    assert streamed_usage["completion_tokens"] == usage["completion_tokens"]
    # the same prompt again, on a replica that has it cached: SMG reports nanoserve's cached tokens
    assert streamed_usage["prompt_tokens_details"]["cached_tokens"] > 0


def test_completions_endpoint_matches_nanoserve_generate(cluster):
    gateway, replicas = cluster
    prompt = "The three primary colours are"
    expected = replicas[1].stub.Generate(pb.GenerateRequest(
        prompt=prompt, sampling=pb.SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)), timeout=120)
    answer = gateway.post("/v1/completions", {"model": MODEL, "prompt": prompt, "temperature": 0, "max_tokens": 12,
                                              "ignore_eos": True})
    choice = answer["choices"][0]
    assert choice["text"] == expected.outputs[0].text
    assert choice["finish_reason"] == "length" and answer["usage"]["completion_tokens"] == 12


def test_response_format_json_schema_returns_json_that_validates(cluster):
    gateway, _ = cluster
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                               "age": {"type": "integer", "minimum": 0, "maximum": 120}},
              "required": ["name", "age"], "additionalProperties": False}
    answer = gateway.post("/v1/chat/completions", {
        "model": MODEL, "temperature": 0, "max_tokens": 60,
        "messages": [{"role": "user", "content": "Make up a person. Reply with their name and age as JSON."}],
        "response_format": {"type": "json_schema", "json_schema": {"name": "person", "schema": schema}}})
    jsonschema.validate(json.loads(answer["choices"][0]["message"]["content"]), schema)


def test_requests_sharing_a_long_system_prompt_concentrate_on_one_replica(cluster):
    gateway, replicas = cluster
    before = [stats(r) for r in replicas]
    questions = ["When do you open on Sundays?", "How do I renew a book?", "Can I print in colour?",
                 "Is there a reading group for teens?", "How much is a late fee?", "Can I book a meeting room?"]
    chats = [[{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": q}] for q in questions]
    prompts = [list(replicas[0].stub.Tokenize(pb.TokenizeRequest(messages=pb.ChatMessages(
        messages=[pb.ChatMessage(**m) for m in chat])), timeout=30).token_ids) for chat in chats]
    shared = next(i for i, column in enumerate(zip(*prompts)) if len(set(column)) > 1)
    shared_blocks = shared // 16  # what a request finds cached where another one ran
    assert shared_blocks >= 8
    for chat in chats:
        gateway.post("/v1/chat/completions", {"model": MODEL, "temperature": 0, "max_tokens": 1, "messages": chat})
    after = [stats(r) for r in replicas]
    hits = [a.prefix_cache_hit_tokens - b.prefix_cache_hit_tokens for a, b in zip(after, before)]
    served = [a.num_finished - b.num_finished for a, b in zip(after, before)]
    favourite = max(range(2), key=lambda i: hits[i])
    # every request after the first finds the system prompt's blocks cached where the first one ran
    assert served[favourite] == len(questions) and served[1 - favourite] == 0, (served, hits)
    assert hits == [0, 0][:favourite] + [(len(questions) - 1) * shared_blocks * 16] + [0, 0][favourite + 1:], hits


def test_get_loads_follows_the_load(cluster):
    _, replicas = cluster
    stub = vllm_stub(replicas[0])
    idle = stub.GetLoads(vllm.GetLoadsRequest(include=["core"]), timeout=10).loads[0]
    calls, first_tokens = [], threading.Barrier(4, timeout=120)

    def run(i: int) -> None:
        call = stub.Generate(vllm.GenerateRequest(
            request_id=f"loads-{i}", tokenized=vllm.TokenizedInput(input_ids=[1 + i] * 40 + list(range(50, 90))),
            sampling_params=vllm.SamplingParams(temperature=0, max_tokens=400, ignore_eos=True), stream=True))
        calls.append(call)
        next(call)
        first_tokens.wait()
        try:
            for _ in call:
                pass
        except grpc.RpcError as exc:
            assert exc.code() == grpc.StatusCode.CANCELLED

    threads = [threading.Thread(target=run, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    first_tokens.wait()
    busy = stub.GetLoads(vllm.GetLoadsRequest(include=["core"]), timeout=10).loads[0]
    assert busy.num_running_reqs == idle.num_running_reqs + 3
    assert busy.token_usage > idle.token_usage and busy.num_used_tokens >= 3 * 80
    for call in calls:
        call.cancel()
    for t in threads:
        t.join(60)
    quiet = wait_for(lambda: (lambda l: l if l.num_running_reqs == 0 and l.num_used_tokens == 0 else None)(
        stub.GetLoads(vllm.GetLoadsRequest(), timeout=10).loads[0]), 30, "the load going back to idle")
    assert quiet.token_usage == 0.0 and quiet.max_total_num_tokens == 256 * 16


def test_a_client_that_disconnects_mid_stream_frees_its_blocks(cluster):
    gateway, replicas = cluster
    before = [stats(r) for r in replicas]
    conn, events = gateway.open_stream("/v1/chat/completions", {
        "model": MODEL, "temperature": 0, "max_tokens": 400, "ignore_eos": True,
        "messages": [{"role": "user", "content": "Write a long story about a lighthouse keeper."}]})
    for _ in range(4):
        next(events)
    running = [stats(r).num_running for r in replicas]
    assert sum(running) == 1, running
    conn.sock.close()  # the client goes away mid-stream
    conn.close()
    serving = running.index(1)
    after = wait_for(lambda: (lambda s: s if s.num_running == 0 else None)(stats(replicas[serving])), 30,
                     "SMG's Abort reaching the replica")
    assert after.num_aborted == before[serving].num_aborted + 1
    assert after.free_kv_blocks == after.total_kv_blocks  # every block back in the pool (cached ones count free)


def test_the_kv_event_stream_answers_at_once_beats_every_second_and_chains_16_token_blocks(cluster):
    _, replicas = cluster
    stub = vllm_stub(replicas[1])
    stream = stub.SubscribeKvEvents(smg_common.SubscribeKvEventsRequest(load_records_before_first_batch=True),
                                    timeout=60)
    started = time.monotonic()
    first = next(stream)
    assert time.monotonic() - started < 1.0 and first.sequence_number == 0 and first.load.load_only
    snapshot = next(stream)  # the replica's whole index, as a new subscriber's first events
    assert snapshot.sequence_number == 1 and snapshot.events[0].WhichOneof("data") == "cleared"
    prompt = [7 + i % 50 for i in range(3 * 16 + 5)]  # three full blocks, never sent before
    list(stub.Generate(vllm.GenerateRequest(request_id="kv-events", tokenized=vllm.TokenizedInput(input_ids=prompt),
                                            sampling_params=vllm.SamplingParams(temperature=0, max_tokens=2))))
    beats, blocks, parent = [], [], None
    while len(beats) < 2:
        batch = next(stream)
        if batch.load.load_only and not batch.events:
            beats.append(time.monotonic())
        for event in batch.events:
            if event.WhichOneof("data") == "stored" and list(event.stored.blocks[0].token_ids) == prompt[:16]:
                parent = event.stored.parent_block_hash if event.stored.HasField("parent_block_hash") else None
                blocks = list(event.stored.blocks)
    stream.cancel()
    assert parent is None and [list(b.token_ids) for b in blocks[:3]] == [prompt[:16], prompt[16:32], prompt[32:48]]
    assert all(b.block_size == 16 for b in blocks) and len({b.block_hash for b in blocks}) == len(blocks)
    assert 0.5 < beats[1] - beats[0] < 2.0  # a heartbeat about every second: SMG drops a stream silent for 2 s


def test_a_field_nanoserve_cannot_honour_is_invalid_argument_naming_it(cluster):
    _, replicas = cluster
    stub = vllm_stub(replicas[1])
    for sampling, name in ((vllm.SamplingParams(logit_bias={5: 1.0}), "logit_bias"),
                           (vllm.SamplingParams(top_p=1.5), "sampling_params.top_p"),
                           (vllm.SamplingParams(structural_tag="{}"), "structural_tag")):
        with pytest.raises(grpc.RpcError) as error:
            list(stub.Generate(vllm.GenerateRequest(request_id="bad", tokenized=vllm.TokenizedInput(input_ids=[1, 2]),
                                                    sampling_params=sampling)))
        assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT and name in error.value.details()
    info = stub.GetModelInfo(vllm.GetModelInfoRequest(), timeout=10)
    assert info.served_model_name == MODEL and list(info.eos_token_ids) == [2] and info.max_context_length == 512
    server = stub.GetServerInfo(vllm.GetServerInfoRequest(), timeout=10)
    assert server.block_size == 16 and server.max_num_seqs == 256  # --max-num-seqs' default
    assert stub.HealthCheck(vllm.HealthCheckRequest(), timeout=10).healthy


def test_killing_a_replica_leaves_smg_serving_through_the_other(cluster):
    gateway, replicas = cluster
    victim, survivor = replicas
    victim.proc.kill()  # SIGKILL: serve's scheduler and executor die with it (PR_SET_PDEATHSIG)
    victim.proc.wait(30)
    served_before = stats(survivor).num_finished
    failures, outcomes = 0, []
    for i in range(8):
        status, _ = gateway.request("POST", "/v1/completions", {
            "model": MODEL, "prompt": f"Count to {i + 3}:", "temperature": 0, "max_tokens": 4}, timeout=120)
        outcomes.append(status)
        failures += status != 200
    assert failures <= 2, outcomes  # SMG retries a failed connection on the other worker within the request
    assert outcomes[-4:] == [200] * 4, outcomes
    assert stats(survivor).num_finished >= served_before + 8 - failures


def test_the_compose_gateway_profile_puts_smg_in_front_of_two_replicas():
    from test_deployment import COMPOSE_FILE, run_compose  # Compose v2's own parser (tests/e2e)

    plain = run_compose(COMPOSE_FILE, "config", "--services")
    assert plain.returncode == 0, plain.stderr
    assert not {"gateway", "replica-1", "replica-2"} & set(plain.stdout.split())  # only with the profile
    result = run_compose(COMPOSE_FILE, "--profile", "gateway", "config", "--format", "json")
    assert result.returncode == 0, result.stderr
    services = json.loads(result.stdout)["services"]
    gateway = services["gateway"]
    assert [(p["target"], str(p["published"])) for p in gateway["ports"]] == [(30000, "30000")]
    command = gateway["command"]
    assert command[:1] == ["launch"] and command[command.index("--policy") + 1] == "cache_aware"
    urls = command[command.index("--worker-urls") + 1:command.index("--worker-urls") + 3]
    assert urls == ["grpc://replica-1:50051", "grpc://replica-2:50051"]
    for name in ("replica-1", "replica-2"):
        assert services[name]["command"][:1] == ["serve"] and "50051" in services[name]["command"]
        assert gateway["depends_on"][name]["condition"] == "service_healthy"
    assert "volumes" not in gateway  # no model beside SMG: the tokenizer comes over GetTokenizer
    # SMG's image is the Dockerfile's gateway stage, which installs the one pin, pyproject.toml's gateway extra,
    # which the tests run too
    assert gateway["build"]["target"] == "gateway"
    with open(os.path.join(REPO, "Dockerfile")) as f:
        stage = f.read().split("FROM python AS gateway\n")[1].split("\nFROM ")[0]
    assert "['optional-dependencies']['gateway']" in stage and 'ENTRYPOINT ["smg"]' in stage
    import importlib.metadata
    import tomllib
    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        pin = tomllib.load(f)["project"]["optional-dependencies"]["gateway"]
    assert pin == [f"smg=={importlib.metadata.version('smg')}"]
