"""Beam search in the public API: which sampling params it accepts, its wire form, and how the two
front ends (the gRPC service and the offline LLM) send it to the engine and read its answer, one
whole hypothesis per request. The engine is a fake here; no process is started."""
from __future__ import annotations

import asyncio
import math

import grpc
import pytest
from hypothesis import given
from hypothesis import strategies as st

from protos import engine_pb2
from protos import generation_pb2 as pb
from scheduler_svc.frontend.generation_service import GenerationService
from scheduler_svc.entrypoints.llm import LLM
from scheduler_svc.frontend.metrics import Metrics
from scheduler_svc.frontend.sampling_params import SamplingParams, from_api
from scheduler_svc.frontend.server_config import RequestLimits, ServerConfig
from scheduler_svc.frontend.stream_queue import StreamQueue
from scheduler_svc.text.tokenizer import Tokenizer
from scheduler_svc.frontend.validation import InvalidArgument, check_sampling, validate_request

VOCAB, EOS = 49152, 2


def beam(**overrides) -> SamplingParams:
    return SamplingParams(**({"beam_width": 4, "n": 2, "max_tokens": 8} | overrides))


# ---------------------------------------------------------------- validation

BAD_BEAM = [
    ("negative beam_width", dict(beam_width=-1), "beam_width must be in [0, 16]"),
    ("beam_width over the limit", dict(beam_width=17, n=1), "beam_width must be in [0, 16]"),
    ("length_penalty NaN", dict(length_penalty=math.nan), "length_penalty must be a finite number"),
    ("length_penalty inf", dict(length_penalty=math.inf), "length_penalty must be a finite number"),
    ("length_penalty > 10", dict(length_penalty=10.5), "length_penalty must be in [-10, 10]"),
    ("length_penalty < -10", dict(length_penalty=-11.0), "length_penalty must be in [-10, 10]"),
    ("n > beam_width", dict(beam_width=2, n=3), "n (3) must be <= beam_width (2)"),
    ("top_p", dict(top_p=0.9), "top_p does not apply to beam search"),
    ("top_k", dict(top_k=5), "top_k does not apply to beam search"),
    ("min_p", dict(min_p=0.1), "min_p does not apply to beam search"),
    ("seed", dict(seed=7), "seed does not apply to beam search"),
    ("presence_penalty", dict(presence_penalty=0.5), "presence_penalty does not apply to beam search"),
    ("frequency_penalty", dict(frequency_penalty=-0.5), "frequency_penalty does not apply to beam search"),
    ("repetition_penalty", dict(repetition_penalty=1.2), "repetition_penalty does not apply to beam search"),
]


@pytest.mark.parametrize("overrides, message", [(o, m) for _, o, m in BAD_BEAM], ids=[n for n, _, _ in BAD_BEAM])
def test_a_bad_beam_search_is_rejected_naming_the_field(overrides, message):
    with pytest.raises(InvalidArgument) as err:
        check_sampling(beam(**overrides))
    assert message in str(err.value)


def test_the_beam_width_limit_is_the_callers():
    check_sampling(beam(beam_width=8, n=1), RequestLimits(max_beam_width=8))
    with pytest.raises(InvalidArgument, match=r"beam_width must be in \[0, 8\]"):
        check_sampling(beam(beam_width=9, n=1), RequestLimits(max_beam_width=8))


def test_beam_search_ignores_temperature_and_accepts_stop_conditions():
    check_sampling(beam(temperature=0.3, length_penalty=-2.0, stop=["\n"], stop_token_ids=[5], min_tokens=2,
                        ignore_eos=True, n=4))
    check_sampling(beam(temperature=0.0, beam_width=1, n=1))


def test_the_sampling_knobs_that_beam_search_rejects_still_work_without_it():
    check_sampling(SamplingParams(top_p=0.9, top_k=5, min_p=0.1, seed=7, logprobs=3, presence_penalty=0.5,
                                  frequency_penalty=0.5, repetition_penalty=1.2, length_penalty=2.0, n=3))


