"""The scheduler process: the single writer of block tables and of the prefix index.

Each iteration it takes requests and aborts from frontends, plans a step, sends the plan to every
executor rank, waits for rank 0's result, applies it, and streams per-request outputs back.
"""
from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import time
from collections import deque
from dataclasses import dataclass

import zmq

from protos import engine_pb2
from scheduler_svc.common.profiling import PythonProfileWindow
from scheduler_svc.common.parent_watch import watch_parent
from scheduler_svc.common.config import EngineConfig, add_engine_args, engine_config_from_args
from scheduler_svc.core.groups.beam_scheduler import BEAM_SEQ_ID_BASE
from scheduler_svc.core.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from scheduler_svc.core.sequence import Sequence
from scheduler_svc.core.step_plan import build_step_plan

log = logging.getLogger("nanoserve.scheduler")

IDLE_POLL_MS = 50


class EngineLostError(Exception):
    """An executor died or stopped answering."""


class ExecutorReplaced(EngineLostError):
    """A rank shook hands again from a new process: the old one is gone, with its KV pool."""

    def __init__(self, handshake: engine_pb2.ExecutorHandshake) -> None:
        super().__init__(f"executor rank {handshake.rank} restarted (now pid {handshake.pid})")
        self.handshake = handshake


@dataclass
class InFlightStep:
    step_id: int
    out: SchedulerOutput
    has_prefill: bool
    launched_at: float


@dataclass
class Request:
    seq: Sequence
    frontend: bytes  # ROUTER identity of the frontend that sent it


