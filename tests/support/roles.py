"""The roles of a deployment as separate OS processes over TCP loopback, as compose runs them:
`nanoserve scheduler`, `nanoserve executor` and one or more `nanoserve frontend`, each startable,
killable and restartable with the same flags. Also `nanoserve serve` (every role under one command),
and the /proc scan that tells whether any of them is left behind."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from scheduler_svc.entrypoints.probe import LISTEN, tcp_sockets
from support.grpc_server import REPO, RunningServer, free_port

CLI = [sys.executable, "-m", "scheduler_svc.entrypoints.cli"]
SERVING = health_pb2.HealthCheckResponse.SERVING


def alive(pid: int) -> bool:
    """The process exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def cmdline(pid: int) -> str:
    """The process's command line, arguments joined by spaces; "" once it is gone."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def processes_mentioning(needles: list[str]) -> list[int]:
    """Live processes whose command line holds one of needles (a test's unique ports or paths)."""
    pids = [int(e) for e in os.listdir("/proc") if e.isdigit() and int(e) != os.getpid()]
    return [pid for pid in pids if any(n in cmdline(pid) for n in needles) and alive(pid)]


def listening_ports(ports: list[int]) -> set[int]:
    """Those of ports that some socket on this host listens on (TCP over IPv4 or IPv6)."""
    return {local for local, _, state in tcp_sockets() if state == LISTEN and local in ports}


def wait_processes_gone(needles: list[str], timeout: float = 10.0) -> list[int]:
    """The processes still mentioning needles after up to timeout seconds."""
    deadline = time.monotonic() + timeout
    while processes_mentioning(needles) and time.monotonic() < deadline:
        time.sleep(0.1)
    return processes_mentioning(needles)


def tail(path: str, chars: int = 3000) -> str:
    with open(path, errors="replace") as f:
        return f.read()[-chars:]


def health_status(channel: grpc.Channel) -> int | None:
    """The server's health status, or None when it does not answer."""
    try:
        return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=2).status
    except grpc.RpcError:
        return None


def wait_serving(channel: grpc.Channel, procs: dict[str, subprocess.Popen], logs: dict[str, str],
                 timeout: float) -> float:
    """Wait until health says SERVING; returns the seconds waited. Fails at once if a process exits."""
    t0 = time.monotonic()
    while time.monotonic() < t0 + timeout:
        for role, proc in procs.items():
            if proc.poll() is not None:
                raise AssertionError(f"{role} exited with {proc.returncode}:\n{tail(logs[role])}")
        if health_status(channel) == SERVING:
            return time.monotonic() - t0
        time.sleep(0.1)
    raise AssertionError(f"not SERVING after {timeout:.0f}s:\n" +
                         "\n".join(f"--- {r}\n{tail(p)}" for r, p in logs.items()))


@dataclass
class RoleProcess:
    """One role's command line; each start appends to the same log."""
    argv: list[str]
    log_path: str
    proc: subprocess.Popen | None = None

    def start(self) -> None:
        assert self.proc is None or self.proc.poll() is not None, "already running"
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(self.argv, cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                                         env={**os.environ, "PYTHONUNBUFFERED": "1"})

    def kill(self, sig: int = signal.SIGKILL, timeout: float = 60.0) -> int:
        self.proc.send_signal(sig)
        return self.proc.wait(timeout)


