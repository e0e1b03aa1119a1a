"""The scheduler counts its steps by wall time (SchedulerStats.step_seconds_counts), so a one-off stall shows
where the sums of step seconds hide it."""
from __future__ import annotations

import itertools

from scheduler_svc.core import engine_core
from scheduler_svc.core.engine_core import STEP_SECONDS_BOUNDS
from support.loopback_engine import add_request, engine, pump


def served_stats(requests: int = 3):
    core, transport, _executor = engine()
    for i in range(requests):
        transport.from_frontend(b"fe", add_request(f"r{i}", [1 + i, 2, 3], max_tokens=5))
    pump(core)
    return core.stats(0)


def test_every_step_is_counted_once_in_the_bucket_of_its_wall_time(monkeypatch):
    stats = served_stats()
    assert tuple(stats.step_seconds_bounds) == STEP_SECONDS_BOUNDS
    assert len(stats.step_seconds_counts) == len(STEP_SECONDS_BOUNDS) + 1
    assert sum(stats.step_seconds_counts) == stats.num_steps > 0

    clock = itertools.count(step=1.5)  # every reading of the clock 1.5 s after the one before
    monkeypatch.setattr(engine_core.time, "perf_counter", lambda: next(clock))
    slow = served_stats()
    assert sum(slow.step_seconds_counts) == slow.num_steps > 0
    # each step spans at least one tick of the clock, so none is counted at or under 1 s
    assert sum(c for bound, c in zip(STEP_SECONDS_BOUNDS, slow.step_seconds_counts) if bound <= 1.0) == 0
