"""The load generator of bench/serving.py: K client processes, each an asyncio gRPC client.

A wave's requests are dealt round-robin to the processes; every process connects, says it is ready,
and all start on one CLOCK_MONOTONIC instant (shared by the processes of a machine), so the arrival
schedule is the wave's, not each process's. Each process times its own requests and its own CPU use
(time.process_time: every thread, gRPC's included) and sends them back over its pipe. A client that
uses a whole core is the bottleneck, not the server: the wave reports each process's CPU share.
"""
from __future__ import annotations

import asyncio
import math
import multiprocessing
import time
from dataclasses import dataclass, field

import grpc

from protos import generation_pb2 as pb
from protos import generation_pb2_grpc

START_MARGIN_S = 0.1  # from the go signal to the first send, so every process is waiting when it comes


@dataclass
class Job:
    """One request of a wave: token ids, or (the text dataset) one user chat message and stop strings."""
    index: int
    prompt_token_ids: list[int]
    max_tokens: int
    send_at: float  # seconds after the wave starts
    chat: str = ""  # when set, sent as one user message (the front end templates and tokenizes it)


@dataclass
class LoadSpec:
    address: str
    temperature: float
    ignore_eos: bool
    timeout_s: float
    max_concurrency: int | None  # per process
    stop: tuple[str, ...] = ()  # stop strings of every request


@dataclass
class RequestResult:
    index: int
    prompt_len: int
    expected_len: int  # max_tokens: with ignore_eos, exactly the tokens that must come back
    ok: bool = False  # the stream ended without an error
    output_len: int = 0
    messages: int = 0  # GenerateResponse messages received
    cached_tokens: int = 0
    text_chars: int = 0  # characters of text received (0 without a tokenizer)
    finish_reason: str = ""
    ttft: float = 0.0  # seconds from sending to the first token
    itl: list[float] = field(default_factory=list)  # gaps between token-carrying messages
    e2el: float = 0.0
    error: str = ""

    @property
    def tpot(self) -> float:
        return (self.e2el - self.ttft) / (self.output_len - 1) if self.output_len > 1 else 0.0


@dataclass
class ProcessLoad:
    """What one client process sends back for a wave."""
    results: list[RequestResult]
    cpu_s: float  # this process's CPU time during the wave, all threads
    end: float  # time.monotonic() when its last request ended


@dataclass
class WaveLoad:
    results: list[RequestResult]  # by request index
    duration_s: float  # from the wave's start to the last request's end
    cpu_s: list[float]  # per client process
    wall_s: list[float]  # per client process: from the wave's start to its last request's end

    @property
    def cpu_share(self) -> list[float]:
        """Each process's CPU time over its wall time: 1.0 is one core, busy throughout."""
        return [c / w if w > 0 else 0.0 for c, w in zip(self.cpu_s, self.wall_s)]


# ---------------------------------------------------------------- inside a client process


async def _one_request(stub, job: Job, spec: LoadSpec, start: float) -> RequestResult:
    result = RequestResult(index=job.index, prompt_len=len(job.prompt_token_ids), expected_len=job.max_tokens)
    sampling = pb.SamplingParams(temperature=spec.temperature, max_tokens=job.max_tokens, ignore_eos=spec.ignore_eos,
                                 stop=spec.stop)
    if job.chat:
        request = pb.GenerateRequest(messages=pb.ChatMessages(messages=[pb.ChatMessage(role="user", content=job.chat)]),
                                     sampling=sampling)
    else:
        request = pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=job.prompt_token_ids), sampling=sampling)
    await asyncio.sleep(max(0.0, start + job.send_at - time.monotonic()))
    sent = last = time.monotonic()
    try:
        async for response in stub.GenerateStream(request, timeout=spec.timeout_s):
            now = time.monotonic()
            result.messages += 1
            tokens = 0
            for out in response.outputs:
                tokens += len(out.token_ids)
                result.text_chars += len(out.text)
                if out.finish_reason:
                    result.finish_reason = pb.FinishReason.Name(out.finish_reason)
            if tokens:
                if result.output_len == 0:
                    result.ttft = now - sent
                else:
                    result.itl.append(now - last)
                last = now
                result.output_len += tokens
            if response.HasField("usage"):
                result.cached_tokens = response.usage.cached_prompt_tokens
                result.prompt_len = response.usage.prompt_tokens
        result.e2el = time.monotonic() - sent
        result.ok = True
    except grpc.aio.AioRpcError as exc:
        result.error = f"{exc.code().name}: {exc.details()}"
    return result


