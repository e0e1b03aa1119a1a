"""Coalescing: a handler that fell behind sends what queued up for one completion as one message, and
never merges across completions, reorders, waits for more, or loses a final output or `usage`."""
from __future__ import annotations

import asyncio
import itertools

from hypothesis import given, strategies as st

from protos import engine_pb2
from protos import generation_pb2 as pb
from scheduler_svc.frontend.server_config import ServerConfig
from scheduler_svc.frontend.stream_queue import StreamQueue
from support.frontend_in_process import READY, serve_frontend

LENGTH = engine_pb2.FINISH_REASON_LENGTH
NOT_DONE = engine_pb2.FINISH_REASON_UNSPECIFIED

# A program: which completion (0..2) sends the next output and how many tokens it has, or None: the
# handler takes one (coalesced) message.
programs = st.lists(st.one_of(st.none(), st.tuples(st.integers(0, 2), st.integers(0, 4))), max_size=60)


@given(num_completions=st.integers(1, 3), program=programs)
def test_coalescing_keeps_the_order_of_every_token_and_each_final_output_last(num_completions, program):
    queue = StreamQueue(max_per_request=10_000)  # no bound merging here: only coalescing is under test
    rids, numbers = [f"r#{i}/0" for i in range(num_completions)], itertools.count()
    sent, taken = [], []  # (rid, token) in the order sent / taken

    async def run():
        def put(rid, num_tokens, finish=NOT_DONE):
            tokens = [next(numbers) for _ in range(num_tokens)]
            sent.extend((rid, t) for t in tokens)
            queue.put_nowait(engine_pb2.RequestOutput(request_id=rid, new_token_ids=tokens, finish_reason=finish))

        messages, puts = [], 0  # (message, puts made before it was taken)
        for step in program:
            if step is None and queue.qsize():
                messages.append((await queue.get_coalesced(), puts))
            elif step is not None and step[0] < num_completions:
                put(rids[step[0]], step[1])
                puts += 1
        for rid in rids:
            put(rid, 1, LENGTH)
            puts += 1
        while queue.qsize():
            messages.append((await queue.get_coalesced(), puts))
        return messages

    taken_with_puts = asyncio.run(run())
    messages = [m for m, _ in taken_with_puts]
    for m in messages:
        taken.extend((m.request_id, t) for t in m.new_token_ids)
    assert taken == sent  # nothing lost, duplicated or reordered, across completions too
    for rid in rids:
        finishes = [m.finish_reason for m in messages if m.request_id == rid]
        assert finishes[-1] == LENGTH and set(finishes[:-1]) <= {NOT_DONE}
    # two messages of one completion taken one after the other with no put between were queued
    # together, so they would have been one, unless the first one was final
    for (m, puts), (later, later_puts) in zip(taken_with_puts, taken_with_puts[1:]):
        if later_puts == puts and later.request_id == m.request_id:
            assert m.finish_reason != NOT_DONE


def test_the_outputs_of_one_completion_queued_together_go_as_one_message_and_others_stay_apart():
    queue = StreamQueue(max_per_request=10_000)
    for rid, tokens, finish in [("a", [1], NOT_DONE), ("a", [2], NOT_DONE), ("b", [3], NOT_DONE),
                                ("a", [4], LENGTH), ("a", [5], NOT_DONE)]:
        queue.put_nowait(engine_pb2.RequestOutput(request_id=rid, new_token_ids=tokens, finish_reason=finish))

    async def take(k):
        return [await queue.get_coalesced() for _ in range(k)]

    first, second, third, fourth = asyncio.run(take(4))
    assert (first.request_id, list(first.new_token_ids)) == ("a", [1, 2])  # merged, up to b's output
    assert (second.request_id, list(second.new_token_ids)) == ("b", [3])
    assert (third.request_id, list(third.new_token_ids), third.finish_reason) == ("a", [4], LENGTH)
    assert list(fourth.new_token_ids) == [5]  # never merged past a final output
    assert queue.qsize() == 0


def test_get_coalesced_returns_what_is_there_without_waiting_for_more():
    async def run():
        queue = StreamQueue(max_per_request=8)
        queue.put_nowait(engine_pb2.RequestOutput(request_id="a", new_token_ids=[1]))
        return await asyncio.wait_for(queue.get_coalesced(), timeout=0.5)  # one output: at once

    assert list(asyncio.run(run()).new_token_ids) == [1]


class BurstEngine:
    """Stands in for AsyncEngineClient: on flush() every completion's outputs (one token each, the last
    one final) are queued at once, in runs of HALF per completion (a's first half, b's, a's second, b's),
    so the handler finds them all waiting."""
    ready = READY
    num_in_flight = 0
    TOKENS = 12
    HALF = TOKENS // 2

    def __init__(self) -> None:
        self.queue: StreamQueue | None = None
        self.added = []

    def open_stream(self, engine_ids):
        self.queue = StreamQueue(max_per_request=64)
        return self.queue

    def add(self, add: engine_pb2.AddRequest) -> None:
        self.added.append(add.request_id)

    def flush(self) -> None:
        for first in (0, self.HALF):
            for rid in self.added:
                for t in range(first, first + self.HALF):
                    self.queue.put_nowait(engine_pb2.RequestOutput(
                        request_id=rid, new_token_ids=[1000 * (1 + self.added.index(rid)) + t],
                        finish_reason=LENGTH if t == self.TOKENS - 1 else NOT_DONE))

    def abort(self, engine_ids) -> None:
        pass

    def close_stream(self, engine_ids) -> None:
        pass


def test_a_stream_served_from_a_full_queue_has_every_token_in_order_one_finish_each_and_usage_last():
    async def run():
        engine = BurstEngine()
        async with serve_frontend(ServerConfig(), None, engine) as fe:
            async with fe.channel() as ch:
                call = fe.stub(ch).GenerateStream(pb.GenerateRequest(
                    prompt_token_ids=pb.TokenIds(ids=[5, 6, 7]), sampling=pb.SamplingParams(max_tokens=BurstEngine.TOKENS, n=2)))
                while len(engine.added) < 2:
                    await asyncio.sleep(0.01)
                engine.flush()
                return [m async for m in call]

    messages = asyncio.run(run())
    assert [len(m.outputs[0].token_ids) for m in messages] == [BurstEngine.HALF] * 4  # one message a run
    tokens = {0: [], 1: []}
    finishes = {0: 0, 1: 0}
    for m in messages:
        (out,) = m.outputs
        tokens[out.index].extend(out.token_ids)
        finishes[out.index] += bool(out.finish_reason)
    assert tokens == {i: [1000 * (1 + i) + t for t in range(BurstEngine.TOKENS)] for i in (0, 1)}
    assert finishes == {0: 1, 1: 1}
    assert [m.HasField("usage") for m in messages] == [False] * (len(messages) - 1) + [True]
    assert messages[-1].usage.completion_tokens == 2 * BurstEngine.TOKENS
