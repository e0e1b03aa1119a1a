"""Optional torch.profiler windows over real executor steps, to see where a step's GPU time goes.

    NANOSERVE_PROFILE_DIR=/tmp/prof NANOSERVE_PROFILE_STEPS=50:20,700:20 nanoserve serve ...

Each window `first:count` traces `count` steps starting at the executor's step `first` (counted from
its first plan, warm-up included) and writes, per window, GPU busy time against wall time (the idle
gap the overlap did not hide) and the kernels by GPU time; a chrome trace with
NANOSERVE_PROFILE_TRACE=1. Only device activity is recorded unless NANOSERVE_PROFILE_CPU=1: host
tracing slows the host and would open gaps that do not exist otherwise.
`python -m executor_svc.step_profiler DIR` prints the summaries.
"""
from __future__ import annotations

import glob
import json
import logging
import os
import sys
import time

import torch

from scheduler_svc.common.profiling import parse_windows

log = logging.getLogger("nanoserve.executor")


def busy_time_us(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of [start, end) intervals: time the device ran at least one kernel."""
    total, cur_start, cur_end = 0.0, None, None
    for start, end in sorted(intervals):
        if cur_end is None or start > cur_end:
            if cur_end is not None:
                total += cur_end - cur_start
            cur_start, cur_end = start, end
        else:
            cur_end = max(cur_end, end)
    if cur_end is not None:
        total += cur_end - cur_start
    return total


class StepProfiler:
    def __init__(self, out_dir: str, windows: list[tuple[int, int]], device: torch.device,
                 trace_host: bool = False) -> None:
        self.out_dir = out_dir
        self.trace_host = trace_host or device.type != "cuda"
        self.windows = windows
        self.device = device
        self.step = 0
        self.prof = None
        self.window_start = 0.0
        self.batch_sizes: list[int] = []
        os.makedirs(out_dir, exist_ok=True)

    @classmethod
    def from_env(cls, device: torch.device) -> "StepProfiler | None":
        out_dir = os.environ.get("NANOSERVE_PROFILE_DIR")
        if not out_dir:
            return None
        windows = parse_windows(os.environ.get("NANOSERVE_PROFILE_STEPS", "100:20"), "NANOSERVE_PROFILE_STEPS")
        return cls(out_dir, windows, device,
                   os.environ.get("NANOSERVE_PROFILE_CPU") == "1")

    def before_step(self, num_seqs: int) -> None:
        if self.prof is None and self.windows and self.step == self.windows[0][0]:
            activities = [torch.profiler.ProfilerActivity.CPU] if self.trace_host else []
            if self.device.type == "cuda":
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self.prof = torch.profiler.profile(activities=activities)
            self.prof.start()
            self.window_start = time.perf_counter()
            self.batch_sizes = []
        if self.prof is not None:
            self.batch_sizes.append(num_seqs)

    def after_step(self) -> None:
        self.step += 1
        if self.prof is not None and self.step == sum(self.windows[0]):
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            wall_s = time.perf_counter() - self.window_start
            self.prof.stop()
            first, count = self.windows.pop(0)
            self._write(self.prof, f"steps_{first}_{count}", wall_s, count)
            self.prof = None

    def _write(self, prof, name: str, wall_s: float, count: int) -> None:
        kernels = [e for e in prof.events() if getattr(e.device_type, "name", "") == "CUDA"]
        intervals = [(e.time_range.start, e.time_range.end) for e in kernels]
        span_us = (max(e for _, e in intervals) - min(s for s, _ in intervals)) if intervals else 0.0
        busy_us = busy_time_us(intervals)
        by_name: dict[str, list[float]] = {}
        for e in kernels:
            by_name.setdefault(e.name, []).append(e.time_range.end - e.time_range.start)
        top = sorted(((sum(v), len(v), k) for k, v in by_name.items()), reverse=True)[:40]
        summary = {
            "steps": count, "wall_ms": wall_s * 1e3, "gpu_span_ms": span_us / 1e3, "gpu_busy_ms": busy_us / 1e3,
            "gpu_idle_ms": (span_us - busy_us) / 1e3, "ms_per_step_wall": wall_s * 1e3 / count,
            "gpu_busy_ms_per_step": busy_us / 1e3 / count,
            "batch_size_mean": sum(self.batch_sizes) / max(1, len(self.batch_sizes)),
            "kernels": [{"name": k[:120], "total_ms": t / 1e3, "calls": n, "us_per_step": t / count}
                        for t, n, k in top],
        }
        base = os.path.join(self.out_dir, name)
        with open(base + ".json", "w") as f:
            json.dump(summary, f, indent=1)
        if self.trace_host:
            with open(base + ".txt", "w") as f:
                f.write(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=40))
        if os.environ.get("NANOSERVE_PROFILE_TRACE") == "1":
            prof.export_chrome_trace(base + ".trace.json")
        log.info("profiled %s: %.2f ms/step wall, GPU busy %.2f ms/step, idle %.1f ms over the window "
                 "(mean batch %.0f)", name, summary["ms_per_step_wall"], summary["gpu_busy_ms_per_step"], summary["gpu_idle_ms"],
                 summary["batch_size_mean"])


def print_summaries(out_dir: str, top: int = 12) -> None:
    paths = [p for p in glob.glob(os.path.join(out_dir, "steps_*_*.json")) if not p.endswith(".trace.json")]
    for path in sorted(paths, key=lambda p: int(os.path.basename(p).split("_")[1])):
        with open(path) as f:
            s = json.load(f)
        print(f"{os.path.basename(path)[:-5]}: batch {s['batch_size_mean']:.0f}, "
              f"wall {s['ms_per_step_wall']:.2f} ms/step, GPU busy {s['gpu_busy_ms_per_step']:.2f} ms/step, GPU idle {s['gpu_idle_ms'] / s['steps']:.2f} ms/step")
        for k in s["kernels"][:top]:
            print(f"  {k['us_per_step']:8.1f} us/step {k['calls'] // s['steps']:5d}/step  {k['name'][:90]}")


if __name__ == "__main__":
    print_summaries(sys.argv[1], *(int(a) for a in sys.argv[2:3]))
