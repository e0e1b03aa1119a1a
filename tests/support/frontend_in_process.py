"""The gRPC front end served in the test's own event loop, over an engine that is ready and idle.

No scheduler or executor runs: for what the front end decides alone (limits, authentication,
tokenization), in milliseconds instead of a model's start-up.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import grpc

from protos import engine_pb2, generation_pb2_grpc
from scheduler_svc.frontend.generation_service import GenerationService
from scheduler_svc.frontend.health import Health
from scheduler_svc.frontend.metrics import Metrics
from scheduler_svc.frontend.server import build_server
from scheduler_svc.frontend.server_config import ServerConfig
from scheduler_svc.text.tokenizer import Tokenizer

# The embedded SmolLM2's facts, with the small context of support/grpc_server.py's engine.
READY = engine_pb2.EngineReady(
    model=engine_pb2.ExecutorHandshake(world_size=1, num_blocks=1024, block_size=16, model_name="SmolLM2-135M",
                                       architecture="LlamaForCausalLM", vocab_size=49152, eos_token_ids=[2]),
    max_model_len=512)


class IdleEngine:
    """Stands in for AsyncEngineClient: ready, nothing in flight. A request that gets as far as the
    engine fails the test, since these tests are about what happens before."""
    ready = READY
    num_in_flight = 0

    def open_stream(self, engine_ids):
        raise AssertionError(f"{engine_ids} reached the engine")


@dataclass
class Frontend:
    service: GenerationService
    addr: str

    def channel(self, **kwargs) -> grpc.aio.Channel:
        return grpc.aio.insecure_channel(self.addr, **kwargs)

    def stub(self, channel: grpc.aio.Channel) -> generation_pb2_grpc.GenerationStub:
        return generation_pb2_grpc.GenerationStub(channel)


@contextlib.asynccontextmanager
async def serve_frontend(config: ServerConfig, tokenizer: Tokenizer | None, engine=None):
    """Yields a Frontend on a free local port; stops it on exit. engine: an IdleEngine unless given."""
    config.host, config.port = "127.0.0.1", 0
    service = GenerationService(engine or IdleEngine(), tokenizer, config, Metrics())
    health = Health()
    server, port = build_server(config, service, health)
    await health.start()
    await server.start()
    try:
        yield Frontend(service, f"127.0.0.1:{port}")
    finally:
        await server.stop(grace=None)
