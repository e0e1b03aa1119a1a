"""`make compose-test`: the image and compose.yaml, for real, with podman or docker.

Builds the image (.ci/build-image.sh), brings compose.yaml up as it is (only its settings, through the
environment: free host ports, the host's model directory, a small CPU engine), and then:
  - waits for gRPC health SERVING on the published port, and checks that no ZMQ port is published;
  - runs each role's own compose health check under the engine;
  - asks "What is the capital of France?" through the published port by server reflection alone
    (as grpcurl does) and expects the greedy answer about Paris;
  - the failure drill. A crash is the role's process dying inside its container: the engine's
    restart policy brings the container back by itself. (`docker kill`/`podman kill` and `stop` count
    as a stop by hand, after which `restart: unless-stopped` leaves the container down.)
      * executor, then scheduler: crashed under streaming clients, every stream ends UNAVAILABLE within
        2 s, the engine restarts the container, and the system is SERVING again within 60 s of that
        restart, with the same answer, while no other container was restarted;
      * frontend: crashed, it comes back by itself; stopped by hand, it stays down, and
        `compose up -d` brings it back;
  - `down` leaves no container and no network of the project; it runs whatever happened before.
Then the gateway profile (`--profile gateway`): SMG, from the Dockerfile's `gateway` stage, in front of two
`nanoserve serve` replicas:
  - only SMG's HTTP port is published; SMG registers both replicas as healthy workers, and every
    container's own health check passes;
  - /v1/chat/completions on the published port, without and with streaming, answers "What is the capital
    of France?" at temperature 0 as the three roles did (Paris), ending on the model's EOS;
  - SMG took the tokenizer over GetTokenizer: its log says so, and its container mounts nothing;
  - `down` leaves nothing behind.
Each phase prints its time. Not collected by `make test`: run by `make compose-test` (and CI)."""
from __future__ import annotations

import json
import os
import re
import shlex
import socket
import subprocess
import sys
import time
import tomllib
from contextlib import contextmanager

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path[:0] = [REPO, os.path.join(REPO, "tests")]

import grpc  # noqa: E402
from grpc_health.v1 import health_pb2, health_pb2_grpc  # noqa: E402

from scheduler_svc.common.model_paths import default_model_dir  # noqa: E402
from support.reflection_client import DynamicClient  # noqa: E402
from support.smg_gateway import SmgHttp  # noqa: E402
from support.streams import ConcurrentStreams  # noqa: E402

PROJECT = "nanoserve-compose-test"
IMAGE = "nanoserve:latest"  # what `make image` tags and compose.yaml runs by default
GATEWAY_IMAGE = "nanoserve-gateway:latest"  # what `make gateway-image` tags
ROLES = ("scheduler", "executor", "frontend")
GATEWAY_SERVICES = ("replica-1", "replica-2", "gateway")  # the gateway profile's
ZMQ_PORTS = {5559, 5560}  # compose.yaml's scheduler sockets: never published
SERVICE = "nanoserve.v1.Generation"
QUESTION = "What is the capital of France?"
ANSWER = "The capital of France is Paris."
MAX_MODEL_LEN = 1024
GATEWAY_MAX_TOKENS = 24  # room past the answer: it must end on EOS
GATEWAY_REGISTERS_WITHIN_S = 90.0  # from the replicas' SERVING to both registered in SMG
# A small KV pool and context for 2 CPU cores; compose.yaml hands it to the scheduler and the executor.
ENGINE_ARGS = f"--device cpu --num-gpu-blocks 512 --max-model-len {MAX_MODEL_LEN}"
UNAVAILABLE_WITHIN_S = 2.0  # the bound: from the crash to the last stream's UNAVAILABLE
CI_NOISE_S = 0.5  # allowed over it on two busy shared cores, as tests/e2e/test_role_recovery.py does
SERVING_WITHIN_S = 60.0  # the bound: from the container's restart to SERVING
FIRST_START_S = 600.0  # the first start loads torch and the weights on slow cores
STREAMS = 4
PROMPT = [1, 5, 9, 14, 20, 27]


def log(msg: str) -> None:
    print(msg, flush=True)


phase_times: list[tuple[str, float]] = []


