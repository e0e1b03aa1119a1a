"""The executor process: rank r of the tensor-parallel group. It loads its shard, shakes hands with
the scheduler, then runs every StepPlan it receives; rank 0 replies with the sampled tokens.

The protobuf side of the executor: this loop reads the plan (the mirrors apply its deltas) and writes
the replies; the model runner and the KV pool take and return plain Python and numpy data."""
from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
import time
import traceback
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING

import zmq
from google.protobuf.message import DecodeError

from executor_svc.copy_costs import CopyTimer
from executor_svc.late_masks import LateMaskError, wait_late_masks
from executor_svc.seq_mirror import SequenceMirrors
from executor_svc.step_profiler import StepProfiler
from protos import engine_pb2
from scheduler_svc.common.parent_watch import add_watch_parent_flag, watch_parent
from scheduler_svc.common.profiling import PythonProfileWindow
from scheduler_svc.common.config import EngineConfig, add_engine_args, engine_config_from_args

if TYPE_CHECKING:
    from executor_svc.model_runner import ModelRunner, PendingStep, SampledToken

log = logging.getLogger("nanoserve.executor")

HEARTBEAT_INTERVAL_S = 1.0


def _init_distributed(rank: int, world_size: int, init_addr: str, device_type: str) -> None:
    import torch.distributed as dist

    backend = "nccl" if device_type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=f"tcp://{init_addr}", rank=rank, world_size=world_size)


class SchedulerEpoch:
    """The scheduler incarnation this executor serves: 0 until its first plan or handshake request. Plans of
    another epoch are dropped; every message out carries it, so a new scheduler never applies an old result."""

    def __init__(self) -> None:
        self.value = 0

    def admits(self, msg: engine_pb2.SchedulerToExecutor) -> bool:
        if self.value == 0:
            self.value = msg.epoch
        return msg.epoch == self.value


def _heartbeat_loop(ctx: zmq.Context, addr: str, rank: int, epoch: SchedulerEpoch, stop: threading.Event) -> None:
    """Liveness on its own socket, so a long forward never looks like a dead executor."""
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, f"rank{rank}-hb".encode())
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(addr)
    while not stop.is_set():
        beat = engine_pb2.ExecutorToScheduler(heartbeat=engine_pb2.Heartbeat(rank=rank), epoch=epoch.value)
        try:
            sock.send(beat.SerializeToString(), zmq.NOBLOCK)
        except zmq.Again:  # scheduler not reachable right now; the next beat tries again
            pass
        stop.wait(HEARTBEAT_INTERVAL_S)
    sock.close()


def block_pairs(copies) -> list[tuple[int, int]]:
    """A plan's repeated BlockCopy as (source, destination) block ids."""
    return [(c.src_block_id, c.dst_block_id) for c in copies]


def sampled_token_message(token: SampledToken) -> engine_pb2.SampledToken:
    """The runner's SampledToken as the reply's message."""
    message = engine_pb2.SampledToken(seq_id=token.seq_id, token_id=token.token_id,
                                      accepted_token_ids=token.accepted_token_ids)
    lp = token.logprobs
    if lp is not None:
        message.logprobs.CopyFrom(engine_pb2.TokenLogprobs(
            sampled_logprob=lp.sampled_logprob, sampled_rank=lp.sampled_rank,
            top_token_ids=lp.top_token_ids, top_logprobs=lp.top_logprobs))
    return message


def handshake(runner: ModelRunner) -> engine_pb2.ExecutorHandshake:
    """What this rank tells the scheduler before it serves: its KV pool sizes and the model's facts."""
    f = runner.facts
    return engine_pb2.ExecutorHandshake(
        rank=runner.rank, world_size=runner.world_size, num_blocks=runner.kv_pool.num_blocks,
        block_size=runner.block_size, model_name=f.model_name, architecture=f.architecture,
        vocab_size=f.vocab_size, max_position_embeddings=f.max_position_embeddings,
        eos_token_ids=f.eos_token_ids, dtype=str(runner.dtype).removeprefix("torch."),
        device=str(runner.device), attention_backend=runner.backend.name, pid=os.getpid(),
        num_host_blocks=runner.kv_pool.num_host_blocks,
        kv_cache_dtype=str(runner.kv_cache_dtype).removeprefix("torch."),
        kv_block_bytes=runner.calibration.kv_block_bytes,
        host_link_bytes_per_s=runner.calibration.host_link_bytes_per_s,
        copy_fixed_seconds=runner.calibration.copy_fixed_seconds,
        prefill_tokens_per_s=runner.calibration.prefill_tokens_per_s,
        weight_format=f.weight_format,
    )


