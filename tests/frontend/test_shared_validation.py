"""The gRPC service and the offline LLM check a request the same way: one validator, the same
messages, and whatever it accepts reaches the engine with finite numbers in their ranges.
No process is started: the service's side is validate_generate, the LLM's is LLM.generate against
a client that fails the test if a request reaches it."""
from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from protos import engine_pb2
from protos import generation_pb2 as pb
from scheduler_svc.core.message_checks import check_add_request
from scheduler_svc.entrypoints.llm import LLM
from scheduler_svc.frontend.sampling_params import SamplingParams
from scheduler_svc.frontend.server_config import RequestLimits, ServerConfig
from scheduler_svc.frontend.validation import InvalidArgument, validate_generate, validate_request

VOCAB, MAX_MODEL_LEN, NUM_BLOCKS, BLOCK_SIZE = 1000, 128, 4, 16
KV_TOKENS = NUM_BLOCKS * BLOCK_SIZE  # 64, below max_model_len: both prompt limits can be reached
LENGTH_LIMIT = min(MAX_MODEL_LEN, KV_TOKENS)  # prompt + max_tokens: a sequence never outgrows the KV cache
READY = engine_pb2.EngineReady(
    model=engine_pb2.ExecutorHandshake(vocab_size=VOCAB, num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE),
    max_model_len=MAX_MODEL_LEN)
LIMITS = RequestLimits()
TINY = 2.0**-149  # the smallest float32: 1 / TINY overflows to inf, and both paths print it alike


def grpc_message(ids: list[int], sampling: dict) -> str:
    """What GenerationService answers as INVALID_ARGUMENT (test_grpc_validation.py checks the status)."""
    request = pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=ids), sampling=pb.SamplingParams(**sampling))
    with pytest.raises(InvalidArgument) as err:
        validate_generate(request, None, READY, LIMITS)
    return str(err.value)


class UnreachableEngine:
    def add(self, request):
        raise AssertionError(f"an invalid request reached the engine: {request}")


def offline_llm() -> LLM:
    llm = object.__new__(LLM)
    llm.tokenizer, llm.client, llm.processes = None, UnreachableEngine(), None
    llm.ready, llm.limits = READY, LIMITS
    return llm


def offline_message(ids: list[int], sampling: dict) -> str:
    with pytest.raises(InvalidArgument) as err:
        offline_llm().generate([ids], SamplingParams(**sampling), use_tqdm=False)
    return str(err.value)


BAD = [  # (name, prompt ids, sampling fields, what the message says)
    ("prompt over the KV cache", [5] * 100, {}, "the prompt has 100 tokens; it must be shorter than the KV cache, "
     f"num_blocks x block_size = {NUM_BLOCKS} x {BLOCK_SIZE} = {KV_TOKENS} tokens"),
    ("prompt over max_model_len", [5] * 200, {}, f"it must be shorter than max_model_len = {MAX_MODEL_LEN}"),
    ("prompt id = vocab", [1, VOCAB], {}, f"prompt_token_ids.ids[1] = {VOCAB} is outside the vocabulary [0, {VOCAB})"),
    ("max_tokens past the KV cache", [5] * 60, dict(max_tokens=KV_TOKENS - 59),  # within max_model_len
     f"must be <= the KV cache's {KV_TOKENS} tokens (num_blocks x block_size), which leaves room for {KV_TOKENS - 60}"),
    ("max_tokens past max_model_len", [5] * 10, dict(max_tokens=MAX_MODEL_LEN),
     f"sampling.max_tokens = {MAX_MODEL_LEN} does not fit"),
    ("stop token id = vocab", [5], dict(stop_token_ids=[3, VOCAB]), "sampling.stop_token_ids[1]"),
    ("repetition_penalty whose reciprocal overflows", [5], dict(repetition_penalty=TINY),
     "sampling.repetition_penalty must be in [0.01, 10]"),
    ("repetition_penalty over 10", [5], dict(repetition_penalty=11.0), "sampling.repetition_penalty must be in"),
    ("temperature NaN", [5], dict(temperature=math.nan), "sampling.temperature must be a finite number"),
    ("temperature < 0", [5], dict(temperature=-0.5), "sampling.temperature must be >= 0"),
    ("presence_penalty inf", [5], dict(presence_penalty=math.inf), "sampling.presence_penalty must be a finite"),
    ("frequency_penalty over 2", [5], dict(frequency_penalty=2.5), "sampling.frequency_penalty must be in [-2, 2]"),
    ("top_p = 0", [5], dict(top_p=0.0), "sampling.top_p must be in (0, 1]"),
    ("min_p > 1", [5], dict(min_p=1.5), "sampling.min_p must be in [0, 1]"),
    ("top_k < 0", [5], dict(top_k=-1), "sampling.top_k must be in [0, 2^31)"),
    ("max_tokens = 0", [5], dict(max_tokens=0), "sampling.max_tokens must be >= 1"),
    ("min_tokens past the fitted max_tokens", [5] * 60, dict(min_tokens=100),
     f"sampling.min_tokens (100) must be <= max_tokens ({LENGTH_LIMIT - 60})"),
    ("n over the limit", [5], dict(n=LIMITS.max_n + 1), f"sampling.n must be in [1, {LIMITS.max_n}]"),
    ("logprobs over the limit", [5], dict(logprobs=LIMITS.max_logprobs + 1), "sampling.logprobs must be in"),
    ("too many stop strings", [5], dict(stop=["s"] * (LIMITS.max_stop_strings + 1)), "sampling.stop has"),
    ("empty stop string", [5], dict(stop=["ok", ""]), "sampling.stop[1] has 0 characters"),
    ("seed at 2^63", [5], dict(seed=2**63), "sampling.seed must be in [0, 2^63)"),
    ("top_k with beam search", [5], dict(beam_width=2, top_k=3), "sampling.top_k does not apply to beam search"),
    ("length_penalty out of range", [5], dict(beam_width=2, length_penalty=20.0),
     "sampling.length_penalty must be in [-10, 10]"),
]


