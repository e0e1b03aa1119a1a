"""The scheduler's EngineCore driven in-process: a loopback transport and a fake executor that answers
plans through the real plan mirrors, so a test can send any bytes to either socket and watch what the
scheduler does, with no process and no model."""
from __future__ import annotations

import time
import zlib
from collections import deque

from executor_svc.seq_mirror import SequenceMirrors
from protos import engine_pb2
from scheduler_svc.common.config import EngineConfig
from scheduler_svc.core.engine_core import EngineCore

VOCAB = 64
EOS = 2


def fake_token(token_ids: list[int]) -> int:
    """A deterministic 'model': the next token depends on the sequence's own history only (never EOS)."""
    return 3 + zlib.crc32(repr(token_ids).encode()) % (VOCAB - 3)


class FakeExecutor:
    """Rank r of a world: applies plans to real mirrors and (rank 0) answers with fake tokens."""

    def __init__(self, transport: "LoopbackTransport", rank: int = 0, world_size: int = 1,
                 num_blocks: int = 64, pid: int = 1000) -> None:
        self.transport, self.rank, self.world_size, self.num_blocks, self.pid = \
            transport, rank, world_size, num_blocks, pid
        self.epoch = 0
        self.mirrors = SequenceMirrors()
        self.shutdowns: list[str] = []
        self.plans_run = 0

    def handshake(self, **overrides) -> engine_pb2.ExecutorToScheduler:
        hs = engine_pb2.ExecutorHandshake(
            rank=self.rank, world_size=self.world_size, num_blocks=self.num_blocks, block_size=4,
            model_name="fake", architecture="Fake", vocab_size=VOCAB, max_position_embeddings=256,
            eos_token_ids=[EOS], dtype="float32", device="cpu", attention_backend="torch", pid=self.pid)
        for key, value in overrides.items():
            if isinstance(value, list):
                getattr(hs, key)[:] = value
            else:
                setattr(hs, key, value)
        return engine_pb2.ExecutorToScheduler(handshake=hs, epoch=self.epoch)

    def join(self) -> None:
        self.transport.from_executor(f"rank{self.rank}".encode(), self.handshake())

    def heartbeat(self) -> None:
        self.transport.from_executor(f"rank{self.rank}-hb".encode(), engine_pb2.ExecutorToScheduler(
            heartbeat=engine_pb2.Heartbeat(rank=self.rank), epoch=self.epoch))

    def receive(self, msg: engine_pb2.SchedulerToExecutor) -> None:
        kind = msg.WhichOneof("kind")
        if kind == "shutdown":
            self.shutdowns.append(msg.shutdown.reason)
        elif kind == "handshake_request":
            self.mirrors = SequenceMirrors()
            self.epoch = msg.epoch
            self.join()
        elif kind == "plan":
            if self.epoch == 0:
                self.epoch = msg.epoch
            if msg.epoch != self.epoch:
                return
            self.plans_run += 1
            chunks = self.mirrors.apply(msg.plan)
            sampling = [c for c in chunks if c.samples]
            self.mirrors.commit(chunks)
            result = engine_pb2.StepResult(step_id=msg.plan.step_id)
            for c in sampling:
                token = fake_token(c.seq.token_ids)
                result.sampled.append(engine_pb2.SampledToken(seq_id=c.seq.seq_id, token_id=token))
                self.mirrors.append_sampled(c.seq.seq_id, token)
            if self.rank == 0:
                self.transport.from_executor(b"rank0", engine_pb2.ExecutorToScheduler(result=result, epoch=self.epoch))


class LoopbackTransport:
    """Messages to executors are handled at once; replies and front-end messages wait in an inbox that
    poll() hands to the core, as ZmqTransport would."""

    def __init__(self) -> None:
        self.inbox: deque[tuple[str, bytes, bytes]] = deque()
        self.executors: dict[int, FakeExecutor] = {}
        self.sent_to_frontends: list[tuple[bytes, engine_pb2.SchedulerToFrontend]] = []

    def send_frontend(self, identity: bytes, msg: engine_pb2.SchedulerToFrontend) -> None:
        copy = engine_pb2.SchedulerToFrontend()
        copy.CopyFrom(msg)
        self.sent_to_frontends.append((identity, copy))

    def send_executor(self, rank: int, msg: engine_pb2.SchedulerToExecutor) -> None:
        if rank in self.executors:
            copy = engine_pb2.SchedulerToExecutor()
            copy.CopyFrom(msg)
            self.executors[rank].receive(copy)

    def poll(self, timeout_ms: int, core: EngineCore) -> None:
        if not self.inbox and timeout_ms > 0:  # as a socket poll with nothing to read: wait out the timeout
            time.sleep(timeout_ms / 1000)
        while self.inbox:
            side, identity, payload = self.inbox.popleft()
            (core.on_frontend if side == "frontend" else core.on_executor)(identity, payload)

    def from_executor(self, identity: bytes, msg) -> None:
        self.inbox.append(("executor", identity, msg if isinstance(msg, bytes) else msg.SerializeToString()))

    def from_frontend(self, identity: bytes, msg) -> None:
        self.inbox.append(("frontend", identity, msg if isinstance(msg, bytes) else msg.SerializeToString()))

    def outputs_for(self, identity: bytes) -> list[engine_pb2.RequestOutput]:
        return [ro for who, m in self.sent_to_frontends if who == identity and m.WhichOneof("kind") == "outputs"
                for ro in m.outputs.outputs]


def engine(num_blocks: int = 64, **config) -> tuple[EngineCore, LoopbackTransport, FakeExecutor]:
    """An EngineCore serving with one fake executor that has shaken hands."""
    transport = LoopbackTransport()
    core = EngineCore(EngineConfig(model="/nonexistent", block_size=4, max_num_seqs=8, max_num_batched_tokens=64,
                                   **config), transport)
    executor = FakeExecutor(transport, num_blocks=num_blocks)
    transport.executors[0] = executor
    executor.join()
    pump(core)
    assert core.ready is not None
    return core, transport, executor


def pump(core: EngineCore, max_iterations: int = 1000) -> None:
    """Run the loop until nothing is left to do (the body of EngineCore.run, without blocking)."""
    for _ in range(max_iterations):
        core.run_once(idle_poll_ms=0)
        busy = core.scheduler is not None and (core.scheduler.has_unfinished() or core.in_flight)
        if not busy and not core.transport.inbox:
            return
    raise AssertionError("the engine core never went idle")


def add_request(request_id: str, prompt: list[int], max_tokens: int = 4, **sampling) -> engine_pb2.FrontendToScheduler:
    return engine_pb2.FrontendToScheduler(add=engine_pb2.AddRequest(
        request_id=request_id, prompt_token_ids=prompt,
        sampling=engine_pb2.SamplingOptions(**sampling),
        stopping=engine_pb2.StoppingOptions(max_tokens=max_tokens)))
