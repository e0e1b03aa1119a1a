"""SMG (Shepherd Model Gateway) in front of nanoserve against nanoserve's gRPC straight, on nano-vLLM's workload.

One `nanoserve serve` (bench/throughput.py's model and engine flags: the Qwen3-0.6B shape, random weights,
prefix caching off since the waves repeat the prompts) and SMG in front of it (`smg launch`, the version
pyproject.toml's gateway extra pins, over vLLM's worker protocol). The same 256 requests (lengths U[100,
1024], seed 0, ignore_eos: 133,966 output tokens) go in alternating waves:
  direct  GenerateStream with prompt_token_ids (bench/serving_load.py, as bench/serving.py sends them);
  smg     POST /v1/completions with "stream": true through SMG's HTTP port.
SMG's /v1/completions takes text only (a prompt of token ids is refused), so each prompt is text that SMG's
tokenizer turns into exactly the workload's length: random ASCII letters under a byte-level tokenizer with
no merges (bench/synthetic_tokenizer.py, the model's vocabulary size), one token per letter; the direct
waves send the very ids that tokenizer gives. SMG tokenizes and detokenizes in its own process; the replica
makes no text on either path. Reported per wave: output tok/s, TTFT and TPOT (mean, median, p99), and for
SMG's waves its process's CPU time (/proc, every thread) per second and per token; then SMG / direct.

    python bench/gateway.py                           # the H200 run (bench/run_on_gpu.sh gateway)
    python bench/gateway.py --model-shape tiny --device cpu --num-prompts 8 --max-input-len 64 \\
        --max-output-len 16 --waves 1                 # a CPU smoke run
"""
from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from bench.nanovllm_workload import ENGINE_DEFAULTS, MODEL_SHAPES, dummy_model_dir, workload  # noqa: E402
from bench.serving import launch_server, stop_server  # noqa: E402
from bench.serving_load import ClientPool, LoadSpec  # noqa: E402
from bench.synthetic_tokenizer import write_synthetic_tokenizer  # noqa: E402

LETTERS = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"


# ---------------------------------------------------------------- SMG


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def smg_command() -> list[str]:
    """`smg` beside this interpreter (a venv), else the package run as a module (wheels installed with --target)."""
    path = os.path.join(os.path.dirname(sys.executable), "smg")
    return [path] if os.path.exists(path) else [sys.executable, "-m", "smg"]


def launch_smg(worker: str, tokenizer_dir: str, log_path: str, policy: str, timeout: float = 180.0):
    """`smg launch` in front of one worker; returns (process, port, model id) once a completion goes through."""
    port = free_port()
    argv = [*smg_command(), "launch", "--host", "127.0.0.1", "--port", str(port), "--prometheus-host", "127.0.0.1",
            "--prometheus-port", str(free_port()), "--worker-urls", f"grpc://{worker}", "--policy", policy,
            "--tokenizer-path", tokenizer_dir, "--model-path", tokenizer_dir, "--worker-warmup-secs", "0",
            "--worker-startup-check-interval", "1", "--shutdown-grace-period-secs", "1", "--log-level", "warn"]
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"smg exited with {proc.returncode}; see {log_path}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=5) as answer:
                models = json.load(answer)["data"]
            if models and asyncio.run(_one_completion("127.0.0.1", port, models[0]["id"], "ab", 2, 0.0))["ok"]:
                return proc, port, models[0]["id"]
        except (OSError, ValueError, KeyError):
            pass
        time.sleep(0.5)
    proc.kill()
    raise SystemExit(f"smg did not serve within {timeout:.0f}s; see {log_path}")