@contextmanager
def phase(name: str):
    log(f"== {name}")
    t0 = time.monotonic()
    try:
        yield
    finally:
        took = time.monotonic() - t0
        phase_times.append((name, took))
        log(f"== {name}: {took:.1f}s")


def sh(cmd: list[str], timeout: float = 300, check: bool = True, env: dict | None = None) -> str:
    result = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout, env=env)
    if check and result.returncode != 0:
        raise AssertionError(f"{shlex.join(cmd)} exited {result.returncode}:\n{result.stdout[-3000:]}"
                             f"\n{result.stderr[-3000:]}")
    return result.stdout


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Engine:
    """podman or docker, and its compose, as .ci/container-engine.sh picks them."""

    def __init__(self) -> None:
        out = sh(["bash", "-c", '. .ci/container-engine.sh && pick_engine >&2 && PY="$0" pick_compose >&2 && '
                               'printf "%s\\n%s\\n%s\\n" "$ENGINE" "$COMPOSE" "${CONTAINERS_CONF:-}"',
                  sys.executable], timeout=900)
        self.name, compose, conf = out.splitlines()[-3:]
        self.compose_cmd = shlex.split(compose)
        self.grpc_port, self.metrics_port, self.gateway_port = free_port(), free_port(), free_port()
        model = default_model_dir()
        # The settings are this check's own: none comes from the caller's environment.
        inherited = {k: v for k, v in os.environ.items()
                     if not k.startswith(("COMPOSE_", "NANOSERVE_")) and k not in ("GPU", "IMAGE", "BASE_IMAGE", "TARGET")}
        self.env = {**inherited, "ENGINE": self.name, "COMPOSE_PROJECT_NAME": PROJECT, "IMAGE": IMAGE,
                    "NANOSERVE_MODELS": os.path.dirname(model), "NANOSERVE_MODEL": os.path.basename(model),
                    "NANOSERVE_ENGINE_ARGS": ENGINE_ARGS, "NANOSERVE_GRPC_PORT": str(self.grpc_port),
                    "NANOSERVE_METRICS_PORT": str(self.metrics_port), "NANOSERVE_GATEWAY_PORT": str(self.gateway_port)}
        if conf:
            self.env["CONTAINERS_CONF"] = conf
        log(f"engine {self.name}, compose `{compose}`, gRPC on 127.0.0.1:{self.grpc_port}")

    def run(self, *args: str, timeout: float = 120, check: bool = True) -> str:
        return sh([self.name, *args], timeout=timeout, check=check, env=self.env)

    def compose(self, *args: str, timeout: float = 600, check: bool = True) -> str:
        return sh([*self.compose_cmd, "-p", PROJECT, "-f", "compose.yaml", *args], timeout=timeout, check=check,
                  env=self.env)

    def containers(self) -> dict[str, str]:
        """service -> container id, for the project's containers, running or not."""
        ids = self.run("ps", "-a", "-q", "--filter", f"label=com.docker.compose.project={PROJECT}").split()
        if not ids:
            return {}
        out = self.run("inspect", "--format", '{{.Id}} {{index .Config.Labels "com.docker.compose.service"}}', *ids)
        return {service: cid for cid, service in (line.split() for line in out.splitlines() if line.strip())}

    def state(self, service: str) -> dict:
        return json.loads(self.run("inspect", self.containers()[service], "--format", "{{json .State}}"))

    def started_at(self, service: str) -> str:
        return self.state(service)["StartedAt"]

    def crash(self, service: str) -> None:
        """The role's process dies (SIGKILL) inside the container: PID 1 is the init, the role its child. The
        container dies with it, sometimes before the engine has recorded the exec's own end (podman 4.3 then
        exits 255, "exec died event ... not found"): the callers prove the crash by the engine's restart."""
        result = subprocess.run([self.name, "exec", self.containers()[service], "sh", "-c",
                                 "kill -KILL $(cat /proc/1/task/1/children)"], env=self.env, capture_output=True,
                                text=True, timeout=60)
        if result.returncode != 0:
            log(f"   the exec that killed it exited {result.returncode}: {result.stderr.strip()[-200:]}")

    def healthy(self, service: str) -> bool:
        """The service's compose health check, run by the engine in the container now."""
        if self.name == "podman":  # podman schedules checks with systemd timers: run one by hand where none is
            check = subprocess.run([self.name, "healthcheck", "run", self.containers()[service]], env=self.env,
                                   capture_output=True, timeout=60)
            return check.returncode == 0
        return self.state(service).get("Health", {}).get("Status") == "healthy"

    def published_ports(self) -> dict[str, set[int]]:
        """service -> the container ports it publishes on the host."""
        found = {}
        for service, cid in self.containers().items():
            bindings = json.loads(self.run("inspect", cid, "--format", "{{json .HostConfig.PortBindings}}")) or {}
            found[service] = {int(key.split("/")[0]) for key, hosts in bindings.items() if hosts}
        return found

    def logs(self, service: str) -> str:
        """The container's output, without the ANSI colours SMG writes."""
        result = subprocess.run([self.name, "logs", self.containers()[service]], env=self.env, capture_output=True,
                                text=True, errors="replace", timeout=60)
        return re.sub(r"\x1b\[[0-9;]*m", "", result.stdout + result.stderr)

    def mount_sources(self, service: str) -> list[str]:
        """The host paths mounted into the service's container."""
        mounts = json.loads(self.run("inspect", self.containers()[service], "--format", "{{json .Mounts}}")) or []
        return [m["Source"] for m in mounts]

    def leftovers(self) -> list[str]:
        names = self.run("ps", "-a", "--format", "{{.Names}}").split()
        networks = self.run("network", "ls", "--format", "{{.Name}}").split()
        return [n for n in names + networks if n.startswith(PROJECT)]


