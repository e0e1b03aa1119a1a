"""Online serving benchmark through gRPC streaming, after vLLM's benchmark_serving method.

Requests arrive at --request-rate per second (Poisson, or gamma with --burstiness; inf sends all at
once), at most --max-concurrency in flight, from --client-procs client processes (bench/serving_load.py).
Each streams GenerateStream with prompt_token_ids and ignore_eos, so that it makes exactly its
max_tokens; a completion of another length is counted and shown. Reported: TTFT, TPOT, ITL and E2E
latency (mean, median, p99), request and token throughput, goodput (requests per second meeting
every --goodput SLO), the client processes' CPU share, and where the server's time went
(bench/serving_probe.py: rates per hop, executor idle share, CPU per token by process role).

Datasets:
  random    a shared prefix of --prefix-len random tokens, then --input-len own tokens; --output-len
  nanovllm  bench/throughput.py's draws (nano-vLLM's bench: 256 prompts, lengths U[100, 1024], seed 0,
            temperature 0.6) on its model (Qwen3-0.6B shape, random weights) and engine flags, with
            prefix caching off on both sides: the repeated waves send the same prompts, which a warm
            cache would serve without their prefill, unlike the single offline run
  text      text on: chat prompts (one user message, made from --seed) sent as messages, so the front
            end templates and tokenizes them, streamed back as text with --stop strings, greedy, EOS
            on; max_tokens U[--min-output-len, --max-output-len]. The model needs a tokenizer (the
            embedded SmolLM2 by default; on a GPU machine its config and tokenizer with --load-format
            dummy). --offline-too runs the offline LLM on the same chats and stop strings.

    python bench/serving.py --launch --num-prompts 20 --input-len 128 --output-len 32
    python bench/serving.py --launch --request-rates 1 2 4 --out bench/results/serving.json  # + .png
    python bench/serving.py --address localhost:50051 --request-rate 4 --goodput ttft:500 tpot:50
    python bench/serving.py --dataset nanovllm --launch --offline-too --repeat 5 --client-procs 2 --scale-check
    python bench/serving.py --dataset nanovllm --launch --offline-too --model-shape tiny --device cpu \\
        --num-prompts 8 --max-input-len 64 --max-output-len 16 --client-procs 2 --repeat 2
    python bench/serving.py --dataset text --launch --offline-too --device cpu --num-prompts 8 --max-output-len 32

With --launch, flags this script does not know (engine and server flags) go to `nanoserve serve`;
with --dataset nanovllm the engine flags also build the --offline-too engine, so both are the same.
--server-tree DIR serves from another source tree, an older commit say (bench/server_tree.py, bench/studies/compare_trees.sh).
"""
from __future__ import annotations

import argparse
import itertools
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

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from bench import server_tree, serving_probe  # noqa: E402
from bench.nanovllm_workload import ENGINE_DEFAULTS, MODEL_SHAPES, dummy_model_dir, workload  # noqa: E402
from bench.serving_figures import json_safe, plot, print_summary, print_table, summarize  # noqa: E402
from bench.serving_load import ClientPool, LoadSpec  # noqa: E402
from protos import generation_pb2 as pb  # noqa: E402
from protos import generation_pb2_grpc  # noqa: E402
from scheduler_svc.common.config import add_engine_args, engine_config_from_args  # noqa: E402
from scheduler_svc.common.model_paths import default_model_dir  # noqa: E402

FIRST_ID = 100  # random prompts skip the low ids, where the special tokens live


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


SUBJECTS = ["the sea", "a lighthouse keeper", "tomatoes", "the history of clocks", "a robot learning to paint",
            "winter in a small town", "the moon landing", "bread", "a lost key", "volcanoes", "chess openings",
            "a friendly dragon", "rain forests", "the first computer", "honey bees", "a train journey"]
ASKS = ["Write a short story about {}.", "Explain {} to a child.", "Give me five facts about {}.",
        "Write a poem about {}.", "Describe {} in detail.", "What should everyone know about {}?"]


