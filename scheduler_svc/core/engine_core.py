"""The scheduler process's logic, apart from its sockets: the single writer of block tables and of the
prefix index (invariant 1).

Each iteration it takes requests and aborts from front ends, plans a step, sends the plan to every
executor rank, waits for rank 0's result, applies it, and sends per-request outputs back. The sockets
are behind a Transport (scheduler_process.py has the ZeroMQ one), so the loop can be driven in tests.
"""
from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass
from typing import Protocol

from protos import engine_pb2
from scheduler_svc.common.config import EngineConfig
from scheduler_svc.common.profiling import PythonProfileWindow
from scheduler_svc.core.scheduler import Scheduler
from scheduler_svc.core.scheduler_config import SchedulerConfig
from scheduler_svc.core.scheduler_output import SchedulerOutput, StepUpdate
from scheduler_svc.core.sequence import Sequence
from scheduler_svc.core.step_plan import build_step_plan

log = logging.getLogger("nanoserve.scheduler")

IDLE_POLL_MS = 50
UNFINISHED = engine_pb2.FINISH_REASON_UNSPECIFIED


class EngineLostError(Exception):
    """An executor died or stopped answering."""


class ExecutorReplaced(EngineLostError):
    """A rank shook hands again from a new process: the old one is gone, with its KV pool."""

    def __init__(self, handshake: engine_pb2.ExecutorHandshake) -> None:
        super().__init__(f"executor rank {handshake.rank} restarted (now pid {handshake.pid})")
        self.handshake = handshake


class Transport(Protocol):
    """The scheduler's two sockets: front ends and executors, each peer known by an opaque identity."""

    def send_frontend(self, identity: bytes, msg: engine_pb2.SchedulerToFrontend) -> None:
        """Best effort: a front end that is gone loses the message."""

    def send_executor(self, rank: int, msg: engine_pb2.SchedulerToExecutor) -> None:
        """Raises EngineLostError when the rank cannot be reached."""

    def poll(self, timeout_ms: int, core: "EngineCore") -> None:
        """Wait up to timeout_ms, then hand every message waiting to core.on_frontend / core.on_executor."""


@dataclass
class InFlightStep:
    step_id: int
    out: SchedulerOutput
    launched_at: float


@dataclass
class StepTimings:
    """Wall-clock accounting of the step loop, named as the fields of engine_pb2.SchedulerStats."""

    prefill_step_seconds: float = 0.0
    decode_step_seconds: float = 0.0
    executor_busy_seconds: float = 0.0
    executor_idle_seconds: float = 0.0