async def _run_share(conn, jobs: list[Job], spec: LoadSpec) -> ProcessLoad:
    limit = asyncio.Semaphore(spec.max_concurrency or max(1, len(jobs)))
    async with grpc.aio.insecure_channel(spec.address) as channel:
        await asyncio.wait_for(channel.channel_ready(), 30)
        stub = generation_pb2_grpc.GenerationStub(channel)
        conn.send("ready")
        start = conn.recv()  # blocks the loop, which has nothing else to do yet

        async def limited(job: Job) -> RequestResult:
            async with limit:
                return await _one_request(stub, job, spec, start)

        await asyncio.sleep(max(0.0, start - time.monotonic()))
        cpu0 = time.process_time()
        results = await asyncio.gather(*(limited(job) for job in jobs))
        return ProcessLoad(list(results), time.process_time() - cpu0, time.monotonic())


def _client_main(conn) -> None:
    """A client process: run each wave it is sent, until it is sent None."""
    while (task := conn.recv()) is not None:
        jobs, spec = task
        conn.send(asyncio.run(_run_share(conn, jobs, spec)))
    conn.close()


# ---------------------------------------------------------------- the parent


class ClientPool:
    """K client processes, kept across waves (spawned, not forked: gRPC does not survive a fork)."""

    def __init__(self, num_procs: int) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.conns, self.procs = [], []
        for _ in range(num_procs):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_client_main, args=(child,), daemon=True)
            proc.start()
            child.close()
            self.conns.append(parent)
            self.procs.append(proc)

    def __enter__(self) -> "ClientPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def run_wave(self, dataset: list[tuple[list[int] | str, int]], send_at: list[float], spec: LoadSpec) -> WaveLoad:
        """dataset: (prompt token ids, or a chat message's text; max_tokens) per request."""
        k = len(self.conns)
        jobs = [Job(i, [] if isinstance(prompt, str) else prompt, max_tokens, t,
                    chat=prompt if isinstance(prompt, str) else "")
                for i, ((prompt, max_tokens), t) in enumerate(zip(dataset, send_at))]
        per_proc = LoadSpec(**{**vars(spec), "max_concurrency": math.ceil(spec.max_concurrency / k)
                               if spec.max_concurrency else None})
        for p, conn in enumerate(self.conns):
            conn.send((jobs[p::k], per_proc))
        for conn in self.conns:
            if self._recv(conn) != "ready":
                raise RuntimeError("a client process did not get ready")
        start = time.monotonic() + START_MARGIN_S
        for conn in self.conns:
            conn.send(start)
        loads: list[ProcessLoad] = [self._recv(conn) for conn in self.conns]
        results = sorted((r for load in loads for r in load.results), key=lambda r: r.index)
        return WaveLoad(results, max(load.end for load in loads) - start, [load.cpu_s for load in loads],
                        [load.end - start for load in loads])

    def _recv(self, conn):
        try:
            return conn.recv()
        except EOFError:
            raise RuntimeError("a client process died; see its traceback above") from None

    def close(self) -> None:
        for conn, proc in zip(self.conns, self.procs):
            try:
                conn.send(None)
            except OSError:
                pass
            proc.join(10)
            if proc.is_alive():
                proc.terminate()
                proc.join()
            conn.close()
