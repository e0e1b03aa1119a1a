"""Where a serving wave's time goes, seen from outside the server: counters before and after.

Three hops carry a token: executor -> scheduler (one result per step), scheduler -> front end (one
StepOutputs per step, with a RequestOutput for each request that has news) and front end -> client
(one GenerateResponse per RequestOutput, counted by the clients). The scheduler's counters come
over its front-end socket (the full SchedulerStats: executor busy and idle time, step seconds),
which a server this bench launched has in its private ipc dir; else over gRPC GetStats (steps and
tokens only). CPU time per role (front end, scheduler, executor ranks) is read from /proc.

The executor counts as idle the time from its last reply to its next plan, so the first step of a
wave carries the whole gap since the previous wave: the executor figures therefore run from a
snapshot taken just after the wave's first step (FirstStepWatch) to the end.
"""
from __future__ import annotations

import glob
import os
import tempfile
import threading
from dataclasses import dataclass, field

import grpc

from protos import generation_pb2 as pb
from protos import generation_pb2_grpc
from scheduler_svc.entrypoints.engine_client import EngineClient
from scheduler_svc.entrypoints.launcher import IPC_DIR_PREFIX

COUNTERS = ("num_steps", "num_generated_tokens", "num_prefill_tokens", "num_preemptions", "prefill_step_seconds",
            "decode_step_seconds", "executor_busy_seconds", "executor_idle_seconds", "prefix_cache_query_tokens",
            "prefix_cache_hit_tokens")
# the scheduler's module now, and up to a22f1ae (2026-11-30, bench/serving.py --server-tree)
SCHEDULER_MODULES = {b"scheduler_svc.core.scheduler_process", b"scheduler_svc.scheduler_process"}


@dataclass
class Snapshot:
    counters: dict[str, float]  # of COUNTERS, those the source has
    cpu_s: dict[str, float] = field(default_factory=dict)  # role -> CPU seconds so far


def scheduler_socket(server_pid: int) -> str | None:
    """The scheduler's front-end socket of a `nanoserve serve` process: launcher.make_ipc_dir's layout, else
    the --frontend-addr of the scheduler it started (a tree before fdd2e3b, 2026-12-01, named its ipc dir without a pid)."""
    paths = glob.glob(os.path.join(tempfile.gettempdir(), f"{IPC_DIR_PREFIX}{server_pid}-*", "frontend.sock"))
    if len(paths) == 1:
        return f"ipc://{paths[0]}"
    for pid in _children(server_pid):
        try:
            argv = _cmdline(pid)
        except OSError:
            continue
        if _role(argv, pid) == "scheduler" and b"--frontend-addr" in argv:
            return argv[argv.index(b"--frontend-addr") + 1].decode()
    return None


def _proc_cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def _cmdline(pid: int) -> list[bytes]:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return f.read().split(b"\0")


def _children(server_pid: int) -> list[int]:
    out = []
    for stat in glob.glob("/proc/[0-9]*/stat"):
        try:
            with open(stat) as f:
                if int(f.read().rsplit(")", 1)[1].split()[1]) == server_pid:
                    out.append(int(stat.split("/")[2]))
        except (OSError, ValueError, IndexError):  # gone meanwhile
            continue
    return out


def _role(argv: list[bytes], pid: int) -> str:
    if b"executor_svc" in argv:  # launcher.launch_engine's command lines
        return f"executor{argv[argv.index(b'--rank') + 1].decode()}"
    if SCHEDULER_MODULES & set(argv):
        return "scheduler"
    return "frontend" if b"frontend" in argv else f"child{pid}"  # serve --frontend-procs' extra front ends


def role_cpu_s(server_pid: int) -> dict[str, float]:
    """CPU seconds of the front end (the serve process itself, and its extra front ends summed) and of each
    of its child roles."""
    out = {"frontend": _proc_cpu_s(server_pid)}
    for pid in _children(server_pid):
        try:
            role = _role(_cmdline(pid), pid)
            out[role] = out.get(role, 0.0) + _proc_cpu_s(pid)
        except (OSError, ValueError, IndexError):  # gone meanwhile
            continue
    return out


def _scheduler_stats(scheduler_addr: str):
    client = EngineClient(scheduler_addr, name="bench-stats")
    try:
        return client.stats(timeout_s=10)
    finally:
        client.close()


def frontend_metrics(metrics_port: int | None) -> dict[str, float]:
    """The front end's own timings from its /metrics (empty without a metrics port)."""
    if not metrics_port:
        return {}
    import urllib.request

    body = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read().decode()
    out = {}
    for line in body.splitlines():
        if line.startswith("nanoserve_frontend_detokenize_seconds_total "):
            out["detokenize_seconds"] = float(line.split()[1])
    return out


def snapshot(address: str, scheduler_addr: str | None, server_pid: int | None,
             metrics_port: int | None = None, counters: tuple[str, ...] = COUNTERS) -> Snapshot:
    """counters: those to read (an older server lacks some: bench/server_tree.py)."""
    if scheduler_addr:
        stats = _scheduler_stats(scheduler_addr)
    else:
        with grpc.insecure_channel(address) as channel:
            stats = generation_pb2_grpc.GenerationStub(channel).GetStats(pb.GetStatsRequest(), timeout=10)
    values = {name: float(getattr(stats, name)) for name in counters if hasattr(stats, name)}
    values.update(frontend_metrics(metrics_port))
    return Snapshot(values, role_cpu_s(server_pid) if server_pid else {})


