"""No message can crash the scheduler: every bad one is dropped, counted and answered where a client
waits, and the engine keeps serving (the hardening issue's defects 2-5, reproduced in-process)."""
from __future__ import annotations

import math
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from executor_svc.seq_mirror import SequenceMirrors
from protos import engine_pb2
from scheduler_svc.common.config import EngineConfig
from scheduler_svc.core.engine_core import EngineCore
from support.loopback_engine import (VOCAB, FakeExecutor, LoopbackTransport, add_request, engine,
                                     fake_token, pump)

FRONT = b"frontend-a"
ERROR, LENGTH = engine_pb2.FINISH_REASON_ERROR, engine_pb2.FINISH_REASON_LENGTH


def expected_tokens(prompt: list[int], n: int) -> list[int]:
    tokens = list(prompt)
    for _ in range(n):
        tokens.append(fake_token(tokens))
    return tokens[len(prompt):]


def served(transport: LoopbackTransport, identity: bytes, request_id: str) -> tuple[list[int], int, str]:
    """The tokens a request got, its finish reason and error, from what the scheduler sent."""
    outs = [o for o in transport.outputs_for(identity) if o.request_id == request_id]
    terminal = [o for o in outs if o.finish_reason]
    assert len(terminal) == 1, f"{request_id}: {len(terminal)} terminal outputs"
    return [t for o in outs for t in o.new_token_ids], terminal[0].finish_reason, terminal[0].error


def assert_still_serves(core: EngineCore, transport: LoopbackTransport, request_id: str = "probe") -> None:
    transport.from_frontend(FRONT, add_request(request_id, [5, 6, 7], max_tokens=3))
    pump(core)
    tokens, reason, error = served(transport, FRONT, request_id)
    assert (tokens, reason, error) == (expected_tokens([5, 6, 7], 3), LENGTH, "")
    bm = core.scheduler.block_manager
    assert bm.num_free_blocks == bm.num_blocks


@pytest.mark.parametrize("payload", [b"\xff\x00garbage\x17", b"\x0a\x05hello", b"\x08"])
def test_random_bytes_to_the_frontend_socket_are_dropped_and_counted(payload):
    core, transport, _ = engine()
    transport.from_frontend(FRONT, payload)
    pump(core)
    assert core.num_rejected_messages == 1
    assert_still_serves(core, transport)


def test_random_bytes_and_empty_envelopes_to_the_executor_socket_are_dropped_and_counted():
    core, transport, _ = engine()
    transport.from_executor(b"rank0", b"\xff\xfe\xfd")
    transport.from_executor(b"rank0", engine_pb2.ExecutorToScheduler())
    pump(core)
    assert core.num_rejected_messages == 2 and core.ready is not None
    assert_still_serves(core, transport)


@pytest.mark.parametrize("field, value", [("num_blocks", -5), ("num_blocks", 0), ("rank", 5), ("world_size", 2),
                                          ("block_size", 16), ("vocab_size", 0)])
def test_a_handshake_out_of_range_is_rejected_and_the_real_executor_keeps_serving(field, value):
    core, transport, executor = engine()
    rogue = executor.handshake(**{field: value, "pid": 4242})
    identity = f"rank{rogue.handshake.rank}".encode()
    transport.from_executor(identity, rogue)
    pump(core)
    assert core.num_rejected_messages == 1
    assert executor.shutdowns == [] and core.ready.model.num_blocks == 64
    assert_still_serves(core, transport)


def test_a_handshake_from_another_ranks_socket_is_rejected():
    core, transport, executor = engine()
    transport.from_executor(b"intruder", executor.handshake(pid=4242))
    pump(core)
    assert core.num_rejected_messages == 1 and executor.shutdowns == []
    assert_still_serves(core, transport)


def test_results_for_steps_not_in_flight_are_dropped_and_never_kept():
    core, transport, _ = engine()
    for step_id in range(1, 2001):
        transport.from_executor(b"rank0", engine_pb2.ExecutorToScheduler(
            result=engine_pb2.StepResult(step_id=core.step_id + step_id), epoch=core.epoch))
    pump(core)
    assert core.num_rejected_messages == 2000 and core.results == {}
    assert_still_serves(core, transport)  # its step ids pass the ones the rejected results named