@dataclass
class Roles:
    """A scheduler, executor rank 0 of 1 and the named front ends, on free loopback ports. The scheduler
    and the executor get the same engine flags; scheduler_flags are the scheduler's alone."""
    log_dir: str
    model: str
    engine_flags: list[str]
    scheduler_flags: list[str] = field(default_factory=list)
    frontends: tuple[str, ...] = ("frontend",)

    def __post_init__(self) -> None:
        self.frontend_zmq = f"tcp://127.0.0.1:{free_port()}"
        self.executor_zmq = f"tcp://127.0.0.1:{free_port()}"
        self.grpc_ports = {name: free_port() for name in self.frontends}
        engine = ["--model", self.model, *self.engine_flags]
        argvs = {
            "scheduler": ["scheduler", "--frontend-addr", self.frontend_zmq, "--executor-addr", self.executor_zmq,
                          *engine, *self.scheduler_flags],
            "executor": ["executor", "--rank", "0", "--world-size", "1", "--scheduler-addr", self.executor_zmq,
                         "--dist-init-addr", f"127.0.0.1:{free_port()}", *engine],
        }
        for name, port in self.grpc_ports.items():
            argvs[name] = ["frontend", "--scheduler-addr", self.frontend_zmq, "--host", "127.0.0.1",
                           "--port", str(port), "--model", self.model]
        self.roles = {name: RoleProcess([*CLI, *argv], os.path.join(self.log_dir, f"{name}.log"))
                      for name, argv in argvs.items()}
        self.channels: dict[str, grpc.Channel] = {}

    def start(self, *names: str) -> None:
        for name in names or self.roles:
            self.roles[name].start()

    def kill(self, name: str, sig: int = signal.SIGKILL) -> int:
        return self.roles[name].kill(sig)

    def channel(self, frontend: str) -> grpc.Channel:
        if frontend not in self.channels:
            self.channels[frontend] = grpc.insecure_channel(f"127.0.0.1:{self.grpc_ports[frontend]}")
        return self.channels[frontend]

    def wait_serving(self, frontend: str, timeout: float) -> float:
        """Seconds until `frontend` says SERVING; fails at once if a running role exits."""
        procs = {n: r.proc for n, r in self.roles.items() if r.proc is not None}
        return wait_serving(self.channel(frontend), procs, self.logs(), timeout)

    def logs(self) -> dict[str, str]:
        return {name: role.log_path for name, role in self.roles.items()}

    def log_tails(self) -> str:
        return "\n".join(f"--- {name}\n{tail(path)}" for name, path in self.logs().items())

    @property
    def ports(self) -> list[int]:
        """The TCP ports the roles listen on: the scheduler's two, and each front end's gRPC port."""
        zmq_ports = [int(addr.rsplit(":", 1)[1]) for addr in (self.frontend_zmq, self.executor_zmq)]
        return [*zmq_ports, *self.grpc_ports.values()]

    @property
    def needles(self) -> list[str]:
        """What every role's command line, and nothing else's, mentions: its unique ports (each followed by the
        space that ends an argument in cmdline(), so port 4555 does not match 45551)."""
        return [f"{self.frontend_zmq} ", f"{self.executor_zmq} ", *(f"--port {p} " for p in self.grpc_ports.values())]

    def stop(self, timeout: float = 60.0) -> dict[str, int]:
        """SIGTERM every role, front ends first; their exit codes."""
        running = {n: r.proc for n, r in self.roles.items() if r.proc is not None and r.proc.poll() is None}
        for name in [*self.frontends, "executor", "scheduler"]:
            if name in running:
                running[name].send_signal(signal.SIGTERM)
        return {name: proc.wait(timeout) for name, proc in running.items()}

    def close(self) -> None:
        """Kill whatever still runs (a failed test's leftovers)."""
        for channel in self.channels.values():
            channel.close()
        for role in self.roles.values():
            if role.proc is not None and role.proc.poll() is None:
                role.proc.kill()
                role.proc.wait()


def start_serve(log_dir: str, model: str, *flags: str, env: dict | None = None) -> RunningServer:
    """`nanoserve serve` on a free port (not waited for: see grpc_server.wait_serving)."""
    port = free_port()
    log_path = os.path.join(log_dir, f"serve-{port}.log")
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([*CLI, "serve", "--model", model, "--port", str(port), *flags], cwd=REPO,
                                stdout=log, stderr=subprocess.STDOUT,
                                env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})
    return RunningServer(proc, port, log_path, grpc.insecure_channel(f"127.0.0.1:{port}"))


def children_of(pid: int) -> list[int]:
    """The live child processes of pid, from /proc."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        if ppid == pid and alive(int(entry)):
            found.append(int(entry))
    return found
