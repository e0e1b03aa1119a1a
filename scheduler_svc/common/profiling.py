"""cProfile over windows of a process's steps, for finding host time in the step loop.

    NANOSERVE_PYPROFILE_DIR=/tmp/py NANOSERVE_PYPROFILE_STEPS=80:20,1000:20 nanoserve serve ...

The scheduler counts the steps it plans, an executor the plans it runs. Each process writes
`<role>_<pid>_steps_<first>_<count>.txt` per window (the pid keeps a later engine's files apart): wall
milliseconds per step, the top functions by their own time, and by their cumulative time.
"""
from __future__ import annotations

import cProfile
import io
import os
import pstats
import time


def parse_windows(spec: str, variable: str = "NANOSERVE_PYPROFILE_STEPS") -> list[tuple[int, int]]:
    """'50:20,700:20' -> [(50, 20), (700, 20)]; a clear error for anything else."""
    windows = []
    for part in filter(None, (p.strip() for p in spec.split(","))):
        first, sep, count = part.partition(":")
        if not sep or not first.isdigit() or not count.isdigit() or int(count) == 0:
            raise ValueError(f"{variable} wants first:count[,first:count...], got {spec!r}")
        windows.append((int(first), int(count)))
    return sorted(windows)


class PythonProfileWindow:
    def __init__(self, out_dir: str, role: str, windows: list[tuple[int, int]]) -> None:
        self.out_dir, self.role, self.windows = out_dir, role, windows
        self.step_index = 0
        self.profile: cProfile.Profile | None = None
        self.started = 0.0
        os.makedirs(out_dir, exist_ok=True)

    @classmethod
    def from_env(cls, role: str) -> "PythonProfileWindow | None":
        out_dir = os.environ.get("NANOSERVE_PYPROFILE_DIR")
        if not out_dir:
            return None
        return cls(out_dir, role, parse_windows(os.environ.get("NANOSERVE_PYPROFILE_STEPS", "100:20")))

    def on_step(self) -> None:
        """Call once per step, before the step's work."""
        if self.profile is not None and self.step_index == sum(self.windows[0]):
            self.profile.disable()
            self._write(*self.windows.pop(0), time.perf_counter() - self.started)
            self.profile = None
        if self.profile is None and self.windows and self.step_index == self.windows[0][0]:
            self.profile = cProfile.Profile()
            self.started = time.perf_counter()
            self.profile.enable()
        self.step_index += 1

    def _write(self, first: int, count: int, wall_s: float) -> None:
        text = io.StringIO()
        stats = pstats.Stats(self.profile, stream=text)
        stats.sort_stats("tottime").print_stats(30)
        stats.sort_stats("cumulative").print_stats(40)  # where the step's time goes, waits included
        with open(os.path.join(self.out_dir, f"{self.role}_{os.getpid()}_steps_{first}_{count}.txt"), "w") as f:
            f.write(f"{count} steps, {wall_s * 1e3 / count:.3f} ms per step (under cProfile)\n")
            f.write(text.getvalue())
