"""The gRPC front end: build the grpc.aio server, link it to the scheduler, serve until SIGTERM.

Lifecycle: health says NOT_SERVING until the engine is ready. On SIGTERM (or SIGINT) the server
stops taking new work (NOT_SERVING, new generations get UNAVAILABLE), lets in-flight requests
finish for --drain-grace-s, fails the rest with UNAVAILABLE (aborting them in the scheduler) and
returns 0.
"""
from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import signal
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from google.protobuf import message_factory
from grpc_reflection.v1alpha import reflection
from smg_grpc_proto import vllm_engine_pb2

from protos import generation_pb2
from scheduler_svc.frontend.async_engine_client import AsyncEngineClient
from scheduler_svc.frontend.generation_service import GenerationService
from scheduler_svc.frontend.health import GENERATION_SERVICE, Health
from scheduler_svc.frontend.metrics import Metrics
from scheduler_svc.common.model_paths import default_model_dir
from scheduler_svc.frontend.request_decoding import MalformedRequest, decode_request
from scheduler_svc.frontend.security import ApiKeyInterceptor, server_credentials
from scheduler_svc.frontend.server_config import ServerConfig
from scheduler_svc.frontend.vllm_worker_service import SERVICE_NAME as VLLM_SERVICE, VllmWorkerService
from scheduler_svc.text.tokenizer import Tokenizer, has_tokenizer

log = logging.getLogger("nanoserve.frontend")

STATS_INTERVAL_S = 1.0


def grpc_options(config: ServerConfig) -> list[tuple[str, int]]:
    return [
        ("grpc.max_receive_message_length", config.receive_limit_bytes()),
        # a second server on a taken port fails instead of sharing it, unless serve's front ends share it
        ("grpc.so_reuseport", int(config.share_port)),
        ("grpc.keepalive_permit_without_calls", 1),  # clients may keep idle connections alive...
        ("grpc.http2.min_ping_interval_without_data_ms", 10_000),  # ...pinging every 10 s, not more often
        ("grpc.http2.max_ping_strikes", 2),  # GOAWAY to a client that pings faster than that
        ("grpc.keepalive_time_ms", 60_000),  # the server pings idle clients every minute
        ("grpc.keepalive_timeout_ms", 20_000),  # and drops those that do not answer
    ]


def _reject_malformed(handler):
    """Wrap a servicer method: a request the deserializer could not take gets INVALID_ARGUMENT."""
    if asyncio.iscoroutinefunction(handler):
        @functools.wraps(handler)
        async def unary(request, context):
            if isinstance(request, MalformedRequest):
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
            return await handler(request, context)
        return unary

    @functools.wraps(handler)
    async def streaming(request, context):
        if isinstance(request, MalformedRequest):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
        async for response in handler(request, context):
            yield response
    return streaming


def checked_handler(service_desc, servicer) -> grpc.GenericRpcHandler:
    """A service's methods with our own request decoding (request_decoding.py): a malformed request is
    INVALID_ARGUMENT naming the field, whichever service it is for."""
    handlers = {}
    for method in service_desc.methods:
        request_cls = message_factory.GetMessageClass(method.input_type)
        response_cls = message_factory.GetMessageClass(method.output_type)
        make = grpc.unary_stream_rpc_method_handler if method.server_streaming else grpc.unary_unary_rpc_method_handler
        handlers[method.name] = make(
            _reject_malformed(getattr(servicer, method.name)),
            request_deserializer=functools.partial(decode_request, request_cls),
            response_serializer=response_cls.SerializeToString)
    return grpc.method_handlers_generic_handler(service_desc.full_name, handlers)


def generation_handler(service: GenerationService) -> grpc.GenericRpcHandler:
    return checked_handler(generation_pb2.DESCRIPTOR.services_by_name["Generation"], service)