@pytest.mark.parametrize("ids, sampling, says", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_a_bad_request_gets_the_same_message_from_the_service_and_the_offline_llm(ids, sampling, says):
    message = grpc_message(ids, sampling)
    assert says in message
    assert offline_message(ids, sampling) == message


def test_a_number_beyond_float32_is_not_finite_on_the_wire():
    message = offline_message([5], dict(temperature=1e39))  # finite in Python, inf in the executor
    assert message == "sampling.temperature must be a finite number (a 32-bit float), got 1e+39"


@pytest.mark.parametrize("prompt_len", [1, 60])
def test_an_unset_max_tokens_is_the_default_cut_to_fit_the_length_limit_on_both_paths(prompt_len):
    ids, limits = [5] * prompt_len, RequestLimits(default_max_tokens=100)
    served = validate_generate(pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=ids)), None, READY, limits)
    llm, shared = offline_llm(), SamplingParams()
    llm.limits = limits
    offline = llm._validate(ids, shared)
    assert served.params.max_tokens == offline.params.max_tokens == min(100, LENGTH_LIMIT - prompt_len)
    assert shared.max_tokens is None  # one SamplingParams may serve prompts of different lengths


# ---------------------------------------------------------------- what reaches the engine


def assert_the_engine_gets_finite_numbers_in_range(adds: list[engine_pb2.AddRequest], params: SamplingParams):
    for sent in adds:
        add = engine_pb2.AddRequest.FromString(sent.SerializeToString())  # what the scheduler decodes
        check_add_request(add, VOCAB, max_num_seqs=1024)  # the scheduler's own refusal, which would be INTERNAL
        for message in (add.sampling, add.stopping, add.beam_search):
            for field, value in message.ListFields():
                if field.type in (field.TYPE_FLOAT, field.TYPE_DOUBLE):
                    assert math.isfinite(value), (field.name, value)
        s, stop = add.sampling, add.stopping
        assert s.temperature >= 0 and 0 < s.top_p <= 1 and 0 <= s.min_p <= 1 and s.top_k >= 0
        assert -2 <= s.presence_penalty <= 2 and -2 <= s.frequency_penalty <= 2
        assert np.float32(0.01) <= s.repetition_penalty <= 10  # the executor divides logits by it
        assert 0 <= s.logprobs <= LIMITS.max_logprobs
        assert 1 <= stop.max_tokens and len(add.prompt_token_ids) + stop.max_tokens <= MAX_MODEL_LEN
        assert 0 <= stop.min_tokens <= stop.max_tokens
        assert all(0 <= t < VOCAB for t in stop.stop_token_ids)
        assert 0 < len(add.prompt_token_ids) < KV_TOKENS and all(0 <= t < VOCAB for t in add.prompt_token_ids)
        if params.beam_width:
            beam = add.beam_search
            assert -10 <= beam.length_penalty <= 10 and 1 <= beam.num_requests <= beam.beam_width
        else:
            assert not add.HasField("beam_search")


def floats(default: float, low: float, high: float):
    """The default, a value in range, or anything at all (NaN, inf, beyond float32, subnormal)."""
    return st.one_of(st.just(default), st.floats(low, high), st.floats(), st.sampled_from([1e-46, 1e-45, 1e39]))


