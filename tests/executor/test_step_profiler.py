"""The executor's profiling windows: the spec parser, the busy-time union, and a window's summary."""
import json
import os

import pytest
import torch
from hypothesis import given, strategies as st

from executor_svc.step_profiler import StepProfiler, busy_time_us
from scheduler_svc.common.profiling import PythonProfileWindow, parse_windows


def test_windows_parse_in_order_and_bad_specs_say_what_is_wanted():
    assert parse_windows("700:20, 50:5") == [(50, 5), (700, 20)]
    for bad in ("50", "a:3", "5:0", "5:-1"):
        with pytest.raises(ValueError, match="first:count"):
            parse_windows(bad)


@given(st.lists(st.tuples(st.integers(0, 200), st.integers(0, 30)), max_size=12))
def test_busy_time_is_the_length_of_the_union_of_kernel_intervals(spans):
    intervals = [(float(a), float(a + d)) for a, d in spans]
    covered = set()
    for a, b in intervals:
        covered.update(range(int(a), int(b)))  # unit cells: integer endpoints make this exact
    assert busy_time_us(intervals) == len(covered)


def test_a_window_writes_its_summary_after_its_last_step(tmp_path):
    prof = StepProfiler(str(tmp_path), [(2, 3)], torch.device("cpu"))
    x = torch.randn(64, 64)
    for step in range(7):
        prof.before_step(num_seqs=step + 1)
        x = (x @ x).tanh()
        prof.after_step()
        written = list(tmp_path.glob("steps_2_3.json"))
        assert bool(written) == (step >= 4)  # steps 2, 3 and 4 are traced
    summary = json.loads(written[0].read_text())
    assert summary["steps"] == 3 and summary["batch_size_mean"] == 4.0
    assert summary["wall_ms"] > 0


def test_python_profile_windows_write_one_report_each(tmp_path):
    window = PythonProfileWindow(str(tmp_path), "scheduler", [(1, 2), (5, 1)])
    for _ in range(8):
        window.on_step()
        sum(i * i for i in range(1000))
    reports = sorted(p.name for p in tmp_path.iterdir())
    pid = os.getpid()
    assert reports == [f"scheduler_{pid}_steps_1_2.txt", f"scheduler_{pid}_steps_5_1.txt"]
    assert "ms per step" in (tmp_path / f"scheduler_{pid}_steps_1_2.txt").read_text()


class _Runner:
    """A runner whose launch fails on the steps named in `fail`."""

    device = torch.device("cpu")
    world_size = 1  # alone: a failed step fails its requests and the loop serves on

    def __init__(self, fail):
        self.fail, self.calls = fail, 0
        self.kv_pool = type("Pool", (), {"move_blocks": lambda self, swap_out, swap_in, copies: None})()

    def launch(self, chunks):
        self.calls += 1
        if self.calls - 1 in self.fail:
            raise RuntimeError("device fault")

    def sample(self, inputs):
        return object()

    def finalize(self, pending):
        return []


class _Mirrors:
    seqs: dict = {}

    def apply(self, plan):
        return []

    def commit(self, chunks):
        pass


class _Socket:
    def __init__(self):
        self.sent = []

    def send(self, data):
        self.sent.append(data)


def test_a_failed_step_still_counts_toward_the_profiler_window(tmp_path):
    from executor_svc.executor import StepLoop
    from protos import engine_pb2

    sock = _Socket()
    loop = StepLoop(_Runner(fail={1}), _Mirrors(), sock, rank=0)
    loop.profiler = StepProfiler(str(tmp_path), [(0, 3)], torch.device("cpu"))
    for step in range(3):  # steps 0, 1 (fails) and 2 make the window
        loop.run_plan(engine_pb2.StepPlan(step_id=step))
    assert (tmp_path / "steps_0_3.json").exists()
    replies = [engine_pb2.ExecutorToScheduler.FromString(m).result for m in sock.sent]
    assert [r.step_id for r in replies if r.error] == [1]
