"""Each role can die and come back without a hand restart of the others (the issue "Hardening").

The roles run as separate processes over TCP loopback, as compose runs them, or all under one
`nanoserve serve`. A killed role fails the streams it carried with UNAVAILABLE within
UNAVAILABLE_WITHIN_S; once it is back the system is SERVING again within SERVING_WITHIN_S and
answers with the same greedy tokens as before; a dead front end's requests are aborted by the
scheduler; and when everything is stopped no process of the test and no ipc dir is left.
The measured times are printed (pytest -s shows them).
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time

import grpc
import pytest

from protos import generation_pb2 as pb
from protos import generation_pb2_grpc
from support.grpc_server import REPO, RunningServer
from support.roles import (SERVING, Roles, alive, children_of, cmdline, health_status, listening_ports, start_serve,
                           wait_processes_gone, wait_serving)
from support.streams import ConcurrentStreams
from support.tiny_checkpoints import make_tiny_llama

CONTEXT = 4096  # long enough that no stream finishes while a role is down (about 90 tokens/s each here)
ENGINE_FLAGS = ["--device", "cpu", "--num-gpu-blocks", "2048", "--max-model-len", str(CONTEXT)]
NUM_STREAMS = 30
PROMPT = [1, 5, 9, 14, 20, 27]
UNAVAILABLE_WITHIN_S = 2.0  # the bound, measured from the kill to the last stream's error
CI_NOISE_S = 0.5  # allowed over it on two busy shared cores; every measured figure is printed
SERVING_WITHIN_S = 30.0  # the bound, measured from the role's restart
STARTUP_TIMEOUT_S = 240.0  # a first start loads torch and the model: slow on shared CPU cores
FRONTEND_TIMEOUT_S = 2.0  # the scheduler's --frontend-timeout-s where a test waits on it
HOUSEKEEPING_S = 0.5  # how often the scheduler looks for silent front ends (engine_core.HOUSEKEEPING_INTERVAL_S)


class TooSlowToFail(AssertionError):
    """Streams got UNAVAILABLE, but later than UNAVAILABLE_WITHIN_S."""


class NotServingAgain(AssertionError):
    """The system did not serve again after the role died."""


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    """A tiny llama with a long context, so that streams outlive a role's death."""
    return make_tiny_llama(str(tmp_path_factory.mktemp("recovery") / "llama"), max_position_embeddings=CONTEXT)


@pytest.fixture
def roles_factory(tmp_path, model):
    made: list[Roles] = []

    def make(**kwargs) -> Roles:
        roles = Roles(str(tmp_path), model, ENGINE_FLAGS, **kwargs)
        made.append(roles)
        return roles

    yield make
    for roles in made:
        roles.close()


def greedy(channel: grpc.Channel, max_tokens: int = 24) -> list[int]:
    response = generation_pb2_grpc.GenerationStub(channel).Generate(pb.GenerateRequest(
        prompt_token_ids=pb.TokenIds(ids=PROMPT), sampling=pb.SamplingParams(temperature=0, max_tokens=max_tokens,
                                                                             ignore_eos=True)), timeout=60)
    return list(response.outputs[0].token_ids)


def stats(channel: grpc.Channel) -> pb.Stats:
    return generation_pb2_grpc.GenerationStub(channel).GetStats(pb.GetStatsRequest(), timeout=10)


def time_to_unavailable(streams: ConcurrentStreams, killed_at: float, what: str) -> float:
    """Seconds from the kill to the last stream's end; every stream must end with UNAVAILABLE."""
    ends = streams.wait_all_ended(timeout=60)
    codes = {end.code for end in ends}
    assert codes == {grpc.StatusCode.UNAVAILABLE}, f"{what}: {[(e.code, e.details) for e in ends]}"
    return max(end.at for end in ends) - killed_at


def report(what: str, unavailable_s: float, serving_s: float | None) -> None:
    serving = f"{serving_s:.2f}s after it came back" if serving_s is not None else "never"
    print(f"\n[{what}] UNAVAILABLE {unavailable_s:.2f}s after the kill; SERVING again {serving}")