def ints(default: int, low: int, high: int):
    return st.one_of(st.just(default), st.integers(low, high), st.integers())


any_params = st.builds(
    SamplingParams,
    temperature=floats(1.0, 0, 5), top_p=floats(1.0, 0, 1), top_k=ints(0, 0, 50), min_p=floats(0.0, 0, 1),
    seed=st.none() | st.integers(-1, 2**64), max_tokens=st.none() | st.integers(-1, MAX_MODEL_LEN + 1),
    min_tokens=ints(0, 0, 8), stop=st.lists(st.text(max_size=300), max_size=LIMITS.max_stop_strings + 1),
    stop_token_ids=st.lists(st.integers(-2, VOCAB + 2), max_size=3), ignore_eos=st.booleans(),
    n=ints(1, 1, LIMITS.max_n), logprobs=ints(0, 0, LIMITS.max_logprobs),
    presence_penalty=floats(0.0, -2, 2), frequency_penalty=floats(0.0, -2, 2),
    repetition_penalty=floats(1.0, 0, 10), beam_width=st.one_of(st.just(0), ints(0, 0, LIMITS.max_beam_width)),
    length_penalty=floats(1.0, -10, 10))
prompts = st.lists(st.integers(-1, VOCAB), min_size=0, max_size=KV_TOKENS + 2)


@given(ids=prompts, params=any_params)
def test_whatever_the_validator_accepts_reaches_the_engine_finite_and_in_range(ids, params):
    try:
        valid = validate_request(ids, params, READY, LIMITS)
    except InvalidArgument:
        return  # anything but InvalidArgument (a TypeError, an OverflowError) fails the test
    rids = [f"r#{i}" for i in range(valid.params.n)]
    assert_the_engine_gets_finite_numbers_in_range(valid.params.add_requests(rids, valid.prompt_token_ids), valid.params)


def f32(low: float, high: float, **kw):
    return st.floats(low, high, width=32, **kw)


