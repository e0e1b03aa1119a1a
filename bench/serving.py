"""Online serving benchmark through gRPC streaming, after vLLM's benchmark_serving method.

Requests arrive at --request-rate per second (Poisson, or gamma with --burstiness; inf sends all at
once), at most --max-concurrency in flight. Each streams GenerateStream with random token ids
(a shared prefix of --prefix-len, then --input-len own tokens) and ignore_eos, so that it makes
exactly --output-len tokens. Reported: TTFT, TPOT, ITL and E2E latency (mean, median, p99),
request and token throughput, and goodput (requests per second meeting every --goodput SLO).

    python bench/serving.py --launch --num-prompts 20 --input-len 128 --output-len 32
    python bench/serving.py --launch --request-rates 1 2 4 --out bench/results/serving.json  # + .png
    python bench/serving.py --launch --prefix-len 512 --input-len 32 --no-enable-prefix-caching
    python bench/serving.py --address localhost:50051 --request-rate 4 --goodput ttft:500 tpot:50

With --launch, flags this script does not know (engine and server flags) go to `nanoserve serve`.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

import grpc
import numpy as np
from grpc_health.v1 import health_pb2, health_pb2_grpc

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from protos import generation_pb2 as pb  # noqa: E402
from protos import generation_pb2_grpc  # noqa: E402

METRICS = ("ttft", "tpot", "itl", "e2el")  # vLLM's names; e2el is end-to-end latency
FIRST_ID = 100  # random prompts skip the low ids, where the special tokens live


@dataclass
class RequestResult:
    prompt_len: int
    ok: bool = False
    output_len: int = 0
    cached_tokens: int = 0
    ttft: float = 0.0  # seconds from sending to the first token
    itl: list[float] = field(default_factory=list)  # gaps between token-carrying messages
    e2el: float = 0.0
    error: str = ""

    @property
    def tpot(self) -> float:
        return (self.e2el - self.ttft) / (self.output_len - 1) if self.output_len > 1 else 0.0


# ---------------------------------------------------------------- workload


def random_dataset(n: int, input_len: int, output_len: int, prefix_len: int, range_ratio: float,
                   vocab_size: int, seed: int) -> list[tuple[list[int], int]]:
    """(prompt token ids, max_tokens) per request; lengths uniform in L*(1 +- range_ratio)."""
    rng = random.Random(seed)

    def length(base: int) -> int:
        return rng.randint(max(1, int(base * (1 - range_ratio))), max(1, int(base * (1 + range_ratio))))

    prefix = [rng.randrange(FIRST_ID, vocab_size) for _ in range(prefix_len)]
    return [(prefix + [rng.randrange(FIRST_ID, vocab_size) for _ in range(length(input_len))], length(output_len))
            for _ in range(n)]


def arrival_gaps(n: int, rate: float, burstiness: float, seed: int) -> list[float]:
    """Seconds to wait before each request: gamma(shape=burstiness, mean=1/rate); burstiness 1 is Poisson."""
    if math.isinf(rate):
        return [0.0] * n
    rng = random.Random(seed)
    return [rng.gammavariate(burstiness, 1.0 / (rate * burstiness)) for _ in range(n)]


# ---------------------------------------------------------------- the load


async def one_request(stub, ids: list[int], max_tokens: int, ignore_eos: bool, timeout: float) -> RequestResult:
    result = RequestResult(prompt_len=len(ids))
    request = pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=ids), sampling=pb.SamplingParams(
        temperature=0.0, max_tokens=max_tokens, ignore_eos=ignore_eos))
    start = last = time.perf_counter()
    try:
        async for response in stub.GenerateStream(request, timeout=timeout):
            now = time.perf_counter()
            tokens = sum(len(o.token_ids) for o in response.outputs)
            if tokens:
                if result.output_len == 0:
                    result.ttft = now - start
                else:
                    result.itl.append(now - last)
                last = now
                result.output_len += tokens
            if response.HasField("usage"):
                result.cached_tokens = response.usage.cached_prompt_tokens
        result.e2el = time.perf_counter() - start
        result.ok = result.output_len > 0
    except grpc.aio.AioRpcError as exc:
        result.error = f"{exc.code().name}: {exc.details()}"
    return result


async def run_load(address: str, dataset, rate: float, burstiness: float, max_concurrency: int | None,
                   ignore_eos: bool, timeout: float, seed: int) -> tuple[list[RequestResult], float]:
    limit = asyncio.Semaphore(max_concurrency or len(dataset))
    async with grpc.aio.insecure_channel(address) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)

        async def limited(ids, max_tokens):
            async with limit:
                return await one_request(stub, ids, max_tokens, ignore_eos, timeout)

        tasks = []
        start = time.perf_counter()
        for (ids, max_tokens), gap in zip(dataset, arrival_gaps(len(dataset), rate, burstiness, seed)):
            await asyncio.sleep(gap)
            tasks.append(asyncio.create_task(limited(ids, max_tokens)))
        results = await asyncio.gather(*tasks)
        return results, time.perf_counter() - start


async def server_stats(address: str) -> pb.Stats:
    async with grpc.aio.insecure_channel(address) as channel:
        return await generation_pb2_grpc.GenerationStub(channel).GetStats(pb.GetStatsRequest(), timeout=10)


async def vocab_size(address: str) -> int:
    async with grpc.aio.insecure_channel(address) as channel:
        return (await generation_pb2_grpc.GenerationStub(channel).GetModelInfo(pb.GetModelInfoRequest(),
                                                                               timeout=10)).vocab_size


# ---------------------------------------------------------------- figures


def summarize(results: list[RequestResult], duration: float, slos: dict[str, float]) -> dict:
    done = [r for r in results if r.ok]
    out_tokens = sum(r.output_len for r in done)
    in_tokens = sum(r.prompt_len for r in done)
    summary = {
        "completed": len(done), "failed": len(results) - len(done), "duration_s": duration,
        "input_tokens": in_tokens, "output_tokens": out_tokens,
        "request_throughput": len(done) / duration, "output_throughput": out_tokens / duration,
        "total_token_throughput": (in_tokens + out_tokens) / duration,
        "cached_prompt_tokens": sum(r.cached_tokens for r in done),
        "errors": sorted({r.error for r in results if r.error})[:5],
    }
    values = {"ttft": [r.ttft for r in done], "tpot": [r.tpot for r in done if r.output_len > 1],
              "itl": [gap for r in done for gap in r.itl], "e2el": [r.e2el for r in done]}
    for name in METRICS:
        ms = np.asarray(values[name] or [0.0]) * 1000
        summary[f"{name}_ms"] = {"mean": float(ms.mean()), "median": float(np.median(ms)),
                                 "p99": float(np.percentile(ms, 99))}
    if slos:
        good = [r for r in done if all(getattr(r, k) * 1000 <= v for k, v in slos.items())]
        summary["goodput"] = len(good) / duration
    return summary


def print_summary(rate: float, s: dict) -> None:
    rows = [("Successful requests", s["completed"]), ("Failed requests", s["failed"]),
            ("Request rate (req/s)", rate), ("Benchmark duration (s)", s["duration_s"]),
            ("Total input tokens", s["input_tokens"]), ("Cached prompt tokens", s["cached_prompt_tokens"]),
            ("Total generated tokens", s["output_tokens"]), ("Request throughput (req/s)", s["request_throughput"]),
            ("Output token throughput (tok/s)", s["output_throughput"]),
            ("Total token throughput (tok/s)", s["total_token_throughput"])]
    if "goodput" in s:
        rows.append(("Request goodput (req/s)", s["goodput"]))
    print(f"{' Serving Benchmark Result ':=^60}")
    for name, value in rows:
        print(f"{name + ':':<40}{value:>20.2f}" if isinstance(value, float) else f"{name + ':':<40}{value:>20}")
    for name in METRICS:
        print(f"{' ' + name.upper() + ' (ms) ':-^60}")
        for stat in ("mean", "median", "p99"):
            print(f"{stat.capitalize() + ':':<40}{s[name + '_ms'][stat]:>20.2f}")
    for error in s["errors"]:
        print(f"error: {error}")
    print("=" * 60)


def plot(runs: list[dict], path: str) -> None:
    """Latency against request rate: TTFT and E2E on the left, TPOT and ITL on the right."""
    try:
        import matplotlib
    except ImportError:
        print("matplotlib is missing (pip install -e '.[bench]'): no plot", file=sys.stderr)
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [r for r in runs if math.isfinite(r["request_rate"])]
    rates = [r["request_rate"] for r in runs]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, names in zip(axes, (("ttft", "e2el"), ("tpot", "itl"))):
        for name, color in zip(names, ("tab:blue", "tab:red")):
            for stat, style in (("median", "-o"), ("p99", "--x")):
                ax.plot(rates, [r[f"{name}_ms"][stat] for r in runs], style, color=color,
                        label=f"{name.upper()} {stat}")
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel("latency (ms)")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(runs[0]["label"] if runs else "")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot: {path}")


# ---------------------------------------------------------------- the server


def launch_server(server_args: list[str], log_path: str, timeout: float) -> tuple[subprocess.Popen, str]:
    """`nanoserve serve` on a free loopback port; returns once health says SERVING."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    address = f"127.0.0.1:{port}"
    with open(log_path, "ab") as log:
        proc = subprocess.Popen([sys.executable, "-m", "scheduler_svc.entrypoints.cli", "serve", "--host", "127.0.0.1",
                                 "--port", str(port), *server_args], cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + timeout
    with grpc.insecure_channel(address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise SystemExit(f"nanoserve serve exited with {proc.returncode}; see {log_path}")
            try:
                status = health.Check(health_pb2.HealthCheckRequest(), timeout=2).status
                if status == health_pb2.HealthCheckResponse.SERVING:
                    return proc, address
            except grpc.RpcError:
                pass
            time.sleep(0.25)
    stop_server(proc)
    raise SystemExit(f"nanoserve serve not SERVING after {timeout:.0f}s; see {log_path}")


def stop_server(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


# ---------------------------------------------------------------- main


def parse_goodput(items: list[str]) -> dict[str, float]:
    slos = {}
    for item in items:
        name, _, value = item.partition(":")
        name = {"e2e": "e2el"}.get(name, name)
        if name not in ("ttft", "tpot", "e2el") or not value:
            raise SystemExit(f"--goodput takes ttft:MS tpot:MS e2el:MS, got {item!r}")
        slos[name] = float(value)
    return slos


def benchmark(args, address: str) -> list[dict]:
    vocab = asyncio.run(vocab_size(address))
    # one warm-up request, apart from the dataset's tokens (Random(-s) equals Random(s): no negative seeds)
    warmup = random_dataset(1, 16, 4, 0, 0.0, vocab, seed=2**32 + args.seed)
    asyncio.run(run_load(address, warmup, math.inf, 1.0, None, True, args.request_timeout, 0))
    rates = args.request_rates or [args.request_rate]
    label = (f"{args.num_prompts} requests, input {args.input_len} (+{args.prefix_len} shared), output "
             f"{args.output_len}, concurrency {args.max_concurrency or 'unlimited'}")
    runs = []
    for i, rate in enumerate(rates):
        # a fresh prefix per run, so that one rate's run never warms the next one's cache
        dataset = random_dataset(args.num_prompts, args.input_len, args.output_len, args.prefix_len,
                                 args.range_ratio, vocab, args.seed + i)
        before = asyncio.run(server_stats(address))
        results, duration = asyncio.run(run_load(address, dataset, rate, args.burstiness, args.max_concurrency,
                                                 not args.no_ignore_eos, args.request_timeout, args.seed + i))
        after = asyncio.run(server_stats(address))
        summary = summarize(results, duration, parse_goodput(args.goodput))
        query = after.prefix_cache_query_tokens - before.prefix_cache_query_tokens
        hits = after.prefix_cache_hit_tokens - before.prefix_cache_hit_tokens
        summary.update(request_rate=rate, burstiness=args.burstiness, label=label,
                       prefix_cache_hit_rate=hits / query if query else 0.0)
        print_summary(rate, summary)
        print(f"server prefix-cache hit rate: {summary['prefix_cache_hit_rate']:.1%}")
        runs.append(summary)
    return runs


def _finite(obj):
    """JSON has no Infinity: an unbounded request rate is written as the string "inf"."""
    if isinstance(obj, float) and math.isinf(obj):
        return "inf"
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_finite(v) for v in obj]
    return obj


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    target = parser.add_mutually_exclusive_group(required=True)
    target.add_argument("--address", help="host:port of a running server")
    target.add_argument("--launch", action="store_true", help="start `nanoserve serve` with the unknown flags")
    parser.add_argument("--num-prompts", type=int, default=20)
    parser.add_argument("--input-len", type=int, default=128, help="own tokens per prompt, after the prefix")
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--prefix-len", type=int, default=0, help="random tokens shared by every prompt")
    parser.add_argument("--range-ratio", type=float, default=0.0, help="lengths uniform in L*(1 +- ratio)")
    parser.add_argument("--no-ignore-eos", action="store_true", help="let EOS end a completion early")
    parser.add_argument("--request-rate", type=float, default=math.inf, help="requests/s; inf: all at once")
    parser.add_argument("--request-rates", type=float, nargs="+", help="several runs, one per rate (plotted)")
    parser.add_argument("--burstiness", type=float, default=1.0, help="gamma shape: 1 Poisson, <1 burstier")
    parser.add_argument("--max-concurrency", type=int, default=None)
    parser.add_argument("--goodput", nargs="+", default=[], metavar="NAME:MS", help="SLOs, e.g. ttft:500 tpot:50")
    parser.add_argument("--request-timeout", type=float, default=600.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", help="write the results as JSON here (and the plot beside it, .png)")
    parser.add_argument("--plot", help="PNG path of the latency/rate plot (default: --out with .png)")
    parser.add_argument("--server-log", default=None, help="with --launch: the server's log file")
    parser.add_argument("--startup-timeout", type=float, default=300.0)
    args, server_args = parser.parse_known_args()
    if server_args and not args.launch:
        parser.error(f"unknown flags {server_args} (engine flags need --launch)")
    parse_goodput(args.goodput)
    if args.burstiness <= 0:
        parser.error("--burstiness must be positive")

    proc = None
    address = args.address
    if args.launch:
        log_path = args.server_log or tempfile.mkstemp(prefix="nanoserve-bench-", suffix=".log")[1]
        print(f"launching nanoserve serve {' '.join(server_args)} (log: {log_path})")
        proc, address = launch_server(server_args, log_path, args.startup_timeout)
    try:
        runs = benchmark(args, address)
    finally:
        if proc is not None:
            stop_server(proc)
    if args.out:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        config = {k: v for k, v in vars(args).items() if k not in ("out", "plot")}
        with open(args.out, "w") as f:
            json.dump(_finite({"config": config, "server_args": server_args, "runs": runs}), f, indent=2)
        print(f"results: {args.out}")
    plot_path = args.plot or (os.path.splitext(args.out)[0] + ".png" if args.out else None)
    if plot_path and len(runs) > 1:
        plot(runs, plot_path)


if __name__ == "__main__":
    main()
