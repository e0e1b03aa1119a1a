"""The scheduler process's logic, apart from its sockets: the single writer of block tables and of the
prefix index (invariant 1).

Each iteration it takes requests and aborts from front ends, plans a step, sends the plan to every
executor rank, waits for rank 0's result, applies it, and sends per-request outputs back. What each front-end
message does is in frontend_requests.py. The sockets are behind a Transport (scheduler_process.py has the
ZeroMQ one), so the loop can be driven in tests.

Every message is checked before it touches any state (message_checks.py); a bad one is dropped, logged
with its peer's identity and counted. Every message out carries this process's epoch, so peers notice
a restarted scheduler, and nothing an executor sent for an earlier epoch is ever applied.
"""
from __future__ import annotations

import logging
import secrets
import time
from bisect import bisect_left
from collections import deque
from dataclasses import dataclass, field
from typing import Protocol

from google.protobuf.message import DecodeError

from protos import engine_pb2
from scheduler_svc.common.config import EngineConfig
from scheduler_svc.common.profiling import PythonProfileWindow
from scheduler_svc.core.executor_registry import EngineLostError, ExecutorRegistry, ExecutorReplaced
from scheduler_svc.core.message_checks import BadMessage, check_handshake, check_heartbeat, check_step_result
from scheduler_svc.core import frontend_requests, kv_events, request_outputs
from scheduler_svc.core.kv_events import KvEventLog
from scheduler_svc.core.scheduler import Scheduler
from scheduler_svc.core.scheduler_config import scheduler_config
from scheduler_svc.core.scheduler_output import SchedulerOutput, StepUpdate
from scheduler_svc.core.step_plan import build_step_plan

log = logging.getLogger("nanoserve.scheduler")

IDLE_POLL_MS = 50
HOUSEKEEPING_INTERVAL_S = 0.5  # how often silent front ends and incomplete beam searches are looked for
PROBE_FOR_S = 2.0  # after an executor connection drops, how long every rank is probed
PROBE_INTERVAL_S = 0.05
ERROR = engine_pb2.FINISH_REASON_ERROR


class Transport(Protocol):
    """The scheduler's two sockets: front ends and executors, each peer known by an opaque identity."""

    def send_frontend(self, identity: bytes, msg: engine_pb2.SchedulerToFrontend) -> None:
        """Best effort, never blocking: a front end that is gone or not reading loses the message."""

    def send_executor(self, rank: int, msg: engine_pb2.SchedulerToExecutor) -> None:
        """Raises EngineLostError when the rank cannot be reached."""

    def poll(self, timeout_ms: int, core: "EngineCore") -> None:
        """Wait up to timeout_ms, then hand every message waiting to core.on_frontend / core.on_executor."""


@dataclass
class InFlightStep:
    step_id: int
    out: SchedulerOutput
    launched_at: float


# Steps by wall time (SchedulerStats.step_seconds_counts): a decode step is a few ms on a GPU, tens to hundreds
# on the CPU; a Triton compile or a CUDA graph capture inside a step takes a second or more.
STEP_SECONDS_BOUNDS = (0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)


@dataclass
class StepTimings:
    """Wall-clock accounting of the step loop, named as the fields of engine_pb2.SchedulerStats."""

    prefill_step_seconds: float = 0.0
    decode_step_seconds: float = 0.0
    step_seconds_bounds: tuple[float, ...] = STEP_SECONDS_BOUNDS
    step_seconds_counts: list[int] = field(default_factory=lambda: [0] * (len(STEP_SECONDS_BOUNDS) + 1))
    executor_busy_seconds: float = 0.0
    executor_idle_seconds: float = 0.0
    late_mask_wait_seconds: float = 0.0
    measured_swap_seconds: float = 0.0  # rank 0's swap copies, as its results report them