# ---------------------------------------------------------------- wire form


@given(beam_width=st.integers(1, 16), data=st.data(),
       length_penalty=st.floats(-10, 10, width=32, allow_nan=False))
def test_beam_search_options_round_trip_through_the_wire(beam_width, data, length_penalty):
    n = data.draw(st.integers(1, beam_width))
    params = SamplingParams(beam_width=beam_width, n=n, length_penalty=length_penalty)
    check_sampling(params)
    wire = engine_pb2.BeamSearchOptions.FromString(params.beam_search_options().SerializeToString())
    assert (wire.beam_width, wire.length_penalty, wire.num_requests) == (beam_width, length_penalty, n)


def test_sampling_has_no_beam_search_options():
    assert SamplingParams().beam_search_options() is None
    assert SamplingParams(length_penalty=0.5).beam_search_options() is None


@pytest.mark.parametrize("n", [1, 3])
def test_every_request_of_a_beam_search_carries_its_options_and_one_group_id(n):
    ids = [f"r#{i}" for i in range(n)]
    adds = beam(beam_width=3, n=n, length_penalty=0.5).add_requests(ids, [1, 2, 3], priority=4)
    assert [a.request_id for a in adds] == ids
    assert {a.group_id for a in adds} == {"r#0"}
    for a in adds:
        assert a.HasField("beam_search") and a.priority == 4 and list(a.prompt_token_ids) == [1, 2, 3]
        assert (a.beam_search.beam_width, a.beam_search.length_penalty, a.beam_search.num_requests) == (3, 0.5, n)


def test_sampled_requests_carry_no_beam_search_and_group_only_parallel_samples():
    one = SamplingParams(max_tokens=4).add_requests(["a"], [1])
    assert not one[0].HasField("beam_search") and one[0].group_id == ""
    many = SamplingParams(n=2, seed=10, max_tokens=4).add_requests(["a#0", "a#1"], [1])
    assert [a.group_id for a in many] == ["a#0", "a#0"]
    assert [a.sampling.seed for a in many] == [10, 11]
    assert not any(a.HasField("beam_search") for a in many)


# ---------------------------------------------------------------- the public request


READY = engine_pb2.EngineReady(model=engine_pb2.ExecutorHandshake(vocab_size=VOCAB, num_blocks=64, block_size=16),
                               max_model_len=512)


def public(**sampling) -> SamplingParams:
    return validate_request([5, 6], from_api(pb.SamplingParams(**sampling)), READY, RequestLimits()).params


def test_a_public_request_reads_beam_width_and_length_penalty():
    params = public(beam_width=3, n=2, length_penalty=0.25)
    assert (params.beam_width, params.n, params.length_penalty) == (3, 2, 0.25)
    assert public(beam_width=3).length_penalty == 1.0  # unset means 1.0, not the proto's 0
    assert public().beam_width == 0


@pytest.mark.parametrize("sampling, message", [
    (dict(beam_width=2, length_penalty=math.nan), "sampling.length_penalty must be a finite number"),
    (dict(beam_width=2, length_penalty=-math.inf), "sampling.length_penalty must be a finite number"),
    (dict(beam_width=17), "sampling.beam_width must be in [0, 16]"),
    (dict(beam_width=2, n=3), "sampling.n (3) must be <= beam_width (2)"),
    (dict(beam_width=2, top_p=0.5), "sampling.top_p does not apply to beam search"),
], ids=["NaN length_penalty", "infinite length_penalty", "beam_width over the limit", "n over beam_width",
        "top_p with beam search"])
def test_a_bad_public_beam_search_is_invalid_argument_naming_the_field(sampling, message):
    with pytest.raises(InvalidArgument) as err:
        public(**sampling)
    assert message in str(err.value)


# ---------------------------------------------------------------- the front ends against a fake engine

HYPOTHESES = [([11, 12, 13, EOS], engine_pb2.FINISH_REASON_STOP, EOS),
              ([21, 22, 23, 24, 25], engine_pb2.FINISH_REASON_LENGTH, -1),
              ([31], engine_pb2.FINISH_REASON_STOP, EOS)]