EXIT_GROUP_OUT_OF_STEP = 3  # a tensor-parallel rank failed a step: the group must restart together


class GroupOutOfStep(RuntimeError):
    """A step failed on one rank of a tensor-parallel group, where its peers may be waiting in (or past) the step's
    collectives and its mirrors may no longer match theirs: no later step can be trusted, so the rank exits and the
    supervisor restarts the whole group (rank 0 first fails the step's requests with the error)."""


@dataclass
class SampledStep:
    """A step sampled on the device, not answered yet."""

    step: PendingStep
    result: engine_pb2.StepResult  # its id and timings; the tokens are added when it is answered
    error: Exception | None = None  # it failed after sampling (its late token masks never came)
    swaps: CopyTimer | None = None  # its swap copies' timer


class StepLoop:
    """Overlaps the host with the device: step N+1 is prepared and launched while step N still runs,
    and step N's ids are sent back only then. With no next plan waiting, step N is answered as soon
    as the device finishes it."""

    def __init__(self, runner, mirrors: SequenceMirrors, sock: zmq.Socket, rank: int,
                 epoch: SchedulerEpoch | None = None, late_mask_timeout_s: float = 10.0) -> None:
        self.runner, self.mirrors, self.sock, self.rank = runner, mirrors, sock, rank
        self.in_group = runner.world_size > 1  # steps run collectives with peer ranks
        self.epoch = epoch if epoch is not None else SchedulerEpoch()
        self.pending: SampledStep | None = None
        self.late_mask_timeout_s = late_mask_timeout_s  # how long rank 0 waits for a step's late token masks
        self.backlog: deque[engine_pb2.SchedulerToExecutor] = deque()  # read while waiting for late masks
        self.last_reply: float | None = None
        self.profiler = StepProfiler.from_env(runner.device)
        self.py_profile = PythonProfileWindow.from_env(f"executor{rank}")

    def next_message(self) -> engine_pb2.SchedulerToExecutor | None:
        """The next message, or None once the pending step is done and no message is waiting."""
        while True:
            if self.backlog:
                return self.backlog.popleft()
            # a step pending on the device: spin between the socket and its event (zmq waits whole milliseconds, and
            # a 1 ms wait would add up to a step's length to steps of ~1 ms); idle: block up to a second
            if self.sock.poll(0 if self.pending else 1000):
                payload = self.sock.recv()
                try:
                    return engine_pb2.SchedulerToExecutor.FromString(payload)
                except DecodeError as exc:
                    log.error("rank %d dropped a malformed message: %s", self.rank, exc)
                    continue
            if self.pending is not None and self.pending.step.done():
                return None

    def reply_pending(self) -> None:
        if self.pending is None:
            return
        sampled_step, self.pending = self.pending, None
        result, step_id = sampled_step.result, sampled_step.result.step_id
        try:
            if sampled_step.error is not None:  # sampled all the same (the other ranks take its tokens)
                raise sampled_step.error
            sampled = self.runner.finalize(sampled_step.step)
            result.swap_seconds = sampled_step.swaps.seconds() if sampled_step.swaps is not None else 0.0
            result.sampled.extend(sampled_token_message(token) for token in sampled if token.token_id >= 0)
            for token in sampled:
                self.mirrors.append_sampled(token.seq_id, token.token_id, token.accepted_token_ids)
        except Exception as exc:
            log.error("rank %d step %d failed:\n%s", self.rank, step_id, traceback.format_exc())
            del result.sampled[:]
            result.error = f"{type(exc).__name__}: {exc}"
            # rank 0's peers took its sampled tokens (broadcast) and the scheduler fails this step's requests, so
            # the group stays in step; a peer that did not append rank 0's tokens would compute on other inputs
            if self.in_group and self.rank != 0:
                raise GroupOutOfStep(f"rank {self.rank} could not append step {step_id}'s tokens") from exc
        self._send(result)
        self.last_reply = time.perf_counter()

    def run_plan(self, plan: engine_pb2.StepPlan) -> None:
        t0 = time.perf_counter()
        idle = t0 - self.last_reply if self.last_reply is not None and self.pending is None else 0.0
        if self.py_profile is not None:
            self.py_profile.on_step()
        if self.profiler is not None:
            self.profiler.before_step(len(plan.new_seqs) + len(plan.cached.seq_ids))
        try:
            self._run_plan(plan, t0, idle)
        finally:  # a failed step still counts, so the profiler windows stay on the steps asked for
            if self.profiler is not None:
                self.profiler.after_step()

    def _run_plan(self, plan: engine_pb2.StepPlan, t0: float, idle: float) -> None:
        if self.rank != 0 and self.pending is not None and self._needs_pending_appended(plan.cached):
            self.reply_pending()  # a rank behind rank 0 appends its pending step first
        try:
            chunks = self.mirrors.apply(plan)
            swaps = self.runner.kv_pool.move_blocks(block_pairs(plan.swap_out), block_pairs(plan.swap_in),
                                                    block_pairs(plan.block_copies))
            inputs = self.runner.launch(chunks)
            self.mirrors.commit(chunks)
        except Exception as exc:  # the scheduler fails this step's requests; we keep serving
            log.error("rank %d step %d failed:\n%s", self.rank, plan.step_id, traceback.format_exc())
            self.reply_pending()  # the step before it is good: its tokens go back (no collective in this)
            for seq_id in [n.seq_id for n in plan.new_seqs] + list(plan.cached.seq_ids):
                self.mirrors.seqs.pop(seq_id, None)
            self._send(engine_pb2.StepResult(step_id=plan.step_id, error=f"{type(exc).__name__}: {exc}"))
            if self.in_group:  # the peers may be inside this step's collectives, waiting for this rank
                raise GroupOutOfStep(f"rank {self.rank} failed step {plan.step_id}") from exc
            return
        self.reply_pending()  # step N's ids go back while step N+1 runs on the device
        error, wait = None, 0.0
        if plan.late_mask_seq_ids and self.rank == 0:  # as late as it can be: the forward runs meanwhile
            t_wait = time.perf_counter()
            try:
                wait_late_masks(self.sock, self.epoch.value, plan.step_id, chunks, self.late_mask_timeout_s,
                                self.backlog)
            except LateMaskError as exc:
                error = exc
            wait = time.perf_counter() - t_wait
        step = self.runner.sample(inputs)
        self.pending = SampledStep(step, engine_pb2.StepResult(
            step_id=plan.step_id, execute_seconds=time.perf_counter() - t0, idle_seconds=idle,
            late_mask_wait_seconds=wait), error, swaps)

    def _needs_pending_appended(self, cached: engine_pb2.CachedSequences) -> bool:
        """Whether this plan drafts for a sequence (a draft proposes from every token) or moves its start back after a
        short verdict (the start must be a token it has), while that sequence has tokens in the step still pending
        here. The scheduler plans either only once it has the verdict, which rank 0 appended before it answered;
        another rank answers nothing, so it may read the next plan before it appended its own pending step."""
        if not (cached.num_draft_tokens or cached.chunk_starts):
            return False
        draft_counts = cached.num_draft_tokens or [0] * len(cached.seq_ids)
        starts = cached.chunk_starts or [-1] * len(cached.seq_ids)
        waiting = {seq_id for seq_id, k, start in zip(cached.seq_ids, draft_counts, starts) if k or start >= 0}
        return any(seq.seq_id in waiting for seq in self.pending.step.seqs)

    def _send(self, result: engine_pb2.StepResult) -> None:
        if self.rank == 0:
            msg = engine_pb2.ExecutorToScheduler(result=result, epoch=self.epoch.value)
            self.sock.send(msg.SerializeToString())

    def restart_for(self, msg: engine_pb2.SchedulerToExecutor) -> None:
        """A scheduler that does not know us asked for a handshake: forget what we held for the last one
        (its sequences and the step in flight) and serve the asking one's epoch."""
        self.pending = None  # its tokens belong to a scheduler that is gone: never answered
        self.mirrors.seqs.clear()
        self.epoch.value = msg.epoch
        self.sock.send(engine_pb2.ExecutorToScheduler(handshake=handshake(self.runner),
                                                      epoch=self.epoch.value).SerializeToString())


