"""Bad input gives INVALID_ARGUMENT naming the field and the limit, and the server keeps serving.
Runs against `nanoserve serve` (max_model_len 512, default limits); the wire checks of
request_decoding.py are also tested alone."""
from __future__ import annotations

import re
import subprocess
import sys

import grpc
import pytest
from grpc_health.v1 import health_pb2

from support.grpc_server import start_server
from protos import generation_pb2 as pb
from scheduler_svc.frontend.request_decoding import MalformedRequest, decode_request

VOCAB = 49152


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = start_server(tmp_path_factory.mktemp("grpc_validation"))
    yield s
    assert s.stop() == 0


def chat(content: str = "Hi", role: str = "user") -> pb.ChatMessages:
    return pb.ChatMessages(messages=[pb.ChatMessage(role=role, content=content)])


def sampled(**sampling) -> pb.GenerateRequest:
    return pb.GenerateRequest(prompt="Hello", sampling=pb.SamplingParams(**sampling))


def two_inputs() -> bytes:
    """prompt and messages both on the wire: concatenated messages merge, and a oneof keeps the last."""
    return pb.GenerateRequest(prompt="Hello").SerializeToString() + \
        pb.GenerateRequest(messages=chat()).SerializeToString()


def bad_utf8(request, placeholder: str = "XXXX") -> bytes:
    """The request's bytes with a 4-byte placeholder replaced by bytes that are not UTF-8."""
    data = request.SerializeToString()
    assert data.count(placeholder.encode()) == 1
    return data.replace(placeholder.encode(), b"\xff\xfe\xc3\x28")


def two_constraints() -> bytes:
    """A regex and json_object in one SamplingParams on the wire: a oneof keeps the last."""
    sampling = pb.SamplingParams(regex="a+").SerializeToString() + pb.SamplingParams(json_object=True).SerializeToString()
    return pb.GenerateRequest(prompt="Hi").SerializeToString() + bytes([5 << 3 | 2, len(sampling)]) + sampling


BAD_GENERATE = [
    ("no input", pb.GenerateRequest(), "one input is required"),
    ("empty prompt", pb.GenerateRequest(prompt=""), "prompt is empty"),
    ("empty token ids", pb.GenerateRequest(prompt_token_ids=pb.TokenIds()), "prompt_token_ids.ids is empty"),
    ("empty messages", pb.GenerateRequest(messages=pb.ChatMessages()), "messages.messages is empty"),
    ("message without role", pb.GenerateRequest(messages=chat(role="")), "messages.messages[0].role"),
    ("two inputs", two_inputs(), "set only one of prompt, prompt_token_ids, messages"),
    ("token id = vocab", pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=[1, VOCAB])),
     f"prompt_token_ids.ids[1] = {VOCAB} is outside the vocabulary [0, {VOCAB})"),
    ("negative token id", pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=[-3])), "prompt_token_ids.ids[0]"),
    ("prompt longer than max_model_len", pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=[5] * 600)),
     "600 tokens; it must be shorter than max_model_len = 512"),
    ("temperature < 0", sampled(temperature=-0.5), "sampling.temperature must be >= 0"),
    ("temperature NaN", sampled(temperature=float("nan")), "sampling.temperature must be a finite number"),
    ("top_p = 0", sampled(top_p=0.0), "sampling.top_p must be in (0, 1]"),
    ("top_p > 1", sampled(top_p=1.5), "sampling.top_p must be in (0, 1]"),
    ("max_tokens = 0", sampled(max_tokens=0), "sampling.max_tokens must be >= 1"),
    ("max_tokens too large", sampled(max_tokens=1000), "sampling.max_tokens = 1000 does not fit"),
    ("n = 0", sampled(n=0), "sampling.n must be in [1, 16]"),
    ("n over the limit", sampled(n=17), "sampling.n must be in [1, 16]"),
    ("logprobs over the limit", sampled(logprobs=21), "sampling.logprobs must be in [0, 20]"),
    ("too many stop strings", sampled(stop=[f"s{i}" for i in range(17)]),
     "sampling.stop has 17 strings; the limit is 16"),
    ("stop string too long", sampled(stop=["x" * 257]), "sampling.stop[0] has 257 characters; it must have 1 to 256"),
    ("empty stop string", sampled(stop=["ok", ""]), "sampling.stop[1] has 0 characters"),
    ("stop token id = vocab", sampled(stop_token_ids=[VOCAB]), "sampling.stop_token_ids[0]"),
    ("min_tokens > max_tokens", sampled(min_tokens=9, max_tokens=4),
     "sampling.min_tokens (9) must be <= max_tokens (4)"),
    ("repetition_penalty = 0", sampled(repetition_penalty=0.0), "sampling.repetition_penalty must be in [0.01, 10]"),
    ("repetition_penalty whose reciprocal overflows", sampled(repetition_penalty=1e-45),
     "sampling.repetition_penalty must be in [0.01, 10]"),
    ("top_p that rounds to 0 in float32", sampled(top_p=1e-46), "sampling.top_p must be in (0, 1]"),
    ("presence_penalty inf", sampled(presence_penalty=float("inf")), "sampling.presence_penalty must be a finite"),
    ("beam_width over the limit", sampled(beam_width=17), "sampling.beam_width must be in [0, 16]"),
    ("n over beam_width", sampled(beam_width=2, n=3), "sampling.n (3) must be <= beam_width (2)"),
    ("top_k with beam search", sampled(beam_width=2, top_k=5), "sampling.top_k does not apply to beam search"),
    ("seed with beam search", sampled(beam_width=2, seed=1), "sampling.seed does not apply to beam search"),
    ("length_penalty NaN", sampled(beam_width=2, length_penalty=float("nan")),
     "sampling.length_penalty must be a finite number"),
    ("length_penalty out of range", sampled(beam_width=2, length_penalty=20.0),
     "sampling.length_penalty must be in [-10, 10]"),
    ("request_id too long", pb.GenerateRequest(request_id="r" * 300, prompt="Hi"), "request_id has 300 characters"),
    ("invalid UTF-8 in messages", bad_utf8(pb.GenerateRequest(messages=chat("say XXXX"))),
     "messages.messages[0].content is not valid UTF-8"),
    ("invalid UTF-8 in the prompt", bad_utf8(pb.GenerateRequest(prompt="say XXXX")), "prompt is not valid UTF-8"),
    ("invalid UTF-8 in a stop string", bad_utf8(sampled(stop=["a", "XXXX"])), "sampling.stop[1] is not valid UTF-8"),
    ("invalid JSON schema", sampled(json_schema='{"type": "foo"}'), "sampling.json_schema: Invalid type: foo"),
    ("JSON schema that is not JSON", sampled(json_schema='{"type": '), "sampling.json_schema: EOF while parsing"),
    ("invalid regex", sampled(regex="[a-"), "unclosed character class"),
    ("invalid grammar", sampled(grammar="start: greeting"), 'sampling.grammar: at 1(8): unknown name: "greeting"'),
    ("empty choice", sampled(choice=pb.Choices()), "sampling.choice needs at least one string"),
    ("choice over the limit", sampled(choice=pb.Choices(choices=[f"option number {i}" for i in range(2001)])),
     "sampling.choice: choice has 2001 strings; the limit is 2000"),
    ("constraint with beam search", sampled(beam_width=2, json_object=True),
     "sampling.json_object (structured output) does not apply to beam search"),
    ("two constraints", two_constraints(), "set only one of sampling.json_schema, sampling.json_object, "
                                           "sampling.regex, sampling.grammar, sampling.choice"),
]