@st.composite
def documented_params(draw) -> SamplingParams:
    """Params inside the ranges protos/generation.proto documents (float fields are float32 there)."""
    common = dict(max_tokens=draw(st.none() | st.integers(1, KV_TOKENS // 2)),
                  stop=draw(st.lists(st.text(min_size=1, max_size=LIMITS.max_stop_string_length), max_size=3)),
                  stop_token_ids=draw(st.lists(st.integers(0, VOCAB - 1), max_size=3)),
                  logprobs=draw(st.integers(0, LIMITS.max_logprobs)), temperature=draw(f32(0, 10)))
    common["min_tokens"] = draw(st.integers(0, common["max_tokens"] or 1))
    if draw(st.booleans()):
        beam_width = draw(st.integers(1, LIMITS.max_beam_width))
        return SamplingParams(beam_width=beam_width, n=draw(st.integers(1, beam_width)),
                              length_penalty=draw(f32(-10, 10)), **common)
    return SamplingParams(
        top_p=draw(f32(0, 1, exclude_min=True)), top_k=draw(st.integers(0, 2 * VOCAB)), min_p=draw(f32(0, 1)),
        seed=draw(st.none() | st.integers(0, 2**63 - 1)), n=draw(st.integers(1, LIMITS.max_n)),
        presence_penalty=draw(f32(-2, 2)), frequency_penalty=draw(f32(-2, 2)),
        repetition_penalty=draw(f32(float(np.float32(0.01)), 10)), **common)


@pytest.mark.parametrize("fields", [dict(top_k=VOCAB), dict(top_k=VOCAB + 1), dict(top_k=2**31 - 1),
                                    dict(repetition_penalty=0.01), dict(temperature=0.01, top_p=0.01),
                                    dict(temperature=3e38), dict(logprobs=LIMITS.max_logprobs)])
def test_values_at_the_edges_the_front_end_accepts_pass_the_schedulers_own_checks(fields):
    """A top_k past the vocabulary keeps every token (sent as 0, off); a float32 0.01 is 0.01 on both sides. The
    scheduler refusing what the front end accepted would reach the client as INTERNAL (found by the gRPC fuzz)."""
    valid = validate_request([5], SamplingParams(max_tokens=4, **fields), READY, LIMITS)
    assert_the_engine_gets_finite_numbers_in_range(valid.params.add_requests(["r"], valid.prompt_token_ids),
                                                   valid.params)
    if "top_k" in fields:
        assert valid.params.top_k == 0


@given(ids=st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=KV_TOKENS // 2), params=documented_params())
def test_every_request_inside_the_documented_ranges_is_accepted(ids, params):
    valid = validate_request(ids, params, READY, LIMITS)
    rids = [f"r#{i}" for i in range(valid.params.n)]
    assert_the_engine_gets_finite_numbers_in_range(valid.params.add_requests(rids, valid.prompt_token_ids), valid.params)


# ---------------------------------------------------------------- structured output

BAD_CONSTRAINTS = [  # (name, the API's fields, the offline SamplingParams' fields, what the message says)
    ("schema of an unknown type", dict(json_schema='{"type": "foo"}'), None, "sampling.json_schema: Invalid type: foo"),
    ("schema that is not JSON", dict(json_schema='{"type": '), None, "sampling.json_schema: "),
    ("schema with a dangling $ref", dict(json_schema='{"$ref": "#/$defs/missing"}'), None,
     "sampling.json_schema: Pointer '/$defs/missing' does not exist"),
    ("regex that does not parse", dict(regex="[a-"), None, "sampling.regex: "),
    ("grammar naming an unknown rule", dict(grammar="start: greeting"), None,
     'sampling.grammar: at 1(8): unknown name: "greeting"'),
    ("empty choice", dict(choice=pb.Choices()), dict(choice=[]), "sampling.choice needs at least one string"),
    ("choice with an empty string", dict(choice=pb.Choices(choices=["yes", ""])), dict(choice=["yes", ""]),
     "and no empty one"),
    ("regex beyond the size limit", dict(regex="a" * 2**18), None, "bytes; the limit is 262144"),
    ("constraint with beam search", dict(beam_width=2, regex="a+"), None,
     "sampling.regex (structured output) does not apply to beam search"),
]


@pytest.mark.parametrize("wire, offline, says", [b[1:] for b in BAD_CONSTRAINTS], ids=[b[0] for b in BAD_CONSTRAINTS])
def test_a_bad_constraint_gets_llguidances_message_from_the_service_and_the_offline_llm(wire, offline, says):
    message = grpc_message([5], wire)
    assert message.startswith(says) if says.endswith(": ") else says in message
    assert offline_message([5], offline or wire) == message


@pytest.mark.parametrize("sampling, says", [
    (dict(json_object=True, regex="a+"), "set at most one of sampling.json_schema, json_object, regex, grammar, "
                                         "choice; got regex, json_object"),
    (dict(json_schema={"enum": {1, 2}}), "sampling.json_schema: Object of type set is not JSON serializable"),
    (dict(regex=5), "sampling.regex must be a string, got 5"),
    (dict(choice="yes"), "sampling.choice must be a list of strings, got 'yes'"),
])
def test_the_offline_llm_refuses_constraints_the_wire_cannot_even_carry(sampling, says):
    assert offline_message([5], sampling) == says


VALID_CONSTRAINTS = [
    (dict(json_schema='{"type": "object"}'), SamplingParams(json_schema={"type": "object"}),
     engine_pb2.Constraint(json_schema='{"type": "object"}')),
    (dict(json_object=True), SamplingParams(json_object=True), engine_pb2.Constraint(json_object=True)),
    (dict(regex="[0-9]+"), SamplingParams(regex="[0-9]+"), engine_pb2.Constraint(regex="[0-9]+")),
    (dict(grammar='start: "a" | "b"'), SamplingParams(grammar='start: "a" | "b"'),
     engine_pb2.Constraint(grammar='start: "a" | "b"')),
    (dict(choice=pb.Choices(choices=["x", "y"])), SamplingParams(choice=["x", "y"]),
     engine_pb2.Constraint(choice=engine_pb2.ChoiceList(choices=["x", "y"]))),
]


@pytest.mark.parametrize("wire, offline, sent", VALID_CONSTRAINTS, ids=lambda v: "")
def test_a_valid_constraint_reaches_every_engine_request_of_the_completion(wire, offline, sent):
    request = pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=[5]), sampling=pb.SamplingParams(n=2, **wire))
    served = validate_generate(request, None, READY, LIMITS).params
    offline = validate_request([5], dataclasses.replace(offline, n=2), READY, LIMITS).params
    for params in (served, offline):
        adds = params.add_requests(["a#0", "a#1"], [5])
        assert [add.constraint for add in adds] == [sent, sent]
    unconstrained = validate_request([5], SamplingParams(), READY, LIMITS).params.add_requests(["b"], [5])
    assert not unconstrained[0].HasField("constraint")


@pytest.mark.parametrize("limits, flag", [(RequestLimits(max_logprobs=1025), "--max-logprobs"),
                                          (RequestLimits(max_beam_width=1025), "--max-beam-width")])
def test_a_server_limit_past_the_schedulers_own_is_refused_at_start_up(limits, flag):
    with pytest.raises(ValueError, match=f"{flag} must be <= 1024"):
        ServerConfig(limits=limits).validate()
