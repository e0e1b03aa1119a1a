"""The gRPC front end's link to the scheduler, for asyncio (the sync twin is engine_client.py).

One reader task receives everything the scheduler sends and routes it: RequestOutputs to the
queue of the stream that owns the request id (a StreamQueue: bounded, and never blocking the reader),
stats replies to the caller waiting on that query id, and EngineReady / NotReady / EngineLost to the
`ready` state. A lost engine ends every open stream. While `on_kv_events` is set, each Hello subscribes to
the prefix index's changes (KvEvents, the scheduler publishes them) and the reader hands each one to it.

`num_in_flight` counts the engine requests the engine still runs for us: one leaves it with its terminal
output or our abort, even while its stream's handler is still writing to a slow client.

A Hello goes out every HELLO_INTERVAL_S and the scheduler answers each: a scheduler silent for
SCHEDULER_TIMEOUT_S is taken as gone, and one whose epoch changed has restarted and forgotten our
requests. Either way the open streams fail at once (UNAVAILABLE), and serving resumes when it answers.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import time
import uuid
from dataclasses import dataclass
from typing import Callable

import zmq
import zmq.asyncio

from google.protobuf.message import DecodeError

from protos import engine_pb2
from scheduler_svc.frontend.stream_queue import StreamQueue

log = logging.getLogger("nanoserve.frontend")

HELLO_INTERVAL_S = 0.25  # the heartbeat: also how a restarted scheduler learns about us
SCHEDULER_TIMEOUT_S = 1.5  # no answer for this long while serving: the scheduler is gone


@dataclass
class EngineLost:
    """Put in every open stream's queue when it cannot be served any more; the reason goes to the client."""
    reason: str


def _log_send_error(future: asyncio.Future) -> None:
    if not future.cancelled() and future.exception() is not None:
        log.warning("send to the scheduler failed: %s", future.exception())


