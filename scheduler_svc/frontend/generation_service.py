"""The nanoserve.v1.Generation service: each RPC checked, run through the engine and answered.

A request with n completions becomes n engine requests; their outputs share one queue and are
merged into one response stream, each output carrying its index. With beam search the n requests
share one search, and each receives its whole hypothesis (the index-th best) in one output.
However the call ends (finished, failed, cancelled by the client, past its deadline), the engine
requests still running are aborted in the scheduler, so their KV blocks go back to the pool.

Slow clients: admission (--max-pending-requests) counts the engine requests still running, so a handler
still writing to a client that reads slowly holds no slot once the engine is done with it; its queued
outputs are bounded (--max-stream-buffered-outputs, stream_queue.py), and a stream whose client reads
nothing for --stream-stall-timeout-s is ended with RESOURCE_EXHAUSTED (the server ran out of patience
for it, not the client's deadline), its engine requests aborted.
"""
from __future__ import annotations

import asyncio
import itertools
import sys
import time
import uuid

import grpc

from protos import engine_pb2, generation_pb2, generation_pb2_grpc
from scheduler_svc.core.structured.grammars import INVALID, OVERLOADED
from scheduler_svc.frontend import api_messages
from scheduler_svc.frontend.async_engine_client import AsyncEngineClient, EngineLost
from scheduler_svc.frontend.metrics import Metrics
from scheduler_svc.text.output_tracker import OutputTracker
from scheduler_svc.frontend.server_config import ServerConfig
from scheduler_svc.frontend.stream_queue import StreamQueue
from scheduler_svc.frontend.tokenization import TokenizerThreads, check_input_size
from scheduler_svc.text.tokenizer import Tokenizer
from scheduler_svc.frontend.validation import (InvalidArgument, Overloaded, chat_token_ids, check_token_ids,
                                               validate_generate)

NO_DEADLINE_S = 365 * 24 * 3600.0  # time_remaining() beyond this means the call has no deadline


class StreamStalled(Exception):
    """A stream's write waited longer than --stream-stall-timeout-s: its client is not reading."""


def engine_error_status(error: str) -> grpc.StatusCode:
    """The engine reports failures as text (engine.proto has no code); map the known causes."""
    if error.startswith(("engine lost", "engine not ready")):
        return grpc.StatusCode.UNAVAILABLE
    if "already in flight" in error:
        return grpc.StatusCode.ALREADY_EXISTS
    if "leaves no room" in error or error.startswith(INVALID):
        return grpc.StatusCode.INVALID_ARGUMENT
    if error.startswith(OVERLOADED):
        return grpc.StatusCode.RESOURCE_EXHAUSTED
    return grpc.StatusCode.INTERNAL