def text_dataset(n: int, min_output: int, max_output: int, seed: int) -> list[tuple[str, int]]:
    """(one user message, max_tokens) per request: varied prompts of a few sentences."""
    rng = random.Random(seed)
    return [(" ".join(rng.choice(ASKS).format(rng.choice(SUBJECTS)) for _ in range(rng.randint(1, 4))),
             rng.randint(min_output, max_output)) for _ in range(n)]


def send_offsets(gaps: list[float]) -> list[float]:
    return list(itertools.accumulate(gaps))


def offline_engine(args, server_args: list[str]):
    """The engine flags among server_args (nanovllm: over bench/throughput.py's defaults, with its dummy
    model unless --model is given): (engine namespace, `nanoserve serve` argv, the model dir to clean up)."""
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)  # --max-n is not --max-num-seqs
    add_engine_args(parser)
    if args.dataset == "nanovllm":
        parser.set_defaults(**ENGINE_DEFAULTS, enable_prefix_caching=False)
    engine, rest = parser.parse_known_args(server_args)
    tmp = None
    if not engine.model and args.dataset == "nanovllm":
        tmp = dummy_model_dir(MODEL_SHAPES[args.model_shape])
        engine.model, engine.load_format = tmp.name, "dummy"
    return engine, engine_config_from_args(engine).to_argv() + rest, tmp


def run_offline(args, engine: argparse.Namespace, prompts, max_tokens) -> dict:
    """bench/throughput.py's measurement, on the same engine flags and draws."""
    from bench.throughput import run_nanoserve  # here: the client processes need not import the engine

    return run_nanoserve(argparse.Namespace(**vars(engine), temperature=args.temperature, no_progress=True),
                         prompts, max_tokens)


def run_offline_text(args, engine: argparse.Namespace, chats: list[tuple[str, int]]) -> dict:
    """The offline LLM on the text dataset: the same chats (templated), stop strings and greedy sampling."""
    from bench.throughput import offline_figures
    from scheduler_svc.entrypoints.llm import LLM
    from scheduler_svc.frontend.sampling_params import SamplingParams

    config = engine_config_from_args(engine)
    with LLM(config.model, **{k: v for k, v in vars(config).items() if k != "model"}) as llm:
        llm.generate([list(range(1, 12))], SamplingParams(max_tokens=8), use_tqdm=False)  # warm-up
        prompts = [llm.tokenizer.encode_chat([{"role": "user", "content": chat}]) for chat, _ in chats]
        params = [SamplingParams(temperature=args.temperature, max_tokens=m, stop=args.stop) for _, m in chats]
        before = llm.stats()
        t0 = time.perf_counter()
        results = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - t0
        after = llm.stats()
    out_tokens = sum(len(r.outputs[0].token_ids) for r in results)
    return {**offline_figures(out_tokens, elapsed, before, after),
            "stopped_by_string": sum(isinstance(r.outputs[0].stop_reason, str) for r in results)}


# ---------------------------------------------------------------- the server


def launch_server(server_args: list[str], log_path: str, timeout: float,
                  tree: server_tree.ServerTree | None = None) -> tuple[subprocess.Popen, str]:
    """`nanoserve serve` (this tree's, or tree's) on a free loopback port; returns once health says SERVING."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    address = f"127.0.0.1:{port}"
    module, cwd, env = ((tree.cli_module, tree.root, server_tree.tree_env(tree.root)) if tree
                        else ("scheduler_svc.entrypoints.cli", REPO, None))
    with open(log_path, "ab") as log:
        proc = subprocess.Popen([sys.executable, "-m", module, "serve", "--host", "127.0.0.1", "--port", str(port),
                                 *server_args], cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT)
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


def vocab_size(address: str) -> int:
    with grpc.insecure_channel(address) as channel:
        return generation_pb2_grpc.GenerationStub(channel).GetModelInfo(pb.GetModelInfoRequest(), timeout=10).vocab_size


def run_wave(pool: ClientPool, args, address: str, probe: dict, dataset, rate: float, seed: int) -> dict:
    """One wave of requests, with the server's counters read before and after it."""
    spec = LoadSpec(address, args.temperature, not args.no_ignore_eos, args.request_timeout, args.max_concurrency,
                    stop=tuple(args.stop))
    before = serving_probe.snapshot(address, **probe)
    watch = serving_probe.FirstStepWatch(probe["scheduler_addr"], before.counters["num_steps"],
                                         counters=probe.get("counters", serving_probe.COUNTERS))
    try:
        load = pool.run_wave(dataset, send_offsets(arrival_gaps(len(dataset), rate, args.burstiness, seed)), spec)
    finally:
        first = watch.stop()
    after = serving_probe.snapshot(address, **probe)
    summary = summarize(load.results, load.duration_s, parse_goodput(args.goodput), spec.ignore_eos)
    summary.update(request_rate=rate, burstiness=args.burstiness, client_procs=len(load.cpu_s),
                   client_cpu_s=load.cpu_s, client_cpu_share=load.cpu_share,
                   server=serving_probe.breakdown(before, first, after, load.duration_s, summary["client_messages"],
                                                  summary["output_tokens"]))
    print_summary(rate, summary)
    serving_probe.print_breakdown(summary["server"])
    print(f"client processes: {len(load.cpu_s)}, CPU s " + " ".join(f"{c:.2f}" for c in load.cpu_s)
          + ", share of a core " + " ".join(f"{u:.0%}" for u in load.cpu_share))
    return summary


