"""serve's supervisor: a role that dies before the engine was ever ready ends the server; one that dies
again after a restart, before the engine is ready again, is retried after doubling pauses, a bounded
number of times in a row (the roles are fakes; tests/e2e/test_role_recovery.py kills real ones)."""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import pytest

from scheduler_svc.common.config import EngineConfig
from scheduler_svc.entrypoints import supervisor


@dataclass
class FakeProcess:
    returncode: int | None = None

    def poll(self) -> int | None:
        return self.returncode


@dataclass
class FakeEngine:
    ready: object | None = None
    times_ready: int = 0
    awaiting_scheduler_loss: bool = False
    lost: list[str] = field(default_factory=list)

    def become_ready(self) -> None:
        self.ready = object()
        self.times_ready += 1

    def mark_lost(self, reason: str, await_scheduler: bool = False) -> None:
        self.lost.append(reason)
        self.ready = None


@dataclass
class FakeRoles:
    """The scheduler's life: each start runs the next entry of `lives`: 'ready' (the engine becomes ready,
    then the scheduler dies), 'dies' (it dies before ready) or 'lives' (it stays up)."""

    engine: FakeEngine
    lives: list[str]
    scheduler: FakeProcess = field(default_factory=FakeProcess)
    config: EngineConfig = field(default_factory=EngineConfig)
    started_at: list[float] = field(default_factory=list)

    def start(self) -> None:
        self.started_at.append(time.monotonic())
        self.scheduler = FakeProcess()
        life = self.lives.pop(0) if self.lives else "lives"
        loop = asyncio.get_running_loop()
        if life == "ready":
            self.engine.become_ready()
            loop.call_later(0.05, self._die)
        elif life == "ready briefly":  # ready, then lost and dead within one of the supervisor's looks
            self.engine.become_ready()
            self.engine.mark_lost("the executor exited")
            loop.call_later(0.001, self._die)
        elif life == "dies":
            loop.call_later(0.02, self._die)

    def _die(self) -> None:
        self.scheduler.returncode = 1

    def restart_scheduler(self) -> None:
        self.start()

    def restart_dead_frontends(self) -> list[int]:
        return []

    def dead(self) -> list[tuple[str, int]]:
        return []


@pytest.fixture(autouse=True)
def fast(monkeypatch):
    monkeypatch.setattr(supervisor, "POLL_S", 0.005)
    monkeypatch.setattr(supervisor, "RESTART_BACKOFF_S", 0.05)
    monkeypatch.setattr(supervisor, "MAX_FAILED_RESTARTS", 3)


def supervise(lives: list[str], run_for_s: float = 3.0) -> tuple[int | None, FakeRoles]:
    """Runs the supervisor over fake roles; its return code, or None when it was still supervising."""
    async def main():
        engine = FakeEngine()
        roles = FakeRoles(engine, lives)
        roles.start()
        stop = asyncio.Event()
        task = asyncio.create_task(supervisor.supervise(roles, engine, stop))
        try:
            return await asyncio.wait_for(asyncio.shield(task), run_for_s), roles
        except asyncio.TimeoutError:
            stop.set()
            await task
            return None, roles
    return asyncio.run(main())


def gaps(roles: FakeRoles) -> list[float]:
    return [b - a for a, b in zip(roles.started_at, roles.started_at[1:])]


def test_a_scheduler_that_dies_before_the_engine_was_ever_ready_ends_the_server_without_a_restart():
    code, roles = supervise(["dies"])
    assert code == 1 and len(roles.started_at) == 1


def test_restarts_that_die_before_ready_are_retried_after_doubling_pauses_then_the_server_exits():
    code, roles = supervise(["ready"] + ["dies"] * 10)
    assert code == 1
    assert len(roles.started_at) == 1 + 1 + 3  # the first start, the restart at once, 3 more after pauses
    pauses = gaps(roles)[1:]  # after the restart at once: the death (~0.02 s after a start), then the pause
    for pause, expected in zip(pauses, (0.05, 0.1, 0.2)):
        assert expected <= pause < expected + 0.5, pauses


def test_an_engine_ready_again_resets_the_count_and_a_later_death_restarts_at_once():
    code, roles = supervise(["ready", "dies", "dies", "ready", "dies", "dies", "lives"], run_for_s=2.0)
    assert code is None  # still supervising the last scheduler, which lives
    assert len(roles.started_at) == 7
    first_gap_after_ready = gaps(roles)[3]  # the 4th start was ready: the 5th start follows its death at once
    assert first_gap_after_ready < 0.05 + 0.04, gaps(roles)


def test_an_engine_ready_and_lost_between_two_looks_still_counts_as_served_and_is_restarted(monkeypatch):
    """The engine became ready and was lost again within one poll (a role killed right after it served): the
    supervisor must restart it, not take it for a configuration that never served (as when it only sampled
    `ready`, which a test of the real roles caught, killing the executor 0.12 s after the engine was ready)."""
    monkeypatch.setattr(supervisor, "POLL_S", 0.05)
    code, roles = supervise(["ready briefly", "lives"], run_for_s=1.0)
    assert code is None and len(roles.started_at) == 2