class SchedulerProcess:
    def __init__(self, config: EngineConfig, frontend_addr: str, executor_addr: str) -> None:
        self.config = config
        self.world_size = config.tensor_parallel_size
        self.ctx = zmq.Context()
        self.frontend = self.ctx.socket(zmq.ROUTER)
        self.frontend.setsockopt(zmq.LINGER, 0)
        self.frontend.bind(frontend_addr)
        self.executors = self.ctx.socket(zmq.ROUTER)
        self.executors.setsockopt(zmq.LINGER, 0)
        self.executors.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a restarted executor reclaims its identity
        self.executors.bind(executor_addr)
        self.poller = zmq.Poller()
        self.poller.register(self.frontend, zmq.POLLIN)
        self.poller.register(self.executors, zmq.POLLIN)

        self.handshakes: dict[int, engine_pb2.ExecutorHandshake] = {}
        self.last_seen: dict[int, float] = {}
        self.scheduler: Scheduler | None = None
        self.ready: engine_pb2.EngineReady | None = None
        self.frontends: set[bytes] = set()
        self.requests: dict[str, Request] = {}
        self.next_seq_id = 1
        self.arrivals = 0
        self.step_id = 0
        self.stopping = False
        # async scheduling: plan step N+1 while step N runs (the executors fill in its sampled tokens)
        self.pipeline_depth = config.max_steps_in_flight if config.async_scheduling else 1
        self.in_flight: deque[InFlightStep] = deque()
        self.results: dict[int, engine_pb2.StepResult] = {}
        self.last_result_at = 0.0
        self.counters = {"num_finished": 0, "num_aborted": 0, "num_generated_tokens": 0, "num_steps": 0,
                         "num_partial_prefill_chunks": 0, "num_mixed_steps": 0, "num_prefill_tokens": 0,
                         "prefill_step_seconds": 0.0, "decode_step_seconds": 0.0, "executor_busy_seconds": 0.0,
                         "executor_idle_seconds": 0.0}
        self.py_profile = PythonProfileWindow.from_env("scheduler")

    # ------------------------------------------------------------------ frontend side

    def _send_frontend(self, identity: bytes, msg: engine_pb2.SchedulerToFrontend) -> None:
        try:
            self.frontend.send_multipart([identity, msg.SerializeToString()], zmq.NOBLOCK)
        except zmq.ZMQError as exc:  # frontend gone: its requests are aborted when it says so
            log.warning("cannot reach frontend %r: %s", identity, exc)

    def _handle_frontend(self, identity: bytes, payload: bytes) -> None:
        msg = engine_pb2.FrontendToScheduler.FromString(payload)
        kind = msg.WhichOneof("kind")
        self.frontends.add(identity)
        if kind == "hello":
            if self.ready is not None:
                self._send_frontend(identity, engine_pb2.SchedulerToFrontend(ready=self.ready))
        elif kind == "add":
            self._add_request(identity, msg.add)
        elif kind == "abort":
            for request_id in msg.abort.request_ids:
                self._abort(request_id, engine_pb2.FINISH_REASON_ABORT)
        elif kind == "stats":
            self._send_frontend(identity, engine_pb2.SchedulerToFrontend(stats=self._stats(msg.stats.query_id)))

    def _add_request(self, identity: bytes, add: engine_pb2.AddRequest) -> None:
        def reject(reason: str) -> None:
            out = engine_pb2.RequestOutput(request_id=add.request_id, finish_reason=engine_pb2.FINISH_REASON_ERROR,
                                           error=reason, stop_token_id=-1,
                                           num_prompt_tokens=len(add.prompt_token_ids))
            self._send_frontend(identity, engine_pb2.SchedulerToFrontend(
                outputs=engine_pb2.StepOutputs(outputs=[out])))

        if self.scheduler is None:
            return reject("engine not ready: executors have not finished their handshake")
        if add.request_id in self.requests:
            return reject(f"request_id {add.request_id!r} is already in flight")
        seq = Sequence(
            seq_id=self.next_seq_id, request_id=add.request_id, token_ids=list(add.prompt_token_ids),
            num_prompt_tokens=len(add.prompt_token_ids), sampling=add.sampling, stopping=add.stopping,
            priority=add.priority, arrival_order=self.arrivals, group_id=add.group_id,
            beam_options=add.beam_search if add.beam_search.beam_width > 0 else None,
        )
        try:
            self.scheduler.add(seq)
        except ValueError as exc:
            return reject(str(exc))
        self.next_seq_id += 1
        self.arrivals += 1
        self.requests[add.request_id] = Request(seq, identity)

    def _abort(self, request_id: str, reason: int, error: str = "") -> None:
        request = self.requests.pop(request_id, None)
        if request is None or self.scheduler is None:
            return
        self.scheduler.abort(request_id)
        self.counters["num_aborted"] += 1
        out = engine_pb2.RequestOutput(
            request_id=request_id, finish_reason=reason, error=error, stop_token_id=-1,
            num_prompt_tokens=request.seq.num_prompt_tokens, num_cached_tokens=request.seq.num_cached_tokens)
        self._send_frontend(request.frontend, engine_pb2.SchedulerToFrontend(
            outputs=engine_pb2.StepOutputs(outputs=[out])))

    def _stats(self, query_id: int) -> engine_pb2.SchedulerStats:
        stats = engine_pb2.SchedulerStats(query_id=query_id, engine_ready=self.ready is not None, **self.counters)
        if self.scheduler is not None:
            fields = set(engine_pb2.SchedulerStats.DESCRIPTOR.fields_by_name)
            for key, value in self.scheduler.stats().items():
                if key in fields and key not in self.counters:
                    setattr(stats, key, value)
        return stats

    # ------------------------------------------------------------------ executor side

    def _handle_executor(self, identity: bytes, payload: bytes) -> None:
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
        num_blocks = min(h.num_blocks for h in self.handshakes.values())
        max_model_len = self.config.max_model_len or rank0.max_position_embeddings
        max_model_len = min(max_model_len, rank0.max_position_embeddings)
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
            self._send_frontend(identity, engine_pb2.SchedulerToFrontend(ready=self.ready))

    def _check_liveness(self) -> None:
        if not self.handshakes:
            return
        now = time.monotonic()
        for rank in self.handshakes:
            if now - self.last_seen.get(rank, now) > self.config.executor_timeout_s:
                raise EngineLostError(f"executor rank {rank} sent no heartbeat for {self.config.executor_timeout_s:.0f}s")

    def _engine_lost(self, reason: str, spare_rank: int | None = None) -> None:
        """Fail every in-flight request, free every block, and wait for executors to shake hands again.
        Surviving ranks are told to exit (a tensor-parallel group restarts whole), except spare_rank,
        whose identity already belongs to a fresh process."""
        log.error("engine lost: %s", reason)
        for request_id in list(self.requests):
            self._abort(request_id, engine_pb2.FINISH_REASON_ERROR, error=f"engine lost: {reason}")
        for identity in self.frontends:
            self._send_frontend(identity, engine_pb2.SchedulerToFrontend(lost=engine_pb2.EngineLost(reason=reason)))
        for rank in list(self.handshakes):
            if rank == spare_rank:
                continue
            try:
                self._send_executor(rank, engine_pb2.SchedulerToExecutor(shutdown=engine_pb2.Shutdown(reason=reason)))
            except EngineLostError:
                pass  # already gone
        self.handshakes.clear()
        self.last_seen.clear()
        self.scheduler = None
        self.ready = None

    def _send_executor(self, rank: int, msg: engine_pb2.SchedulerToExecutor) -> None:
        try:
            self.executors.send_multipart([f"rank{rank}".encode(), msg.SerializeToString()], zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            raise EngineLostError(f"cannot send to executor rank {rank}: {exc}") from exc

    # ------------------------------------------------------------------ the loop

    def _poll(self, timeout_ms: int) -> None:
        events = dict(self.poller.poll(timeout_ms))
        if self.frontend in events:
            while True:
                try:
                    identity, payload = self.frontend.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                self._handle_frontend(identity, payload)
        if self.executors in events:
            while True:
                try:
                    identity, payload = self.executors.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                self._handle_executor(identity, payload)

    def run(self) -> None:
        log.info("scheduler waiting for %d executor(s)", self.world_size)
        while not self.stopping:
            busy = self.scheduler is not None and (self.scheduler.has_unfinished() or self.in_flight)
            try:
                self._poll(0 if busy else IDLE_POLL_MS)
                self._check_liveness()
                self._advance()
            except EngineLostError as exc:
                self.in_flight.clear()
                self.results.clear()
                fresh = exc.handshake if isinstance(exc, ExecutorReplaced) else None
                self._engine_lost(str(exc), spare_rank=fresh.rank if fresh else None)
                if fresh is not None:
                    self._on_handshake(fresh)
        for rank in list(self.handshakes):
            try:
                self._send_executor(rank, engine_pb2.SchedulerToExecutor(shutdown=engine_pb2.Shutdown(reason="stop")))
            except EngineLostError:
                pass

    def _advance(self) -> None:
        """Plan ahead while fewer than pipeline_depth steps are in flight, else apply the oldest result."""
        if self.scheduler is None:
            return
        if len(self.in_flight) < self.pipeline_depth and self.scheduler.has_unfinished():
            if self._launch_step():
                return
        if self.in_flight:
            outputs = self._finish_step(self.in_flight.popleft())
            # the executor may be waiting for a plan: send the next one before telling the frontends
            if self.scheduler.has_unfinished() and len(self.in_flight) < self.pipeline_depth:
                self._launch_step()
            self._emit(*outputs)
        elif self.scheduler.has_unfinished():
            time.sleep(0.001)  # nothing fits this instant (e.g. all waiting on blocks); don't spin hot

    def _launch_step(self) -> bool:
        out = self.scheduler.schedule()
        if not out.scheduled:
            return False
        self.step_id += 1
        if self.py_profile is not None:
            self.py_profile.on_step()
        has_prefill = self._count_step(out)
        msg = engine_pb2.SchedulerToExecutor(plan=build_step_plan(self.step_id, out, self.pipeline_depth == 1))
        for rank in range(self.world_size):
            self._send_executor(rank, msg)
        self.in_flight.append(InFlightStep(self.step_id, out, has_prefill, time.perf_counter()))
        return True

    def _finish_step(self, step: "InFlightStep") -> tuple[list, dict[int, engine_pb2.SampledToken]]:
        """Apply a step's result to the scheduler; returns what _emit tells the frontends."""
        result = self._wait_result(step.step_id)
        now = time.perf_counter()
        # steps overlap, so a step's share of the wall clock runs from the later of its launch and the last reply
        self.counters["prefill_step_seconds" if step.has_prefill else "decode_step_seconds"] += \
            now - max(step.launched_at, self.last_result_at)
        self.last_result_at = now
        self.counters["num_steps"] += 1
        self.counters["executor_busy_seconds"] += result.execute_seconds
        self.counters["executor_idle_seconds"] += result.idle_seconds
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
                          if k >= BEAM_SEQ_ID_BASE}
        return self.scheduler.postprocess(out, {k: v.token_id for k, v in sampled.items()}, candidates), sampled

    def _count_step(self, out: SchedulerOutput) -> bool:
        """Update step counters; True when the step computes prefill tokens."""
        decodes = prefills = 0
        for item in out.scheduled:
            if not item.samples:
                self.counters["num_partial_prefill_chunks"] += 1
            if item.start >= item.seq.num_prompt_tokens and item.num_new_tokens == 1:
                decodes += 1
            else:
                prefills += 1
                self.counters["num_prefill_tokens"] += item.num_new_tokens
        if decodes and prefills:
            self.counters["num_mixed_steps"] += 1
        return prefills > 0

    def _wait_result(self, step_id: int) -> engine_pb2.StepResult:
        while step_id not in self.results:
            self._poll(IDLE_POLL_MS)
            self._check_liveness()
        return self.results.pop(step_id)

    def _emit(self, updates, sampled: dict[int, engine_pb2.SampledToken]) -> None:
        by_frontend: dict[bytes, engine_pb2.StepOutputs] = {}
        for update in updates:
            seq = update.seq
            request = self.requests.get(seq.request_id)
            if request is None or request.seq is not seq:
                continue
            out = engine_pb2.RequestOutput(
                request_id=seq.request_id, finish_reason=update.finish_reason, stop_token_id=seq.stop_token_id,
                num_prompt_tokens=seq.num_prompt_tokens, num_cached_tokens=seq.num_cached_tokens)
            if update.new_token_id is not None:
                out.new_token_ids.append(update.new_token_id)
                self.counters["num_generated_tokens"] += 1
                token = sampled.get(seq.seq_id)
                if token is not None and token.HasField("logprobs"):
                    out.logprobs.append(token.logprobs)
            elif seq.beam_options is not None and update.finish_reason != engine_pb2.FINISH_REASON_UNSPECIFIED:
                out.new_token_ids.extend(seq.output_token_ids)  # a beam search's hypothesis, whole
                out.logprobs.extend(engine_pb2.TokenLogprobs(
                    sampled_logprob=lp, sampled_rank=rank, top_token_ids=ids, top_logprobs=lps)
                    for lp, rank, ids, lps in seq.beam_logprobs)
                self.counters["num_generated_tokens"] += seq.num_output_tokens
            if update.finish_reason != engine_pb2.FINISH_REASON_UNSPECIFIED:
                self.requests.pop(seq.request_id, None)
                self.counters["num_finished"] += 1
            elif update.new_token_id is None:
                continue  # a prefill chunk that did not reach the end: nothing to say yet
            by_frontend.setdefault(request.frontend, engine_pb2.StepOutputs()).outputs.append(out)
        for identity, outputs in by_frontend.items():
            self._send_frontend(identity, engine_pb2.SchedulerToFrontend(outputs=outputs))

    def close(self) -> None:
        self.frontend.close()
        self.executors.close()
        self.ctx.term()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser("nanoserve scheduler", description="the control-plane process")
    parser.add_argument("--frontend-addr", default=os.environ.get("NANOSERVE_FRONTEND_ADDR", "tcp://127.0.0.1:5559"),
                        help="ZMQ address to bind for frontends")
    parser.add_argument("--executor-addr", default=os.environ.get("NANOSERVE_EXECUTOR_ADDR", "tcp://127.0.0.1:5560"),
                        help="ZMQ address to bind for executors")
    parser.add_argument("--watch-parent", action="store_true", help="exit when the parent process dies")
    parser.add_argument("--log-level", default=os.environ.get("NANOSERVE_LOG_LEVEL", "INFO"))
    add_engine_args(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s scheduler %(levelname)s %(message)s")
    if args.watch_parent:
        watch_parent()
    process = SchedulerProcess(engine_config_from_args(args), args.frontend_addr, args.executor_addr)

    def on_term(signum, frame):
        process.stopping = True

    signal.signal(signal.SIGTERM, on_term)
    try:
        process.run()
    finally:
        process.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