def health(channel: grpc.Channel) -> int | None:
    try:
        return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=SERVICE),
                                                         timeout=2).status
    except grpc.RpcError:
        return None


def wait_serving(channel: grpc.Channel, timeout: float, engine: Engine) -> float:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if health(channel) == health_pb2.HealthCheckResponse.SERVING:
            return time.monotonic() - t0
        time.sleep(0.2)
    raise AssertionError(f"not SERVING after {timeout:.0f}s\n{engine.compose('logs', '--tail', '40', check=False)}")


def ask(channel: grpc.Channel) -> str:
    body = {"messages": {"messages": [{"role": "user", "content": QUESTION}]},
            "sampling": {"temperature": 0, "maxTokens": 12}}
    (response,) = DynamicClient(channel).call(f"{SERVICE}.Generate", body, timeout=120)
    return response["outputs"][0]["text"]


def ask_until_answered(channel: grpc.Channel, deadline: float) -> str:
    """SERVING may still be the front end's word from before a scheduler restart: a request is the proof."""
    while True:
        try:
            return ask(channel)
        except grpc.RpcError as exc:
            if exc.code() != grpc.StatusCode.UNAVAILABLE or time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def wait_restarted(engine: Engine, service: str, before: str, timeout: float = 60) -> float:
    """Waits for the engine to start service's container again; returns time.monotonic() when seen running."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        state = engine.state(service)
        if state["Running"] and state["StartedAt"] != before:
            return time.monotonic()
        time.sleep(0.2)
    raise AssertionError(f"the engine did not restart {service} within {timeout:.0f}s: {engine.state(service)}")


def crash_under_streams(engine: Engine, channel: grpc.Channel, service: str) -> None:
    others = {s: engine.started_at(s) for s in ROLES if s != service}
    before = engine.started_at(service)
    streams = ConcurrentStreams(channel, STREAMS, PROMPT, max_tokens=MAX_MODEL_LEN - len(PROMPT))
    try:
        streams.wait_all_streaming(min_tokens=3, timeout=120)
        engine.crash(service)
        crashed_at = time.monotonic()
        ends = streams.wait_all_ended(timeout=60)
    finally:
        streams.cancel()
    codes = {end.code for end in ends}
    unavailable_s = max(end.at for end in ends) - crashed_at
    log(f"   streams ended {sorted(c.name for c in codes)} {unavailable_s:.2f}s after the crash")
    assert codes == {grpc.StatusCode.UNAVAILABLE}, [(e.code, e.details) for e in ends]
    assert unavailable_s <= UNAVAILABLE_WITHIN_S + CI_NOISE_S, \
        f"UNAVAILABLE {unavailable_s:.2f}s after the crash, not within {UNAVAILABLE_WITHIN_S}s"
    restarted_at = wait_restarted(engine, service, before)
    log(f"   the engine restarted {service} {restarted_at - crashed_at:.2f}s after the crash")
    answer = ask_until_answered(channel, restarted_at + SERVING_WITHIN_S)
    wait_serving(channel, 10, engine)
    serving_s = time.monotonic() - restarted_at
    log(f"   answered and SERVING {serving_s:.2f}s after the restart")
    assert serving_s <= SERVING_WITHIN_S, f"SERVING {serving_s:.1f}s after the restart"
    assert answer == ANSWER, answer
    assert {s: engine.started_at(s) for s in others} == others, "another role's container was restarted"


def gateway_chat(gateway: SmgHttp, model: str) -> tuple[str, str]:
    """(the answer, the streamed answer) of /v1/chat/completions at temperature 0; both end on the model's EOS."""
    body = {"model": model, "messages": [{"role": "user", "content": QUESTION}], "temperature": 0,
            "max_tokens": GATEWAY_MAX_TOKENS}
    choice = gateway.post("/v1/chat/completions", body)["choices"][0]
    assert choice["finish_reason"] == "stop", choice  # the model's EOS, which SMG never sends to a worker
    choices = [event["choices"][0] for event in gateway.stream("/v1/chat/completions", body) if event.get("choices")]
    assert [c.get("finish_reason") for c in choices if c.get("finish_reason")] == ["stop"], choices
    return choice["message"]["content"], "".join(c.get("delta", {}).get("content") or "" for c in choices)


