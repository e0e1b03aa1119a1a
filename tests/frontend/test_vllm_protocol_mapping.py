"""vLLM's worker protocol as SMG speaks it, mapped onto nanoserve (vllm_messages.py, kv_event_relay.py,
tokenizer_archive.py): every sampling field reaches nanoserve.v1 or is refused by name, answers carry
tokens, logprobs, finish reasons and counts the way SMG reads them, the prefix index reaches a gateway as
chained block events, and the tokenizer travels as a checked zip."""
from __future__ import annotations

import hashlib
import io
import zipfile

import pytest
from smg_grpc_proto import vllm_engine_pb2 as vllm

from protos import engine_pb2
from scheduler_svc.core.prefix_cache import hash_block
from scheduler_svc.frontend import tokenizer_archive
from scheduler_svc.frontend.kv_event_relay import KvEventRelay, Overrun, signed64
from scheduler_svc.frontend.server_config import RequestLimits
from scheduler_svc.frontend.validation import InvalidArgument, validate_generate
from scheduler_svc.frontend.vllm_messages import CompletionAnswer, as_vllm_error, to_generation_request
from scheduler_svc.text.output_tracker import Delta, OutputTracker

READY = engine_pb2.EngineReady(model=engine_pb2.ExecutorHandshake(vocab_size=100, num_blocks=64, block_size=16),
                               max_model_len=512)


def request(**sampling) -> vllm.GenerateRequest:
    return vllm.GenerateRequest(request_id="chatcmpl-1", tokenized=vllm.TokenizedInput(input_ids=[5, 6, 7]),
                                sampling_params=vllm.SamplingParams(**sampling))


def test_every_sampling_field_reaches_nanoserve():
    mapped = to_generation_request(request(
        temperature=0.7, top_p=0.9, top_k=20, min_p=0.05, frequency_penalty=0.5, presence_penalty=-0.5,
        repetition_penalty=1.2, max_tokens=30, min_tokens=2, stop=["\n\n"], stop_token_ids=[9], ignore_eos=True,
        n=2, logprobs=3, seed=11, include_stop_str_in_output=True, regex="[a-z]+",
        skip_special_tokens=True, spaces_between_special_tokens=True))
    s = mapped.request.sampling
    assert mapped.request.request_id == "chatcmpl-1" and list(mapped.request.prompt_token_ids.ids) == [5, 6, 7]
    assert (s.temperature, s.top_k, s.max_tokens, s.min_tokens, s.n, s.logprobs, s.seed) == \
        (pytest.approx(0.7), 20, 30, 2, 2, 3, 11)
    assert (s.top_p, s.min_p, s.frequency_penalty, s.presence_penalty, s.repetition_penalty) == \
        pytest.approx((0.9, 0.05, 0.5, -0.5, 1.2))
    assert list(s.stop) == ["\n\n"] and list(s.stop_token_ids) == [9]
    assert s.ignore_eos and s.include_stop_str_in_output and s.regex == "[a-z]+"
    assert mapped.top_logprobs == 3 and not mapped.stream


@pytest.mark.parametrize("constraint, value, check", [
    ("json_schema", '{"type": "object"}', lambda s: s.json_schema == '{"type": "object"}'),
    ("grammar", 'start: "a"', lambda s: s.grammar == 'start: "a"'),
    ("json_object", True, lambda s: s.json_object),
    ("choice", vllm.ChoiceConstraint(choices=["yes", "no"]), lambda s: list(s.choice.choices) == ["yes", "no"]),
])
def test_each_constraint_reaches_nanoserve(constraint, value, check):
    assert check(to_generation_request(request(**{constraint: value})).request.sampling)


def test_proto3_zeros_take_nanoserves_defaults():
    """SMG leaves fields at proto3's 0 when the client did not set them: they mean vLLM's defaults."""
    s = to_generation_request(request()).request.sampling
    for name in ("temperature", "top_p", "repetition_penalty", "max_tokens", "n", "seed"):
        assert not s.HasField(name), name
    valid = validate_generate(to_generation_request(request()).request, None, READY, RequestLimits())
    assert (valid.params.temperature, valid.params.top_p, valid.params.repetition_penalty, valid.params.n) == (1, 1, 1, 1)
    assert valid.params.logprobs == 0