class GenerationService(generation_pb2_grpc.GenerationServicer):
    def __init__(self, engine: AsyncEngineClient, tokenizer: Tokenizer | None, config: ServerConfig,
                 metrics: Metrics) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.config = config
        self.metrics = metrics
        self.draining = False  # set on SIGTERM: new generations get UNAVAILABLE
        self.requests: dict[str, list[str]] = {}  # in-flight public request id -> its engine request ids
        self._incarnation = itertools.count()  # engine ids never repeat, so a late output can't reach a new stream
        self.tokenizing = TokenizerThreads(config.tokenizer_threads)  # tokenizer work, off the event loop

    # ------------------------------------------------------------------ generation

    async def GenerateStream(self, request, context):
        await self._generate(request, context, lambda part: self._write(context, part))

    async def Generate(self, request, context):
        response, outputs = generation_pb2.GenerateResponse(), {}

        async def collect(part: generation_pb2.GenerateResponse) -> None:
            response.request_id = part.request_id
            for out in part.outputs:
                api_messages.merge_output(outputs.setdefault(out.index, generation_pb2.CompletionOutput(
                    index=out.index)), out)
            if part.HasField("usage"):
                response.usage.CopyFrom(part.usage)

        await self._generate(request, context, collect)
        response.outputs.extend(outputs[i] for i in sorted(outputs))
        return response

    async def _write(self, context, part: generation_pb2.GenerateResponse) -> None:
        """Send one message of a stream; StreamStalled when the client has read nothing for the stall timeout."""
        timeout_s = self.config.stream_stall_timeout_s
        try:
            if sys.version_info >= (3, 11):  # a timer per message; wait_for makes a task per message before 3.12
                async with asyncio.timeout(timeout_s):
                    await context.write(part)
            else:
                await asyncio.wait_for(context.write(part), timeout_s)
        except asyncio.TimeoutError:
            raise StreamStalled(f"the client read nothing for {timeout_s:g}s (--stream-stall-timeout-s)") from None

    async def _generate(self, request: generation_pb2.GenerateRequest, context, send, respond=None,
                        text: bool = True, describe=str) -> None:
        """Pass send() one message per engine output: the delta of one completion, as respond(rid, index,
        delta, tracker, usage) writes it (usage: the whole request's, with the last delta only; by default a
        nanoserve.v1 GenerateResponse). text=False: the client detokenizes itself (SMG), so only stop strings
        need text here. describe(InvalidArgument) words a refusal in the client's field names."""
        respond = respond or _v1_response
        ready = await self._admit(context)
        try:
            check_input_size(request, self.config.limits.max_prompt_bytes)
            valid = await self.tokenizing.run(validate_generate, request, self.tokenizer, ready, self.config.limits)
        except InvalidArgument as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, describe(exc))
        except Overloaded as exc:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
        await self._admit(context)  # again: draining may have begun, or the engine gone, while it tokenized
        rid, params = request.request_id or uuid.uuid4().hex, valid.params
        if rid in self.requests:
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, f"request_id {rid!r} is already in flight")
        limit = self.config.max_pending_requests
        if self.engine.num_in_flight + params.n > limit:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"{self.engine.num_in_flight} sequences running in the engine; "
                                f"--max-pending-requests is {limit}")
        incarnation = next(self._incarnation)
        engine_ids = [f"{rid}#{i}/{incarnation}" for i in range(params.n)]
        index = {eid: i for i, eid in enumerate(engine_ids)}
        tokenizer = self.tokenizer if text or params.stop else None
        trackers = {eid: OutputTracker(tokenizer, valid.prompt_token_ids, params.stop,
                                       params.include_stop_str_in_output) for eid in engine_ids}
        queue = self.engine.open_stream(engine_ids)
        self.requests[rid] = engine_ids
        pending = set(engine_ids)
        detokenize_s = 0.0  # counted once per request: a Prometheus inc per delta takes a lock on the hot path
        timer, outcome = self.metrics.start_request(), "cancelled"
        try:
            for add in params.add_requests(engine_ids, valid.prompt_token_ids, priority=request.priority,
                                           client_request_id=rid):
                self.engine.add(add)
            while pending:
                item = await self._next(queue, context)
                if item is None:
                    outcome = "deadline_exceeded"
                    await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, "the deadline passed")
                if isinstance(item, EngineLost):
                    outcome = "unavailable"
                    await context.abort(grpc.StatusCode.UNAVAILABLE, item.reason)
                started = time.perf_counter()
                delta = trackers[item.request_id].apply(item)
                detokenize_s += time.perf_counter() - started
                if delta is None:
                    continue
                if delta.stopped_by_string:
                    self.engine.abort([item.request_id])
                if delta.finish_reason == engine_pb2.FINISH_REASON_ERROR:
                    code = engine_error_status(delta.error)
                    outcome = code.name.lower()
                    await context.abort(code, delta.error)
                if delta.finished:
                    pending.discard(item.request_id)
                timer.on_tokens(len(delta.token_ids))
                usage = None if pending else api_messages.usage(len(valid.prompt_token_ids), trackers.values())
                try:
                    await send(respond(rid, index[item.request_id], delta, trackers[item.request_id], usage))
                except StreamStalled as exc:
                    # Not context.abort: its status would wait behind the unread messages, and with it the
                    # cleanup below. Returning frees everything now; gRPC sends the status when it can.
                    outcome = "resource_exhausted"
                    self.metrics.stalled_streams.inc()
                    context.set_code(grpc.StatusCode.RESOURCE_EXHAUSTED)
                    context.set_details(str(exc))
                    return
            outcome = "finished"
        finally:
            self.engine.abort([eid for eid in engine_ids if eid in pending])
            self.engine.close_stream(engine_ids)
            self.requests.pop(rid, None)
            timer.finish(outcome, len(valid.prompt_token_ids))
            self.metrics.detokenize_seconds.inc(detokenize_s)

    async def _admit(self, context) -> engine_pb2.EngineReady:
        if self.draining:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the server is shutting down")
        if self.engine.ready is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the engine is not ready: executors are starting or lost")
        return self.engine.ready

    @staticmethod
    async def _next(queue: StreamQueue, context):
        """The next engine output or EngineLost; None once the call's deadline has passed."""
        remaining = context.time_remaining()
        if remaining is None or remaining > NO_DEADLINE_S:
            return await queue.get_coalesced()
        try:
            return await asyncio.wait_for(queue.get_coalesced(), max(remaining, 0.0))
        except asyncio.TimeoutError:
            return None

    async def Abort(self, request, context):
        """Aborts the request wherever it runs: here, or through another front end sharing the scheduler."""
        wanted, aborted = list(dict.fromkeys(request.request_ids)), set()
        for rid in wanted:
            engine_ids = self.requests.get(rid)
            if engine_ids:
                self.engine.abort(engine_ids)
                aborted.add(rid)
        if wanted and self.engine.ready is not None:
            try:
                aborted.update(await self.engine.abort_everywhere(wanted, timeout_s=self.config.scheduler_timeout_s))
            except asyncio.TimeoutError:
                await context.abort(grpc.StatusCode.UNAVAILABLE, "the scheduler did not answer the abort")
        return generation_pb2.AbortResponse(aborted_request_ids=[rid for rid in wanted if rid in aborted])

    # ------------------------------------------------------------------ tokenizer

    async def _tokenizer(self, context) -> Tokenizer:
        if self.tokenizer is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "this model has no tokenizer")
        return self.tokenizer

    async def Tokenize(self, request, context):
        tokenizer = await self._tokenizer(context)
        try:
            check_input_size(request, self.config.limits.max_prompt_bytes)
            return await self.tokenizing.run(tokenize, request, tokenizer)
        except InvalidArgument as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))

    async def Detokenize(self, request, context):
        tokenizer = await self._tokenizer(context)
        try:
            return await self.tokenizing.run(detokenize, request, tokenizer)
        except InvalidArgument as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))

    # ------------------------------------------------------------------ engine facts

    async def GetModelInfo(self, request, context):
        ready = self.engine.ready
        if ready is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the engine is not ready: executors are starting or lost")
        return api_messages.model_info(ready)

    async def GetStats(self, request, context):
        try:
            stats = await self.engine.stats(timeout_s=5.0)
        except asyncio.TimeoutError:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the scheduler did not answer")
        return api_messages.stats(stats)


