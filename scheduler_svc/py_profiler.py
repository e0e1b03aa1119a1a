"""cProfile over a window of a process's steps, for finding host time in the step loop.

    NANOSERVE_PYPROFILE_DIR=/tmp/py NANOSERVE_PYPROFILE_STEPS=1000:20 nanoserve serve ...

The scheduler counts the steps it plans, an executor the plans it runs. Each process writes
`<role>_steps_<first>_<count>.txt`: wall milliseconds per step and the top functions by own time.
"""
from __future__ import annotations

import cProfile
import io
import os
import pstats
import time


class PythonProfileWindow:
    def __init__(self, out_dir: str, role: str, first: int, count: int) -> None:
        self.path = os.path.join(out_dir, f"{role}_steps_{first}_{count}.txt")
        self.first, self.count = first, count
        self.step_index = 0
        self.profile: cProfile.Profile | None = None
        self.started = 0.0
        os.makedirs(out_dir, exist_ok=True)

    @classmethod
    def from_env(cls, role: str) -> "PythonProfileWindow | None":
        out_dir = os.environ.get("NANOSERVE_PYPROFILE_DIR")
        if not out_dir:
            return None
        first, sep, count = os.environ.get("NANOSERVE_PYPROFILE_STEPS", "100:20").partition(":")
        if not sep or not first.isdigit() or not count.isdigit() or int(count) == 0:
            raise ValueError("NANOSERVE_PYPROFILE_STEPS wants first:count")
        return cls(out_dir, role, int(first), int(count))

    def on_step(self) -> None:
        """Call once per step, before the step's work."""
        if self.step_index == self.first:
            self.profile = cProfile.Profile()
            self.started = time.perf_counter()
            self.profile.enable()
        elif self.profile is not None and self.step_index == self.first + self.count:
            self.profile.disable()
            wall_ms = (time.perf_counter() - self.started) * 1e3
            text = io.StringIO()
            stats = pstats.Stats(self.profile, stream=text)
            stats.sort_stats("tottime").print_stats(30)
            with open(self.path, "w") as f:
                f.write(f"{self.count} steps, {wall_ms / self.count:.3f} ms per step (under cProfile)\n")
                f.write(text.getvalue())
            self.profile = None
        self.step_index += 1
