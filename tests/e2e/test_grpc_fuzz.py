"""Random SamplingParams through a real server (the hardening issue's fuzz acceptance): each request is
served or refused with INVALID_ARGUMENT, never anything else, and afterwards every process is alive and a
greedy request gives the same tokens as before."""
from __future__ import annotations

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from protos import generation_pb2 as pb
from support.grpc_server import start_server

floats = st.floats(allow_nan=True, allow_infinity=True, width=32) | st.sampled_from([0.0, 1e-45, 0.5, 1.0, 2.0])
small_ints = st.integers(-3, 6)


@st.composite
def sampling_params(draw) -> pb.SamplingParams:
    sp = pb.SamplingParams(top_k=draw(st.integers(-2, 70000)), min_p=draw(floats),
                           min_tokens=draw(small_ints), logprobs=draw(st.integers(-1, 25)),
                           presence_penalty=draw(floats), frequency_penalty=draw(floats),
                           beam_width=draw(st.integers(0, 2)), ignore_eos=draw(st.booleans()),
                           stop_token_ids=draw(st.lists(st.integers(-1, 50000), max_size=2)),
                           stop=draw(st.lists(st.text(max_size=3), max_size=2)))
    for name, strategy in (("temperature", floats), ("top_p", floats), ("repetition_penalty", floats),
                           ("length_penalty", floats), ("max_tokens", st.integers(-2, 4)),
                           ("n", st.integers(-1, 3)), ("seed", st.integers(0, 2**64 - 1))):
        if draw(st.booleans()):
            setattr(sp, name, draw(strategy))
    return sp


def greedy(stub) -> list[int]:
    reply = stub.Generate(pb.GenerateRequest(prompt="The capital of France is", sampling=pb.SamplingParams(
        temperature=0.0, max_tokens=6)), timeout=120)
    return list(reply.outputs[0].token_ids)


@pytest.mark.slow
def test_random_sampling_params_are_served_or_refused_and_the_server_keeps_serving(tmp_path):
    server = start_server(tmp_path)
    try:
        stub = server.stub
        before = greedy(stub)
        outcomes = {"served": 0, "refused": 0}

        @settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck), database=None)
        @given(sampling_params())
        def one_request(sp):
            try:
                stub.Generate(pb.GenerateRequest(prompt="Hello hello hello", sampling=sp), timeout=120)
                outcomes["served"] += 1
            except grpc.RpcError as err:
                assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, (err.code(), err.details(), sp)
                outcomes["refused"] += 1

        one_request()
        # the request that killed the executor, and its logprobs-0 twin that failed a neighbour
        for logprobs in (1, 0):
            with pytest.raises(grpc.RpcError) as err:
                stub.Generate(pb.GenerateRequest(prompt="Hello hello hello", sampling=pb.SamplingParams(
                    max_tokens=8, repetition_penalty=1e-45, logprobs=logprobs)), timeout=60)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert server.proc.poll() is None and outcomes["served"] and outcomes["refused"], outcomes
        assert greedy(stub) == before
        assert server.health() == 1  # SERVING
    finally:
        server.stop()
