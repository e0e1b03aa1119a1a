"""SMG (the pinned `smg` from PyPI) in front of running `nanoserve serve` replicas, for tests: start, wait
until it serves, talk HTTP (JSON and server-sent events), stop. `SmgHttp` alone talks to an SMG started
elsewhere (compose's gateway profile, in tests/compose/check_compose.py)."""
from __future__ import annotations

import http.client
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass

from support.grpc_server import free_port


def smg_binary() -> str:
    """The `smg` console script installed beside this interpreter (the test extra pins it)."""
    path = os.path.join(os.path.dirname(sys.executable), "smg")
    return path if os.path.exists(path) else shutil.which("smg") or path


@dataclass
class SmgHttp:
    """SMG's HTTP API on 127.0.0.1:port."""
    port: int

    def request(self, method: str, path: str, body: dict | None = None, timeout: float = 120.0):
        """(status, parsed JSON or text)."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            conn.request(method, path, body=json.dumps(body) if body is not None else None,
                         headers={"content-type": "application/json"})
            response = conn.getresponse()
            data = response.read().decode()
            try:
                return response.status, json.loads(data)
            except json.JSONDecodeError:
                return response.status, data
        finally:
            conn.close()

    def post(self, path: str, body: dict, timeout: float = 120.0) -> dict:
        status, data = self.request("POST", path, body, timeout)
        if status != 200:
            raise AssertionError(f"POST {path}: HTTP {status}: {data}")
        return data

    def open_stream(self, path: str, body: dict, timeout: float = 120.0) -> tuple[http.client.HTTPConnection, object]:
        """Start a streaming request; returns the connection and an iterator over its SSE data payloads."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        conn.request("POST", path, body=json.dumps({**body, "stream": True}), headers={"content-type": "application/json"})
        response = conn.getresponse()
        if response.status != 200:
            raise AssertionError(f"POST {path} (stream): HTTP {response.status}: {response.read().decode()}")

        def events():
            for line in response:
                line = line.decode().strip()
                if not line.startswith("data:"):
                    continue
                payload = line[len("data:"):].strip()
                if payload == "[DONE]":
                    return
                yield json.loads(payload)
        return conn, events()

    def stream(self, path: str, body: dict, timeout: float = 120.0) -> list[dict]:
        conn, events = self.open_stream(path, body, timeout)
        try:
            return list(events)
        finally:
            conn.close()

    def healthy_workers(self) -> int:
        """How many workers SMG has registered and holds healthy (0 while it does not answer)."""
        try:
            status, workers = self.request("GET", "/workers", timeout=5)
        except (OSError, http.client.HTTPException):
            return 0
        return sum(w.get("is_healthy", False) for w in workers.get("workers", [])) if status == 200 else 0


@dataclass
class Gateway(SmgHttp):
    """An SMG process of the test's own."""
    proc: subprocess.Popen
    log_path: str

    def log(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def start_gateway(log_dir, worker_addrs: list[str], model: str, *flags: str, timeout: float = 120.0) -> Gateway:
    """SMG on free ports in front of these gRPC workers, routing deterministically (no warm-up diversions), with
    no tokenizer of its own: it takes the workers' (GetModelInfo's path where it finds it, else GetTokenizer's
    stream). It runs 16 directories deep in log_dir, where a worker's relative path leads nowhere. Waits until a
    completion goes through."""
    port, metrics_port = free_port(), free_port()
    log_path = os.path.join(str(log_dir), f"smg-{port}.log")
    argv = [smg_binary(), "launch", "--host", "127.0.0.1", "--port", str(port),
            "--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics_port),
            "--worker-urls", *[f"grpc://{a}" for a in worker_addrs],
            "--worker-warmup-secs", "0", "--worker-warmup-divert-every", "0",
            "--shutdown-grace-period-secs", "1", "--worker-startup-check-interval", "1", "--log-json", *flags]
    workdir = os.path.join(str(log_dir), f"smg-{port}", *["d"] * 16)
    os.makedirs(workdir)
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(argv, cwd=workdir, stdout=log, stderr=subprocess.STDOUT,
                                env={**os.environ, "HF_HUB_OFFLINE": "1"})
    gateway = Gateway(port, proc, log_path)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"smg exited with {proc.returncode}:\n{gateway.log()[-4000:]}")
        try:
            if gateway.healthy_workers() == len(worker_addrs):
                status, _ = gateway.request("POST", "/v1/completions",
                                            {"model": model, "prompt": "Hi", "max_tokens": 1}, timeout=60)
                if status == 200:
                    return gateway
        except (OSError, http.client.HTTPException):
            pass
        time.sleep(0.5)
    gateway.stop()
    raise RuntimeError(f"smg did not serve within {timeout:.0f}s:\n{gateway.log()[-4000:]}")