class EngineCore:
    def __init__(self, config: EngineConfig, transport: Transport) -> None:
        self.config = config
        self.transport = transport
        self.world_size = config.tensor_parallel_size
        self.handshakes: dict[int, engine_pb2.ExecutorHandshake] = {}
        self.last_seen: dict[int, float] = {}
        self.scheduler: Scheduler | None = None  # made once every rank has shaken hands
        self.ready: engine_pb2.EngineReady | None = None
        self.frontends: set[bytes] = set()
        self.step_id = 0
        self.stopping = False
        # async scheduling: plan step N+1 while step N runs (the executors fill in its sampled tokens)
        self.pipeline_depth = config.max_steps_in_flight if config.async_scheduling else 1
        self.in_flight: deque[InFlightStep] = deque()
        self.results: dict[int, engine_pb2.StepResult] = {}
        self.last_result_at = 0.0
        self.timings = StepTimings()
        self.py_profile = PythonProfileWindow.from_env("scheduler")

    # ------------------------------------------------------------------ front ends

    def on_frontend(self, identity: bytes, payload: bytes) -> None:
        msg = engine_pb2.FrontendToScheduler.FromString(payload)
        kind = msg.WhichOneof("kind")
        self.frontends.add(identity)
        if kind == "hello":
            if self.ready is not None:
                self.transport.send_frontend(identity, engine_pb2.SchedulerToFrontend(ready=self.ready))
        elif kind == "add":
            self._add_request(identity, msg.add)
        elif kind == "abort":
            for request_id in msg.abort.request_ids:
                self._abort(request_id, engine_pb2.FINISH_REASON_ABORT)
        elif kind == "stats":
            self.transport.send_frontend(identity, engine_pb2.SchedulerToFrontend(stats=self._stats(msg.stats.query_id)))

    def _add_request(self, identity: bytes, add: engine_pb2.AddRequest) -> None:
        if self.scheduler is None:
            return self._reject(identity, add, "engine not ready: executors have not finished their handshake")
        seq = Sequence(
            seq_id=self.scheduler.new_seq_id(), request_id=add.request_id, token_ids=list(add.prompt_token_ids),
            num_prompt_tokens=len(add.prompt_token_ids), sampling=add.sampling, stopping=add.stopping,
            priority=add.priority, group_id=add.group_id, reply_to=identity,
            beam_options=add.beam_search if add.beam_search.beam_width > 0 else None,
        )
        try:
            self.scheduler.add(seq)
        except ValueError as exc:
            self._reject(identity, add, str(exc))

    def _reject(self, identity: bytes, add: engine_pb2.AddRequest, reason: str) -> None:
        out = engine_pb2.RequestOutput(request_id=add.request_id, finish_reason=engine_pb2.FINISH_REASON_ERROR,
                                       error=reason, stop_token_id=-1, num_prompt_tokens=len(add.prompt_token_ids))
        self.transport.send_frontend(identity, engine_pb2.SchedulerToFrontend(
            outputs=engine_pb2.StepOutputs(outputs=[out])))

    def _abort(self, request_id: str, reason: int, error: str = "") -> None:
        """End a request now with one terminal output (invariant 7); unknown or finished ids are ignored."""
        seq = self.scheduler.abort(request_id) if self.scheduler is not None else None
        if seq is None:
            return
        out = engine_pb2.RequestOutput(
            request_id=request_id, finish_reason=reason, error=error, stop_token_id=-1,
            num_prompt_tokens=seq.num_prompt_tokens, num_cached_tokens=seq.num_cached_tokens)
        self.transport.send_frontend(seq.reply_to, engine_pb2.SchedulerToFrontend(
            outputs=engine_pb2.StepOutputs(outputs=[out])))

    def _stats(self, query_id: int) -> engine_pb2.SchedulerStats:
        stats = engine_pb2.SchedulerStats(query_id=query_id, engine_ready=self.ready is not None,
                                          **vars(self.timings))
        if self.scheduler is not None:
            for key, value in self.scheduler.stats().items():
                setattr(stats, key, value)
        return stats

    # ------------------------------------------------------------------ executors

    def on_executor(self, identity: bytes, payload: bytes) -> None:
        msg = engine_pb2.ExecutorToScheduler.FromString(payload)
        kind = msg.WhichOneof("kind")
        if kind == "heartbeat":
            self.last_seen[msg.heartbeat.rank] = time.monotonic()
        elif kind == "handshake":
            self._on_handshake(msg.handshake)
        elif kind == "result":
            self.results[msg.result.step_id] = msg.result

    def _on_handshake(self, hs: engine_pb2.ExecutorHandshake) -> None:
        log.info("executor rank %d/%d joined (pid %d): %d blocks of %d on %s, %s, backend %s", hs.rank,
                 hs.world_size, hs.pid, hs.num_blocks, hs.block_size, hs.device, hs.dtype, hs.attention_backend)
        if hs.world_size != self.world_size or hs.block_size != self.config.block_size:
            log.error("executor rank %d disagrees on world size or block size; ignored", hs.rank)
            return
        old = self.handshakes.get(hs.rank)
        if old is not None and old.pid != hs.pid and self.scheduler is not None:
            raise ExecutorReplaced(hs)
        self.handshakes[hs.rank] = hs
        self.last_seen[hs.rank] = time.monotonic()
        if len(self.handshakes) == self.world_size and self.scheduler is None:
            self._start_serving()

    def _start_serving(self) -> None:
        rank0 = self.handshakes[0]
        num_blocks = min(h.num_blocks for h in self.handshakes.values())  # the scheduler serves the smallest pool
        max_model_len = min(self.config.max_model_len or rank0.max_position_embeddings, rank0.max_position_embeddings)
        self.scheduler = Scheduler(SchedulerConfig(
            max_num_seqs=self.config.max_num_seqs,
            max_num_batched_tokens=self.config.max_num_batched_tokens,
            max_model_len=max_model_len,
            block_size=self.config.block_size,
            num_blocks=num_blocks,
            enable_prefix_caching=self.config.enable_prefix_caching,
            eos_token_ids=tuple(rank0.eos_token_ids),
            num_host_blocks=min(h.num_host_blocks for h in self.handshakes.values()),
        ))
        facts = engine_pb2.ExecutorHandshake()
        facts.CopyFrom(rank0)
        facts.num_blocks = num_blocks
        self.ready = engine_pb2.EngineReady(model=facts, max_model_len=max_model_len)
        log.info("serving %s: %d KV blocks, max_model_len %d", rank0.model_name, num_blocks, max_model_len)
        for identity in self.frontends:
            self.transport.send_frontend(identity, engine_pb2.SchedulerToFrontend(ready=self.ready))

    def _check_liveness(self) -> None:
        now = time.monotonic()
        for rank in self.handshakes:
            if now - self.last_seen.get(rank, now) > self.config.executor_timeout_s:
                raise EngineLostError(f"executor rank {rank} sent no heartbeat for {self.config.executor_timeout_s:.0f}s")

    def _engine_lost(self, reason: str, spare_rank: int | None = None) -> None:
        """Fail every in-flight request, free every block, and wait for executors to shake hands again.
        Surviving ranks are told to exit (a tensor-parallel group restarts whole), except spare_rank,
        whose identity already belongs to a fresh process."""
        log.error("engine lost: %s", reason)
        self.in_flight.clear()
        self.results.clear()
        if self.scheduler is not None:
            for request_id in list(self.scheduler.requests):
                self._abort(request_id, engine_pb2.FINISH_REASON_ERROR, error=f"engine lost: {reason}")
        for identity in self.frontends:
            self.transport.send_frontend(identity, engine_pb2.SchedulerToFrontend(
                lost=engine_pb2.EngineLost(reason=reason)))
        self._shutdown_executors(reason, spare_rank)
        self.handshakes.clear()
        self.last_seen.clear()
        self.scheduler = None
        self.ready = None

    def _shutdown_executors(self, reason: str, spare_rank: int | None = None) -> None:
        for rank in list(self.handshakes):
            if rank == spare_rank:
                continue
            try:
                self.transport.send_executor(rank, engine_pb2.SchedulerToExecutor(
                    shutdown=engine_pb2.Shutdown(reason=reason)))
            except EngineLostError:
                pass  # already gone

    # ------------------------------------------------------------------ the loop

    def run(self) -> None:
        log.info("scheduler waiting for %d executor(s)", self.world_size)
        while not self.stopping:
            busy = self.scheduler is not None and (self.scheduler.has_unfinished() or self.in_flight)
            try:
                self.transport.poll(0 if busy else IDLE_POLL_MS, self)
                self._check_liveness()
                self._advance()
            except EngineLostError as exc:
                fresh = exc.handshake if isinstance(exc, ExecutorReplaced) else None
                self._engine_lost(str(exc), spare_rank=fresh.rank if fresh else None)
                if fresh is not None:
                    self._on_handshake(fresh)
        self._shutdown_executors("stop")

    def _advance(self) -> None:
        """Plan ahead while fewer than pipeline_depth steps are in flight, else apply the oldest result."""
        if self.scheduler is None:
            return
        if len(self.in_flight) < self.pipeline_depth and self.scheduler.has_unfinished():
            if self._launch_step():
                return
        if self.in_flight:
            updates, sampled = self._finish_step(self.in_flight.popleft())
            # the executor may be waiting for a plan: send the next one before telling the front ends
            if self.scheduler.has_unfinished() and len(self.in_flight) < self.pipeline_depth:
                self._launch_step()
            self._emit(updates, sampled)
        elif self.scheduler.has_unfinished():
            time.sleep(0.001)  # nothing fits this instant (e.g. all waiting on blocks); don't spin hot

    def _launch_step(self) -> bool:
        out = self.scheduler.schedule()
        if not out.scheduled:
            return False
        self.step_id += 1
        if self.py_profile is not None:
            self.py_profile.on_step()
        msg = engine_pb2.SchedulerToExecutor(plan=build_step_plan(self.step_id, out, self.pipeline_depth == 1))
        for rank in range(self.world_size):
            self.transport.send_executor(rank, msg)
        self.in_flight.append(InFlightStep(self.step_id, out, time.perf_counter()))
        return True

    def _finish_step(self, step: InFlightStep) -> tuple[list[StepUpdate], dict[int, engine_pb2.SampledToken]]:
        """Apply a step's result to the scheduler; returns what _emit tells the front ends."""
        result = self._wait_result(step.step_id)
        now = time.perf_counter()
        # steps overlap, so a step's share of the wall clock runs from the later of its launch and the last reply
        elapsed = now - max(step.launched_at, self.last_result_at)
        t = self.timings
        if step.out.has_prefill:
            t.prefill_step_seconds += elapsed
        else:
            t.decode_step_seconds += elapsed
        self.last_result_at = now
        t.executor_busy_seconds += result.execute_seconds
        t.executor_idle_seconds += result.idle_seconds
        out = step.out
        if result.error:
            log.error("step %d failed: %s", step.step_id, result.error)
            for item in out.scheduled:
                for request_id in self.scheduler.request_ids(item.seq):
                    self._abort(request_id, engine_pb2.FINISH_REASON_ERROR, error=f"executor: {result.error}")
            self.scheduler.postprocess(out, {})
            return [], {}
        sampled = {s.seq_id: s for s in result.sampled}
        candidates = None
        if self.scheduler.beams.searches:  # beams choose among their top candidates, not the sampled token
            candidates = {k: (v.logprobs.top_token_ids, v.logprobs.top_logprobs) for k, v in sampled.items()
                          if v.HasField("logprobs")}
        return self.scheduler.postprocess(out, {k: v.token_id for k, v in sampled.items()}, candidates), sampled

    def _wait_result(self, step_id: int) -> engine_pb2.StepResult:
        while step_id not in self.results:
            self.transport.poll(IDLE_POLL_MS, self)
            self._check_liveness()
        return self.results.pop(step_id)

    def _emit(self, updates: list[StepUpdate], sampled: dict[int, engine_pb2.SampledToken]) -> None:
        """One StepOutputs message per front end, with an output for each request that has news."""
        by_frontend: dict[bytes, engine_pb2.StepOutputs] = {}
        for update in updates:
            seq = update.seq
            if update.new_token_id is None and update.finish_reason == UNFINISHED:
                continue  # a prefill chunk that did not reach the end: nothing to say yet
            out = engine_pb2.RequestOutput(
                request_id=seq.request_id, finish_reason=update.finish_reason, stop_token_id=seq.stop_token_id,
                num_prompt_tokens=seq.num_prompt_tokens, num_cached_tokens=seq.num_cached_tokens)
            if update.new_token_id is not None:
                out.new_token_ids.append(update.new_token_id)
                token = sampled.get(seq.seq_id)
                if token is not None and token.HasField("logprobs"):
                    out.logprobs.append(token.logprobs)
            elif seq.beam_options is not None:
                out.new_token_ids.extend(seq.output_token_ids)  # a beam search's hypothesis, whole
                out.logprobs.extend(engine_pb2.TokenLogprobs(
                    sampled_logprob=lp, sampled_rank=rank, top_token_ids=ids, top_logprobs=lps)
                    for lp, rank, ids, lps in seq.beam_logprobs)
            by_frontend.setdefault(seq.reply_to, engine_pb2.StepOutputs()).outputs.append(out)
        for identity, outputs in by_frontend.items():
            self.transport.send_frontend(identity, engine_pb2.SchedulerToFrontend(outputs=outputs))