def kill_under_streams(channel: grpc.Channel, kill, what: str) -> tuple[float, float]:
    """Open NUM_STREAMS long streams, call kill() once all of them stream, and return (when it was killed,
    seconds from then to the last stream's UNAVAILABLE)."""
    streams = ConcurrentStreams(channel, NUM_STREAMS, PROMPT, max_tokens=CONTEXT - len(PROMPT))
    try:
        streams.wait_all_streaming(min_tokens=5, timeout=60)
        kill()
        killed_at = time.monotonic()
        return killed_at, time_to_unavailable(streams, killed_at, what)
    finally:
        streams.cancel()


def check_unavailable_in_time(what: str, unavailable_s: float) -> None:
    if unavailable_s > UNAVAILABLE_WITHIN_S + CI_NOISE_S:
        raise TooSlowToFail(f"{what}: the streams got UNAVAILABLE {unavailable_s:.2f}s after the kill, "
                            f"not within {UNAVAILABLE_WITHIN_S}s (+{CI_NOISE_S}s for CI noise)")


def stop_and_check_nothing_left(roles: Roles) -> None:
    codes = roles.stop()
    assert all(code == 0 for code in codes.values()), f"{codes}\n{roles.log_tails()}"
    assert wait_processes_gone(roles.needles) == [], "a role left a process behind"
    assert listening_ports(roles.ports) == set(), "a port is still bound"


# ---------------------------------------------------------------- separate roles over TCP


@pytest.mark.slow
def test_a_restarted_scheduler_serves_the_same_greedy_tokens_without_restarting_the_others(roles_factory):
    roles = roles_factory()
    roles.start()
    roles.wait_serving("frontend", STARTUP_TIMEOUT_S)
    channel = roles.channel("frontend")
    before = greedy(channel)
    others = {name: roles.roles[name].proc.pid for name in ("executor", "frontend")}

    roles.kill("scheduler")
    restarted_at = time.monotonic()
    roles.start("scheduler")  # at once, as a restart policy does: the front end learns of it by its epoch
    # SERVING may still be the old scheduler's word until the front end notices; a request is the proof.
    deadline = restarted_at + SERVING_WITHIN_S
    while True:
        roles.wait_serving("frontend", max(deadline - time.monotonic(), 0.1))
        try:
            after = greedy(channel)
            break
        except grpc.RpcError as exc:
            assert exc.code() == grpc.StatusCode.UNAVAILABLE and time.monotonic() < deadline, \
                f"{exc.code()}: {exc.details()}\n{roles.log_tails()}"
            time.sleep(0.2)
    print(f"\n[scheduler restarted at once] a request completed {time.monotonic() - restarted_at:.2f}s after")

    assert after == before
    assert health_status(channel) == SERVING
    assert {name: roles.roles[name].proc.pid for name in others} == others
    assert all(roles.roles[name].proc.poll() is None for name in others)
    stop_and_check_nothing_left(roles)


@pytest.mark.slow
def test_a_dead_frontends_requests_are_aborted_after_frontend_timeout(roles_factory):
    roles = roles_factory(frontends=("frontend-a", "frontend-b"),
                          scheduler_flags=["--frontend-timeout-s", str(FRONTEND_TIMEOUT_S)])
    roles.start()
    roles.wait_serving("frontend-a", STARTUP_TIMEOUT_S)
    roles.wait_serving("frontend-b", STARTUP_TIMEOUT_S)
    b = roles.channel("frontend-b")
    before = stats(b)
    streams = ConcurrentStreams(roles.channel("frontend-a"), 4, PROMPT, max_tokens=CONTEXT - len(PROMPT))
    streams.wait_all_streaming(min_tokens=10, timeout=60)
    assert stats(b).num_running == 4

    roles.kill("frontend-a")
    killed_at = time.monotonic()
    streams.wait_all_ended(timeout=30)
    bound = FRONTEND_TIMEOUT_S + HOUSEKEEPING_S + 2.0  # a margin for two busy cores
    while True:
        now = stats(b)
        elapsed = time.monotonic() - killed_at
        if now.num_running == 0 or elapsed > bound:
            break
        time.sleep(0.1)
    print(f"\n[front end A SIGKILLed] its requests were aborted {elapsed:.2f}s after")

    assert now.num_running == 0 and now.num_waiting == 0, f"still generating {elapsed:.1f}s after the kill: {now}"
    assert now.num_aborted == before.num_aborted + 4
    assert now.num_finished == before.num_finished  # aborted, not run to their end
    assert now.free_kv_blocks == now.total_kv_blocks
    assert greedy(b)  # the other front end serves on
    stop_and_check_nothing_left(roles)