def check_gateway(engine: Engine) -> None:
    """The gateway profile: up, SMG registers both replicas, chat through SMG's published port, GetTokenizer."""
    gateway = SmgHttp(engine.gateway_port)
    with phase("gateway: up"):
        engine.compose("--profile", "gateway", "up", "-d", "gateway")  # the replicas come along (depends_on)
        published = engine.published_ports()
        log(f"   published container ports: {published}")
        assert published == {"replica-1": set(), "replica-2": set(), "gateway": {30000}}, published
    with phase("gateway: replicas serving"):
        for service in ("replica-1", "replica-2"):  # their own compose health checks: gRPC health SERVING
            deadline = time.monotonic() + FIRST_START_S
            while not engine.healthy(service):
                assert time.monotonic() < deadline, f"{service} not healthy\n{engine.logs(service)[-4000:]}"
                time.sleep(1)
    with phase("gateway: both replicas registered"):
        # SMG looks for its workers every 5 s (--worker-startup-check-interval in compose.yaml).
        deadline = time.monotonic() + GATEWAY_REGISTERS_WITHIN_S
        while gateway.healthy_workers() < 2:
            assert time.monotonic() < deadline, f"SMG registered {gateway.healthy_workers()} of 2 healthy workers " \
                f"within {GATEWAY_REGISTERS_WITHIN_S:.0f}s\n{engine.logs('gateway')[-4000:]}"
            time.sleep(1)
        status, models = gateway.request("GET", "/v1/models", timeout=10)
        assert status == 200 and len(models["data"]) == 1, (status, models)
        model = models["data"][0]["id"]
        log(f"   2 healthy workers, serving {model!r}")
        deadline = time.monotonic() + 60
        while not engine.healthy("gateway"):  # SMG's /readiness, by the container's own check
            assert time.monotonic() < deadline, f"the gateway's health check fails under {engine.name}"
            time.sleep(1)
    with phase("gateway: chat completions"):
        answer, streamed = gateway_chat(gateway, model)
        log(f"   {QUESTION!r} -> {answer!r}, streamed {streamed!r}")
        assert answer == streamed == ANSWER, (answer, streamed)  # what the three roles answered: Paris
    with phase("gateway: tokenizer over GetTokenizer"):
        # SMG's log names where its tokenizer came from; its container has no model to read one from.
        assert "Fetching tokenizer from worker" in engine.logs("gateway"), engine.logs("gateway")[-4000:]
        models_dir = engine.env["NANOSERVE_MODELS"]
        mounts = {service: engine.mount_sources(service) for service in GATEWAY_SERVICES}
        log(f"   mounts: {mounts}")
        assert mounts["gateway"] == [], mounts
        assert all(models_dir in mounts[r] for r in ("replica-1", "replica-2")), mounts


