"""The public API through generated stubs, against `nanoserve serve` (frontend, scheduler and
executor processes) with SmolLM2 on the CPU: every RPC, streaming, stop strings, n, seeds,
logprobs, Abort, cancels and deadlines."""
from __future__ import annotations

import threading
import time
import urllib.request

import grpc
import pytest

from support.grpc_server import free_port, smol_dir, start_server
from support.hf_reference import hf_beam_search
from protos import generation_pb2 as pb
from scheduler_svc.text.tokenizer import Tokenizer

CAPITAL = "What is the capital of France?"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    metrics_port = free_port()
    s = start_server(tmp_path_factory.mktemp("grpc_api"), "--max-pending-requests", "8",
                     "--metrics-port", str(metrics_port))
    s.metrics_port = metrics_port
    yield s
    assert s.stop() == 0


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer(smol_dir())


def chat(content: str, **sampling) -> pb.GenerateRequest:
    return pb.GenerateRequest(messages=pb.ChatMessages(messages=[pb.ChatMessage(role="user", content=content)]),
                              sampling=pb.SamplingParams(**sampling))


def stream(stub, request, **kwargs) -> list[pb.GenerateResponse]:
    return list(stub.GenerateStream(request, timeout=120, **kwargs))


def joined(parts: list[pb.GenerateResponse], index: int = 0) -> pb.CompletionOutput:
    """The streamed deltas of one completion put together."""
    total = pb.CompletionOutput(index=index)
    for part in parts:
        for out in part.outputs:
            if out.index == index:
                total.text += out.text
                total.token_ids.extend(out.token_ids)
                total.logprobs.extend(out.logprobs)
                if out.finish_reason:
                    assert not total.finish_reason, "a completion finished twice"
                    total.finish_reason = out.finish_reason
    return total


def wait_idle(stub, timeout: float = 30.0) -> pb.Stats:
    """Stats once nothing runs or waits; asserts the KV pool is whole again."""
    deadline = time.monotonic() + timeout
    while True:
        stats = stub.GetStats(pb.GetStatsRequest(), timeout=10)
        if stats.num_running == 0 and stats.num_waiting == 0 and stats.free_kv_blocks == stats.total_kv_blocks:
            return stats
        assert time.monotonic() < deadline, f"engine not idle: {stats}"
        time.sleep(0.1)


def greedy_tokens(stub, content: str, max_tokens: int) -> list[int]:
    response = stub.Generate(chat(content, temperature=0, max_tokens=max_tokens, ignore_eos=True), timeout=120)
    return list(response.outputs[0].token_ids)


# ---------------------------------------------------------------- generation


def test_generate_answers_the_chat_prompt_greedily_and_reports_usage(server, tokenizer):
    response = server.stub.Generate(chat(CAPITAL, temperature=0, max_tokens=20), timeout=120)
    (out,) = response.outputs
    assert out.text == "The capital of France is Paris."
    assert out.finish_reason == pb.FINISH_REASON_STOP
    assert out.WhichOneof("stop_reason") == "stop_token_id" and out.stop_token_id == 2
    assert out.text == tokenizer.decode(list(out.token_ids))
    prompt = tokenizer.encode_chat([{"role": "user", "content": CAPITAL}])
    assert response.usage.prompt_tokens == len(prompt)
    assert response.usage.completion_tokens == len(out.token_ids)
    assert response.request_id


def test_streamed_deltas_concatenate_to_the_unary_text_byte_for_byte(server):
    for content in ["Write one sentence in French about a café in Zürich.", "Say hello with three emoji."]:
        request = chat(content, temperature=0, max_tokens=24, ignore_eos=True)
        unary = server.stub.Generate(request, timeout=120).outputs[0]
        parts = stream(server.stub, request)
        streamed = joined(parts)
        assert streamed.text.encode() == unary.text.encode()
        assert list(streamed.token_ids) == list(unary.token_ids) and len(unary.token_ids) == 24
        assert streamed.finish_reason == unary.finish_reason == pb.FINISH_REASON_LENGTH
        assert [p.HasField("usage") for p in parts] == [False] * (len(parts) - 1) + [True]
        assert len({p.request_id for p in parts}) == 1


def test_a_given_request_id_is_echoed_and_an_empty_one_is_made_up(server):
    parts = stream(server.stub, pb.GenerateRequest(request_id="my-id-1", prompt="Hello",
                                                   sampling=pb.SamplingParams(max_tokens=2)))
    assert {p.request_id for p in parts} == {"my-id-1"}
    a = server.stub.Generate(pb.GenerateRequest(prompt="Hello", sampling=pb.SamplingParams(max_tokens=2)), timeout=60)
    b = server.stub.Generate(pb.GenerateRequest(prompt="Hello", sampling=pb.SamplingParams(max_tokens=2)), timeout=60)
    assert a.request_id and b.request_id and a.request_id != b.request_id


