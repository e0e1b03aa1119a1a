"""The ipc:// socket directory of an engine whose launcher died without cleaning up (SIGKILL) is
removed when the next engine starts; a directory whose owner still runs is never touched."""
from __future__ import annotations

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
from grpc_health.v1 import health_pb2, health_pb2_grpc

from support.grpc_server import REPO, free_port
from support.tiny_checkpoints import tiny_checkpoint

OWNER = textwrap.dedent("""
    import sys, time
    sys.path.insert(0, {repo!r})
    from scheduler_svc.entrypoints.launcher import make_ipc_dir
    print(make_ipc_dir({parent!r}).path, flush=True)
    time.sleep(120)
""")


@pytest.fixture
def parent():
    """A private temp directory, short enough for ipc:// socket paths (108 bytes at most)."""
    path = tempfile.mkdtemp(prefix="ns-")
    yield path
    shutil.rmtree(path, ignore_errors=True)


def ipc_dirs(parent: str) -> set[str]:
    return {os.path.join(parent, n) for n in os.listdir(parent) if n.startswith("nanoserve-")
            and os.path.isdir(os.path.join(parent, n))}


def start_owner(parent: str) -> tuple[subprocess.Popen, str]:
    """Another process that made an ipc directory and keeps running."""
    proc = subprocess.Popen([sys.executable, "-c", OWNER.format(repo=REPO, parent=parent)], stdout=subprocess.PIPE,
                            text=True, cwd=REPO)
    return proc, proc.stdout.readline().strip()


def dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def test_a_dead_owners_ipc_dir_is_removed_and_a_live_owners_is_kept(parent):
    from scheduler_svc.entrypoints.launcher import make_ipc_dir, remove_stale_ipc_dirs

    ours = make_ipc_dir(parent)  # this process lives
    owner, theirs = start_owner(parent)  # so does that one, for now
    killed, gone = start_owner(parent)
    killed.kill()
    killed.wait()
    fake = os.path.join(parent, f"nanoserve-{dead_pid()}-fake")  # as a SIGKILLed launcher leaves it
    os.makedirs(fake)
    open(os.path.join(fake, "owner.lock"), "w").close()
    unowned = os.path.join(parent, "nanoserve-no-owner-file")  # not one of ours to judge: kept
    os.makedirs(unowned)
    bench_log = os.path.join(parent, "nanoserve-bench-1.log")
    open(bench_log, "w").close()
    try:
        assert sorted(remove_stale_ipc_dirs(parent)) == sorted([gone, fake])
        assert ipc_dirs(parent) == {ours.path, theirs, unowned} and os.path.exists(bench_log)
        owner.kill()
        owner.wait()
        assert remove_stale_ipc_dirs(parent) == [theirs]
    finally:
        owner.kill()
        ours.cleanup()
    assert ipc_dirs(parent) == {unowned}


def test_an_ipc_dir_is_named_for_its_owner_and_cleanup_removes_it(parent):
    from scheduler_svc.entrypoints.launcher import make_ipc_dir

    ipc = make_ipc_dir(parent)
    assert os.path.basename(ipc.path).startswith(f"nanoserve-{os.getpid()}-")
    with open(os.path.join(ipc.path, "owner.lock")) as f:
        assert f.read().split() == [str(os.getpid())]
    ipc.cleanup()
    assert ipc_dirs(parent) == set()


def wait_for(condition, timeout: float, what: str, proc: subprocess.Popen, log_path: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if proc.poll() is not None or time.monotonic() > deadline:
            with open(log_path, errors="replace") as f:
                raise AssertionError(f"{what}; serve exit {proc.poll()}:\n{f.read()[-3000:]}")
        time.sleep(0.1)


def serving(port: int) -> bool:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        try:
            return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=2).status == \
                health_pb2.HealthCheckResponse.SERVING
        except grpc.RpcError:
            return False


@pytest.mark.slow
def test_serve_started_after_a_sigkilled_serve_removes_its_ipc_dir(parent, tmp_path_factory):
    model = tiny_checkpoint("llama", tmp_path_factory)
    env = {**os.environ, "TMPDIR": parent, "PYTHONUNBUFFERED": "1"}
    log_path = os.path.join(parent, "serve.log")

    def serve(port: int) -> subprocess.Popen:
        with open(log_path, "ab") as log:
            return subprocess.Popen([sys.executable, "-m", "scheduler_svc.entrypoints.cli", "serve", "--model", model,
                                     "--device", "cpu", "--port", str(port)], cwd=REPO, env=env, stdout=log,
                                    stderr=subprocess.STDOUT)

    first = serve(free_port())
    wait_for(lambda: len(ipc_dirs(parent)) == 1, 60, "the first serve made no ipc dir", first, log_path)
    (left_behind,) = ipc_dirs(parent)
    first.send_signal(signal.SIGKILL)
    first.wait()
    assert ipc_dirs(parent) == {left_behind}

    port = free_port()
    second = serve(port)
    try:
        wait_for(lambda: left_behind not in ipc_dirs(parent), 60, "the stale ipc dir stayed", second, log_path)
        wait_for(lambda: serving(port), 180, "the second serve never served", second, log_path)
        assert len(ipc_dirs(parent)) == 1  # its own
        second.send_signal(signal.SIGTERM)
        assert second.wait(timeout=60) == 0
    finally:
        second.kill()
    assert ipc_dirs(parent) == set()