def main() -> int:
    t_all = time.monotonic()
    model = default_model_dir()
    assert os.path.exists(os.path.join(model, "config.json")), f"no model at {model}: run `make model`"
    with phase("engine"):
        engine = Engine()
    with phase("image"):
        built = sh([".ci/build-image.sh"], timeout=1800, env=engine.env)
        log("\n".join("   " + line[3:] for line in built.splitlines() if line.startswith("== ")))
        built = sh([".ci/build-image.sh"], timeout=900, env={**engine.env, "TARGET": "gateway", "IMAGE": GATEWAY_IMAGE})
        log("\n".join("   " + line[3:] for line in built.splitlines() if line.startswith("== built")))
        # SMG runs as a non-root user too, at the version that pyproject.toml's gateway extra pins.
        inside = engine.run("run", "--rm", "--entrypoint", "python3", GATEWAY_IMAGE, "-c",
                            "import importlib.metadata, os; print(os.getuid(), importlib.metadata.version('smg'))").split()
        with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
            pin = tomllib.load(f)["project"]["optional-dependencies"]["gateway"]
        assert inside[0] != "0" and pin == [f"smg=={inside[1]}"], (inside, pin)
        # The roles run as a non-root user, and a CPU image carries no C compiler.
        inside = engine.run("run", "--rm", "--entrypoint", "sh", IMAGE, "-c",
                            "id -u; command -v cc gcc c99 || echo no-compiler").split()
        assert inside == [inside[0], "no-compiler"] and inside[0] != "0", inside
    failed = True
    try:
        with phase("up"):
            engine.compose("--profile", "gateway", "down", "-t", "5", check=False)  # a previous run's leftovers
            engine.compose("up", "-d")
            published = engine.published_ports()
            log(f"   published container ports: {published}")
            assert published == {"scheduler": set(), "executor": set(), "frontend": {50051, 8000}}, published
            assert not any(ports & ZMQ_PORTS for ports in published.values()), "a ZMQ port is published"
        channel = grpc.insecure_channel(f"127.0.0.1:{engine.grpc_port}")
        with phase("serving"):
            wait_serving(channel, FIRST_START_S, engine)
        with phase("health checks"):
            for service in ROLES:
                deadline = time.monotonic() + 60
                while not engine.healthy(service):
                    assert time.monotonic() < deadline, f"{service}'s health check fails under {engine.name}"
                    time.sleep(1)
                log(f"   {service}: healthy")
        with phase("chat by reflection"):
            answer = ask(channel)
            log(f"   {QUESTION!r} -> {answer!r}")
            assert answer == ANSWER, answer
        for service in ("executor", "scheduler"):
            with phase(f"drill: {service} crashes"):
                crash_under_streams(engine, channel, service)
        with phase("drill: frontend crashes"):
            before = engine.started_at("frontend")
            engine.crash("frontend")
            restarted_at = wait_restarted(engine, "frontend", before)
            log(f"   SERVING {wait_serving(channel, SERVING_WITHIN_S, engine):.2f}s after the engine restarted it")
            assert ask(channel) == ANSWER
        with phase("drill: frontend stopped by hand"):
            engine.compose("stop", "frontend")
            time.sleep(5)
            assert not engine.state("frontend")["Running"], "a stopped container came back: not unless-stopped"
            assert health(channel) is None
            engine.compose("up", "-d")
            log(f"   `compose up -d` restarted it, SERVING {wait_serving(channel, SERVING_WITHIN_S, engine):.2f}s "
                "later")
            assert ask(channel) == ANSWER
        channel.close()
        failed = False
    finally:
        if failed:
            log(engine.compose("logs", "--tail", "60", check=False, timeout=60))
        with phase("down"):
            engine.compose("down", "-t", "20", timeout=300, check=False)
            left = engine.leftovers()
            assert left == [], f"`down` left {left}"
    failed = True
    try:
        check_gateway(engine)
        failed = False
    finally:
        if failed:
            log(engine.compose("--profile", "gateway", "logs", "--tail", "60", check=False, timeout=60))
        with phase("gateway: down"):
            engine.compose("--profile", "gateway", "down", "-t", "20", timeout=300, check=False)
            left = engine.leftovers()
            assert left == [], f"`down` left {left}"
    log("== phases: " + ", ".join(f"{name} {took:.1f}s" for name, took in phase_times))
    log(f"== compose-test passed in {time.monotonic() - t_all:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