@pytest.mark.slow
@pytest.mark.parametrize("role", [
    "executor",
    "scheduler",
    "frontend",
])
def test_a_killed_role_fails_its_streams_fast_and_the_system_serves_again_once_it_is_back(roles_factory, role):
    roles = roles_factory()
    roles.start()
    roles.wait_serving("frontend", STARTUP_TIMEOUT_S)
    channel = roles.channel("frontend")
    before = greedy(channel)
    others = {name: roles.roles[name].proc.pid for name in roles.roles if name != role}
    _, unavailable_s = kill_under_streams(channel, lambda: roles.kill(role), f"{role} killed")

    roles.start(role)
    serving_s = roles.wait_serving("frontend", SERVING_WITHIN_S)
    report(f"{role} killed, separate roles", unavailable_s, serving_s)
    assert greedy(channel) == before
    assert {name: roles.roles[name].proc.pid for name in others} == others, "another role was restarted"
    stop_and_check_nothing_left(roles)
    check_unavailable_in_time(f"{role} killed", unavailable_s)


# ---------------------------------------------------------------- every role under one `nanoserve serve`


@pytest.fixture
def serve_tmpdir():
    """serve's TMPDIR, where it makes its ipc dir: private, and short enough for ipc:// paths."""
    path = tempfile.mkdtemp(prefix="ns-")
    yield path
    shutil.rmtree(path, ignore_errors=True)


def ipc_dirs(parent: str) -> list[str]:
    return [name for name in os.listdir(parent) if name.startswith("nanoserve-")]


def serve_child(server: RunningServer, module: str) -> int:
    """The pid of serve's child that runs `python -m module`."""
    (pid,) = [p for p in children_of(server.proc.pid) if f"-m {module} " in cmdline(p)]
    return pid


def serve_child_or_none(server: RunningServer, module: str) -> int | None:
    try:
        return serve_child(server, module)
    except ValueError:  # none (or, briefly, two)
        return None


def start_serving(tmp_path, model: str, tmpdir: str) -> RunningServer:
    server = start_serve(str(tmp_path), model, *ENGINE_FLAGS, env={"TMPDIR": tmpdir})
    try:
        wait_serving(server.channel, {"serve": server.proc}, {"serve": server.log_path}, STARTUP_TIMEOUT_S)
    except BaseException:
        server.stop()
        raise
    return server


def stop_serve_and_check_nothing_left(server: RunningServer, tmpdir: str) -> None:
    children = children_of(server.proc.pid)
    code = server.stop()
    assert code == 0, server.log()[-3000:]
    assert wait_processes_gone([tmpdir, f"--port {server.port} "]) == [], "serve left a process behind"
    assert [pid for pid in children if alive(pid)] == [], "a child of serve outlived it"
    assert ipc_dirs(tmpdir) == [], "serve left its ipc dir"


