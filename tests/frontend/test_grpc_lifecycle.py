"""How `nanoserve serve` starts, stops and survives: SIGTERM drains, an API key and mutual TLS
guard the calls, and a killed executor fails the streams, turns health NOT_SERVING, and is
restarted until the service is SERVING again with correct output."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2
from smg_grpc_proto import vllm_engine_pb2 as vllm
from smg_grpc_proto import vllm_engine_pb2_grpc

from support.grpc_server import REPO, start_server, wait_serving
from protos import generation_pb2 as pb
from protos import generation_pb2_grpc

SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
CAPITAL = pb.GenerateRequest(messages=pb.ChatMessages(messages=[pb.ChatMessage(
    role="user", content="What is the capital of France?")]), sampling=pb.SamplingParams(temperature=0, max_tokens=12))


def long_request(request_id: str) -> pb.GenerateRequest:
    return pb.GenerateRequest(request_id=request_id, prompt="Write a very long story about dragons.",
                              sampling=pb.SamplingParams(max_tokens=400, ignore_eos=True))


def consume(call, into: dict) -> None:
    """Read a stream to its end in a thread; record its status and how many tokens came (outputs queued behind
    the one read are merged into one message, so messages are not tokens)."""
    into["tokens"] = 0
    try:
        for response in call:
            into["tokens"] += sum(len(o.token_ids) for o in response.outputs)
        into["code"] = grpc.StatusCode.OK
    except grpc.RpcError as exc:
        into["code"], into["details"] = exc.code(), exc.details()
    into["ended"] = time.monotonic()


def wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def _first_health_answer(server) -> int:
    deadline = time.monotonic() + 60
    while True:
        try:
            return server.health()
        except grpc.RpcError:
            assert time.monotonic() < deadline and server.proc.poll() is None, server.log()
            time.sleep(0.05)


def test_health_is_not_serving_until_the_executor_has_shaken_hands(tmp_path):
    server = start_server(tmp_path, wait=False)
    try:
        assert _first_health_answer(server) == NOT_SERVING  # the executor takes seconds to load
        with pytest.raises(grpc.RpcError) as err:
            server.stub.Generate(CAPITAL, timeout=10)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE and "not ready" in err.value.details()
        assert server.stub.Tokenize(pb.TokenizeRequest(text="Hi"), timeout=10).token_ids  # needs no engine
        # vLLM's worker HealthCheck fails, so that SMG does not register the worker before it can describe it
        vllm_stub = vllm_engine_pb2_grpc.VllmEngineStub(server.channel)
        with pytest.raises(grpc.RpcError) as err:
            vllm_stub.HealthCheck(vllm.HealthCheckRequest(), timeout=10)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE and "not ready" in err.value.details()
        wait_serving(server, 180)
        assert server.health("nanoserve.v1.Generation") == SERVING
        assert vllm_stub.HealthCheck(vllm.HealthCheckRequest(), timeout=10).healthy
    finally:
        assert server.stop() == 0


def test_sigterm_drains_in_flight_requests_then_aborts_the_rest_and_exits_0(tmp_path):
    server = start_server(tmp_path, "--drain-grace-s", "10")
    short, long = {}, {}
    short_call = server.stub.GenerateStream(pb.GenerateRequest(prompt="Hi", sampling=pb.SamplingParams(
        max_tokens=3, ignore_eos=True)), timeout=120)
    long_call = server.stub.GenerateStream(long_request("long"), timeout=120)
    threads = [threading.Thread(target=consume, args=(c, d)) for c, d in ((short_call, short), (long_call, long))]
    for t in threads:
        t.start()
    wait_for(lambda: long.get("tokens", 0) > 0 or "code" in long, 60, "the first token")
    server.proc.send_signal(signal.SIGTERM)
    wait_for(lambda: server.health() == NOT_SERVING, 10, "NOT_SERVING")
    with pytest.raises(grpc.RpcError) as err:
        server.stub.Generate(CAPITAL, timeout=10)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    for t in threads:
        t.join(60)
    assert short["code"] == grpc.StatusCode.OK and short["tokens"] == 3
    assert long["code"] == grpc.StatusCode.UNAVAILABLE and "shutting down" in long["details"]
    assert server.proc.wait(60) == 0
    server.stop()


# ---------------------------------------------------------------- API key and mutual TLS


def _openssl(*args: str, cwd) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def make_certs(d) -> dict[str, str]:
    """A CA, a server certificate for 127.0.0.1 and a client certificate, all signed by the CA."""
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=test-ca",
             "-keyout", "ca.key", "-out", "ca.pem", cwd=d)
    for name in ("server", "client"):
        _openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={name}", "-keyout", f"{name}.key",
                 "-out", f"{name}.csr", cwd=d)
        (d / f"{name}.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
        _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
                 "-days", "2", "-extfile", f"{name}.ext", "-out", f"{name}.pem", cwd=d)
    return {n: str(d / n) for n in ("ca.pem", "server.pem", "server.key", "client.pem", "client.key")}


@pytest.fixture(scope="module")
def secure_server(tmp_path_factory):
    if shutil.which("openssl") is None:
        pytest.skip("openssl is needed to make test certificates")
    d = tmp_path_factory.mktemp("tls")
    certs = make_certs(d)

    def read(name):
        with open(certs[name], "rb") as f:
            return f.read()

    creds = grpc.ssl_channel_credentials(read("ca.pem"), read("client.key"), read("client.pem"))
    server = start_server(d, "--api-key", "s3cret", "--tls-cert", certs["server.pem"], "--tls-key",
                          certs["server.key"], "--tls-client-ca", certs["ca.pem"],
                          channel_factory=lambda addr: grpc.secure_channel(addr, creds))
    server.certs = certs
    yield server
    assert server.stop() == 0


def test_calls_without_the_api_key_are_unauthenticated_but_health_is_open(secure_server):
    for metadata in (None, [("authorization", "Bearer wrong")], [("authorization", "s3cret")]):
        with pytest.raises(grpc.RpcError) as err:
            secure_server.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10, metadata=metadata)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.RpcError) as err:
            list(secure_server.stub.GenerateStream(CAPITAL, timeout=10, metadata=metadata))
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert secure_server.health() == SERVING
    key = [("authorization", "Bearer s3cret")]
    out = secure_server.stub.Generate(CAPITAL, timeout=120, metadata=key).outputs[0]
    assert out.text == "The capital of France is Paris."


def test_tls_requires_a_client_certificate_signed_by_the_client_ca(secure_server):
    ca = open(secure_server.certs["ca.pem"], "rb").read()
    for creds in (None, grpc.ssl_channel_credentials(ca)):  # plaintext; TLS without a client certificate
        channel = grpc.secure_channel(secure_server.addr, creds) if creds else grpc.insecure_channel(secure_server.addr)
        with channel, pytest.raises(grpc.RpcError) as err:
            generation_pb2_grpc.GenerationStub(channel).GetStats(
                pb.GetStatsRequest(), timeout=5, metadata=[("authorization", "Bearer s3cret")])
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE


def test_the_client_command_speaks_tls_with_the_api_key(secure_server):
    certs = secure_server.certs
    tls = ["--addr", secure_server.addr, "--tls-ca", certs["ca.pem"], "--tls-cert", certs["client.pem"],
           "--tls-key", certs["client.key"]]

    def run(*args):
        return subprocess.run([sys.executable, "-m", "scheduler_svc.entrypoints.cli", "client", *args], capture_output=True,
                              text=True, timeout=120, cwd=REPO)

    health = run("health", *tls)
    assert health.returncode == 0 and health.stdout.strip() == "SERVING"
    chat = run("chat", "What is the capital of France?", "--max-tokens", "12", "--api-key", "s3cret", *tls)
    assert chat.returncode == 0 and "The capital of France is Paris." in chat.stdout
    denied = run("stats", *tls)
    assert denied.returncode == 1 and "UNAUTHENTICATED" in denied.stderr


# ---------------------------------------------------------------- a dead executor


def _children(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(p) for p in f.read().split()]


def _executor_pid(server_pid: int) -> int:
    for pid in _children(server_pid):
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            if b"executor_svc" in f.read():
                return pid
    raise AssertionError("no executor process")


def test_a_killed_executor_fails_streams_and_is_restarted_until_serving_again(tmp_path):
    server = start_server(tmp_path, "--executor-timeout-s", "2")
    try:
        stats0 = server.stub.GetStats(pb.GetStatsRequest(), timeout=10)
        streams = [({}, server.stub.GenerateStream(long_request(f"victim-{i}"), timeout=300)) for i in range(3)]
        threads = [threading.Thread(target=consume, args=(call, into)) for into, call in streams]
        for t in threads:
            t.start()
        wait_for(lambda: all(into.get("tokens", 0) > 0 for into, _ in streams), 120, "every stream to start")
        old_executor = _executor_pid(server.proc.pid)
        killed_at = time.monotonic()
        os.kill(old_executor, signal.SIGKILL)
        for t in threads:
            t.join(30)
        for into, _ in streams:
            assert into["code"] == grpc.StatusCode.UNAVAILABLE, into
            assert into["ended"] - killed_at < 5, "streams must fail within seconds"
        assert server.health() == NOT_SERVING
        assert server.health("nanoserve.v1.Generation") == NOT_SERVING
        with pytest.raises(grpc.RpcError) as err:
            server.stub.Generate(CAPITAL, timeout=10)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        wait_serving(server, 180)
        assert _executor_pid(server.proc.pid) != old_executor
        assert server.stub.Generate(CAPITAL, timeout=120).outputs[0].text == "The capital of France is Paris."
        stats = server.stub.GetStats(pb.GetStatsRequest(), timeout=10)
        assert stats.num_running == stats.num_waiting == 0 and stats.free_kv_blocks == stats.total_kv_blocks
        assert stats.total_kv_blocks == stats0.total_kv_blocks
    finally:
        assert server.stop() == 0