def test_prompt_token_ids_and_text_prompts_give_the_same_completion(server, tokenizer):
    ids = tokenizer.encode_chat([{"role": "user", "content": CAPITAL}])
    sampling = pb.SamplingParams(temperature=0, max_tokens=8)
    by_ids = server.stub.Generate(pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=ids), sampling=sampling))
    by_messages = server.stub.Generate(chat(CAPITAL, temperature=0, max_tokens=8))
    assert by_ids.outputs[0].token_ids == by_messages.outputs[0].token_ids
    assert by_ids.outputs[0].text.startswith("The capital of France")


def _stop_string_across_a_token_boundary(tokenizer, ids: list[int]) -> tuple[str, int]:
    """A 4-character substring of the greedy text that spans a token boundary; and where it starts."""
    full = tokenizer.decode(ids)
    for k in range(3, len(ids) - 2):
        p = len(tokenizer.decode(ids[:k]))
        candidate = full[p - 2:p + 2]
        if full[:p] == tokenizer.decode(ids[:k]) and len(candidate) == 4 and candidate.strip() == candidate \
                and full.find(candidate) == p - 2:
            return candidate, p - 2
    raise AssertionError(f"no usable token boundary in {full!r}")


def test_a_stop_string_split_across_tokens_ends_the_text_before_it(server, tokenizer):
    content = "Describe the ocean in two sentences."
    ids = greedy_tokens(server.stub, content, 24)
    full = tokenizer.decode(ids)
    stop, start = _stop_string_across_a_token_boundary(tokenizer, ids)
    request = chat(content, temperature=0, max_tokens=24, ignore_eos=True, stop=["never-appears", stop])
    unary = server.stub.Generate(request, timeout=120).outputs[0]
    assert unary.text == full[:start]
    assert unary.finish_reason == pb.FINISH_REASON_STOP and unary.stop_string == stop
    assert len(unary.token_ids) < len(ids) and list(unary.token_ids) == ids[:len(unary.token_ids)]
    streamed = joined(stream(server.stub, request))
    assert streamed.text == unary.text and streamed.finish_reason == pb.FINISH_REASON_STOP
    request.sampling.include_stop_str_in_output = True
    assert server.stub.Generate(request, timeout=120).outputs[0].text == full[:start + len(stop)]
    wait_idle(server.stub)  # the stop string aborted the sequence in the scheduler


def test_a_stop_token_id_ends_the_completion_on_that_token(server):
    content = "Count from one to ten in words."
    ids = greedy_tokens(server.stub, content, 16)
    k = next(i for i in range(2, len(ids)) if ids[i] not in ids[:i])
    out = server.stub.Generate(chat(content, temperature=0, max_tokens=16, ignore_eos=True,
                                    stop_token_ids=[ids[k]]), timeout=120).outputs[0]
    assert list(out.token_ids) == ids[:k + 1]
    assert out.finish_reason == pb.FINISH_REASON_STOP and out.stop_token_id == ids[k]


def test_n_completions_come_back_indexed_in_one_response(server):
    request = chat("Invent a name for a cat.", temperature=1.0, max_tokens=12, ignore_eos=True, n=3, seed=1234)
    unary = server.stub.Generate(request, timeout=120)
    assert [o.index for o in unary.outputs] == [0, 1, 2]
    assert all(len(o.token_ids) == 12 and o.finish_reason == pb.FINISH_REASON_LENGTH for o in unary.outputs)
    assert len({tuple(o.token_ids) for o in unary.outputs}) > 1, "the n samples must use different seeds"
    assert unary.usage.completion_tokens == 36
    parts = stream(server.stub, request)
    assert parts[-1].HasField("usage") and sum(p.HasField("usage") for p in parts) == 1
    for o in unary.outputs:  # same seed, same outputs, streamed or not
        assert joined(parts, o.index).text == o.text


def test_beam_search_returns_the_best_hypotheses_of_transformers_beam_search(server, tokenizer):
    request = chat(CAPITAL, beam_width=3, n=2, max_tokens=12)
    prompt = tokenizer.encode_chat([{"role": "user", "content": CAPITAL}])
    expected = hf_beam_search(smol_dir(), prompt, 3, 2, 12, eos_token_id=2)
    unary = server.stub.Generate(request, timeout=120)
    assert [list(o.token_ids) for o in unary.outputs] == expected
    assert [o.index for o in unary.outputs] == [0, 1]
    assert all(o.finish_reason in (pb.FINISH_REASON_STOP, pb.FINISH_REASON_LENGTH) for o in unary.outputs)
    assert unary.usage.completion_tokens == sum(map(len, expected))
    parts = stream(server.stub, request)
    for o in unary.outputs:  # each hypothesis streams as one whole message
        assert joined(parts, o.index).text == o.text and sum(o.index == x.index for p in parts for x in p.outputs) == 1
    wait_idle(server.stub)