def test_a_result_of_an_earlier_scheduler_epoch_is_never_applied():
    core, transport, executor = engine()
    transport.from_frontend(FRONT, add_request("a", [1, 2, 3], max_tokens=2))
    transport.poll(0, core)
    core._advance()  # step 1 is in flight; its result waits in the inbox
    old = engine_pb2.ExecutorToScheduler(result=engine_pb2.StepResult(
        step_id=1, sampled=[engine_pb2.SampledToken(seq_id=1, token_id=9)]), epoch=core.epoch ^ 0xFF)
    transport.inbox.appendleft(("executor", b"rank0", old.SerializeToString()))
    pump(core)
    assert core.num_rejected_messages == 1
    assert served(transport, FRONT, "a")[0] == expected_tokens([1, 2, 3], 2)  # the right result, not token 9


@pytest.mark.parametrize("bad", [math.nan, math.inf, -1.0, 1e300])
def test_a_result_with_timings_that_are_no_times_is_applied_with_them_zeroed(bad):
    core, transport, _ = engine()
    transport.from_frontend(FRONT, add_request("a", [1, 2, 3], max_tokens=2))
    transport.poll(0, core)
    core._advance()  # step 1 is in flight; the fake executor's result waits in the inbox: corrupt its times
    (i, (_, _, raw)), = [(i, m) for i, m in enumerate(transport.inbox) if m[:2] == ("executor", b"rank0")]
    msg = engine_pb2.ExecutorToScheduler.FromString(raw)
    for name in ("execute_seconds", "idle_seconds", "late_mask_wait_seconds", "swap_seconds"):
        setattr(msg.result, name, bad)
    transport.inbox[i] = ("executor", b"rank0", msg.SerializeToString())
    pump(core)
    assert served(transport, FRONT, "a")[0] == expected_tokens([1, 2, 3], 2)  # applied, not dropped
    t = core.timings
    times = (t.executor_busy_seconds, t.executor_idle_seconds, t.late_mask_wait_seconds, t.measured_swap_seconds)
    assert all(math.isfinite(x) and 0.0 <= x < 1e6 for x in times), times
    assert core.num_rejected_messages == 0


@pytest.mark.parametrize("sampling, stopping, why", [
    ({"temperature": math.nan}, {}, "temperature"),
    ({"temperature": math.inf}, {}, "temperature"),
    ({"top_p": 1.5}, {}, "top_p"),
    ({"repetition_penalty": 1e-30}, {}, "repetition_penalty"),
    ({"logprobs": -1}, {}, "logprobs"),
    ({}, {"max_tokens": -5}, "max_tokens"),
    ({}, {"stop_token_ids": [VOCAB]}, "stop_token_ids"),
])
def test_an_add_request_out_of_range_fails_alone_while_a_concurrent_request_is_served(sampling, stopping, why):
    core, transport, _ = engine()
    transport.from_frontend(FRONT, add_request("good", [4, 5, 6], max_tokens=5))
    bad = add_request("bad", [7, 8], **sampling)
    bad.add.stopping.MergeFrom(engine_pb2.StoppingOptions(**stopping))
    transport.from_frontend(FRONT, bad)
    pump(core)
    tokens, reason, error = served(transport, FRONT, "bad")
    assert reason == ERROR and why in error and tokens == []
    assert served(transport, FRONT, "good") == (expected_tokens([4, 5, 6], 5), LENGTH, "")
    assert core.num_rejected_messages == 1


def test_a_prompt_token_outside_the_vocabulary_is_rejected():
    core, transport, _ = engine()
    transport.from_frontend(FRONT, add_request("huge", [1, 10**9]))
    pump(core)
    _, reason, error = served(transport, FRONT, "huge")
    assert reason == ERROR and "vocabulary" in error
    assert_still_serves(core, transport)


@pytest.mark.parametrize("constraint, beam_width, why", [
    (engine_pb2.Constraint(), 0, "constraint is set but empty"),
    (engine_pb2.Constraint(regex="a+"), 2, "does not apply to beam search"),
    (engine_pb2.Constraint(regex="a" * 2**18), 0, "bytes; the limit is 262144"),
])
def test_a_malformed_constraint_is_rejected(constraint, beam_width, why):
    core, transport, _ = engine()
    bad = add_request("bad", [7, 8])
    bad.add.constraint.CopyFrom(constraint)
    bad.add.group_id = "g" if beam_width else ""
    bad.add.beam_search.MergeFrom(engine_pb2.BeamSearchOptions(beam_width=beam_width, num_requests=1))
    transport.from_frontend(FRONT, bad)
    pump(core)
    _, reason, error = served(transport, FRONT, "bad")
    assert reason == ERROR and why in error
    assert_still_serves(core, transport)