class FirstStepWatch:
    """Polls the scheduler from a thread until a step beyond steps_before has been answered; then
    holds the counters of that moment (None if the wave ended first or there is no socket)."""

    def __init__(self, scheduler_addr: str | None, steps_before: float, poll_s: float = 0.005,
                 counters: tuple[str, ...] = COUNTERS) -> None:
        self.snapshot: Snapshot | None = None
        self._counters = counters
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(scheduler_addr, steps_before, poll_s), daemon=True)
        if scheduler_addr:
            self._thread.start()

    def _run(self, scheduler_addr: str, steps_before: float, poll_s: float) -> None:
        client = EngineClient(scheduler_addr, name="bench-first-step")
        try:
            while not self._done.is_set():
                stats = client.stats(timeout_s=10)
                if stats.num_steps > steps_before:
                    self.snapshot = Snapshot({name: float(getattr(stats, name)) for name in self._counters})
                    return
                self._done.wait(poll_s)
        finally:
            client.close()

    def stop(self) -> Snapshot | None:
        self._done.set()
        if self._thread.is_alive():
            self._thread.join()
        return self.snapshot


def breakdown(before: Snapshot, first: Snapshot | None, after: Snapshot, duration_s: float, client_messages: int,
              client_tokens: int) -> dict:
    """The wave's figures: rates per hop, executor idle share (from the first step on), CPU per output
    token by role."""
    d = {k: after.counters[k] - before.counters[k] for k in after.counters}
    steps, tokens = d.get("num_steps", 0.0), d.get("num_generated_tokens", 0.0)
    out = {"steps": int(steps), "steps_per_s": steps / duration_s,
           "server_tokens_per_s": tokens / duration_s, "client_messages_per_s": client_messages / duration_s,
           "tokens_per_client_message": client_tokens / client_messages if client_messages else 0.0,
           "preemptions": int(d.get("num_preemptions", 0))}
    if "detokenize_seconds" in d:
        out["detokenize_us_per_token"] = 1e6 * d["detokenize_seconds"] / client_tokens if client_tokens else 0.0
    query = d.get("prefix_cache_query_tokens", 0.0)
    out["prefix_cache_hit_rate"] = d.get("prefix_cache_hit_tokens", 0.0) / query if query else 0.0
    if "executor_busy_seconds" in d and first is not None:
        since = {k: after.counters[k] - first.counters[k] for k in first.counters}
        busy, idle, n = since["executor_busy_seconds"], since["executor_idle_seconds"], since["num_steps"]
        out.update(executor_busy_s=busy, executor_idle_s=idle,
                   executor_idle_share=idle / (busy + idle) if busy + idle else 0.0,
                   executor_idle_ms_per_step=1000 * idle / n if n else 0.0,
                   executor_idle_before_wave_s=first.counters["executor_idle_seconds"]
                   - before.counters["executor_idle_seconds"],
                   prefill_step_s=d["prefill_step_seconds"], decode_step_s=d["decode_step_seconds"],
                   # the scheduler's wall clock of steps in flight: the rest of the wave ran no step at all
                   no_step_share=max(0.0, 1 - (d["prefill_step_seconds"] + d["decode_step_seconds"]) / duration_s))
    if before.cpu_s and after.cpu_s:
        cpu = {role: after.cpu_s[role] - before.cpu_s.get(role, 0.0) for role in after.cpu_s}
        out["cpu_s"] = cpu
        out["cpu_us_per_token"] = {role: 1e6 * s / client_tokens if client_tokens else 0.0 for role, s in cpu.items()}
    return out


def print_breakdown(b: dict) -> None:
    print(f"{' Where the time goes ':-^60}")
    rows = [("Steps (exec->sched results, sched->FE msgs) /s", b["steps_per_s"]),
            ("Tokens generated by the server /s", b["server_tokens_per_s"]),
            ("gRPC messages received by the clients /s", b["client_messages_per_s"]),
            ("Tokens per gRPC message", b["tokens_per_client_message"]),
            ("Preemptions", b["preemptions"]), ("Prefix-cache hit rate", b["prefix_cache_hit_rate"])]
    if "executor_idle_share" in b:
        rows += [("Executor idle before the first step (s)", b["executor_idle_before_wave_s"]),
                 ("Executor busy from the first step (s)", b["executor_busy_s"]),
                 ("Executor idle from the first step (s)", b["executor_idle_s"]),
                 ("Executor idle share", b["executor_idle_share"]),
                 ("Executor idle per step (ms)", b["executor_idle_ms_per_step"]),
                 ("Prefill-step / decode-step wall (s)", f"{b['prefill_step_s']:.2f} / {b['decode_step_s']:.2f}"),
                 ("Share of the wave with no step in flight", b["no_step_share"])]
    if "detokenize_us_per_token" in b:
        rows.append(("Front end: detokenize + stop strings per token (us)", b["detokenize_us_per_token"]))
    for role, us in sorted(b.get("cpu_us_per_token", {}).items()):
        rows.append((f"CPU per output token, {role} (us)", us))
    for name, value in rows:
        shown = f"{value:.3f}" if isinstance(value, float) else str(value)
        print(f"{name + ':':<48}{shown:>12}")