@pytest.mark.parametrize("field, make", [
    ("logit_bias", lambda: request(logit_bias={3: 1.0})),
    ("prompt_logprobs", lambda: request(prompt_logprobs=1)),
    ("structural_tag", lambda: request(structural_tag="{}")),
    ("kv_transfer_params", lambda: vllm.GenerateRequest(
        tokenized=vllm.TokenizedInput(input_ids=[1]), kv_transfer_params_json="{}")),
    ("mm_inputs", lambda: vllm.GenerateRequest(tokenized=vllm.TokenizedInput(input_ids=[1]),
                                               mm_inputs=vllm.MultimodalInputs())),
    ("data_parallel_rank", lambda: vllm.GenerateRequest(tokenized=vllm.TokenizedInput(input_ids=[1]),
                                                        data_parallel_rank=1)),
    ("logprobs", lambda: request(logprobs=-1)),
    ("seed", lambda: request(seed=-3)),
    ("max_tokens", lambda: request(max_tokens=2**32 - 1)),
])
def test_a_field_nanoserve_cannot_honour_is_refused_by_name(field, make):
    with pytest.raises(InvalidArgument, match=field):
        to_generation_request(make())


def test_out_of_range_values_are_refused_by_nanoserves_validation_in_vllms_field_names():
    with pytest.raises(InvalidArgument, match="top_p") as error:
        validate_generate(to_generation_request(request(top_p=1.5)).request, None, READY, RequestLimits())
    assert as_vllm_error(error.value).startswith("sampling_params.top_p must be in (0, 1]")


def test_truncate_prompt_tokens_keeps_the_last_ones():
    mapped = to_generation_request(request(truncate_prompt_tokens=2))
    assert list(mapped.request.prompt_token_ids.ids) == [6, 7]


def test_vllm_logprobs_zero_returns_the_sampled_tokens_logprob_only():
    mapped = to_generation_request(request(logprobs=0))
    assert mapped.request.sampling.logprobs == 1 and mapped.top_logprobs == 0  # the engine computes one


def delta(tokens, finish=engine_pb2.FINISH_REASON_UNSPECIFIED, stop=None, logprobs=()) -> Delta:
    return Delta(token_ids=list(tokens), finish_reason=finish, stop_reason=stop, logprobs=list(logprobs))


def tracker(prompt_len=4, cached=16) -> OutputTracker:
    t = OutputTracker(None, list(range(prompt_len)), [])
    t.num_cached_tokens = cached
    return t


def lp(token: int) -> engine_pb2.TokenLogprobs:
    return engine_pb2.TokenLogprobs(sampled_logprob=-0.5, sampled_rank=1, top_token_ids=[token, 1, 2],
                                    top_logprobs=[-0.5, -1.0, -2.0])


def test_a_stream_is_chunks_of_new_tokens_then_a_complete():
    answer, t = CompletionAnswer(1, stream=True, top_logprobs=2), tracker()
    t.num_tokens = 2
    first = answer.answer(delta([7, 8], logprobs=[lp(7), lp(8)]), t)
    t.num_tokens = 3
    last = answer.answer(delta([2], engine_pb2.FINISH_REASON_STOP, stop=2, logprobs=[lp(2)]), t)
    assert [m.WhichOneof("response") for m in first + last] == ["chunk", "chunk", "complete"]
    chunk = first[0].chunk
    assert list(chunk.token_ids) == [7, 8] and chunk.index == 1
    assert (chunk.prompt_tokens, chunk.completion_tokens, chunk.cached_tokens) == (4, 2, 16)
    assert list(chunk.output_logprobs.top_logprobs[0].token_ids) == [7, 1]  # two candidates asked for
    complete = last[1].complete
    assert complete.finish_reason == "stop" and complete.matched_token_id == 2 and complete.completion_tokens == 3
    assert not complete.output_ids  # streamed tokens went in the chunks


def test_without_stream_one_complete_carries_every_token():
    answer, t = CompletionAnswer(0, stream=False, top_logprobs=None), tracker()
    assert answer.answer(delta([7, 8]), t) == []
    t.num_tokens = 3
    (final,) = answer.answer(delta([9], engine_pb2.FINISH_REASON_LENGTH), t)
    assert list(final.complete.output_ids) == [7, 8, 9] and final.complete.finish_reason == "length"
    assert not final.complete.HasField("output_logprobs")