def test_a_constrained_request_on_an_engine_without_a_tokenizer_fails_alone_and_the_engine_serves_on():
    core, transport, _ = engine()  # its model directory has no tokenizer.json
    constrained = add_request("json", [4, 5, 6])
    constrained.add.constraint.json_object = True
    transport.from_frontend(FRONT, constrained)
    transport.from_frontend(FRONT, add_request("free", [4, 5, 6], max_tokens=5))
    pump(core)
    deadline = time.monotonic() + 30
    while core.scheduler.structured.compiling and time.monotonic() < deadline:  # the compiler's thread
        pump(core)
    tokens, reason, error = served(transport, FRONT, "json")
    assert (tokens, reason) == ([], ERROR) and "structured output is unavailable" in error
    assert served(transport, FRONT, "free") == (expected_tokens([4, 5, 6], 5), LENGTH, "")
    assert core.stats(0).num_grammar_compile_errors == 1
    assert_still_serves(core, transport)


def test_the_same_request_id_from_two_front_ends_names_two_requests():
    core, transport, _ = engine()
    transport.from_frontend(FRONT, add_request("same", [1, 2, 3], max_tokens=6))
    transport.from_frontend(b"frontend-b", add_request("same", [9, 8, 7], max_tokens=6))
    transport.from_frontend(b"frontend-b", engine_pb2.FrontendToScheduler(
        abort=engine_pb2.AbortRequests(request_ids=["same"])))  # b's abort ends b's request only
    pump(core)
    assert served(transport, FRONT, "same") == (expected_tokens([1, 2, 3], 6), LENGTH, "")
    assert served(transport, b"frontend-b", "same")[1] == engine_pb2.FINISH_REASON_ABORT


def test_a_silent_front_end_has_its_requests_aborted(monkeypatch):
    core, transport, _ = engine(frontend_timeout_s=5.0)
    transport.from_frontend(FRONT, add_request("long", [1, 2, 3], max_tokens=200))
    transport.from_frontend(b"frontend-b", engine_pb2.FrontendToScheduler(hello=engine_pb2.Hello()))
    transport.poll(0, core)
    core._advance()
    now = time.monotonic()
    core.frontends[b"frontend-b"] = now + 10  # b keeps talking; a went silent
    monkeypatch.setattr(time, "monotonic", lambda: now + 6)
    core.next_housekeeping = 0
    pump(core)
    assert core.scheduler.requests == {} and FRONT not in core.frontends and b"frontend-b" in core.frontends
    assert core.scheduler.counters.num_aborted == 1
    bm = core.scheduler.block_manager
    assert bm.num_free_blocks == bm.num_blocks


def test_a_beam_search_whose_members_never_all_arrive_fails_after_the_timeout(monkeypatch):
    core, transport, _ = engine(beam_group_timeout_s=3.0)
    first = add_request("m0", [1, 2, 3], max_tokens=4)
    first.add.group_id = "g"
    first.add.beam_search.CopyFrom(engine_pb2.BeamSearchOptions(beam_width=2, num_requests=2))
    transport.from_frontend(FRONT, first)
    pump(core)
    assert core.scheduler.beams.searches  # waiting for its second member
    now = time.monotonic()
    monkeypatch.setattr(time, "monotonic", lambda: now + 4)
    core.next_housekeeping = 0
    core.frontends[FRONT] = now + 4
    pump(core)
    _, reason, error = served(transport, FRONT, "m0")
    assert reason == ERROR and "not all its requests arrived" in error
    assert not core.scheduler.beams.searches and core.scheduler.requests == {}


