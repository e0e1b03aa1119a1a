"""Clients that read slowly or not at all: the front end's own stream plumbing (AsyncEngineClient and its
read loop, GenerationService) over a fake scheduler on a real ZeroMQ socket, all in the test's event loop.

A client that stops reading blocks its handler's writes once HTTP/2 flow control is full; from then on:
its admission slot is free as soon as the engine has finished its request, its queued outputs stay
within --max-stream-buffered-outputs (later ones are merged), the other streams are not held up, and
after --stream-stall-timeout-s its stream ends with RESOURCE_EXHAUSTED and its engine request is aborted.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import time

import grpc
import pytest
import zmq
import zmq.asyncio

from protos import engine_pb2
from protos import generation_pb2 as pb
from scheduler_svc.frontend.async_engine_client import AsyncEngineClient
from scheduler_svc.frontend.server_config import ServerConfig, add_server_args, server_config_from_args
from support.frontend_in_process import serve_frontend

READY = engine_pb2.EngineReady(
    model=engine_pb2.ExecutorHandshake(world_size=1, num_blocks=1 << 16, block_size=16, model_name="fake",
                                       architecture="Fake", vocab_size=49152, eos_token_ids=[2]),
    max_model_len=1 << 20)
TOKEN = 40_000  # three bytes on the wire, so a few hundred steps overflow HTTP/2's 64 KiB windows
CHUNK = 512  # tokens per request per step: one output is ~1.5 KB
STEP_S = 0.001
LONG = 200 * CHUNK  # ~300 KB of output: far more than the flow-control windows hold
SHORT = 4 * CHUNK

# A client that does not read: BDP probing off, else grpc keeps widening the window and buffers for it;
# its own subchannel pool, so it does not share a connection (and its connection window) with readers.
NOT_READING = [("grpc.http2.bdp_probe", 0), ("grpc.use_local_subchannel_pool", 1)]
READING = [("grpc.use_local_subchannel_pool", 1)]


class FakeScheduler:
    """Answers every Hello with READY and runs each request in steps of CHUNK tokens up to its max_tokens,
    then ends it (LENGTH); the outputs of all running requests go in one message per step, as the engine
    batches them. A request whose id starts with "endless" stops producing at max_tokens but never ends.
    An abort ends a request with its terminal output, as the scheduler does."""

    def __init__(self) -> None:
        self.ctx = zmq.asyncio.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.addr = f"tcp://127.0.0.1:{self.sock.bind_to_random_port('tcp://127.0.0.1')}"
        self.running: dict[str, int] = {}  # engine request id -> tokens still to produce
        self.steps: dict[str, int] = {}  # engine request id -> outputs sent
        self.ended_at: dict[str, float] = {}  # engine request id -> when its terminal output was sent
        self.aborted: list[str] = []
        self.frontend = b""

    async def run(self) -> None:
        await asyncio.gather(self._receive(), self._step())

    async def _receive(self) -> None:
        while True:
            self.frontend, payload = await self.sock.recv_multipart()
            msg = engine_pb2.FrontendToScheduler.FromString(payload)
            kind = msg.WhichOneof("kind")
            if kind == "hello":
                self._send(engine_pb2.SchedulerToFrontend(ready=READY, epoch=7))
            elif kind == "add":
                self.running[msg.add.request_id] = msg.add.stopping.max_tokens
                self.steps[msg.add.request_id] = 0
            elif kind == "abort":
                for rid in msg.abort.request_ids:
                    if rid in self.running:
                        self.aborted.append(rid)
                        self._end([rid], engine_pb2.FINISH_REASON_ABORT)

    async def _step(self) -> None:
        while True:
            await asyncio.sleep(STEP_S)
            outputs, ended = [], []
            for rid, left in self.running.items():
                if left == 0:
                    continue
                n = min(CHUNK, left)
                self.running[rid] = left - n
                self.steps[rid] += 1
                outputs.append(engine_pb2.RequestOutput(request_id=rid, new_token_ids=[TOKEN] * n,
                                                        stop_token_id=-1, num_prompt_tokens=1))
                if left == n and not rid.startswith("endless"):
                    outputs[-1].finish_reason = engine_pb2.FINISH_REASON_LENGTH
                    ended.append(rid)
            if outputs:
                self._send(engine_pb2.SchedulerToFrontend(outputs=engine_pb2.StepOutputs(outputs=outputs), epoch=7))
            for rid in ended:
                del self.running[rid]
                self.ended_at[rid] = time.monotonic()

    def _end(self, rids: list[str], reason: int) -> None:
        outputs = [engine_pb2.RequestOutput(request_id=rid, finish_reason=reason, stop_token_id=-1) for rid in rids]
        self._send(engine_pb2.SchedulerToFrontend(outputs=engine_pb2.StepOutputs(outputs=outputs), epoch=7))
        for rid in rids:
            del self.running[rid]
            self.ended_at[rid] = time.monotonic()

    def _send(self, msg: engine_pb2.SchedulerToFrontend) -> None:
        self.sock.send_multipart([self.frontend, msg.SerializeToString()])

    def close(self) -> None:
        self.sock.close()
        self.ctx.term()


@contextlib.asynccontextmanager
async def frontend_over_fake_scheduler(config: ServerConfig):
    """Yields (frontend, scheduler, queues): queues collects every stream queue the engine client opens."""
    scheduler = FakeScheduler()
    scheduler_task = asyncio.create_task(scheduler.run())
    engine = AsyncEngineClient(scheduler.addr, max_buffered_outputs=config.max_stream_buffered_outputs)
    queues = []
    open_stream = engine.open_stream
    engine.open_stream = lambda ids: queues.append(open_stream(ids)) or queues[-1]
    await engine.start()
    try:
        await wait_until(lambda: engine.ready is not None, "the engine client got READY")
        async with serve_frontend(config, None, engine=engine) as frontend:
            yield frontend, scheduler, queues
    finally:
        await engine.close()
        scheduler_task.cancel()
        await asyncio.gather(scheduler_task, return_exceptions=True)
        scheduler.close()


async def wait_until(condition, what: str, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout_s}s: {what}")
        await asyncio.sleep(0.01)


def request(rid: str, max_tokens: int) -> pb.GenerateRequest:
    return pb.GenerateRequest(request_id=rid, prompt_token_ids=pb.TokenIds(ids=[5]),
                              sampling=pb.SamplingParams(max_tokens=max_tokens, ignore_eos=True))


async def read_all(call) -> tuple[list[pb.GenerateResponse], grpc.StatusCode, str]:
    messages = []
    try:
        async for response in call:
            messages.append(response)
    except grpc.aio.AioRpcError:
        pass
    return messages, await call.code(), await call.details()


def test_clients_that_never_read_free_their_admission_slots_once_the_engine_has_finished_their_requests():
    async def main():
        async with frontend_over_fake_scheduler(ServerConfig(max_pending_requests=4)) as (frontend, scheduler, _):
            async with frontend.channel(options=NOT_READING) as idle, frontend.channel(options=READING) as active:
                calls = [frontend.stub(idle).GenerateStream(request(f"unread-{i}", LONG)) for i in range(4)]
                await wait_until(lambda: len(scheduler.ended_at) == 4, "the engine finished the unread requests")
                await asyncio.sleep(0.2)  # the terminal outputs reach the front end
                still_writing = set(frontend.service.requests)
                try:
                    response = await frontend.stub(active).Generate(request("normal", SHORT), timeout=10)
                    outcome = grpc.StatusCode.OK, len(response.outputs[0].token_ids)
                except grpc.aio.AioRpcError as err:
                    outcome = err.code(), err.details()
                for call in calls:
                    call.cancel()
            return still_writing, outcome

    still_writing, outcome = asyncio.run(main())
    assert still_writing == {f"unread-{i}" for i in range(4)}, "the unread streams' handlers are still writing"
    assert outcome == (grpc.StatusCode.OK, SHORT)


def test_a_client_that_stops_reading_neither_delays_another_stream_nor_queues_more_than_the_bound():
    bound = 8

    async def main():
        config = ServerConfig(max_stream_buffered_outputs=bound)
        async with frontend_over_fake_scheduler(config) as (frontend, scheduler, queues):
            async with frontend.channel(options=NOT_READING) as idle, frontend.channel(options=READING) as active:
                unread = frontend.stub(idle).GenerateStream(request("endless-unread", LONG))
                await wait_until(lambda: scheduler.running.get("endless-unread#0/0") == 0,
                                 "the engine produced all the unread tokens")
                unread_queue = queues[0]
                messages, code, _ = await read_all(frontend.stub(active).GenerateStream(request("reader", LONG)))
                received_at = time.monotonic()
                reader_delay = received_at - scheduler.ended_at["reader#0/1"]
                unread_queued = unread_queue.qsize()
                unread.cancel()
            return code, sum(len(m.outputs[0].token_ids) for m in messages), reader_delay, unread_queued

    code, tokens, reader_delay, unread_queued = asyncio.run(main())
    assert code == grpc.StatusCode.OK and tokens == LONG
    assert reader_delay < 1.0, f"the reader got its last token {reader_delay:.2f}s after the engine sent it"
    assert unread_queued <= bound


def test_a_client_that_reads_late_receives_every_token_merged_into_fewer_messages():
    async def main():
        config = ServerConfig(max_stream_buffered_outputs=2)
        async with frontend_over_fake_scheduler(config) as (frontend, scheduler, _):
            async with frontend.channel(options=NOT_READING) as channel:
                call = frontend.stub(channel).GenerateStream(request("slow", LONG))
                await wait_until(lambda: len(scheduler.ended_at) == 1, "the engine finished the request")
                return await read_all(call), scheduler.steps["slow#0/0"]

    (messages, code, _), engine_outputs = asyncio.run(main())
    assert code == grpc.StatusCode.OK
    assert sum(len(m.outputs[0].token_ids) for m in messages) == LONG
    assert messages[-1].outputs[0].finish_reason == pb.FINISH_REASON_LENGTH
    assert messages[-1].usage.completion_tokens == LONG
    assert len(messages) < engine_outputs


def test_a_stream_left_unread_past_the_stall_timeout_is_ended_and_its_engine_request_aborted():
    async def main():
        config = ServerConfig(stream_stall_timeout_s=0.5)
        async with frontend_over_fake_scheduler(config) as (frontend, scheduler, _):
            async with frontend.channel(options=NOT_READING) as idle:
                call = frontend.stub(idle).GenerateStream(request("endless-stalled", LONG))
                await wait_until(lambda: scheduler.aborted, "the stalled request was aborted")
                await wait_until(lambda: not frontend.service.requests, "the stalled stream ended")
                stalled = frontend.service.metrics.registry.get_sample_value("nanoserve_streams_stalled_total")
                return scheduler.aborted, stalled, await read_all(call)

    aborted, stalled, (messages, code, details) = asyncio.run(main())
    assert aborted == ["endless-stalled#0/0"]
    assert stalled == 1
    assert messages, "what was written before the stall still arrives"
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "--stream-stall-timeout-s" in details


def test_an_unread_stream_is_aborted_in_the_engine_when_its_deadline_passes_or_it_is_cancelled():
    async def main(end: str):
        async with frontend_over_fake_scheduler(ServerConfig()) as (frontend, scheduler, _):
            async with frontend.channel(options=NOT_READING) as idle:
                timeout = 2.0 if end == "deadline" else None
                call = frontend.stub(idle).GenerateStream(request("endless-unread", LONG), timeout=timeout)
                await wait_until(lambda: scheduler.steps.get("endless-unread#0/0", 0) > 100, "the window filled")
                if end == "cancel":
                    call.cancel()
                await wait_until(lambda: scheduler.aborted, "the unread request was aborted")
                await wait_until(lambda: not frontend.service.requests, "the unread stream ended")
                return scheduler.aborted

    for end in ("deadline", "cancel"):
        assert asyncio.run(main(end)) == ["endless-unread#0/0"], end


def test_the_slow_client_flags_reach_the_config_and_out_of_range_values_are_refused():
    def parse(*flags: str) -> ServerConfig:
        parser = argparse.ArgumentParser()
        add_server_args(parser)
        return server_config_from_args(parser.parse_args(list(flags)))

    config = parse("--max-stream-buffered-outputs", "3", "--stream-stall-timeout-s", "2.5")
    assert (config.max_stream_buffered_outputs, config.stream_stall_timeout_s) == (3, 2.5)
    for flags in (("--max-stream-buffered-outputs", "0"), ("--stream-stall-timeout-s", "0")):
        with pytest.raises(ValueError, match=flags[0]):
            parse(*flags)
