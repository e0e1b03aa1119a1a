"""A client that knows nothing but the server's address, as grpcurl: it lists and describes the
services through server reflection, builds requests from JSON and calls methods by name."""
from __future__ import annotations

import grpc
import pytest

from support.grpc_server import start_server
from support.reflection_client import DynamicClient

SERVICE = "nanoserve.v1.Generation"
RPCS = {"Generate", "GenerateStream", "Tokenize", "Detokenize", "GetModelInfo", "GetStats", "Abort"}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = start_server(tmp_path_factory.mktemp("grpc_reflection"))
    yield s
    assert s.stop() == 0


@pytest.fixture(scope="module")
def client(server):
    return DynamicClient(server.channel)


def test_list_shows_the_generation_health_and_reflection_services(client):
    assert {SERVICE, "grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"} <= set(client.services())


def test_describe_shows_every_rpc_with_its_message_types(client):
    service = client.pool.FindServiceByName(SERVICE)
    assert {m.name for m in service.methods} == RPCS
    stream = service.methods_by_name["GenerateStream"]
    assert stream.server_streaming and not stream.client_streaming
    assert stream.input_type.full_name == "nanoserve.v1.GenerateRequest"
    request = stream.input_type
    assert [f.name for f in request.oneofs_by_name["input"].fields] == ["prompt", "prompt_token_ids", "messages"]
    sampling = request.fields_by_name["sampling"].message_type
    assert sampling.fields_by_name["temperature"].has_presence and not sampling.fields_by_name["top_k"].has_presence
    output = client.pool.FindMessageTypeByName("nanoserve.v1.CompletionOutput")
    assert [f.name for f in output.oneofs_by_name["stop_reason"].fields] == ["stop_string", "stop_token_id"]


def test_generate_by_name_from_json(client):
    body = {"messages": {"messages": [{"role": "user", "content": "What is the capital of France?"}]},
            "sampling": {"temperature": 0, "maxTokens": 12}}
    (response,) = client.call(f"{SERVICE}.Generate", body)
    assert response["outputs"][0]["text"] == "The capital of France is Paris."
    assert response["outputs"][0]["finishReason"] == "FINISH_REASON_STOP"
    parts = client.call(f"{SERVICE}.GenerateStream", body)
    assert "".join(o.get("text", "") for p in parts for o in p["outputs"]) == "The capital of France is Paris."
    assert "usage" in parts[-1]


def test_every_other_rpc_answers_by_name(client):
    (tokens,) = client.call(f"{SERVICE}.Tokenize", {"text": "Hello world"})
    assert tokens["tokens"] == ["Hello", "\u0120world"]
    (text,) = client.call(f"{SERVICE}.Detokenize", {"tokenIds": tokens["tokenIds"]})
    assert text["text"] == "Hello world"
    (info,) = client.call(f"{SERVICE}.GetModelInfo", {})
    assert info["modelName"] == "SmolLM2-135M-Instruct" and info["maxModelLen"] == 512
    (stats,) = client.call(f"{SERVICE}.GetStats", {})
    assert stats["engineReady"] and stats["totalKvBlocks"] == stats["freeKvBlocks"]
    (aborted,) = client.call(f"{SERVICE}.Abort", {"requestIds": ["nothing-like-this"]})
    assert aborted == {}
    (health,) = client.call("grpc.health.v1.Health.Check", {"service": SERVICE})
    assert health["status"] == "SERVING"


def test_bad_input_by_name_is_invalid_argument(client):
    with pytest.raises(grpc.RpcError) as err:
        client.call(f"{SERVICE}.Generate", {"prompt": "Hi", "sampling": {"temperature": -1}})
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "sampling.temperature" in err.value.details()