def test_the_same_seed_gives_the_same_sample(server):
    request = chat("Tell me a random fact.", temperature=1.0, top_p=0.95, max_tokens=16, ignore_eos=True, seed=7)
    first = server.stub.Generate(request, timeout=120).outputs[0]
    second = server.stub.Generate(request, timeout=120).outputs[0]
    assert list(first.token_ids) == list(second.token_ids) and first.text == second.text
    request.sampling.seed = 8
    other = server.stub.Generate(request, timeout=120).outputs[0]
    assert list(other.token_ids) != list(first.token_ids)


def test_logprobs_describe_each_generated_token(server):
    for temperature in (0.0, 1.0):
        request = chat("Name three colours.", temperature=temperature, max_tokens=10, ignore_eos=True,
                       logprobs=4, seed=3)
        out = server.stub.Generate(request, timeout=120).outputs[0]
        assert len(out.logprobs) == len(out.token_ids) == 10
        for token_id, lp in zip(out.token_ids, out.logprobs):
            assert lp.token_id == token_id and lp.logprob <= 0 and lp.rank >= 1
            tops = list(lp.top_logprobs)
            assert len(tops) == 4 and all(a.logprob >= b.logprob for a, b in zip(tops, tops[1:]))
            if lp.rank <= 4:
                assert tops[lp.rank - 1].token_id == token_id
                assert tops[lp.rank - 1].logprob == pytest.approx(lp.logprob, abs=1e-4)
            if temperature == 0:
                assert lp.rank == 1
        streamed = joined(stream(server.stub, request))
        assert [lp.token_id for lp in streamed.logprobs] == list(out.token_ids)


# ---------------------------------------------------------------- tokenizer and facts


def test_tokenize_and_detokenize_round_trip(server, tokenizer):
    text = "Hello, wörld! 👋"
    tok = server.stub.Tokenize(pb.TokenizeRequest(text=text), timeout=10)
    assert list(tok.token_ids) == tokenizer.encode(text)
    assert list(tok.tokens) == [tokenizer.id_to_token(t) for t in tok.token_ids]
    assert server.stub.Detokenize(pb.DetokenizeRequest(token_ids=tok.token_ids), timeout=10).text == text
    messages = pb.ChatMessages(messages=[pb.ChatMessage(role="user", content=CAPITAL)])
    chat_tok = server.stub.Tokenize(pb.TokenizeRequest(messages=messages), timeout=10)
    assert list(chat_tok.token_ids) == tokenizer.encode_chat([{"role": "user", "content": CAPITAL}])
    with_special = server.stub.Detokenize(pb.DetokenizeRequest(token_ids=chat_tok.token_ids), timeout=10).text
    without = server.stub.Detokenize(pb.DetokenizeRequest(token_ids=chat_tok.token_ids, skip_special_tokens=True))
    assert "<|im_start|>" in with_special and "<|im_start|>" not in without.text


def test_model_info_describes_the_engine(server):
    info = server.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10)
    assert info.model_name == "SmolLM2-135M-Instruct" and info.architecture == "LlamaForCausalLM"
    assert (info.max_model_len, info.vocab_size, list(info.eos_token_ids)) == (512, 49152, [2])
    assert (info.block_size, info.num_kv_blocks, info.tensor_parallel_size) == (16, 1024, 1)
    assert info.device == "cpu" and info.dtype == "float32" and info.attention_backend
    assert info.kv_cache_dtype == "float32"  # --kv-cache-dtype auto: the model's
    assert info.weight_format == "float32"  # plain weights: the dtype they are served in
    assert info.max_num_seqs == 256  # --max-num-seqs' default


def test_stats_count_finished_requests_and_generated_tokens(server):
    before = server.stub.GetStats(pb.GetStatsRequest(), timeout=10)
    server.stub.Generate(chat("Hi", max_tokens=5, ignore_eos=True), timeout=60)
    after = wait_idle(server.stub)
    assert after.engine_ready and after.total_kv_blocks == 1024
    assert after.num_finished == before.num_finished + 1
    assert after.num_generated_tokens == before.num_generated_tokens + 5
    assert after.prefix_cache_query_tokens > before.prefix_cache_query_tokens


# ---------------------------------------------------------------- abort, cancel, deadline, limits


def _long_stream(server, request_id: str, n: int = 1):
    request = chat("Write a very long story about dragons.", max_tokens=400, ignore_eos=True, n=n)
    request.request_id = request_id
    return server.stub.GenerateStream(request, timeout=120)