class FakeBeamEngine:
    """Answers a beam search as the scheduler does: once all num_requests of a group have arrived,
    request i (arrival order) gets the i-th best hypothesis in one output."""

    def __init__(self, hypotheses=HYPOTHESES):
        self.hypotheses = hypotheses  # (tokens, finish reason, stop token id), best first
        self.adds: list[engine_pb2.AddRequest] = []
        self.aborted: list[str] = []

    def add(self, request: engine_pb2.AddRequest) -> None:
        self.adds.append(request)
        group = [a for a in self.adds if a.group_id == request.group_id]
        if request.HasField("beam_search") and len(group) == request.beam_search.num_requests:
            self.reply([engine_pb2.RequestOutput(
                request_id=a.request_id, new_token_ids=tokens, finish_reason=reason, stop_token_id=stop,
                num_prompt_tokens=len(a.prompt_token_ids)) for a, (tokens, reason, stop) in zip(group, self.hypotheses)])

    def abort(self, request_ids: list[str]) -> None:
        self.aborted.extend(request_ids)


class FakeAsyncEngine(FakeBeamEngine):
    """The seam of GenerationService (async_engine_client.py)."""

    def __init__(self):
        super().__init__()
        self.ready = READY
        self.queues: dict[str, StreamQueue] = {}

    @property
    def num_in_flight(self) -> int:
        return len(self.queues)

    def open_stream(self, request_ids):
        queue = StreamQueue(max_per_request=64)
        self.queues.update(dict.fromkeys(request_ids, queue))
        return queue

    def close_stream(self, request_ids):
        for rid in request_ids:
            self.queues.pop(rid, None)

    def reply(self, outputs):
        for ro in outputs:
            self.queues[ro.request_id].put_nowait(ro)


class Aborted(Exception):
    pass


class FakeContext:
    def __init__(self):
        self.written: list[pb.GenerateResponse] = []  # a stream's messages

    async def write(self, message):
        self.written.append(message)

    async def abort(self, code, details):
        raise Aborted(code, details)

    def time_remaining(self):
        return None


def serve(method: str, request: pb.GenerateRequest, engine: FakeAsyncEngine):
    service = GenerationService(engine, tokenizer=None, config=ServerConfig(), metrics=Metrics())

    async def call():
        if method == "Generate":
            return await service.Generate(request, FakeContext())
        context = FakeContext()
        await service.GenerateStream(request, context)
        return context.written
    return asyncio.run(call())


def beam_request(**sampling) -> pb.GenerateRequest:
    return pb.GenerateRequest(request_id="q", prompt_token_ids=pb.TokenIds(ids=[5, 6, 7]),
                              sampling=pb.SamplingParams(**({"beam_width": 3, "n": 2, "max_tokens": 5} | sampling)))


def test_the_service_sends_a_beam_search_as_one_group_and_returns_the_n_best_whole():
    engine = FakeAsyncEngine()
    response = serve("Generate", beam_request(length_penalty=0.5), engine)
    assert len(engine.adds) == 2 and len({a.group_id for a in engine.adds}) == 1
    assert engine.adds[0].group_id == engine.adds[0].request_id
    assert all(a.beam_search == engine_pb2.BeamSearchOptions(beam_width=3, length_penalty=0.5, num_requests=2)
               for a in engine.adds)
    best, second = response.outputs
    assert (best.index, list(best.token_ids), best.finish_reason, best.stop_token_id) == (
        0, [11, 12, 13, EOS], pb.FINISH_REASON_STOP, EOS)
    assert (second.index, list(second.token_ids), second.finish_reason, second.WhichOneof("stop_reason")) == (
        1, [21, 22, 23, 24, 25], pb.FINISH_REASON_LENGTH, None)
    assert (response.usage.prompt_tokens, response.usage.completion_tokens) == (3, 9)
    assert engine.aborted == [] and engine.queues == {}