class EngineCore:
    def __init__(self, config: EngineConfig, transport: Transport) -> None:
        self.config = config
        self.transport = transport
        self.world_size = config.tensor_parallel_size
        self.epoch = secrets.randbits(63) | 1  # this process's incarnation; never 0, the "not yet known" value
        self.executors = ExecutorRegistry(self.world_size, config.executor_timeout_s)
        self.scheduler: Scheduler | None = None  # made once every rank has shaken hands
        self.ready: engine_pb2.EngineReady | None = None
        self.frontends: dict[bytes, float] = {}  # identity -> when it was last heard from (monotonic)
        self.kv_subscribers: set[bytes] = set()  # front ends that follow the prefix index (Hello.kv_events)
        self.kv_event_log: KvEventLog | None = None  # attached to the block pool while someone subscribes
        self.num_rejected_messages = 0
        self.handshake_refused = ""  # why the last handshake was refused, told to front ends waiting for ready
        self.step_id = 0
        self.stopping = False
        # async scheduling: plan step N+1 while step N runs (the executors fill in its sampled tokens)
        self.pipeline_depth = config.max_steps_in_flight if config.async_scheduling else 1
        self.in_flight: deque[InFlightStep] = deque()
        self.results: dict[int, engine_pb2.StepResult] = {}
        self.last_result_at = 0.0
        self.next_housekeeping = 0.0
        self.probe_until = self.next_probe = 0.0
        self.timings = StepTimings()
        self.py_profile = PythonProfileWindow.from_env("scheduler")

    # ------------------------------------------------------------------ messages out

    def to_frontend(self, identity: bytes, msg: engine_pb2.SchedulerToFrontend) -> None:
        msg.epoch = self.epoch
        self.transport.send_frontend(identity, msg)

    def to_executor(self, rank: int, msg: engine_pb2.SchedulerToExecutor) -> None:
        msg.epoch = self.epoch
        self.transport.send_executor(rank, msg)

    def reject_message(self, identity: bytes, reason: str) -> None:
        """A message that is malformed or breaks a rule: dropped whole, logged and counted."""
        self.num_rejected_messages += 1
        log.warning("dropped a message from %r: %s", identity, reason)

    # ------------------------------------------------------------------ front ends

    def on_frontend(self, identity: bytes, payload: bytes) -> None:
        """Heartbeats, new requests, aborts and stats queries: frontend_requests.py."""
        frontend_requests.on_frontend(self, identity, payload)

    def stats(self, query_id: int) -> engine_pb2.SchedulerStats:
        """The answer to a stats query: the loop's counters and timings, then the scheduler's."""
        stats = engine_pb2.SchedulerStats(query_id=query_id, engine_ready=self.ready is not None,
                                          num_rejected_messages=self.num_rejected_messages, **vars(self.timings))
        if self.scheduler is not None:
            for key, value in self.scheduler.stats().items():
                if isinstance(value, list):  # a repeated field
                    getattr(stats, key).extend(value)
                else:
                    setattr(stats, key, value)
        return stats

    # ------------------------------------------------------------------ KV events (kv_events.py)

    def follow_kv_events(self, identity: bytes, wanted: bool) -> None:
        if wanted == (identity in self.kv_subscribers):
            return
        if not wanted:
            self.kv_subscribers.discard(identity)
            self._attach_kv_event_log()
            return
        self.publish_kv_events()  # those already logged belong to the earlier subscribers only
        self.kv_subscribers.add(identity)
        self._attach_kv_event_log()
        pool = self.scheduler.block_manager.pool if self.scheduler is not None else None
        events = kv_events.snapshot(pool) if pool is not None else engine_pb2.KvEvents(cleared=True)
        self.to_frontend(identity, engine_pb2.SchedulerToFrontend(kv_events=events))

    def _attach_kv_event_log(self) -> None:
        """Log the index's changes while someone subscribes, and only then."""
        if not self.kv_subscribers:
            self.kv_event_log = None
        elif self.kv_event_log is None:
            self.kv_event_log = KvEventLog()
        if self.scheduler is not None:
            self.scheduler.block_manager.pool.listener = self.kv_event_log

    def publish_kv_events(self, cleared: bool = False) -> None:
        """Send what the index gained and lost since the last time to every subscriber."""
        events = self.kv_event_log.drain() if self.kv_event_log is not None else None
        if cleared and self.kv_subscribers:
            events = events or engine_pb2.KvEvents()
            del events.events[:]  # the index they described is gone
            events.cleared = True
        if events is not None:
            for identity in self.kv_subscribers:
                self.to_frontend(identity, engine_pb2.SchedulerToFrontend(kv_events=events))

    # ------------------------------------------------------------------ executors

    def on_executor(self, identity: bytes, payload: bytes) -> None:
        try:
            msg = engine_pb2.ExecutorToScheduler.FromString(payload)
        except DecodeError as exc:
            return self.reject_message(identity, f"not an ExecutorToScheduler: {exc}")
        kind = msg.WhichOneof("kind")
        try:
            if kind == "heartbeat":  # of any epoch: a live executor this scheduler may not know yet
                self._on_heartbeat(identity, msg.heartbeat)
            elif msg.epoch not in (0, self.epoch):
                raise BadMessage(f"a {kind} of scheduler epoch {msg.epoch}, not this one's ({self.epoch})")
            elif kind == "handshake":
                try:
                    check_handshake(msg.handshake, identity, self.world_size, self.config.block_size)
                except BadMessage as exc:
                    self.handshake_refused = f"executor rank {msg.handshake.rank}'s handshake refused: {exc}"
                    raise
                self._join(msg.handshake)
            elif kind == "result":
                check_step_result(msg.result, identity, {s.step_id for s in self.in_flight})
                self.results[msg.result.step_id] = msg.result
            else:
                raise BadMessage("an ExecutorToScheduler with no message in it")
        except BadMessage as exc:
            self.reject_message(identity, str(exc))

    def on_executor_disconnected(self) -> None:
        """A connection on the executor socket dropped: probe every rank for a while. A send to a dead rank
        fails at once, so its streams fail within moments, not after --executor-timeout-s of silence."""
        self.probe_until = time.monotonic() + PROBE_FOR_S

    def _check_executors(self) -> None:
        self.executors.check_liveness()
        now = time.monotonic()
        if now < self.probe_until and now >= self.next_probe:
            self.next_probe = now + PROBE_INTERVAL_S
            for rank in list(self.executors.handshakes):
                self.to_executor(rank, engine_pb2.SchedulerToExecutor())  # empty: executors ignore it

    def _on_heartbeat(self, identity: bytes, hb: engine_pb2.Heartbeat) -> None:
        check_heartbeat(hb, identity, self.world_size)
        self.executors.heard_from(hb.rank)
        if hb.rank not in self.executors.handshakes:
            # alive but unknown (this scheduler restarted, or a handshake is on its way): it shakes hands again,
            # dropping what it held for an earlier scheduler. Safe while a handshake is on its way: the executor
            # reads this request before any plan that the handshake lets the scheduler send.
            try:
                self.to_executor(hb.rank, engine_pb2.SchedulerToExecutor(
                    handshake_request=engine_pb2.HandshakeRequest()))
            except EngineLostError:
                pass  # its main socket is not connected yet: the next heartbeat asks again

    def _join(self, hs: engine_pb2.ExecutorHandshake) -> None:
        self.executors.join(hs, serving=self.scheduler is not None)
        if self.executors.complete and self.scheduler is None:
            self._start_serving()

    def _start_serving(self) -> None:
        self.ready = self.executors.engine_facts(self.config.max_model_len, self.config.max_num_seqs)
        config = scheduler_config(self.config, self.ready)
        self.scheduler = Scheduler(config)
        self._attach_kv_event_log()
        facts, costs = self.ready.model, config.preemption_costs
        log.info("serving %s: %d KV blocks, %d host blocks, max_model_len %d; preemption %s, %s", facts.model_name,
                 facts.num_blocks, facts.num_host_blocks, self.ready.max_model_len, config.preemption_mode,
                 config.preemption_policy)
        log.info("preemption costs: KV block %.0f KiB, host link %.2f GB/s + %.1f us per copy, prefill %.0f tok/s "
                 "(0: not measured)", costs.block_bytes / 1024, costs.host_link_bytes_per_s / 1e9,
                 costs.copy_fixed_s * 1e6, costs.prefill_tokens_per_s)
        for identity in self.frontends:
            self.to_frontend(identity, engine_pb2.SchedulerToFrontend(ready=self.ready))

    def _engine_lost(self, reason: str, spare_rank: int | None = None) -> None:
        """Fail every in-flight request, free every block, and wait for executors to shake hands again.
        Surviving ranks are told to exit (a tensor-parallel group restarts whole), except spare_rank,
        whose identity already belongs to a fresh process."""
        log.error("engine lost: %s", reason)
        self.in_flight.clear()
        self.results.clear()
        if self.scheduler is not None:
            for identity, request_id in list(self.scheduler.requests):
                frontend_requests.abort(self, identity, request_id, ERROR, error=f"engine lost: {reason}")
        for identity in self.frontends:
            self.to_frontend(identity, engine_pb2.SchedulerToFrontend(lost=engine_pb2.EngineLost(reason=reason)))
        self._shutdown_executors(self.executors.forget(), reason, spare_rank)
        if self.scheduler is not None:
            self.scheduler.close()
        self.scheduler = None
        self.ready = None
        self.publish_kv_events(cleared=True)

    def _shutdown_executors(self, ranks: list[int], reason: str, spare_rank: int | None = None) -> None:
        for rank in ranks:
            if rank == spare_rank:
                continue
            try:
                self.to_executor(rank, engine_pb2.SchedulerToExecutor(shutdown=engine_pb2.Shutdown(reason=reason)))
            except EngineLostError:
                pass  # already gone

    # ------------------------------------------------------------------ the loop

    def run(self) -> None:
        log.info("scheduler (epoch %x) waiting for %d executor(s)", self.epoch, self.world_size)
        while not self.stopping:
            self.run_once()
        self._shutdown_executors(list(self.executors.handshakes), "stop")

    def run_once(self, idle_poll_ms: int = IDLE_POLL_MS) -> None:
        """One turn of the loop: read the sockets, check the executors, then plan or apply a step."""
        busy = self.scheduler is not None and (self.scheduler.has_unfinished() or self.in_flight)
        try:
            self.transport.poll(0 if busy else idle_poll_ms, self)
            self._check_executors()
            self._housekeeping()
            self._advance()
            self.publish_kv_events()
        except EngineLostError as exc:
            fresh = exc.handshake if isinstance(exc, ExecutorReplaced) else None
            self._engine_lost(str(exc), spare_rank=fresh.rank if fresh else None)
            if fresh is not None:
                self._join(fresh)

    def _housekeeping(self) -> None:
        """Now and then: forget silent front ends, aborting their requests, and fail beam searches whose
        members never all arrived."""
        now = time.monotonic()
        if now < self.next_housekeeping:
            return
        self.next_housekeeping = now + HOUSEKEEPING_INTERVAL_S
        for identity in [f for f, seen in self.frontends.items() if now - seen > self.config.frontend_timeout_s]:
            del self.frontends[identity]
            self.follow_kv_events(identity, False)
            mine = [rid for f, rid in self.scheduler.requests if f == identity] if self.scheduler else []
            if mine:
                log.warning("front end %r silent for %.0fs: aborting its %d requests", identity,
                            self.config.frontend_timeout_s, len(mine))
            for request_id in mine:
                self.scheduler.abort(request_id, identity)
        if self.scheduler is not None and self.scheduler.beams.searches:
            timeout = self.config.beam_group_timeout_s
            for member in self.scheduler.abort_incomplete_beam_searches(older_than=now - timeout):
                frontend_requests.tell_ended(self, member, ERROR, f"beam search group {member.group_id!r}: not all "
                                             f"its requests arrived within {timeout:.0f}s")

    def _advance(self) -> None:
        """Plan ahead while fewer than _depth() steps are in flight, else apply the oldest result."""
        if self.scheduler is None:
            return
        if self.scheduler.structured.compiling:  # grammars compile in a worker thread; the loop never waits
            for seq, error in self.scheduler.admit_compiled_grammars():
                frontend_requests.tell_ended(self, seq, ERROR, error)
        if len(self.in_flight) < self._depth() and self.scheduler.has_unfinished():
            if self._launch_step():
                return
        if self.in_flight:
            # still in flight until its result is in; the next step's late masks go out on the way
            updates, sampled = self._finish_step(self.in_flight[0])
            # the executor may be waiting for a plan: send the next one before telling the front ends
            if self.scheduler.has_unfinished() and len(self.in_flight) < self._depth():
                self._launch_step()
            self._emit(updates, sampled)
        elif self.scheduler.has_unfinished():
            # nothing fits this instant (e.g. all waiting on blocks): wait for the next message, which is what can
            # change that, rather than sleep (a 1 ms sleep took 10 ms on the H200 machine: 6 of 500 steps there)
            self.transport.poll(1, self)

    def _depth(self) -> int:
        """Steps planned ahead of the oldest unanswered one. While constrained sequences run, one more: rank 0
        waits for their late masks, which the answer to the step before fills, so with --max-steps-in-flight
        plans only the next plan sat on that path too (H200, half of nano-vLLM's workload under a JSON
        schema: 0.720x of all free at 3 in flight, 0.679x at 2, in one call)."""
        if self.pipeline_depth > 1 and self.scheduler.structured.matchers:
            return self.pipeline_depth + 1
        return self.pipeline_depth

    def _launch_step(self) -> bool:
        out = self.scheduler.schedule()
        if not out.scheduled:
            return False
        self.step_id += 1
        if self.py_profile is not None:
            self.py_profile.on_step()
        msg = engine_pb2.SchedulerToExecutor(plan=build_step_plan(self.step_id, out, self.pipeline_depth == 1))
        for rank in range(self.world_size):
            self.to_executor(rank, msg)
        self.in_flight.append(InFlightStep(self.step_id, out, time.perf_counter()))
        return True

    def _send_late_masks(self, answered: SchedulerOutput | None = None, tokens: dict[int, int] | None = None) -> None:
        """The oldest step in flight may hold constrained samples planned on tokens of the step just answered:
        their masks go to rank 0 (the only one that samples), which waits for them before sampling it. With
        the answered step's tokens (checked, not applied yet), exactly those rows' matchers take theirs first;
        postprocess applies the rest after the masks are sent."""
        if not (self.in_flight and self.in_flight[0].out.late_masked):
            return
        step = self.in_flight[0]
        if answered is not None:
            self.scheduler.accept_ahead(answered, tokens, step.out.late_masked)
        msg = engine_pb2.SchedulerToExecutor()  # filled in place: a constructor would copy the masks whole
        self.scheduler.structured.late_masks(msg.late_masks, step.step_id, step.out.late_masked)
        self.to_executor(0, msg)

    def _finish_step(self, step: InFlightStep) -> tuple[list[StepUpdate], dict[int, engine_pb2.SampledToken]]:
        """Apply a step's result to the scheduler and send the next step's late masks (as soon as they can be
        filled: rank 0 waits on them); returns what _emit tells the front ends."""
        result = self._wait_result(step.step_id)
        self.in_flight.popleft()
        now = time.perf_counter()
        # steps overlap, so a step's share of the wall clock runs from the later of its launch and the last reply
        elapsed = now - max(step.launched_at, self.last_result_at)
        t = self.timings
        if step.out.has_prefill:
            t.prefill_step_seconds += elapsed
        else:
            t.decode_step_seconds += elapsed
        t.step_seconds_counts[bisect_left(STEP_SECONDS_BOUNDS, elapsed)] += 1
        self.last_result_at = now
        t.executor_busy_seconds += result.execute_seconds
        t.executor_idle_seconds += result.idle_seconds
        t.late_mask_wait_seconds += result.late_mask_wait_seconds
        t.measured_swap_seconds += result.swap_seconds
        self.scheduler.preemption.costs.observe_step(step.out.num_prefill_tokens, elapsed)
        if not result.error:
            sampled = {s.seq_id: s for s in result.sampled}
            candidates = None
            if self.scheduler.beams.searches:  # beams choose among their top candidates, not the sampled token
                candidates = {k: (v.logprobs.top_token_ids, v.logprobs.top_logprobs) for k, v in sampled.items()
                              if v.HasField("logprobs")}
            tokens = {k: v.token_id for k, v in sampled.items()}
            accepted = None  # speculative decoding: the proposals each verification accepted, before its token
            if self.scheduler.speculator is not None:
                accepted = {k: list(v.accepted_token_ids) for k, v in sampled.items() if v.accepted_token_ids}
            ids = [*tokens.values(), *(t for a in (accepted or {}).values() for t in a)]  # (a draft's accepted too)
            if not ids or (min(ids) >= 0 and max(ids) < self.ready.model.vocab_size):
                try:
                    self.scheduler.check_result(step.out, tokens, candidates, accepted)
                except ValueError as exc:  # refused before anything changed
                    result.error = f"an inconsistent reply: {exc}"
                else:
                    self._send_late_masks(step.out, tokens)
                    return self.scheduler.postprocess(step.out, tokens, candidates, checked=True,
                                                      accepted=accepted), sampled
            else:
                result.error = "an inconsistent reply: a sampled token outside the vocabulary"
            self.reject_message(b"rank0", f"step {step.step_id}: {result.error}")
        self._fail_step(step, result.error)
        self._send_late_masks()  # the failed step's sequences have ended: their late rows are dropped
        return [], {}

    def _fail_step(self, step: InFlightStep, error: str) -> None:
        """A step that failed fails the requests it carried, and only those."""
        log.error("step %d failed: %s", step.step_id, error)
        for item in step.out.scheduled:
            for request in self.scheduler.requests_served_by(item.seq):
                frontend_requests.abort(self, request.reply_to, request.request_id, ERROR, error=f"executor: {error}")
        self.scheduler.postprocess(step.out, {})

    def _wait_result(self, step_id: int) -> engine_pb2.StepResult:
        while step_id not in self.results:
            self.transport.poll(IDLE_POLL_MS, self)
            self._check_executors()
        return self.results.pop(step_id)

    def _emit(self, updates: list[StepUpdate], sampled: dict[int, engine_pb2.SampledToken]) -> None:
        # the blocks this step hashed go out before its outputs: a router that sees a request end already
        # knows where its prefix is cached, and routes the next one sharing it there
        self.publish_kv_events()
        for identity, outputs in request_outputs.step_outputs(updates, sampled).items():
            self.to_frontend(identity, engine_pb2.SchedulerToFrontend(outputs=outputs))