@pytest.mark.slow
def test_serve_restarts_a_killed_executor_and_its_streams_fail_fast(tmp_path, model, serve_tmpdir):
    server = start_serving(tmp_path, model, serve_tmpdir)
    try:
        before = greedy(server.channel)
        executor = serve_child(server, "executor_svc")
        killed_at, unavailable_s = kill_under_streams(
            server.channel, lambda: os.kill(executor, signal.SIGKILL), "serve's executor killed")
        deadline = killed_at + STARTUP_TIMEOUT_S
        while serve_child_or_none(server, "executor_svc") in (None, executor) and time.monotonic() < deadline:
            assert server.proc.poll() is None, server.log()[-3000:]
            time.sleep(0.1)
        back_at = time.monotonic()
        serving_s = wait_serving(server.channel, {"serve": server.proc}, {"serve": server.log_path}, SERVING_WITHIN_S)
        print(f"\n[serve's executor killed] serve started a new one {back_at - killed_at:.2f}s after the kill")
        report("serve's executor killed", unavailable_s, serving_s)
        assert greedy(server.channel) == before
        stop_serve_and_check_nothing_left(server, serve_tmpdir)
        check_unavailable_in_time("serve's executor killed", unavailable_s)
    finally:
        server.stop()


@pytest.mark.slow
def test_serve_restarts_a_killed_scheduler_and_its_streams_fail_fast(tmp_path, model, serve_tmpdir):
    server = start_serving(tmp_path, model, serve_tmpdir)
    try:
        scheduler = serve_child(server, "scheduler_svc.core.scheduler_process")
        killed_at, unavailable_s = kill_under_streams(
            server.channel, lambda: os.kill(scheduler, signal.SIGKILL), "serve's scheduler killed")
        deadline = killed_at + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline and server.proc.poll() is None and health_status(server.channel) != SERVING:
            time.sleep(0.1)
        report("serve's scheduler killed", unavailable_s, None)
        check_unavailable_in_time("serve's scheduler killed", unavailable_s)
        if server.proc.poll() is not None:
            code = server.proc.returncode
            assert wait_processes_gone([serve_tmpdir, f"--port {server.port} "]) == [], "serve left a process behind"
            assert ipc_dirs(serve_tmpdir) == [], "serve left its ipc dir"
            raise NotServingAgain(f"serve exited with code {code} after its scheduler was killed:\n"
                                  f"{server.log()[-1500:]}")
        assert health_status(server.channel) == SERVING, "serve neither exited nor served again"
        stop_serve_and_check_nothing_left(server, serve_tmpdir)
    finally:
        server.stop()


# serve's supervisor restarts a dead executor from the front end's process, where gRPC threads run.
SPAWN_UNDER_GRPC = textwrap.dedent("""
    import asyncio, json, subprocess, sys, threading
    import grpc
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc
    from scheduler_svc.common.config import EngineConfig
    from scheduler_svc.entrypoints.launcher import EngineProcesses

    def health_checks(port, done):  # clients of the server, as serve has
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            while not done.is_set():
                try:
                    stub.Check(health_pb2.HealthCheckRequest(), timeout=2)
                except grpc.RpcError:
                    pass

    async def main(restarts):
        server = grpc.aio.server()
        health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        done = threading.Event()
        threading.Thread(target=health_checks, args=(port, done), daemon=True).start()
        exited = subprocess.Popen(["true"])
        exited.wait()
        procs = EngineProcesses("", "", scheduler=exited, executors=[exited], config=EngineConfig(),
                                executor_argvs=[["true"]])  # an "executor" that exits 0 at once
        codes = []
        for _ in range(restarts):
            procs.restart_dead_executors()
            while procs.executors[0].poll() is None:
                await asyncio.sleep(0.002)
            codes.append(procs.executors[0].returncode)
        done.set()
        await server.stop(0)
        print(json.dumps(codes))

    asyncio.run(main(int(sys.argv[1])))
""")


def test_a_process_serving_grpc_starts_every_new_executor_it_spawns():
    child = subprocess.run([sys.executable, "-c", SPAWN_UNDER_GRPC, "300"], cwd=REPO, capture_output=True, text=True,
                           timeout=120)
    assert child.returncode == 0, child.stderr[-3000:]
    codes = json.loads(child.stdout.strip().splitlines()[-1])
    crashed = [code for code in codes if code != 0]
    assert crashed == [], f"{len(crashed)} of {len(codes)} restarted executors died before exec: {crashed}"