def _call(server, method: str, request, response_cls, stream: bool = False):
    """Call by method name; bytes go out as they are, so malformed requests can be sent."""
    serializer = None if isinstance(request, bytes) else type(request).SerializeToString
    path = f"/nanoserve.v1.Generation/{method}"
    if stream:
        return list(server.channel.unary_stream(path, request_serializer=serializer,
                                                response_deserializer=response_cls.FromString)(request, timeout=30))
    return server.channel.unary_unary(path, request_serializer=serializer,
                                      response_deserializer=response_cls.FromString)(request, timeout=30)


@pytest.mark.parametrize("request_, field", [(r, f) for _, r, f in BAD_GENERATE], ids=[n for n, _, _ in BAD_GENERATE])
def test_bad_generate_requests_are_invalid_argument_naming_the_field(server, request_, field):
    for method, stream in (("Generate", False), ("GenerateStream", True)):
        with pytest.raises(grpc.RpcError) as err:
            _call(server, method, request_, pb.GenerateResponse, stream)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
        assert field in err.value.details()


@pytest.mark.parametrize("method, request_, response_cls, field", [
    ("Tokenize", pb.TokenizeRequest(), pb.TokenizeResponse, "one input is required: text or messages"),
    ("Tokenize", pb.TokenizeRequest(messages=pb.ChatMessages()), pb.TokenizeResponse, "messages.messages is empty"),
    ("Tokenize", bad_utf8(pb.TokenizeRequest(messages=chat("XXXX"))), pb.TokenizeResponse,
     "messages.messages[0].content is not valid UTF-8"),
    ("Detokenize", pb.DetokenizeRequest(token_ids=[1, 2, VOCAB + 5]), pb.DetokenizeResponse,
     f"token_ids[2] = {VOCAB + 5} is outside the vocabulary"),
], ids=["tokenize nothing", "tokenize no messages", "tokenize bad UTF-8", "detokenize id over vocab"])
def test_bad_tokenizer_requests_are_invalid_argument(server, method, request_, response_cls, field):
    with pytest.raises(grpc.RpcError) as err:
        _call(server, method, request_, response_cls)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and field in err.value.details()