def build_server(config: ServerConfig, service: GenerationService, health: Health,
                 worker: VllmWorkerService | None = None) -> tuple[grpc.aio.Server, int]:
    """The server with every service added and its port bound; returns (server, bound port). worker: SMG's
    vLLM worker protocol beside nanoserve.v1 (vllm_worker_service.py)."""
    interceptors = [ApiKeyInterceptor(config.api_key)] if config.api_key else []
    server = grpc.aio.server(options=grpc_options(config), interceptors=interceptors)
    server.add_generic_rpc_handlers([generation_handler(service)])
    names = [GENERATION_SERVICE]
    if worker is not None:
        server.add_generic_rpc_handlers([checked_handler(vllm_engine_pb2.DESCRIPTOR.services_by_name["VllmEngine"],
                                                         worker)])
        names.append(VLLM_SERVICE)
    health_pb2_grpc.add_HealthServicer_to_server(health.servicer, server)
    reflection.enable_server_reflection(
        names + [health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME], server)
    address = f"{config.host}:{config.port}"
    if config.tls_cert:
        credentials = server_credentials(config.tls_cert, config.tls_key, config.tls_client_ca)
        port = server.add_secure_port(address, credentials)
    else:
        port = server.add_insecure_port(address)
    return server, port


async def poll_stats(engine: AsyncEngineClient, metrics: Metrics, timeout_s: float) -> None:
    """Metrics from the scheduler's counters; a scheduler silent for timeout_s counts as lost."""
    last_answer = time.monotonic()
    while True:
        await asyncio.sleep(STATS_INTERVAL_S)
        try:
            metrics.update_from_stats(await engine.stats(timeout_s=STATS_INTERVAL_S))
            last_answer = time.monotonic()
        except asyncio.TimeoutError:
            if time.monotonic() - last_answer > timeout_s and engine.ready is not None:
                engine.mark_lost(f"the scheduler did not answer for {timeout_s:.0f}s")


async def drain(service: GenerationService, health: Health, grace_s: float) -> None:
    """Stop taking work, wait for in-flight requests up to grace_s, then fail the rest."""
    service.draining = True
    health.set_serving(False)
    deadline = time.monotonic() + grace_s
    if service.requests:
        log.info("draining %d in-flight requests for up to %.0fs", len(service.requests), grace_s)
    while service.requests and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    if service.requests:
        log.warning("aborting %d requests still in flight", len(service.requests))
        service.engine.fail_streams("the server is shutting down")


def _exit_code(supervisor: asyncio.Task | None) -> int:
    if supervisor is None or not supervisor.done() or supervisor.cancelled():
        return 0
    if supervisor.exception() is not None:
        log.error("the supervisor failed", exc_info=supervisor.exception())
        return 1
    return supervisor.result() or 0


async def run_frontend(config: ServerConfig, scheduler_addr: str, supervise=None,
                       stop: asyncio.Event | None = None) -> int:
    """Serve until SIGTERM/SIGINT (or `stop` is set). supervise(engine, stop) is an optional
    coroutine that watches local engine processes (`nanoserve serve`); it returns an exit code."""
    model_dir = config.model or default_model_dir()
    tokenizer = Tokenizer(model_dir) if has_tokenizer(model_dir) else None
    if tokenizer is None:
        log.warning("%s has no tokenizer.json: only prompt_token_ids are accepted", model_dir)
    stop = stop or asyncio.Event()
    engine = AsyncEngineClient(scheduler_addr, max_buffered_outputs=config.max_stream_buffered_outputs)
    metrics, health = Metrics(), Health()
    service = GenerationService(engine, tokenizer, config, metrics)
    worker = VllmWorkerService(service, model_dir)
    engine.on_ready_change.append(lambda ready: health.set_serving(ready and not service.draining))
    server, port = build_server(config, service, health, worker)
    metrics_server = metrics.serve(config.host, config.metrics_port) if config.metrics_port else None
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await health.start()
    await server.start()
    await engine.start()
    log.info("nanoserve.v1.Generation and %s on %s:%d (%s), scheduler %s", VLLM_SERVICE, config.host, port,
             "TLS" if config.tls_cert else "plaintext", scheduler_addr)
    supervisor = asyncio.create_task(supervise(engine, stop)) if supervise else None
    background = [asyncio.create_task(poll_stats(engine, metrics, config.scheduler_timeout_s))]
    background += [supervisor] if supervisor else []
    try:
        await stop.wait()
        log.info("shutting down")
        await drain(service, health, config.drain_grace_s)
        await server.stop(grace=5)
    finally:
        exit_code = _exit_code(supervisor)
        for task in background:
            task.cancel()
        await asyncio.gather(*background, return_exceptions=True)
        await engine.close()
        service.tokenizing.close()
        if metrics_server is not None:
            metrics_server.shutdown()
        for sig in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(Exception):
                loop.remove_signal_handler(sig)
    return exit_code
