"""grpc.health.v1 for the whole server ("") and for nanoserve.v1.Generation.

SERVING only while the engine is ready (every executor shook hands) and the server is not
draining; load balancers and compose healthchecks read it.
"""
from __future__ import annotations

import asyncio

from grpc_health.v1 import health
from grpc_health.v1 import health_pb2

GENERATION_SERVICE = "nanoserve.v1.Generation"
SERVICES = ("", GENERATION_SERVICE)
SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING


class Health:
    def __init__(self) -> None:
        self.servicer = health.aio.HealthServicer()
        self.serving = False
        self._tasks: set[asyncio.Task] = set()

    async def start(self) -> None:
        await self._apply()

    def set_serving(self, serving: bool) -> None:
        """Callable from sync code running in the event loop."""
        if serving != self.serving:
            self.serving = serving
            task = asyncio.get_running_loop().create_task(self._apply())
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _apply(self) -> None:
        for name in SERVICES:  # read self.serving each time, so the latest value wins however tasks interleave
            await self.servicer.set(name, SERVING if self.serving else NOT_SERVING)