def test_a_stop_string_is_reported_as_matched_stop_str():
    (final,) = CompletionAnswer(0, False, None).answer(delta([5], engine_pb2.FINISH_REASON_STOP, stop="\n\n"),
                                                        tracker())
    assert final.complete.matched_stop_str == "\n\n"


# ---------------------------------------------------------------- KV events to a gateway


def stored(h: int, parent: int | None, tokens) -> engine_pb2.KvEvent:
    s = engine_pb2.KvBlockStored(block_hash=h, token_ids=tokens)
    if parent is not None:
        s.parent_hash = parent
    return engine_pb2.KvEvent(stored=s)


def make_relay():
    follows = []
    relay = KvEventRelay(follows.append, lambda: 16)
    return relay, follows


def test_a_chain_of_stored_blocks_is_one_event_chained_by_parent_hash():
    relay, follows = make_relay()
    queue = relay.subscribe()
    assert follows == [relay.on_kv_events]  # the first subscriber subscribes the front end
    big = 2**64 - 5  # past int64: SMG's hashes are the same 64 bits, signed
    relay.on_kv_events(engine_pb2.KvEvents(cleared=True, events=[
        stored(1, None, [1] * 16), stored(big, 1, [2] * 16), stored(3, None, [3] * 16),
        engine_pb2.KvEvent(removed=4), engine_pb2.KvEvent(removed=5)]))
    events = queue.get_nowait()
    assert [e.WhichOneof("data") for e in events] == ["cleared", "stored", "stored", "removed"]
    first = events[1].stored
    assert [b.block_hash for b in first.blocks] == [1, signed64(big)] and not first.HasField("parent_block_hash")
    assert signed64(big) == -5 and all(b.block_size == 16 for b in first.blocks)
    assert list(events[3].removed.block_hashes) == [4, 5]
    assert len({e.event_id for e in events}) == len(events)


def test_a_second_gateway_starts_from_the_whole_index():
    relay, follows = make_relay()
    first = relay.subscribe()
    relay.on_kv_events(engine_pb2.KvEvents(cleared=True, events=[stored(2, 1, [2]), stored(1, None, [1]),
                                                                 stored(7, None, [7]),
                                                                 engine_pb2.KvEvent(removed=7)]))
    second = relay.subscribe()
    assert len(follows) == 1  # the scheduler is followed once for both
    snapshot = second.get_nowait()
    assert snapshot[0].WhichOneof("data") == "cleared"
    assert [b.block_hash for b in snapshot[1].stored.blocks] == [1, 2]  # parent first, one chain
    relay.unsubscribe(first)
    relay.unsubscribe(second)
    assert follows[-1] is None and relay.index == {}


def test_a_gateway_that_falls_behind_is_told_to_subscribe_again():
    relay, _ = make_relay()
    queue = relay.subscribe()
    for i in range(queue.maxsize + 1):
        relay.on_kv_events(engine_pb2.KvEvents(events=[engine_pb2.KvEvent(removed=i)]))
    items = [queue.get_nowait() for _ in range(queue.qsize())]
    assert isinstance(items[-1], Overrun) and queue not in relay.queues


def test_the_relay_index_follows_the_scheduler_hashes():
    relay, _ = make_relay()
    relay.subscribe()
    h = hash_block(None, (1, 2)) & (2**64 - 1)
    relay.on_kv_events(engine_pb2.KvEvents(events=[stored(h, None, [1, 2])]))
    assert relay.index == {h: (None, (1, 2))}


# ---------------------------------------------------------------- the tokenizer as a zip


def test_the_tokenizer_zip_holds_the_tokenizer_files_and_its_sha256_comes_last(embedded_model):
    data = tokenizer_archive.tokenizer_zip(embedded_model)
    names = zipfile.ZipFile(io.BytesIO(data)).namelist()
    assert "tokenizer.json" in names and "tokenizer_config.json" in names and "chat_template.jinja" in names
    assert "model.safetensors" not in names
    parts = tokenizer_archive.chunks(data, chunk_bytes=100_000)
    assert len(parts) > 1 and all(digest == "" for _, digest in parts[:-1])
    assert b"".join(p for p, _ in parts) == data and parts[-1][1] == hashlib.sha256(data).hexdigest()


def test_a_model_without_tokenizer_has_no_zip(tmp_path):
    with pytest.raises(ValueError, match="tokenizer.json"):
        tokenizer_archive.tokenizer_zip(tmp_path)
