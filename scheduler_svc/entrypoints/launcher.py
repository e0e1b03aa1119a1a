"""Start the scheduler and executor processes of one machine, and make sure none outlives us."""
from __future__ import annotations

import atexit
import fcntl
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import weakref
from dataclasses import dataclass, field

from scheduler_svc.common.config import EngineConfig

log = logging.getLogger("nanoserve.launcher")

IPC_DIR_PREFIX = "nanoserve-"
# Inside each ipc dir: the owner's pid, and an flock the owner holds while it lives. The kernel
# drops the lock when the owner dies, SIGKILL included; a pid alone could be reused, or belong to
# another pid namespace sharing this /tmp.
OWNER_LOCK = "owner.lock"
# NVLink multicast (NVLS, symmetric-memory multicast) stays off in tensor-parallel groups: the lent
# multi-GPU machines do not support it (shared/gpu/README.md).
NVLINK_MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


@dataclass(eq=False)
class IpcDir:
    """A private directory for one engine's ipc:// sockets, locked by the process that made it."""
    path: str
    lock_fd: int

    def cleanup(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)
        os.close(self.lock_fd)


def make_ipc_dir(parent: str | None = None) -> IpcDir:
    """A new ipc dir under parent (the temp dir by default), named and locked for this process."""
    path = tempfile.mkdtemp(prefix=f"{IPC_DIR_PREFIX}{os.getpid()}-", dir=parent)
    unnamed = os.path.join(path, OWNER_LOCK + ".new")
    fd = os.open(unnamed, os.O_CREAT | os.O_WRONLY, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)
    os.write(fd, f"{os.getpid()}\n".encode())
    os.rename(unnamed, os.path.join(path, OWNER_LOCK))  # only ever seen locked, so no sweep takes it for stale
    return IpcDir(path, fd)


def remove_stale_ipc_dirs(parent: str | None = None) -> list[str]:
    """Remove the ipc dirs under parent whose owner is gone (a SIGKILLed launcher cannot clean up);
    returns their paths. A dir without an owner lock is not one we can judge, and stays."""
    parent = parent or tempfile.gettempdir()
    removed = []
    for name in os.listdir(parent):
        path = os.path.join(parent, name)
        if not name.startswith(IPC_DIR_PREFIX):
            continue
        try:
            fd = os.open(os.path.join(path, OWNER_LOCK), os.O_RDONLY)
        except OSError:  # not a dir, no lock file, not ours to read
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # held: the owner lives
            continue
        else:
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
        finally:
            os.close(fd)
    return removed


@dataclass(eq=False)
class EngineProcesses:
    frontend_addr: str
    executor_addr: str
    scheduler: subprocess.Popen
    executors: list[subprocess.Popen]
    config: EngineConfig
    ipc_dir: IpcDir | None = None
    executor_argvs: list[list[str]] = field(default_factory=list)  # to restart a rank with the same flags
    scheduler_argv: list[str] = field(default_factory=list)  # to restart the scheduler with the same flags
    env: dict | None = None
    log_path: str | None = None
    frontends: list[subprocess.Popen] = field(default_factory=list)  # serve's front ends beyond its own
    frontend_argvs: list[list[str]] = field(default_factory=list)
    frontend_env: dict | None = None
    _closed: bool = field(default=False, repr=False)

    def all(self) -> list[subprocess.Popen]:
        return [self.scheduler, *self.executors]

    def dead(self) -> list[tuple[str, int]]:
        """(name, exit code) of every child that has exited."""
        names = ["scheduler"] + [f"executor rank {r}" for r in range(len(self.executors))]
        return [(n, p.returncode) for n, p in zip(names, self.all()) if p.poll() is not None]

    def restart_dead_executors(self) -> list[int]:
        """Start again every executor that exited, with the same flags; returns the restarted ranks.

        With tensor parallelism the whole group restarts: a survivor is stuck in the old group's
        collectives. Call it once the scheduler has declared the engine lost, so that it takes the
        new handshakes as a fresh engine.
        """
        dead = [rank for rank, proc in enumerate(self.executors) if proc.poll() is not None]
        if not dead or self._closed:
            return []
        ranks = dead
        if len(self.executors) > 1:
            ranks = list(range(len(self.executors)))
            for proc in self.executors:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
            dist_addr = f"127.0.0.1:{_free_port()}"
            for argv in self.executor_argvs:
                argv[argv.index("--dist-init-addr") + 1] = dist_addr
        for rank in ranks:
            self.executors[rank] = self._spawn_logged(self.executor_argvs[rank], self.env or dict(os.environ))
        return ranks

    def start_frontends(self, argvs: list[list[str]], env: dict) -> None:
        """Start more front ends on this engine (`serve --frontend-procs`); each argv is one's."""
        self.frontend_argvs, self.frontend_env = argvs, env
        self.frontends = [self._spawn_logged(argv, env) for argv in argvs]

    def restart_dead_frontends(self) -> list[int]:
        """Start again every extra front end that exited; returns their indexes (1-based, serve's own is 0)."""
        dead = [i for i, proc in enumerate(self.frontends) if proc.poll() is not None]
        if self._closed:
            return []
        for i in dead:
            self.frontends[i] = self._spawn_logged(self.frontend_argvs[i], self.frontend_env)
        return [i + 1 for i in dead]

    def _spawn_logged(self, argv: list[str], env: dict) -> subprocess.Popen:
        """One role started, its output appended to the engine's log (when it has one)."""
        stdout = open(self.log_path, "ab") if self.log_path else None
        try:
            return _spawn(argv, stdout, env)
        finally:
            if stdout:
                stdout.close()

    def restart_scheduler(self) -> bool:
        """Start the scheduler again if it exited. The executors that live on shake hands with it when it
        asks (their heartbeats reach a scheduler that does not know them)."""
        if self._closed or self.scheduler.poll() is None:
            return False
        self.scheduler = self._spawn_logged(self.scheduler_argv, self.env or dict(os.environ))
        return True

    def shutdown(self, timeout: float = 10.0) -> None:
        """SIGTERM the scheduler (it tells executors to exit), then make sure everyone is gone."""
        if self._closed:
            return
        self._closed = True
        for proc in self.frontends:  # first, so that they drain while the engine still runs
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.frontends:
            try:
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if self.scheduler.poll() is None:
            self.scheduler.send_signal(signal.SIGTERM)
        for proc in self.all():
            try:
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                proc.terminate()
        for proc in self.all():
            try:
                proc.wait(timeout=2)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if self.ipc_dir is not None:
            self.ipc_dir.cleanup()


