"""`authorization: Bearer <key>`: the scheme is case-insensitive (RFC 6750, RFC 9110 11.1), the key is
not, and anything else is UNAUTHENTICATED."""
from __future__ import annotations

import asyncio

import grpc
import pytest

from protos import generation_pb2 as pb
from scheduler_svc.frontend.server_config import ServerConfig
from support.frontend_in_process import serve_frontend

KEY = "s3cret-Key"


def status_with(authorization: str | None) -> grpc.StatusCode:
    metadata = None if authorization is None else [("authorization", authorization)]

    async def main():
        async with serve_frontend(ServerConfig(api_key=KEY), None) as frontend, frontend.channel() as channel:
            try:
                await frontend.stub(channel).GetModelInfo(pb.GetModelInfoRequest(), timeout=10, metadata=metadata)
            except grpc.aio.AioRpcError as err:
                return err.code()
            return grpc.StatusCode.OK

    return asyncio.run(main())


@pytest.mark.parametrize("authorization", [f"Bearer {KEY}", f"bearer {KEY}", f"BEARER {KEY}", f"bEaReR {KEY}",
                                           f"Bearer  {KEY}"])
def test_the_bearer_scheme_in_any_case_with_the_key_is_let_in(authorization):
    assert status_with(authorization) == grpc.StatusCode.OK


@pytest.mark.parametrize("authorization", [None, "", KEY, "Bearer", f"Bearer {KEY.lower()}", f"Bearer {KEY}x",
                                           f"Bearer {KEY[:-1]}", f"Basic {KEY}", f"Bearer{KEY}", f"Bearers {KEY}",
                                           f"Bearer {KEY} {KEY}"])
def test_anything_but_the_bearer_scheme_and_the_exact_key_is_unauthenticated(authorization):
    assert status_with(authorization) == grpc.StatusCode.UNAUTHENTICATED