def test_a_restarted_scheduler_asks_the_surviving_executor_to_shake_hands_and_serves_again():
    core, transport, executor = engine()
    assert_still_serves(core, transport, "before")
    old_epoch = executor.epoch
    # the scheduler process dies; a new one binds the same sockets and the executor keeps heart-beating
    fresh = EngineCore(core.config, transport)
    transport.executors[0] = executor
    assert fresh.epoch != old_epoch and fresh.ready is None
    # a result of the old scheduler still queued in the executor arrives first, then a heartbeat
    transport.from_executor(b"rank0", engine_pb2.ExecutorToScheduler(
        result=engine_pb2.StepResult(step_id=1), epoch=old_epoch))
    executor.heartbeat()
    pump(fresh)
    assert fresh.ready is not None and executor.epoch == fresh.epoch
    assert fresh.num_rejected_messages == 1 and fresh.results == {}
    assert_still_serves(fresh, transport, "after")


def test_every_message_to_a_peer_carries_the_epoch():
    core, transport, executor = engine()
    transport.from_frontend(FRONT, engine_pb2.FrontendToScheduler(hello=engine_pb2.Hello()))
    assert_still_serves(core, transport)
    assert transport.sent_to_frontends and all(m.epoch == core.epoch for _, m in transport.sent_to_frontends)
    assert executor.epoch == core.epoch and executor.plans_run > 0


def test_a_hello_is_answered_with_not_ready_until_every_rank_has_joined():
    transport = LoopbackTransport()
    core = EngineCore(EngineConfig(model="/nonexistent", block_size=4, tensor_parallel_size=2), transport)
    transport.from_frontend(FRONT, engine_pb2.FrontendToScheduler(hello=engine_pb2.Hello()))
    pump(core)
    (_, answer), = transport.sent_to_frontends
    assert answer.WhichOneof("kind") == "not_ready" and answer.not_ready.world_size == 2


# ------------------------------------------------------------------ fuzzing

def _mutations(valid: bytes):
    """Bytes near a valid message: truncated, bit-flipped, or spliced."""
    return st.one_of(
        st.integers(0, len(valid)).map(lambda n: valid[:n]),
        st.tuples(st.integers(0, max(len(valid) - 1, 0)), st.integers(0, 7)).map(
            lambda t: valid[:t[0]] + bytes([valid[t[0]] ^ (1 << t[1])]) + valid[t[0] + 1:] if valid else valid),
        st.binary(max_size=64).map(lambda b: valid[: len(valid) // 2] + b),
    )


VALID_FRONTEND = [add_request("x", [1, 2, 3], max_tokens=3).SerializeToString(),
                  engine_pb2.FrontendToScheduler(abort=engine_pb2.AbortRequests(request_ids=["x"])).SerializeToString(),
                  engine_pb2.FrontendToScheduler(stats=engine_pb2.StatsQuery(query_id=3)).SerializeToString()]
VALID_EXECUTOR = [engine_pb2.ExecutorToScheduler(result=engine_pb2.StepResult(step_id=1)).SerializeToString(),
                  FakeExecutor(LoopbackTransport()).handshake().SerializeToString()]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.sampled_from(["frontend", "executor"]), st.sampled_from([b"rank0", FRONT, b"x"]),
                          st.one_of(st.binary(max_size=200), *[_mutations(v) for v in VALID_FRONTEND + VALID_EXECUTOR])),
                max_size=12))
def test_fuzzed_messages_to_both_sockets_never_crash_the_scheduler_and_it_serves_afterwards(messages):
    core, transport, executor = engine()
    for side, identity, payload in messages:
        transport.inbox.append((side, identity, payload))
    pump(core)
    if core.ready is None:
        # a handshake from rank 0's socket with another pid means a new rank-0 process, whose KV pool is not
        # the old one's: the engine is lost by design (the real executor was told to exit). Its restart serves.
        assert executor.shutdowns, "the engine went down without telling the executor why"
        executor.pid, executor.epoch, executor.mirrors = executor.pid + 1, 0, SequenceMirrors()
        executor.join()
        pump(core)
    transport.sent_to_frontends.clear()
    assert_still_serves(core, transport, "after-fuzz")


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(temperature=st.floats(allow_nan=True, allow_infinity=True, width=32),
       top_p=st.floats(allow_nan=True, allow_infinity=True, width=32),
       top_k=st.integers(-2**31, 2**31 - 1), repetition_penalty=st.floats(width=32),
       presence_penalty=st.floats(width=32), logprobs=st.integers(-2**31, 2**31 - 1),
       max_tokens=st.integers(-2**31, 2**31 - 1), min_tokens=st.integers(-2**31, 2**31 - 1),
       stop=st.lists(st.integers(-2**31, 2**31 - 1), max_size=3))
