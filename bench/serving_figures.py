"""The figures of bench/serving.py: one wave's latencies and throughput (vLLM's benchmark_serving
names), the latency/rate plot, and the short table of every wave against the offline engine."""
from __future__ import annotations

import math
import statistics
import sys

import numpy as np

from bench.serving_load import RequestResult

METRICS = ("ttft", "tpot", "itl", "e2el")  # vLLM's names; e2el is end-to-end latency


def summarize(results: list[RequestResult], duration: float, slos: dict[str, float], ignore_eos: bool) -> dict:
    done = [r for r in results if r.ok]
    short = [r for r in done if ignore_eos and r.output_len != r.expected_len]
    out_tokens = sum(r.output_len for r in done)
    in_tokens = sum(r.prompt_len for r in done)
    summary = {
        "completed": len(done), "failed": len(results) - len(done), "duration_s": duration,
        "input_tokens": in_tokens, "output_tokens": out_tokens,
        "request_throughput": len(done) / duration, "output_throughput": out_tokens / duration,
        "total_token_throughput": (in_tokens + out_tokens) / duration,
        "cached_prompt_tokens": sum(r.cached_tokens for r in done),
        "errors": sorted({r.error for r in results if r.error})[:5],
        # with ignore_eos a completion is exactly max_tokens long; anything else is a defect
        "short_outputs": len(short), "short_examples": [f"request {r.index}: {r.output_len} of {r.expected_len} "
                                                         f"tokens ({r.finish_reason or 'no finish reason'})"
                                                         for r in short[:5]],
        "client_messages": sum(r.messages for r in done),
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
            ("Outputs not of max_tokens", s["short_outputs"]),
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
    for error in s["errors"] + s["short_examples"]:
        print(f"error: {error}")
    print("=" * 60)


def plot(runs: list[dict], path: str, title: str = "") -> None:
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
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot: {path}")


TABLE = (("run", 9), ("rate", 5), ("procs", 5), ("seconds", 8), ("out tok/s", 9), ("x offl", 6), ("bad", 4),
         ("cli CPU", 7), ("cli msg/s", 9), ("steps/s", 7), ("ex idle", 7), ("no step", 7), ("FE us/t", 7),
         ("sch us/t", 8), ("TPOT/step", 9))


def _print_row(cells: list) -> None:
    print(" ".join(f"{c:>{width}}" for c, (_, width) in zip(cells, TABLE)))


def _percent(figures: dict, key: str) -> str:
    return f"{figures[key]:.1%}" if key in figures else "-"  # a gRPC-only server has no executor counters


def print_table(title: str, runs: list[dict], offline: dict | None, scale: dict | None) -> dict:
    """The short table, printed last; returns the ratios to offline and the scale check's figures."""
    print(f"\n{title}")
    _print_row([name for name, _ in TABLE])
    for name, r in [(f"wave {r['wave']}", r) for r in runs] + ([("scale", scale)] if scale else []):
        s, per_token = r["server"], r["server"].get("cpu_us_per_token", {})
        _print_row([name, r["request_rate"], r["client_procs"], f"{r['duration_s']:.2f}",
                    f"{r['output_throughput']:.0f}",
                    f"{r['output_throughput'] / offline['output_tok_per_s']:.2f}" if offline else "-",
                    r["failed"] + r["short_outputs"], f"{max(r['client_cpu_share']):.0%}",
                    f"{s['client_messages_per_s']:.0f}", f"{s['steps_per_s']:.1f}", _percent(s, "executor_idle_share"),
                    _percent(s, "no_step_share"), f"{per_token.get('frontend', 0):.1f}",
                    f"{per_token.get('scheduler', 0):.1f}",
                    f"{r['tpot_ms']['median'] / offline['step_ms']:.2f}" if offline else "-"])
    out: dict = {}
    if offline:
        o = offline
        busy_idle = o["executor_busy_seconds"] + o["executor_idle_seconds"]
        _print_row(["offline", "-", "-", f"{o['seconds']:.2f}", f"{o['output_tok_per_s']:.0f}", "1.00", "-", "-",
                    "-", f"{o['steps'] / o['seconds']:.1f}",
                    f"{o['executor_idle_seconds'] / busy_idle if busy_idle else 0:.1%}",
                    f"{max(0.0, 1 - (o['prefill_seconds'] + o['decode_seconds']) / o['seconds']):.1%}", "-", "-",
                    f"{o['step_ms']:.1f}ms"])
        ratios = [r["output_throughput"] / o["output_tok_per_s"] for r in runs]
        tpot_ratios = [r["tpot_ms"]["median"] / o["step_ms"] for r in runs]
        out.update(ratio_median=statistics.median(ratios), ratio_min=min(ratios), ratios=ratios,
                   tpot_over_step_median=statistics.median(tpot_ratios))
        print(f"gRPC / offline output tok/s over {len(ratios)} waves: median {out['ratio_median']:.3f}, "
              f"min {out['ratio_min']:.3f}")
        print(f"gRPC TPOT median / offline wall per step ({o['step_ms']:.2f} ms): median over waves "
              f"{out['tpot_over_step_median']:.3f}")
    if scale:
        base = statistics.median(r["output_throughput"] for r in runs if r["request_rate"] == scale["request_rate"])
        procs = runs[0]["client_procs"]
        out["scale_check"] = {"procs": [procs, scale["client_procs"]],
                              "output_throughput": [base, scale["output_throughput"]]}
        print(f"scale check: {procs} client processes {base:.0f} tok/s (median), {scale['client_procs']} processes "
              f"{scale['output_throughput']:.0f} tok/s ({scale['output_throughput'] / base:.3f}x)")
    bad = sum(r["failed"] + r["short_outputs"] for r in runs + ([scale] if scale else []))
    print(f"failed or short completions: {bad}")
    return out


def json_safe(obj):
    """JSON has no Infinity: an unbounded request rate is written as the string "inf"."""
    if isinstance(obj, float) and math.isinf(obj):
        return "inf"
    if isinstance(obj, dict):
        return {k: json_safe(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [json_safe(v) for v in obj]
    return obj