def benchmark(args, address: str, probe: dict, fixed_set) -> tuple[list[dict], dict | None]:
    """Every wave on this server: --repeat per rate, then the --scale-check wave at twice the processes."""
    vocab = vocab_size(address)
    # one warm-up request, apart from the dataset's tokens (Random(-s) equals Random(s): no negative seeds)
    warmup = random_dataset(1, 16, 4, 0, 0.0, vocab, seed=2**32 + args.seed)
    rates = args.request_rates or [args.request_rate]

    def dataset(run: int):
        if fixed_set is not None:  # the same draws every wave
            return fixed_set
        # a fresh prefix per run, so that one run never warms the next one's cache
        return random_dataset(args.num_prompts, args.input_len, args.output_len, args.prefix_len,
                              args.range_ratio, vocab, args.seed + run)

    runs, run = [], 0
    with ClientPool(args.client_procs) as pool:
        pool.run_wave(warmup, [0.0], LoadSpec(address, 0.0, True, args.request_timeout, None))
        for rate in rates:
            for wave in range(1, args.repeat + 1):
                print(f"\nwave {wave}/{args.repeat} at rate {rate}, {args.client_procs} client processes")
                runs.append({"wave": wave, **run_wave(pool, args, address, probe, dataset(run), rate, args.seed + run)})
                run += 1
    scale = None
    if args.scale_check:
        procs = 2 * args.client_procs
        print(f"\nscale check: wave at rate {rates[0]}, {procs} client processes")
        with ClientPool(procs) as pool:
            scale = run_wave(pool, args, address, probe, dataset(run), rates[0], args.seed + run)
    return runs, scale


