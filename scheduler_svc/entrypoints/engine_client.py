"""The frontend's link to the scheduler process: send requests and aborts, receive outputs."""
from __future__ import annotations

import itertools
import time
import uuid

import zmq

from protos import engine_pb2


HELLO_INTERVAL_S = 1.0


class EngineError(RuntimeError):
    """The engine failed or could not start."""


class EngineClient:
    def __init__(self, frontend_addr: str, name: str = "frontend") -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.IDENTITY, f"{name}-{uuid.uuid4().hex[:8]}".encode())
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(frontend_addr)
        self.ready: engine_pb2.EngineReady | None = None
        self._query_ids = itertools.count(1)
        self._hello = engine_pb2.FrontendToScheduler(hello=engine_pb2.Hello(frontend_name=name))
        self._next_hello = 0.0
        self._say_hello()

    def _say_hello(self) -> None:
        """The heartbeat: the scheduler aborts the requests of a front end it stops hearing from."""
        now = time.monotonic()
        if now >= self._next_hello:
            self._send(self._hello)
            self._next_hello = now + HELLO_INTERVAL_S

    def _send(self, msg: engine_pb2.FrontendToScheduler) -> None:
        self.sock.send(msg.SerializeToString())

    def add(self, request: engine_pb2.AddRequest) -> None:
        self._send(engine_pb2.FrontendToScheduler(add=request))

    def abort(self, request_ids: list[str]) -> None:
        if request_ids:
            self._send(engine_pb2.FrontendToScheduler(abort=engine_pb2.AbortRequests(request_ids=request_ids)))

    def recv(self, timeout_ms: int) -> engine_pb2.SchedulerToFrontend | None:
        self._say_hello()
        if not self.sock.poll(timeout_ms):
            return None
        msg = engine_pb2.SchedulerToFrontend.FromString(self.sock.recv())
        kind = msg.WhichOneof("kind")
        if kind == "ready":
            self.ready = msg.ready
        elif kind == "not_ready" and msg.not_ready.refused:
            raise EngineError(f"the engine cannot start: {msg.not_ready.refused}")
        return msg

    def wait_ready(self, timeout_s: float, check_alive=None) -> engine_pb2.EngineReady:
        """Block until every executor has shaken hands; check_alive() raises if a child died."""
        deadline = time.monotonic() + timeout_s
        while self.ready is None:
            if check_alive is not None:
                check_alive()
            if time.monotonic() > deadline:
                raise EngineError(f"engine not ready after {timeout_s:.0f}s")
            self.recv(200)
        return self.ready

    def ask_stats(self) -> int:
        """Ask for counters without waiting: the SchedulerStats with the returned query_id arrives through recv()."""
        query_id = next(self._query_ids)
        self._send(engine_pb2.FrontendToScheduler(stats=engine_pb2.StatsQuery(query_id=query_id)))
        return query_id

    def stats(self, timeout_s: float = 10.0) -> engine_pb2.SchedulerStats:
        """Ask for counters; outputs that arrive meanwhile are returned to nobody, so use when idle."""
        query_id = self.ask_stats()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            msg = self.recv(100)
            if msg is not None and msg.WhichOneof("kind") == "stats" and msg.stats.query_id == query_id:
                return msg.stats
        raise EngineError("no stats reply from the scheduler")

    def close(self) -> None:
        self.sock.close()
        self.ctx.term()
