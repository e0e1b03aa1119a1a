"""Draining closes the door for a request that was still being tokenized when SIGTERM came: it gets
UNAVAILABLE and never reaches the engine (the check runs again after tokenization)."""
from __future__ import annotations

import asyncio

import grpc

from protos import generation_pb2 as pb
from scheduler_svc.frontend.server_config import ServerConfig
from support.frontend_in_process import serve_frontend


def test_a_request_tokenized_while_draining_begins_is_unavailable_and_never_reaches_the_engine():
    async def run():
        async with serve_frontend(ServerConfig(), None) as fe:  # the idle engine fails any request reaching it
            tokenize = fe.service.tokenizing.run

            async def draining_meanwhile(*args):
                result = await tokenize(*args)
                fe.service.draining = True  # SIGTERM arrives while this prompt is tokenized
                return result

            fe.service.tokenizing.run = draining_meanwhile
            async with fe.channel() as ch:
                try:
                    await fe.stub(ch).Generate(pb.GenerateRequest(
                        prompt_token_ids=pb.TokenIds(ids=[5, 6, 7]), sampling=pb.SamplingParams(max_tokens=4)))
                except grpc.aio.AioRpcError as exc:
                    return exc.code(), exc.details()
        return None

    assert asyncio.run(run()) == (grpc.StatusCode.UNAVAILABLE, "the server is shutting down")