class AsyncEngineClient:
    def __init__(self, scheduler_addr: str, name: str = "frontend", max_buffered_outputs: int = 64) -> None:
        self.name = name
        self.ctx = zmq.asyncio.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.IDENTITY, f"{name}-{uuid.uuid4().hex[:8]}".encode())
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(scheduler_addr)
        self.ready: engine_pb2.EngineReady | None = None
        # how many times the engine became ready: a watcher that samples `ready` now and then (serve's supervisor)
        # still learns of a readiness lost again between two looks
        self.times_ready = 0
        self.awaiting_scheduler_loss = False  # see mark_lost
        self.on_ready_change: list[Callable[[bool], None]] = []  # called with the new readiness
        self.max_buffered_outputs = max_buffered_outputs  # per engine request, in a StreamQueue
        self._streams: dict[str, StreamQueue] = {}  # engine request id -> its stream's queue
        self._in_engine: set[str] = set()  # engine request ids not finished or aborted yet
        self._waiters: dict[int, asyncio.Future] = {}  # query id -> the answer's future (stats, aborted)
        self._query_ids = itertools.count(1)
        self._tasks: list[asyncio.Task] = []
        self.epoch = 0  # the scheduler's incarnation, once it has answered
        self.refused = ""  # why the scheduler refused an executor's handshake, if it did
        self.last_heard = time.monotonic()
        self.on_kv_events: Callable[[engine_pb2.KvEvents], None] | None = None  # set: subscribed (Hello.kv_events)

    async def start(self) -> None:
        self._tasks = [asyncio.create_task(self._read_loop()), asyncio.create_task(self._hello_loop())]

    # ------------------------------------------------------------------ requests

    def open_stream(self, request_ids: list[str]) -> StreamQueue:
        """One queue that receives the outputs of all these engine requests (n samples of a request)."""
        queue = StreamQueue(self.max_buffered_outputs)
        for rid in request_ids:
            self._streams[rid] = queue
        self._in_engine.update(request_ids)
        return queue

    def close_stream(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self._streams.pop(rid, None)
        self._in_engine.difference_update(request_ids)

    @property
    def num_in_flight(self) -> int:
        """Engine requests still running in the engine (admission counts these, not open streams)."""
        return len(self._in_engine)

    def add(self, request: engine_pb2.AddRequest) -> None:
        self._send(engine_pb2.FrontendToScheduler(add=request))

    def abort(self, request_ids: list[str]) -> None:
        self._in_engine.difference_update(request_ids)  # the scheduler frees them on receipt
        if request_ids:
            self._send(engine_pb2.FrontendToScheduler(abort=engine_pb2.AbortRequests(request_ids=request_ids)))

    def follow_kv_events(self, callback: Callable[[engine_pb2.KvEvents], None] | None) -> None:
        """Subscribe to the prefix index's changes, handed to callback (None: unsubscribe); said at once."""
        self.on_kv_events = callback
        self._send_hello()

    async def stats(self, timeout_s: float = 5.0) -> engine_pb2.SchedulerStats:
        """Ask the scheduler for its counters; TimeoutError if it does not answer."""
        return await self._ask(lambda query_id: engine_pb2.FrontendToScheduler(
            stats=engine_pb2.StatsQuery(query_id=query_id)), timeout_s)

    async def abort_everywhere(self, client_request_ids: list[str], timeout_s: float = 5.0) -> list[str]:
        """Abort the requests with these client ids whichever front end runs them (several may share the
        scheduler); returns those that were running. TimeoutError if the scheduler does not answer."""
        answer = await self._ask(lambda query_id: engine_pb2.FrontendToScheduler(abort=engine_pb2.AbortRequests(
            client_request_ids=client_request_ids, query_id=query_id)), timeout_s)
        return list(answer.client_request_ids)

    async def _ask(self, make_query, timeout_s: float):
        query_id = next(self._query_ids)
        future = asyncio.get_running_loop().create_future()
        self._waiters[query_id] = future
        try:
            self._send(make_query(query_id))
            return await asyncio.wait_for(future, timeout_s)
        finally:
            self._waiters.pop(query_id, None)

    def fail_streams(self, reason: str) -> None:
        """End every open stream: each gets an EngineLost."""
        self._in_engine.clear()  # nothing runs for us any more, or the handlers abort it now
        for queue in {id(q): q for q in self._streams.values()}.values():
            queue.put_nowait(EngineLost(reason))

    def mark_lost(self, reason: str, await_scheduler: bool = False) -> None:
        """The engine cannot serve: end every open stream and stop being ready.

        await_scheduler: we saw the loss first (an executor process exited); ignore the scheduler's
        `ready` until it reports the loss itself, since until then it still thinks it can serve.
        """
        was_ready = self.ready is not None
        self.ready = None
        self.awaiting_scheduler_loss = self.awaiting_scheduler_loss or await_scheduler
        self.fail_streams(f"engine lost: {reason}")
        if was_ready:
            log.error("engine lost: %s", reason)
            self._notify(False)

    # ------------------------------------------------------------------ the reader

    def _send(self, msg: engine_pb2.FrontendToScheduler) -> None:
        # A DEALER send does not block while the peer keeps up; the future is only for errors.
        self.sock.send(msg.SerializeToString()).add_done_callback(_log_send_error)

    async def _read_loop(self) -> None:
        while True:
            payload = await self.sock.recv()
            try:
                msg = engine_pb2.SchedulerToFrontend.FromString(payload)
            except DecodeError as exc:
                log.warning("dropped a malformed message from the scheduler: %s", exc)
                continue
            self.last_heard = time.monotonic()
            if msg.epoch != self.epoch:
                if self.epoch:  # a new scheduler process: what we had in flight is gone with the old one
                    self.awaiting_scheduler_loss = False
                    self.mark_lost("the scheduler restarted")
                self.epoch = msg.epoch
            kind = msg.WhichOneof("kind")
            if kind == "outputs":
                for ro in msg.outputs.outputs:
                    queue = self._streams.get(ro.request_id)
                    if queue is not None:
                        queue.put_nowait(ro)
                    if ro.finish_reason != engine_pb2.FINISH_REASON_UNSPECIFIED:
                        self._in_engine.discard(ro.request_id)
            elif kind == "kv_events":
                if self.on_kv_events is not None:
                    self.on_kv_events(msg.kv_events)
            elif kind in ("stats", "aborted"):
                answer = getattr(msg, kind)
                future = self._waiters.get(answer.query_id)
                if future is not None and not future.done():
                    future.set_result(answer)
            elif kind == "ready" and not self.awaiting_scheduler_loss:
                became_ready = self.ready is None
                self.ready = msg.ready
                if became_ready:
                    self.times_ready += 1
                    log.info("engine ready: %s, max_model_len %d", msg.ready.model.model_name,
                             msg.ready.max_model_len)
                    self._notify(True)
            elif kind == "lost":
                self.awaiting_scheduler_loss = False
                self.mark_lost(msg.lost.reason)
            elif kind == "not_ready":
                self.awaiting_scheduler_loss = False  # it knows the engine is down
                if msg.not_ready.refused and msg.not_ready.refused != self.refused:
                    log.error("the engine cannot start: %s", msg.not_ready.refused)
                self.refused = msg.not_ready.refused
                if self.ready is not None:
                    self.mark_lost(f"the scheduler has {msg.not_ready.num_executors} of "
                                   f"{msg.not_ready.world_size} executors")

    def _send_hello(self) -> None:
        self._send(engine_pb2.FrontendToScheduler(hello=engine_pb2.Hello(
            frontend_name=self.name, kv_events=self.on_kv_events is not None)))

    async def _hello_loop(self) -> None:
        while True:
            self._send_hello()
            await asyncio.sleep(HELLO_INTERVAL_S)
            silent = time.monotonic() - self.last_heard
            if self.ready is not None and silent > SCHEDULER_TIMEOUT_S:
                self.mark_lost(f"no answer from the scheduler for {silent:.1f}s")

    def _notify(self, ready: bool) -> None:
        for callback in self.on_ready_change:
            callback(ready)

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self.sock.close()
        self.ctx.term()