def _v1_response(rid: str, index: int, delta, tracker: OutputTracker,
                 usage: generation_pb2.Usage | None) -> generation_pb2.GenerateResponse:
    response = generation_pb2.GenerateResponse(request_id=rid, outputs=[api_messages.completion_output(index, delta)])
    if usage is not None:
        response.usage.CopyFrom(usage)
    return response


# ---------------------------------------------------------------- tokenizer work, run in TokenizerThreads

def tokenize(request: generation_pb2.TokenizeRequest, tokenizer: Tokenizer) -> generation_pb2.TokenizeResponse:
    kind = request.WhichOneof("input")
    if kind is None:
        raise InvalidArgument("one input is required: text or messages")
    if kind == "text":
        add_special = request.add_special_tokens if request.HasField("add_special_tokens") else True
        ids = tokenizer.encode(request.text, add_special_tokens=add_special)
    else:
        add_prompt = request.add_generation_prompt if request.HasField("add_generation_prompt") else True
        ids = chat_token_ids(request.messages, tokenizer, "messages", add_generation_prompt=add_prompt)
    return generation_pb2.TokenizeResponse(token_ids=ids, tokens=[tokenizer.id_to_token(t) or "" for t in ids])


def detokenize(request: generation_pb2.DetokenizeRequest, tokenizer: Tokenizer) -> generation_pb2.DetokenizeResponse:
    check_token_ids(request.token_ids, tokenizer.vocab_size, "token_ids")
    text = tokenizer.decode(list(request.token_ids), skip_special_tokens=request.skip_special_tokens)
    return generation_pb2.DetokenizeResponse(text=text)
