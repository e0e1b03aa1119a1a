"""A constraint the front end cannot check in time is INVALID_ARGUMENT ("too complex"), and while too many
such checks still run abandoned, a new constraint is RESOURCE_EXHAUSTED; neither reaches the engine
(support/frontend_in_process.py's IdleEngine fails the test if one does)."""
from __future__ import annotations

import asyncio
import json

import grpc

from protos import generation_pb2 as pb
from scheduler_svc.core.structured import grammar_threads
from scheduler_svc.frontend.server_config import ServerConfig
from support.frontend_in_process import serve_frontend


def status_of(request: pb.GenerateRequest) -> tuple[grpc.StatusCode, str]:
    async def main():
        async with serve_frontend(ServerConfig(), None) as frontend, frontend.channel() as channel:
            try:
                await frontend.stub(channel).Generate(request, timeout=30)
            except grpc.aio.AioRpcError as err:
                return err.code(), err.details()
        return grpc.StatusCode.OK, ""
    return asyncio.run(main())


def constrained(**constraint) -> pb.GenerateRequest:
    return pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=[1, 2, 3]),
                              sampling=pb.SamplingParams(max_tokens=4, **constraint))


def test_a_schema_whose_check_takes_too_long_is_invalid_argument(monkeypatch):
    monkeypatch.setattr("scheduler_svc.core.structured.grammars.VALIDATE_TIMEOUT_S", 0.2)
    # 200 patternProperties: llguidance checks them pairwise for overlap, ~1.5 s
    schema = {"type": "object", "patternProperties": {f"^k{i}[a-z]*$": {"type": "integer"} for i in range(200)}}
    code, details = status_of(constrained(json_schema=json.dumps(schema)))
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert details.startswith("sampling.json_schema: too complex: building it took longer than 0.2 s")


def test_a_constraint_is_resource_exhausted_while_abandoned_checks_still_run(monkeypatch):
    monkeypatch.setattr(grammar_threads, "MAX_OVERDUE", 0)  # as if the abandoned builds had reached the bound
    code, details = status_of(constrained(regex="[0-9]+"))
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert details.startswith("sampling.regex cannot be checked now")