_live: "weakref.WeakSet[EngineProcesses]" = weakref.WeakSet()


@atexit.register
def _shutdown_all() -> None:
    for procs in list(_live):
        procs.shutdown(timeout=5)


def _spawn(argv: list[str], stdout, env: dict) -> subprocess.Popen:
    # No preexec_fn: running Python between fork and exec in a process whose gRPC threads are busy (serve
    # restarting an executor) crashed about one child in ten. The child arms PR_SET_PDEATHSIG itself
    # (--watch-parent PID), and exits at once if PID is gone by then; its watcher thread backs that up.
    return subprocess.Popen(argv, stdout=stdout, stderr=subprocess.STDOUT if stdout else None, env=env)


def launch_engine(config: EngineConfig, log_path: str | None = None, dist_port: int | None = None) -> EngineProcesses:
    """Start one scheduler and tensor_parallel_size executors, linked over ipc:// sockets."""
    try:
        for path in remove_stale_ipc_dirs():
            log.info("removed %s, left by a launcher that is gone", path)
    except OSError as exc:
        log.warning("could not look for stale ipc dirs: %s", exc)
    ipc_dir = make_ipc_dir()
    frontend_addr = f"ipc://{ipc_dir.path}/frontend.sock"
    executor_addr = f"ipc://{ipc_dir.path}/executor.sock"
    env = dict(os.environ)
    env.setdefault("PYTHONUNBUFFERED", "1")
    for name, value in NVLINK_MULTICAST_OFF.items():  # the executors' NCCL groups, unless the user says otherwise
        env.setdefault(name, value)
    stdout = open(log_path, "ab") if log_path else None
    flags = config.to_argv()
    watch = ["--watch-parent", str(os.getpid())]  # named, so a child that outlives us while it starts still knows
    scheduler_argv = [sys.executable, "-m", "scheduler_svc.core.scheduler_process", *watch,
                      "--frontend-addr", frontend_addr, "--executor-addr", executor_addr, *flags]
    scheduler = _spawn(scheduler_argv, stdout, env)
    dist_addr = f"127.0.0.1:{dist_port or _free_port()}"
    executor_argvs = [
        [sys.executable, "-m", "executor_svc", *watch, "--rank", str(rank),
         "--world-size", str(config.tensor_parallel_size), "--scheduler-addr", executor_addr,
         "--dist-init-addr", dist_addr, *flags]
        for rank in range(config.tensor_parallel_size)
    ]
    executors = [_spawn(argv, stdout, env) for argv in executor_argvs]
    if stdout:
        stdout.close()
    procs = EngineProcesses(frontend_addr, executor_addr, scheduler, executors, config, ipc_dir,
                            executor_argvs=executor_argvs, scheduler_argv=scheduler_argv, env=env, log_path=log_path)
    _live.add(procs)
    return procs


def frontend_argv(procs: EngineProcesses, server_flags: list[str]) -> list[str]:
    """`nanoserve frontend` on this engine's scheduler, dying with us."""
    return [sys.executable, "-m", "scheduler_svc.entrypoints.cli", "frontend", "--watch-parent", str(os.getpid()),
            "--scheduler-addr", procs.frontend_addr, *server_flags]


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