def parse_args():
    # no abbreviations: an engine flag (--model) must not be taken for one of ours (--model-shape)
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                     allow_abbrev=False)
    target = parser.add_mutually_exclusive_group(required=True)
    target.add_argument("--address", help="host:port of a running server")
    target.add_argument("--launch", action="store_true", help="start `nanoserve serve` with the unknown flags")
    parser.add_argument("--dataset", choices=["random", "nanovllm", "text"], default="random")
    parser.add_argument("--num-prompts", type=int, default=None, help="default 20 (random), 256 (nanovllm)")
    g = parser.add_argument_group("random dataset")
    g.add_argument("--input-len", type=int, default=128, help="own tokens per prompt, after the prefix")
    g.add_argument("--output-len", type=int, default=32)
    g.add_argument("--prefix-len", type=int, default=0, help="random tokens shared by every prompt")
    g.add_argument("--range-ratio", type=float, default=0.0, help="lengths uniform in L*(1 +- ratio)")
    g.add_argument("--seed", type=int, default=0, help="of the prompts and of the arrival times")
    g = parser.add_argument_group("nanovllm dataset (bench/throughput.py's)")
    g.add_argument("--max-input-len", type=int, default=1024)
    g.add_argument("--max-output-len", type=int, default=1024)
    g.add_argument("--min-input-len", type=int, default=100, help="cut to --max-input-len when above it")
    g.add_argument("--min-output-len", type=int, default=100, help="cut to --max-output-len when above it")
    g.add_argument("--workload-seed", type=int, default=0)
    g.add_argument("--model-shape", choices=sorted(MODEL_SHAPES), default="qwen3-0.6b",
                   help="the dummy model's config when --model is not given (tiny: a CPU smoke run)")
    g.add_argument("--offline-too", action="store_true", help="also run the offline engine on the same draws "
                   "(nanovllm, text)")
    g.add_argument("--stop", action="append", default=None, help="stop string (repeatable); the text dataset's "
                   "default: a blank line twice, and '###'")
    g = parser.add_argument_group("load")
    g.add_argument("--temperature", type=float, default=None, help="default 0 (random), 0.6 (nanovllm)")
    g.add_argument("--no-ignore-eos", action="store_true", help="let EOS end a completion early")
    g.add_argument("--request-rate", type=float, default=math.inf, help="requests/s; inf: all at once")
    g.add_argument("--request-rates", type=float, nargs="+", help="several runs, one per rate (plotted)")
    g.add_argument("--burstiness", type=float, default=1.0, help="gamma shape: 1 Poisson, <1 burstier")
    g.add_argument("--max-concurrency", type=int, default=None, help="in flight at once, split over the processes")
    g.add_argument("--client-procs", type=int, default=1, help="client processes sharing each wave")
    g.add_argument("--repeat", type=int, default=1, help="consecutive waves per rate on the same server")
    g.add_argument("--scale-check", action="store_true", help="one more wave at twice --client-procs")
    g.add_argument("--request-timeout", type=float, default=600.0)
    parser.add_argument("--goodput", nargs="+", default=[], metavar="NAME:MS", help="SLOs, e.g. ttft:500 tpot:50")
    parser.add_argument("--scheduler-addr", help="with --address: the scheduler's front-end socket, for its "
                        "executor counters (a launched server's is found)")
    parser.add_argument("--out", help="write the results as JSON here (and the plot beside it, .png)")
    parser.add_argument("--plot", help="PNG path of the latency/rate plot (default: --out with .png)")
    parser.add_argument("--server-log", default=None, help="with --launch: the server's log file")
    parser.add_argument("--server-tree", metavar="DIR", help="with --launch: serve from the source tree DIR (an "
                        "older commit, stubs built in it; bench/server_tree.py)")
    parser.add_argument("--startup-timeout", type=float, default=300.0)
    args, server_args = parser.parse_known_args()
    if server_args and not args.launch:
        parser.error(f"unknown flags {server_args} (engine flags need --launch)")
    parse_goodput(args.goodput)
    if args.burstiness <= 0 or args.client_procs < 1 or args.repeat < 1:
        parser.error("--burstiness, --client-procs and --repeat must be positive")
    nanovllm, text = args.dataset == "nanovllm", args.dataset == "text"
    if args.offline_too and not ((nanovllm or text) and args.launch):
        parser.error("--offline-too needs --dataset nanovllm or text, and --launch (it runs the launched engine's "
                     "flags)")
    if args.server_tree and (not args.launch or args.offline_too):
        parser.error("--server-tree needs --launch, and not --offline-too (that would run this tree's engine)")
    if nanovllm and args.no_ignore_eos:
        parser.error("the nanovllm dataset ignores EOS")
    args.no_ignore_eos = args.no_ignore_eos or text  # text runs as users do: EOS and stop strings end it
    args.stop = args.stop if args.stop is not None else (["\n\n\n", "###"] if text else [])
    args.num_prompts = args.num_prompts or (256 if nanovllm or text else 20)
    args.temperature = args.temperature if args.temperature is not None else (0.6 if nanovllm else 0.0)
    return args, server_args


