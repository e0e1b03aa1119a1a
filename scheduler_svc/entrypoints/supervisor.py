"""`nanoserve serve`: watch the engine processes started on this machine; restart the dead ones.

An executor that exits fails the in-flight streams at once (the front end sees the exit before
the scheduler misses its heartbeats). The new executor starts only after the scheduler has declared
the engine lost, so that its handshake is taken as a fresh engine. A scheduler that exits is started
again at once: the live executors shake hands with it, and the front end sees its new epoch. A role
that dies before the engine was ever ready is a configuration error, not a crash to retry: the
server exits. One that dies again after a restart, before the engine is ready again, is retried after
a doubling pause (RESTART_BACKOFF_S up to RESTART_BACKOFF_MAX_S), at most MAX_FAILED_RESTARTS times in a
row, since the engine did serve with this configuration (a GPU still being freed, a port in TIME_WAIT).
The extra front ends of `--frontend-procs` are started again when they exit, at most
once every FRONTEND_RESTART_S each, since they hold no request state beyond their own streams.
"""
from __future__ import annotations

import asyncio
import logging
import time

from scheduler_svc.frontend.async_engine_client import AsyncEngineClient
from scheduler_svc.entrypoints.launcher import EngineProcesses

log = logging.getLogger("nanoserve.supervisor")

POLL_S = 0.2
FRONTEND_RESTART_S = 1.0  # a front end that keeps dying (a port taken) is retried this often, not in a spin
RESTART_BACKOFF_S = 1.0  # the pause before the second restart in a row of a role that died before ready
RESTART_BACKOFF_MAX_S = 30.0
MAX_FAILED_RESTARTS = 5  # restarts in a row that died before the engine was ready again; then serve exits


async def _wait_for_scheduler_loss(engine: AsyncEngineClient, timeout_s: float, stop: asyncio.Event) -> None:
    deadline = time.monotonic() + timeout_s
    while engine.awaiting_scheduler_loss and time.monotonic() < deadline and not stop.is_set():
        await asyncio.sleep(POLL_S)
    engine.awaiting_scheduler_loss = False  # it did, or it never will: take its next `ready`


async def supervise(procs: EngineProcesses, engine: AsyncEngineClient, stop: asyncio.Event) -> int:
    """Runs until stop is set; sets it itself (and returns 1) when the engine cannot be kept up."""
    served = False  # the engine was ready since the roles last (re)started
    ever_served = False  # ... since serve started
    times_ready = 0  # engine.times_ready when last looked at: a readiness lost again within POLL_S still counts
    failed_restarts = 0  # restarts in a row whose roles died before the engine was ready again
    frontends_checked = time.monotonic()

    async def may_restart(reason: str) -> bool:
        """Whether to restart after `reason`; pauses first when the last restart already failed."""
        nonlocal failed_restarts
        if not ever_served:
            log.error("%s before the engine was ever ready; not restarting", reason)
            return False
        if served:
            return True
        failed_restarts += 1
        if failed_restarts > MAX_FAILED_RESTARTS:
            log.error("%s before the engine was ready again, %d restarts in a row; not restarting", reason,
                      MAX_FAILED_RESTARTS)
            return False
        pause = min(RESTART_BACKOFF_S * 2 ** (failed_restarts - 1), RESTART_BACKOFF_MAX_S)
        log.warning("%s before the engine was ready again; restarting in %.1fs (%d of %d)", reason, pause,
                    failed_restarts, MAX_FAILED_RESTARTS)
        try:
            await asyncio.wait_for(stop.wait(), pause)
        except asyncio.TimeoutError:
            pass
        return not stop.is_set()

    while not stop.is_set():
        await asyncio.sleep(POLL_S)
        if engine.times_ready != times_ready:
            times_ready = engine.times_ready
            served = ever_served = True
            failed_restarts = 0
        if time.monotonic() - frontends_checked >= FRONTEND_RESTART_S:
            frontends_checked = time.monotonic()
            for i in procs.restart_dead_frontends():
                log.warning("front end %d exited; restarted it", i)
        if procs.scheduler.poll() is not None:
            code = procs.scheduler.returncode
            engine.mark_lost("the scheduler exited")
            if not await may_restart(f"the scheduler exited with code {code}"):
                break
            procs.restart_scheduler()  # the executors shake hands with it again; the front end sees its epoch
            log.warning("the scheduler exited with code %s; restarted it", code)
            served = False
            continue
        dead = [(name, code) for name, code in procs.dead() if name != "scheduler"]
        if not dead:
            continue
        reason = ", ".join(f"{name} exited with code {code}" for name, code in dead)
        if engine.ready is not None:
            engine.mark_lost(reason, await_scheduler=True)
            await _wait_for_scheduler_loss(engine, procs.config.executor_timeout_s + 10, stop)
        if not await may_restart(reason):
            break
        ranks = procs.restart_dead_executors()
        log.warning("%s; restarted rank(s) %s", reason, ranks)
        served = False
    if stop.is_set():
        return 0
    stop.set()
    return 1
