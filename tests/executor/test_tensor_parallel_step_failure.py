"""A step that fails on one rank of a tensor-parallel group must not leave the other waiting in the step's
collectives: here two real executor processes (gloo on the CPU) get a plan that rank 1 cannot apply while rank 0
runs it. Rank 1 exits (code 3), rank 0's collective then fails, rank 0 fails the step to the scheduler with the
error and exits too, so the supervisor restarts the group. Before, rank 0 waited in the all-reduce for ever while
both heartbeats went on, and the scheduler waited for the step."""
from __future__ import annotations

import os
import subprocess
import sys
import time

import zmq

from executor_svc.executor import EXIT_GROUP_OUT_OF_STEP
from protos import engine_pb2
from support.grpc_server import REPO, free_port
from support.tiny_checkpoints import make_tiny_qwen3
from test_token_masks import new_seq

EPOCH = 5
STARTUP_TIMEOUT_S = 180.0
FAILURE_TIMEOUT_S = 60.0


def start_rank(rank: int, model: str, scheduler_addr: str, dist_port: int, log_dir) -> subprocess.Popen:
    argv = [sys.executable, "-m", "executor_svc.executor", "--rank", str(rank), "--world-size", "2",
            "--scheduler-addr", scheduler_addr, "--dist-init-addr", f"127.0.0.1:{dist_port}", "--model", model,
            "--device", "cpu", "--num-gpu-blocks", "8", "--block-size", "16", "--max-model-len", "128"]
    log = open(log_dir / f"rank{rank}.log", "w")
    return subprocess.Popen(argv, cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                            env={**os.environ, "PYTHONPATH": REPO})


def receive(router: zmq.Socket, timeout_s: float) -> tuple[bytes, engine_pb2.ExecutorToScheduler] | None:
    if not router.poll(int(timeout_s * 1000)):
        return None
    identity, payload = router.recv_multipart()
    return identity, engine_pb2.ExecutorToScheduler.FromString(payload)


def test_a_step_failing_on_one_rank_ends_the_whole_group_instead_of_hanging_it(tmp_path):
    model = make_tiny_qwen3(str(tmp_path / "qwen3"))
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    dist_port = free_port()
    ranks = [start_rank(r, model, f"tcp://127.0.0.1:{port}", dist_port, tmp_path) for r in (0, 1)]
    try:
        joined, deadline = set(), time.monotonic() + STARTUP_TIMEOUT_S
        while joined != {b"rank0", b"rank1"}:
            got = receive(router, max(0.0, deadline - time.monotonic()))
            assert got is not None, f"ranks {joined} joined within {STARTUP_TIMEOUT_S}s"
            if got[1].WhichOneof("kind") == "handshake":
                joined.add(got[0])

        good = engine_pb2.StepPlan(step_id=1, new_seqs=[new_seq(1, [5, 6, 7], 0)])
        # the same step as rank 1 reads it: a sequence it never saw (as a mirror that fell out of step would)
        bad = engine_pb2.StepPlan(step_id=1, cached=engine_pb2.CachedSequences(
            seq_ids=[42], num_new_blocks=[0], last_token_ids=[3], num_scheduled_tokens=[1]))
        router.send_multipart([b"rank1", engine_pb2.SchedulerToExecutor(plan=bad, epoch=EPOCH).SerializeToString()])
        router.send_multipart([b"rank0", engine_pb2.SchedulerToExecutor(plan=good, epoch=EPOCH).SerializeToString()])

        result, deadline = None, time.monotonic() + FAILURE_TIMEOUT_S
        while result is None and time.monotonic() < deadline:
            got = receive(router, 1.0)
            if got is not None and got[1].WhichOneof("kind") == "result":
                result = got[1].result
        assert result is not None, f"rank 0 answered nothing for step 1 within {FAILURE_TIMEOUT_S}s"
        assert result.step_id == 1 and result.error and not result.sampled, result
        codes = [proc.wait(timeout=FAILURE_TIMEOUT_S) for proc in ranks]
        assert codes == [EXIT_GROUP_OUT_OF_STEP] * 2, (codes, [(tmp_path / f"rank{r}.log").read_text()[-3000:]
                                                               for r in (0, 1)])
    finally:
        for proc in ranks:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        router.close()
        ctx.term()