def main() -> None:
    args, server_args = parse_args()
    tree = server_tree.open_tree(args.server_tree, serving_probe.COUNTERS) if args.server_tree else None
    engine, tmp, fixed_set, offline, has_tokenizer = None, None, None, None, True
    if args.launch and args.dataset in ("nanovllm", "text"):
        engine, server_args, tmp = offline_engine(args, server_args)
        has_tokenizer = os.path.exists(os.path.join(engine.model or default_model_dir(), "tokenizer.json"))
    if args.dataset == "text":
        fixed_set = text_dataset(args.num_prompts, min(args.min_output_len, args.max_output_len), args.max_output_len,
                                 args.seed)
        print(f"text workload: {len(fixed_set)} chats, max_tokens {sum(m for _, m in fixed_set)} in all, "
              f"stop strings {args.stop!r}")
        if args.offline_too:
            offline = run_offline_text(args, engine, fixed_set)
            print(f"offline: {offline['output_tokens']} tokens in {offline['seconds']:.2f}s, "
                  f"{offline['output_tok_per_s']:.0f} tok/s")
    if args.dataset == "nanovllm":
        prompts, max_tokens = workload(args.num_prompts, args.max_input_len, args.max_output_len, args.workload_seed,
                                       min(args.min_input_len, args.max_input_len),
                                       min(args.min_output_len, args.max_output_len))
        fixed_set = list(zip(prompts, max_tokens))
        print(f"nanovllm workload: {len(prompts)} prompts, {sum(map(len, prompts))} prompt tokens, "
              f"{sum(max_tokens)} output tokens")
        if args.offline_too:  # first, so that the server does not hold the device meanwhile
            offline = run_offline(args, engine, prompts, max_tokens)
            print(f"offline: {offline['output_tokens']} tokens in {offline['seconds']:.2f}s, "
                  f"{offline['output_tok_per_s']:.0f} tok/s")
    proc, address, probe = None, args.address, {"scheduler_addr": args.scheduler_addr, "server_pid": None}
    try:
        if args.launch:
            log_path = args.server_log or tempfile.mkstemp(prefix="nanoserve-bench-", suffix=".log")[1]
            metrics_port = None
            if "--metrics-port" not in server_args:  # the front end's own timings (detokenization) come from it
                with socket.socket() as sock:
                    sock.bind(("127.0.0.1", 0))
                    metrics_port = sock.getsockname()[1]
                server_args = [*server_args, "--metrics-port", str(metrics_port)]
            if tree is not None:
                server_args, dropped = server_tree.adapt_argv(tree, server_args)
                print(f"server tree {tree.root} ({tree.cli_module}); flags it lacks, at this tree's defaults, "
                      f"left out: {' '.join(dropped) or 'none'}; counters it lacks: {' '.join(tree.lacking) or 'none'}")
            print(f"launching nanoserve serve {' '.join(server_args)} (log: {log_path})")
            proc, address = launch_server(server_args, log_path, args.startup_timeout, tree)
            probe = {"scheduler_addr": serving_probe.scheduler_socket(proc.pid), "server_pid": proc.pid,
                     "metrics_port": metrics_port,
                     "counters": tuple(c for c in serving_probe.COUNTERS if tree is None or c not in tree.lacking)}
            if probe["scheduler_addr"] is None:
                print("the scheduler's socket was not found: no executor counters, only gRPC GetStats")
            if metrics_port and not serving_probe.frontend_metrics(metrics_port):
                print("the front end's /metrics has no detokenize counter: no detokenize figure")
        runs, scale = benchmark(args, address, probe, fixed_set)
    finally:
        if proc is not None:
            stop_server(proc)
        if tmp is not None:
            tmp.cleanup()
    if engine is not None and not has_tokenizer:
        print("detokenization: none (the model has no tokenizer.json, so the front end sends token ids only)")
    title = (f"serving: {args.dataset} dataset, {args.num_prompts} requests a wave, {args.repeat} wave(s) per rate "
             f"on one server")
    figures = print_table(title, runs, offline, scale)
    if args.out:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        config = {k: v for k, v in vars(args).items() if k not in ("out", "plot")}
        with open(args.out, "w") as f:
            json.dump(json_safe({"config": config, "server_args": server_args, "runs": runs, "offline": offline,
                               "scale_check_run": scale, **figures}), f, indent=2)
        print(f"results: {args.out}")
    plot_path = args.plot or (os.path.splitext(args.out)[0] + ".png" if args.out else None)
    first_waves = [r for r in runs if r["wave"] == 1]  # one point per rate
    if plot_path and len(first_waves) > 1:
        plot(first_waves, plot_path, title)


if __name__ == "__main__":
    main()