def test_abort_ends_the_stream_with_abort_and_is_idempotent(server):
    responses = _long_stream(server, "to-abort")
    first = next(responses)
    assert first.outputs[0].token_ids
    aborted = server.stub.Abort(pb.AbortRequest(request_ids=["to-abort", "unknown-id", "to-abort"]), timeout=10)
    assert list(aborted.aborted_request_ids) == ["to-abort"]
    rest = list(responses)
    outs = joined([first, *rest])
    assert outs.finish_reason == pb.FINISH_REASON_ABORT and len(outs.token_ids) < 400
    assert rest[-1].HasField("usage")
    again = server.stub.Abort(pb.AbortRequest(request_ids=["to-abort"]), timeout=10)
    assert list(again.aborted_request_ids) == []
    wait_idle(server.stub)


def test_a_duplicate_in_flight_request_id_is_already_exists(server):
    responses = _long_stream(server, "dup")
    next(responses)
    with pytest.raises(grpc.RpcError) as err:
        server.stub.Generate(pb.GenerateRequest(request_id="dup", prompt="x"), timeout=10)
    assert err.value.code() == grpc.StatusCode.ALREADY_EXISTS and "dup" in err.value.details()
    responses.cancel()
    wait_idle(server.stub)
    server.stub.Generate(pb.GenerateRequest(request_id="dup", prompt="x", sampling=pb.SamplingParams(max_tokens=1)))


def test_a_client_cancel_aborts_the_request_and_frees_its_blocks(server):
    responses = _long_stream(server, "to-cancel", n=2)
    next(responses)
    assert server.stub.GetStats(pb.GetStatsRequest(), timeout=10).num_running == 2
    responses.cancel()
    with pytest.raises(grpc.RpcError) as err:
        list(responses)
    assert err.value.code() == grpc.StatusCode.CANCELLED
    wait_idle(server.stub)


def test_a_deadline_aborts_the_request_and_frees_its_blocks(server):
    for call in (server.stub.Generate, lambda r, timeout: list(server.stub.GenerateStream(r, timeout=timeout))):
        with pytest.raises(grpc.RpcError) as err:
            call(chat("Write a very long story about dragons.", max_tokens=400, ignore_eos=True), timeout=1.0)
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        wait_idle(server.stub)


def test_more_pending_sequences_than_the_limit_is_resource_exhausted(server):
    responses = _long_stream(server, "fills-the-queue", n=8)  # the module's server allows 8
    next(responses)
    with pytest.raises(grpc.RpcError) as err:
        server.stub.Generate(pb.GenerateRequest(prompt="one more"), timeout=10)
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "max-pending-requests" in err.value.details()
    responses.cancel()
    wait_idle(server.stub)
    assert server.stub.Generate(pb.GenerateRequest(prompt="one more", sampling=pb.SamplingParams(max_tokens=1)))


def test_concurrent_streams_each_get_their_own_text(server):
    prompts = [CAPITAL, "What is 2 + 2?", "Name a fruit."]
    alone = [server.stub.Generate(chat(p, temperature=0, max_tokens=10), timeout=120).outputs[0].text
             for p in prompts]
    results = [None] * len(prompts)

    def run(i):
        results[i] = joined(stream(server.stub, chat(prompts[i], temperature=0, max_tokens=10))).text

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == alone


# ---------------------------------------------------------------- metrics


def _scrape(port: int) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            samples[name] = float(value)
    return samples


def test_prometheus_metrics_count_latencies_tokens_and_engine_gauges(server):
    before = _scrape(server.metrics_port)
    server.stub.Generate(chat("Hi", max_tokens=4, ignore_eos=True), timeout=60)
    time.sleep(2.5)  # the scheduler's gauges are polled every second
    after = _scrape(server.metrics_port)
    grew = lambda name, by: after[name] - before.get(name, 0) == by  # noqa: E731
    assert grew("nanoserve_time_to_first_token_seconds_count", 1)
    assert grew("nanoserve_e2e_request_latency_seconds_count", 1)
    assert grew("nanoserve_time_per_output_token_seconds_count", 1)
    assert grew("nanoserve_generation_tokens_total", 4)
    assert grew('nanoserve_requests_total{outcome="finished"}', 1)
    assert after["nanoserve_num_requests_running"] == after["nanoserve_num_requests_waiting"] == 0
    assert after["nanoserve_num_requests_swapped"] == 0
    assert after["nanoserve_kv_cache_usage_ratio"] == 0
    assert 0 < after["nanoserve_prefix_cache_hit_rate"] <= 1
    assert "nanoserve_preemptions_total" in after