def test_any_sampling_numbers_either_run_in_range_or_are_rejected(temperature, top_p, top_k, repetition_penalty,
                                                                   presence_penalty, logprobs, max_tokens,
                                                                   min_tokens, stop):
    core, transport, _ = engine()
    msg = add_request("r", [1, 2], max_tokens=0, temperature=temperature, top_p=top_p, top_k=top_k,
                      repetition_penalty=repetition_penalty, presence_penalty=presence_penalty, logprobs=logprobs)
    msg.add.stopping.CopyFrom(engine_pb2.StoppingOptions(max_tokens=max_tokens, min_tokens=min_tokens,
                                                         stop_token_ids=stop))
    transport.from_frontend(FRONT, msg)
    pump(core, max_iterations=5000)
    tokens, reason, error = served(transport, FRONT, "r")
    if reason == ERROR:
        assert error.startswith("rejected by the scheduler") or "leaves no room" in error
    else:  # accepted: it ran to its stop rule like any request
        s = msg.add.sampling
        assert math.isfinite(s.temperature) and 0 <= s.temperature and max_tokens >= 0 and min_tokens >= 0
        assert all(0 <= t < VOCAB for t in stop)
        limit = 256 - 2 if max_tokens == 0 else min(max_tokens, 256 - 2)
        want = []
        while len(want) < limit:
            want.append(fake_token([1, 2, *want]))
            if want[-1] in stop and len(want) >= min_tokens:
                break
        assert tokens == want
    bm = core.scheduler.block_manager
    assert bm.num_free_blocks == bm.num_blocks


def test_a_refused_handshake_is_told_to_front_ends_waiting_for_the_engine():
    """A misconfigured executor (here an EOS id outside its vocabulary) must not leave a caller waiting in
    silence: the answer to its Hello says why the engine cannot start."""
    transport = LoopbackTransport()
    core = EngineCore(EngineConfig(model="/nonexistent", block_size=4), transport)
    executor = FakeExecutor(transport)
    transport.from_executor(b"rank0", executor.handshake(eos_token_ids=[VOCAB + 5]))
    transport.from_frontend(FRONT, engine_pb2.FrontendToScheduler(hello=engine_pb2.Hello()))
    pump(core)
    (_, answer), = transport.sent_to_frontends
    assert core.ready is None and "eos_token_ids outside the vocabulary" in answer.not_ready.refused


def test_a_multi_frame_send_and_random_bytes_on_the_real_sockets_are_dropped_and_counted():
    """The ZeroMQ transport: a DEALER that sends two frames, or bytes that are no protobuf, to either socket
    is counted and dropped, and the scheduler keeps answering on the same sockets."""
    import socket as pysocket

    import zmq

    from scheduler_svc.core.scheduler_process import ZmqTransport

    def port() -> int:
        with pysocket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]

    frontend_addr, executor_addr = f"tcp://127.0.0.1:{port()}", f"tcp://127.0.0.1:{port()}"
    transport = ZmqTransport(frontend_addr, executor_addr)
    core = EngineCore(EngineConfig(model="/nonexistent", block_size=4), transport)
    ctx = zmq.Context()
    peers = []
    try:
        for addr in (frontend_addr, executor_addr):
            peer = ctx.socket(zmq.DEALER)
            peer.setsockopt(zmq.LINGER, 0)
            peer.connect(addr)
            peer.send_multipart([b"one", b"two"])
            peer.send(b"\xff\xfe not a protobuf")
            peers.append(peer)
        peers[0].send(engine_pb2.FrontendToScheduler(hello=engine_pb2.Hello()).SerializeToString())
        for _ in range(100):
            transport.poll(20, core)
            if core.num_rejected_messages == 4 and peers[0].poll(0):
                break
        answer = engine_pb2.SchedulerToFrontend.FromString(peers[0].recv())
        assert core.num_rejected_messages == 4
        assert answer.WhichOneof("kind") == "not_ready" and answer.epoch == core.epoch
    finally:
        for peer in peers:
            peer.close()
        ctx.term()
        transport.close()