def cpu_seconds(pid: int) -> float:
    """A process's user + system CPU time, every thread (/proc/PID/stat)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _one_completion(host: str, port: int, model: str, prompt: str, max_tokens: int, temperature: float,
                          timeout: float = 600.0) -> dict:
    """One streamed /v1/completions over a plain HTTP/1.1 connection: its timings and token count."""
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": temperature,
                       "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}).encode()
    result = {"ok": False, "ttft": 0.0, "e2el": 0.0, "output_len": 0, "prompt_len": 0, "events": 0, "error": "",
              "letters": len(prompt)}
    sent = time.monotonic()
    reader, writer = await asyncio.open_connection(host, port)
    try:
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: gateway\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n" % len(body) + body)
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), timeout)
        if b" 200 " not in head.split(b"\r\n", 1)[0]:
            result["error"] = head.split(b"\r\n", 1)[0].decode()
            return result
        chunked = b"transfer-encoding: chunked" in head.lower()
        buffer, done = b"", False
        while not done:
            if chunked:
                size = int((await asyncio.wait_for(reader.readuntil(b"\r\n"), timeout)).strip(), 16)
                if size == 0:
                    break
                data = (await reader.readexactly(size + 2))[:-2]
            else:
                data = await asyncio.wait_for(reader.read(65536), timeout)
                if not data:
                    break
            buffer += data
            while b"\n\n" in buffer:
                event, buffer = buffer.split(b"\n\n", 1)
                payload = event.strip()[len(b"data:"):].strip()
                if payload == b"[DONE]":
                    done = True
                    break
                if b'"usage":{' in payload and b'"choices":[]' in payload:
                    usage = json.loads(payload)["usage"]
                    result["output_len"], result["prompt_len"] = usage["completion_tokens"], usage["prompt_tokens"]
                    continue
                if result["events"] == 0:
                    result["ttft"] = time.monotonic() - sent
                result["events"] += 1
        result["e2el"] = time.monotonic() - sent
        result["ok"] = done and result["output_len"] == max_tokens
        if not result["ok"]:
            result["error"] = f"{result['output_len']} tokens of {max_tokens}, [DONE] {done}"
    finally:
        writer.close()
    return result


def _smg_client(conn, host: str, port: int, model: str, jobs: list[tuple[str, int]], temperature: float) -> None:
    """A client process: wait for the start instant, send every job at once, report results and CPU time."""
    async def run():
        start = conn.recv()
        await asyncio.sleep(max(0.0, start - time.monotonic()))
        cpu0 = time.process_time()
        results = await asyncio.gather(*(_one_completion(host, port, model, p, m, temperature) for p, m in jobs))
        return results, time.process_time() - cpu0
    conn.send("ready")
    conn.send(asyncio.run(run()))


def smg_wave(port: int, model: str, prompts: list[str], max_tokens: list[int], temperature: float, procs: int) -> dict:
    ctx = multiprocessing.get_context("spawn")
    shares = [[(p, m) for i, (p, m) in enumerate(zip(prompts, max_tokens)) if i % procs == k] for k in range(procs)]
    pipes, children = [], []
    for jobs in shares:
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_smg_client, args=(child, "127.0.0.1", port, model, jobs, temperature))
        proc.start()
        pipes.append(parent)
        children.append(proc)
    for parent in pipes:
        assert parent.recv() == "ready"
    start = time.monotonic() + 0.2
    for parent in pipes:
        parent.send(start)
    answers = [parent.recv() for parent in pipes]
    for proc in children:
        proc.join()
    results = [r for rs, _ in answers for r in rs]
    return {"results": results, "duration_s": max(r["e2el"] for r in results) + 0.0,
            "client_cpu_s": [c for _, c in answers]}


# ---------------------------------------------------------------- figures


def figures(results: list[dict], duration_s: float) -> dict:
    ok = [r for r in results if r["ok"]]
    tpots = [(r["e2el"] - r["ttft"]) / (r["output_len"] - 1) for r in ok if r["output_len"] > 1]
    ttfts = [r["ttft"] for r in ok]

    def stats(xs):
        xs = sorted(xs)
        return {"mean_ms": 1e3 * statistics.fmean(xs), "median_ms": 1e3 * statistics.median(xs),
                "p99_ms": 1e3 * xs[min(len(xs) - 1, int(0.99 * len(xs)))]} if xs else {}
    out_tokens = sum(r["output_len"] for r in ok)
    return {"requests": len(results), "failed": len(results) - len(ok), "output_tokens": out_tokens,
            "duration_s": duration_s, "output_tok_per_s": out_tokens / duration_s if duration_s else 0.0,
            "ttft": stats(ttfts), "tpot": stats(tpots)}


def direct_wave(pool: ClientPool, address: str, ids: list[list[int]], max_tokens: list[int], temperature: float):
    spec = LoadSpec(address, temperature, True, 600.0, None)
    load = pool.run_wave(list(zip(ids, max_tokens)), [0.0] * len(ids), spec)
    results = [{"ok": r.ok and r.output_len == r.expected_len, "ttft": r.ttft, "e2el": r.e2el,
                "output_len": r.output_len} for r in load.results]
    return results, load.duration_s, load.cpu_s


def print_row(name: str, f: dict, extra: str = "") -> None:
    print(f"{name:8s} {f['output_tok_per_s']:>10,.0f} {f['ttft'].get('mean_ms', 0):>9.1f} "
          f"{f['ttft'].get('median_ms', 0):>9.1f} {f['ttft'].get('p99_ms', 0):>9.1f} {f['tpot'].get('mean_ms', 0):>8.2f} "
          f"{f['tpot'].get('median_ms', 0):>8.2f} {f['tpot'].get('p99_ms', 0):>8.2f} {f['failed']:>4d} {extra}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                     allow_abbrev=False)
    parser.add_argument("--model-shape", choices=sorted(MODEL_SHAPES), default="qwen3-0.6b")
    parser.add_argument("--num-prompts", type=int, default=256)
    parser.add_argument("--max-input-len", type=int, default=1024)
    parser.add_argument("--max-output-len", type=int, default=1024)
    parser.add_argument("--min-len", type=int, default=100, help="lower bound of both lengths (cut to the maxima)")
    parser.add_argument("--waves", type=int, default=2, help="waves of each kind, alternating direct, smg")
    parser.add_argument("--client-procs", type=int, default=2, help="client processes of each kind")
    parser.add_argument("--policy", default="cache_aware", help="SMG's routing policy")
    parser.add_argument("--temperature", type=float, default=0.6)
    parser.add_argument("--device", default=None, help="the engine's --device (default: the engine's choice)")
    parser.add_argument("--out", default=None, help="write the figures as JSON here")
    parser.add_argument("--log-dir", default=tempfile.gettempdir())
    args, engine_flags = parser.parse_known_args()

    shape = MODEL_SHAPES[args.model_shape]
    lens, max_tokens = workload(args.num_prompts, args.max_input_len, args.max_output_len, seed=0,
                                min_input=min(args.min_len, args.max_input_len),
                                min_output=min(args.min_len, args.max_output_len))
    rng = random.Random(1)
    prompts = ["".join(rng.choice(LETTERS) for _ in ids) for ids in lens]  # one byte-level token per letter
    model = dummy_model_dir(shape)
    tokenizer_dir = tempfile.mkdtemp(prefix="gateway-tokenizer-")
    write_synthetic_tokenizer(tokenizer_dir, shape["vocab_size"], shape["eos_token_id"])
    with open(os.path.join(tokenizer_dir, "config.json"), "w") as f:
        json.dump(shape, f)
    from tokenizers import Tokenizer
    tokenizer = Tokenizer.from_file(os.path.join(tokenizer_dir, "tokenizer.json"))
    ids = [tokenizer.encode(p, add_special_tokens=False).ids for p in prompts]
    assert [len(i) for i in ids] == [len(p) for p in prompts], "a letter that is not one token"

    flags = ["--model", model.name, "--load-format", "dummy"]
    flags += [f"--{k.replace('_', '-')}={v}" for k, v in ENGINE_DEFAULTS.items()] + ["--no-enable-prefix-caching"]
    flags += (["--device", args.device] if args.device else []) + engine_flags
    os.makedirs(args.log_dir, exist_ok=True)
    server, address = launch_server(flags, os.path.join(args.log_dir, "gateway-serve.log"), 900)
    smg = None
    rows = []
    try:
        smg, port, model_id = launch_smg(address, tokenizer_dir, os.path.join(args.log_dir, "gateway-smg.log"), args.policy)
        print(f"nanoserve serve on {address}, smg {args.policy} on 127.0.0.1:{port}; {args.num_prompts} requests, "
              f"{sum(max_tokens):,} output tokens a wave", flush=True)
        print(f"{'path':8s} {'out tok/s':>10s} {'TTFT mean':>9s} {'median':>9s} {'p99 ms':>9s} {'TPOT mean':>8s} "
              f"{'median':>8s} {'p99 ms':>8s} {'fail':>4s} SMG CPU", flush=True)
        with ClientPool(args.client_procs) as pool:
            pool.run_wave([(ids[0][:16], 4)], [0.0], LoadSpec(address, 0.0, True, 600.0, None))  # warm-up
            for wave in range(args.waves):
                results, duration, client_cpu = direct_wave(pool, address, ids, max_tokens, args.temperature)
                f = figures(results, duration)
                rows.append({"path": "direct", "wave": wave, "client_cpu_s": client_cpu, **f})
                print_row("direct", f)
                cpu0 = cpu_seconds(smg.pid)
                wave_out = smg_wave(port, model_id, prompts, max_tokens, args.temperature, args.client_procs)
                smg_cpu = cpu_seconds(smg.pid) - cpu0
                f = figures(wave_out["results"], wave_out["duration_s"])
                cores = smg_cpu / f["duration_s"] if f["duration_s"] else 0.0
                per_token_us = 1e6 * smg_cpu / f["output_tokens"] if f["output_tokens"] else 0.0
                rows.append({"path": "smg", "wave": wave, "smg_cpu_s": smg_cpu, "smg_cores": cores,
                             "smg_cpu_us_per_token": per_token_us, "client_cpu_s": wave_out["client_cpu_s"], **f})
                print_row("smg", f, f"{cores:.2f} cores, {per_token_us:.1f} us/token")
                off = sum(r["prompt_len"] != r["letters"] for r in wave_out["results"] if r["ok"])
                if off:  # SMG's tokenizer must see the workload's lengths, or the two paths differ
                    print(f"  {off} prompts did not tokenize to one token per letter through SMG")
                errors = {r["error"] for r in wave_out["results"] if not r["ok"]}
                if errors:
                    print("  smg errors:", sorted(errors)[:3])
    finally:
        if smg is not None and smg.poll() is None:
            smg.send_signal(signal.SIGTERM)
            try:
                smg.wait(20)
            except subprocess.TimeoutExpired:
                smg.kill()
        stop_server(server)
        model.cleanup()
    direct = [r["output_tok_per_s"] for r in rows if r["path"] == "direct"]
    through = [r["output_tok_per_s"] for r in rows if r["path"] == "smg"]
    ratio = statistics.median(through) / statistics.median(direct) if direct and through else 0.0
    print(f"SMG / direct output tok/s (medians of {len(through)} and {len(direct)} waves): {ratio:.3f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"rows": rows, "ratio": ratio, "policy": args.policy, "model_shape": args.model_shape}, f,
                      indent=1)


if __name__ == "__main__":
    main()