def test_the_server_keeps_serving_after_bad_requests(server):
    for _, request_, _ in BAD_GENERATE:
        with pytest.raises(grpc.RpcError):
            _call(server, "Generate", request_, pb.GenerateResponse)
    assert server.health() == health_pb2.HealthCheckResponse.SERVING
    out = server.stub.Generate(sampled(max_tokens=3, ignore_eos=True), timeout=60).outputs[0]
    assert len(out.token_ids) == 3
    stats = server.stub.GetStats(pb.GetStatsRequest(), timeout=10)
    assert stats.num_running == stats.num_waiting == 0 and stats.free_kv_blocks == stats.total_kv_blocks


def test_constrained_requests_are_served_matching_their_constraint(server):
    choice = server.stub.Generate(sampled(choice=pb.Choices(choices=["red", "green"]), max_tokens=8), timeout=60)
    regex = server.stub.Generate(sampled(regex="[0-9]{2}-[0-9]{2}", max_tokens=12, temperature=0.0), timeout=60)
    assert choice.outputs[0].text in ("red", "green") and choice.outputs[0].finish_reason == pb.FINISH_REASON_STOP
    assert re.fullmatch("[0-9]{2}-[0-9]{2}", regex.outputs[0].text)
    stats = server.stub.GetStats(pb.GetStatsRequest(), timeout=10)
    assert stats.num_constrained_requests >= 2 and stats.num_masked_steps > 0 and stats.token_mask_seconds > 0


def test_a_constraint_chained_deeper_than_a_threads_stack_is_served_and_the_server_lives_on(server):
    # llguidance recurses once per rule: 5,000 of them overflowed a thread's 8 MiB stack, a segfault that
    # killed the front end while validating, then the scheduler while compiling (grammar_threads.py)
    rules = "\n".join(f"r{i}: r{i + 1}" for i in range(5000))
    deep = sampled(grammar=f'start: r0\n{rules}\nr5000: "z"', max_tokens=4)
    assert server.stub.Generate(deep, timeout=60).outputs[0].text == "z"
    assert server.health() == health_pb2.HealthCheckResponse.SERVING


def test_the_cli_client_sends_its_constraint_flags(server, tmp_path):
    def client(*flags: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "scheduler_svc.entrypoints.cli", "client", "generate", "Hi",
                               "--addr", server.addr, "--no-stream", "--max-tokens", "16", *flags],
                              capture_output=True, text=True, timeout=120)

    done = client("--choice", "yes", "--choice", "no")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() in ("yes", "no")
    done = client("--regex", "[0-9]{3}")
    assert done.returncode == 0 and re.fullmatch("[0-9]{3}", done.stdout.strip()), done.stdout + done.stderr
    schema = tmp_path / "bad.json"
    schema.write_text('{"type": "foo"}')
    done = client("--json-schema", str(schema))
    assert done.returncode == 1 and "INVALID_ARGUMENT: sampling.json_schema: Invalid type: foo" in done.stderr


def test_an_unset_max_tokens_is_cut_to_fit_max_model_len(server):
    response = server.stub.Generate(pb.GenerateRequest(
        prompt_token_ids=pb.TokenIds(ids=[5] * 508), sampling=pb.SamplingParams(ignore_eos=True)), timeout=120)
    assert len(response.outputs[0].token_ids) == 4
    assert response.outputs[0].finish_reason == pb.FINISH_REASON_LENGTH


def test_a_message_over_the_receive_limit_is_rejected_without_harm(server):
    with pytest.raises(grpc.RpcError) as err:
        server.stub.Tokenize(pb.TokenizeRequest(text="a" * (17 * 2**20)), timeout=30)
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert list(server.stub.Tokenize(pb.TokenizeRequest(text="ok"), timeout=10).token_ids)


# ---------------------------------------------------------------- the wire checks alone


def test_decoding_a_clean_request_gives_the_message():
    request = pb.GenerateRequest(request_id="a", messages=chat("héllo"), sampling=pb.SamplingParams(stop=["x"], n=2))
    assert decode_request(pb.GenerateRequest, request.SerializeToString()) == request


def test_decoding_names_the_repeated_field_with_bad_utf8():
    messages = pb.ChatMessages(messages=[pb.ChatMessage(role="user", content="fine"),
                                         pb.ChatMessage(role="user", content="XXXX")])
    result = decode_request(pb.GenerateRequest, bad_utf8(pb.GenerateRequest(messages=messages)))
    assert isinstance(result, MalformedRequest)
    assert result.message.startswith("messages.messages[1].content is not valid UTF-8")


def test_decoding_rejects_a_oneof_given_twice_but_not_a_field_repeated():
    assert isinstance(decode_request(pb.GenerateRequest, two_inputs()), MalformedRequest)
    twice = pb.GenerateRequest(prompt="a").SerializeToString() + pb.GenerateRequest(prompt="b").SerializeToString()
    assert decode_request(pb.GenerateRequest, twice) == pb.GenerateRequest(prompt="b")


def test_decoding_rejects_truncated_bytes():
    data = pb.GenerateRequest(prompt="Hello there").SerializeToString()
    result = decode_request(pb.GenerateRequest, data[:-3])
    assert isinstance(result, MalformedRequest) and "truncated" in result.message