def run_executor(config: EngineConfig, rank: int, world_size: int, scheduler_addr: str,
                 dist_init_addr: str) -> int:
    from executor_svc.model_runner import ModelRunner, resolve_device

    if world_size > 1:
        _init_distributed(rank, world_size, dist_init_addr, resolve_device(config.device, rank).type)
    t0 = time.perf_counter()
    runner = ModelRunner(config, rank, world_size)
    log.info("rank %d ready in %.1fs: %s on %s, %s, %d KV blocks of %d (%s), backend %s", rank,
             time.perf_counter() - t0, runner.facts.architecture, runner.device, runner.dtype,
             runner.kv_pool.num_blocks, runner.block_size, runner.kv_cache_dtype, runner.backend.name)

    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, f"rank{rank}".encode())
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(scheduler_addr)
    stop = threading.Event()
    epoch = SchedulerEpoch()
    threading.Thread(target=_heartbeat_loop, args=(ctx, scheduler_addr, rank, epoch, stop), daemon=True).start()
    sock.send(engine_pb2.ExecutorToScheduler(handshake=handshake(runner)).SerializeToString())

    mirrors = SequenceMirrors()
    # rank 0 waits for late token masks as long as the scheduler waits for a silent executor
    loop = StepLoop(runner, mirrors, sock, rank, epoch, late_mask_timeout_s=config.executor_timeout_s)
    try:
        while True:
            msg = loop.next_message()
            if msg is None:  # the device finished the pending step before the next plan came
                loop.reply_pending()
                continue
            kind = msg.WhichOneof("kind")  # late_masks here belong to a step that failed before it waited
            if kind == "shutdown":
                log.info("rank %d shutting down: %s", rank, msg.shutdown.reason)
                return 0
            if kind == "handshake_request":
                log.info("rank %d: scheduler epoch %x asks for a handshake (was %x)", rank, msg.epoch, epoch.value)
                loop.restart_for(msg)
            elif kind == "plan" and epoch.admits(msg):
                loop.run_plan(msg.plan)
            elif kind == "plan":
                log.warning("rank %d dropped plan %d of scheduler epoch %x (serving %x)", rank, msg.plan.step_id,
                            msg.epoch, epoch.value)
    except GroupOutOfStep as exc:
        log.critical("%s; exiting (code %d) so that the tensor-parallel group restarts together", exc,
                     EXIT_GROUP_OUT_OF_STEP)
        return EXIT_GROUP_OUT_OF_STEP
    finally:
        stop.set()
        sock.close()
        ctx.term()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser("nanoserve executor", description="one tensor-parallel rank of the data plane")
    parser.add_argument("--rank", type=int, default=int(os.environ.get("NANOSERVE_RANK", 0)))
    parser.add_argument("--world-size", type=int, default=int(os.environ.get("NANOSERVE_WORLD_SIZE", 1)))
    parser.add_argument("--scheduler-addr", default=os.environ.get("NANOSERVE_EXECUTOR_ADDR", "tcp://127.0.0.1:5560"),
                        help="the scheduler's executor socket (ZMQ address)")
    parser.add_argument("--dist-init-addr", default=os.environ.get("NANOSERVE_DIST_INIT_ADDR", "127.0.0.1:29500"),
                        help="host:port of rank 0 for torch.distributed when world size > 1")
    add_watch_parent_flag(parser)
    parser.add_argument("--log-level", default=os.environ.get("NANOSERVE_LOG_LEVEL", "INFO"))
    add_engine_args(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level, format=f"%(asctime)s executor[{args.rank}] %(levelname)s %(message)s")
    if args.watch_parent is not None:
        watch_parent(args.watch_parent)
    # SIGTERM (compose stop, a supervisor) ends the process cleanly: sockets closed, exit code 0
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(0))
    config = engine_config_from_args(args)
    config.tensor_parallel_size = args.world_size
    return run_executor(config, args.rank, args.world_size, args.scheduler_addr, args.dist_init_addr)


if __name__ == "__main__":
    sys.exit(main())
