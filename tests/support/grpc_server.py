"""Start `nanoserve serve` as a real process (frontend + scheduler + executor on the CPU) for tests."""
from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from protos import generation_pb2_grpc
from scheduler_svc.common.model_paths import default_model_dir

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# Small engine: a 512-token context keeps "prompt too long" cheap; 1024 blocks hold 200 short streams.
ENGINE_FLAGS = ["--device", "cpu", "--num-gpu-blocks", "1024", "--max-model-len", "512"]


def smol_dir() -> str:
    path = default_model_dir()
    if not os.path.exists(os.path.join(path, "config.json")):
        raise RuntimeError(f"embedded model missing at {path}: run `make model`")
    return path


_handed_out: set[int] = set()
_pick = random.Random()  # seeded from the OS: concurrent test processes pick apart


def _ephemeral_range() -> tuple[int, int]:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = map(int, f.read().split())
            return low, high
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def free_port() -> int:
    """A loopback port nothing listens on, below the kernel's ephemeral range and never handed out before in this
    process. A port bound to 0 comes from that range, where any outgoing connection may take it as its source port
    before the role it was meant for binds it (a scheduler's ZMQ bind failed so with EADDRINUSE); below the range
    only a listener can hold it."""
    low, _ = _ephemeral_range()
    floor = max(10000, low - 8192)  # clear of the well-known and registered services most hosts run
    if low - floor >= 1024:
        for _ in range(200):
            port = _pick.randrange(floor, low)
            if port in _handed_out:
                continue
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", port))
                except OSError:
                    continue
            _handed_out.add(port)
            return port
    with socket.socket() as s:  # a host whose ephemeral range leaves no room below it
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class RunningServer:
    proc: subprocess.Popen
    port: int
    log_path: str
    channel: grpc.Channel

    @property
    def addr(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def stub(self) -> generation_pb2_grpc.GenerationStub:
        return generation_pb2_grpc.GenerationStub(self.channel)

    def health(self, service: str = "", metadata=None) -> int:
        return health_pb2_grpc.HealthStub(self.channel).Check(
            health_pb2.HealthCheckRequest(service=service), timeout=5, metadata=metadata).status

    def log(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def stop(self, timeout: float = 60.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.channel.close()
        return self.proc.returncode


def wait_for(condition, timeout: float, what: str):
    """condition()'s first true value, polled every 0.2 s; AssertionError naming what after timeout seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def wait_serving(server: RunningServer, timeout: float, metadata=None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.proc.poll() is not None:
            raise RuntimeError(f"server exited with {server.proc.returncode}:\n{server.log()[-4000:]}")
        try:
            if server.health(metadata=metadata) == health_pb2.HealthCheckResponse.SERVING:
                return
        except grpc.RpcError:
            pass
        time.sleep(0.25)
    raise RuntimeError(f"server not SERVING after {timeout:.0f}s:\n{server.log()[-4000:]}")


def start_server(log_dir, *flags: str, channel_factory=None, startup_timeout: float = 180.0,
                 wait: bool = True) -> RunningServer:
    """`nanoserve serve` on a free port with the embedded model; waits for SERVING unless wait=False."""
    port = free_port()
    log_path = os.path.join(str(log_dir), f"serve-{port}.log")
    argv = [sys.executable, "-m", "scheduler_svc.entrypoints.cli", "serve", "--model", smol_dir(), "--port", str(port),
            *ENGINE_FLAGS, *flags]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(argv, cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})
    addr = f"127.0.0.1:{port}"
    channel = channel_factory(addr) if channel_factory else grpc.insecure_channel(addr)
    server = RunningServer(proc, port, log_path, channel)
    if wait:
        try:
            wait_serving(server, startup_timeout)
        except BaseException:
            server.stop()
            raise
    return server