def test_a_streamed_beam_search_gives_one_message_per_hypothesis_and_usage_on_the_last():
    engine = FakeAsyncEngine()
    parts = serve("GenerateStream", beam_request(n=1, beam_width=2), engine)
    assert len(engine.adds) == 1 and engine.adds[0].group_id == engine.adds[0].request_id
    assert engine.adds[0].beam_search.num_requests == 1
    assert len(parts) == 1 and list(parts[0].outputs[0].token_ids) == [11, 12, 13, EOS]
    assert parts[0].usage.completion_tokens == 4


def test_the_service_rejects_a_bad_beam_search_before_reaching_the_engine():
    engine = FakeAsyncEngine()
    with pytest.raises(Aborted) as err:
        serve("Generate", beam_request(top_k=2), engine)
    assert err.value.args[0] == grpc.StatusCode.INVALID_ARGUMENT
    assert "sampling.top_k does not apply to beam search" in err.value.args[1]
    assert engine.adds == []


class FakeEngineClient(FakeBeamEngine):
    """The seam of LLM (engine_client.py): replies wait in a list for recv."""

    def __init__(self, hypotheses):
        super().__init__(hypotheses)
        self.inbox: list[engine_pb2.SchedulerToFrontend] = []

    def reply(self, outputs):
        self.inbox.append(engine_pb2.SchedulerToFrontend(outputs=engine_pb2.StepOutputs(outputs=outputs)))

    def recv(self, timeout_ms):
        return self.inbox.pop(0) if self.inbox else None

    def close(self):
        pass


def offline_llm(tokenizer: Tokenizer, hypotheses) -> LLM:
    """An LLM wired to a fake engine client instead of started processes."""
    llm = object.__new__(LLM)
    llm.tokenizer, llm.client, llm.processes = tokenizer, FakeEngineClient(hypotheses), None
    llm.ready, llm.limits = READY, RequestLimits()
    return llm


def test_the_offline_llm_runs_each_prompt_as_its_own_beam_search(embedded_model):
    tokenizer = Tokenizer(embedded_model)
    words = tokenizer.encode(" Paris is the capital of France")
    llm = offline_llm(tokenizer, [(words + [EOS], engine_pb2.FINISH_REASON_STOP, EOS)] + HYPOTHESES[1:])
    results = llm.generate(["Hello", [5, 6, 7]], [beam(beam_width=3, n=3), beam(beam_width=2, n=1)], use_tqdm=False)
    adds = llm.client.adds
    assert [len(r.outputs) for r in results] == [3, 1]
    assert [a.group_id for a in adds] == [adds[0].request_id] * 3 + [adds[3].request_id]
    assert [a.beam_search.num_requests for a in adds] == [3, 3, 3, 1]
    first = results[0].outputs
    assert first[0].text == " Paris is the capital of France" and first[0].token_ids == words + [EOS]
    assert (first[0].finish_reason, first[0].stop_reason) == ("stop", EOS)
    assert (first[1].token_ids, first[1].finish_reason, first[1].stop_reason) == ([21, 22, 23, 24, 25], "length", None)
    assert first[2].token_ids == [31]
    assert results[1].outputs[0].token_ids == words + [EOS] and llm.client.aborted == []


def test_a_stop_string_cuts_a_beam_hypothesis_text_and_tokens_without_aborting(embedded_model):
    tokenizer = Tokenizer(embedded_model)
    tokens = tokenizer.encode(" one. two. three")
    llm = offline_llm(tokenizer, [(tokens, engine_pb2.FINISH_REASON_LENGTH, -1)])
    [result] = llm.generate([[5, 6]], beam(beam_width=2, n=1, stop=[" two"]), use_tqdm=False)
    out = result.outputs[0]
    assert (out.text, out.finish_reason, out.stop_reason) == (" one.", "stop", " two")
    cut = tokens.index(tokenizer.encode(" two")[0]) + 1  # the token that completed the match is the last one
    assert list(out.token_ids) == tokens[:cut] and cut < len(tokens)
    assert llm.client.aborted == []  # the search had already ended
