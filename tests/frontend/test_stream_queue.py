"""StreamQueue: a stream's queued engine outputs stay within the bound whatever the engine sends and
however rarely the handler takes them, and merging loses, reorders or duplicates nothing."""
from __future__ import annotations

import asyncio
import itertools

from hypothesis import given, strategies as st

from protos import engine_pb2
from scheduler_svc.frontend.async_engine_client import EngineLost
from scheduler_svc.frontend.stream_queue import StreamQueue

# One program: (request index, tokens in the output) puts, or None for one get by the handler.
programs = st.lists(st.one_of(st.none(), st.tuples(st.integers(0, 2), st.integers(0, 5))), max_size=60)


def drain(queue: StreamQueue) -> list:
    async def take_all():
        return [await queue.get() for _ in range(queue.qsize())]
    return asyncio.run(take_all())


@given(bound=st.integers(1, 4), num_requests=st.integers(1, 3), program=programs)
def test_queued_outputs_stay_within_the_bound_and_merging_keeps_every_token_in_order(bound, num_requests, program):
    queue, rids, numbers = StreamQueue(bound), [f"r#{i}/0" for i in range(num_requests)], itertools.count()
    sent = {rid: [] for rid in rids}
    received = {rid: [] for rid in rids}
    finishes = {rid: [] for rid in rids}

    def take(items):
        for ro in items:
            received[ro.request_id].extend(ro.new_token_ids)
            finishes[ro.request_id].append(ro.finish_reason)

    def put(rid, num_tokens, finish=engine_pb2.FINISH_REASON_UNSPECIFIED):
        tokens = [next(numbers) for _ in range(num_tokens)]
        sent[rid].extend(tokens)
        queue.put_nowait(engine_pb2.RequestOutput(request_id=rid, new_token_ids=tokens, finish_reason=finish))
        assert queue.queued(rid) <= bound
        assert queue.qsize() <= bound * num_requests

    for step in program:
        if step is None:
            if queue.qsize():
                take([asyncio.run(queue.get())])
        elif step[0] < num_requests:
            put(rids[step[0]], step[1])
    for rid in rids:
        put(rid, 1, engine_pb2.FINISH_REASON_LENGTH)
    take(drain(queue))
    assert received == sent
    for rid in rids:  # one finish per request, on its last output
        assert finishes[rid][-1] == engine_pb2.FINISH_REASON_LENGTH
        assert set(finishes[rid][:-1]) <= {engine_pb2.FINISH_REASON_UNSPECIFIED}


def test_an_output_already_handed_out_is_never_changed_by_later_ones():
    queue = StreamQueue(1)
    queue.put_nowait(engine_pb2.RequestOutput(request_id="a", new_token_ids=[1]))
    first = asyncio.run(queue.get())
    queue.put_nowait(engine_pb2.RequestOutput(request_id="a", new_token_ids=[2], stop_token_id=-1))
    queue.put_nowait(engine_pb2.RequestOutput(request_id="a", new_token_ids=[3], stop_token_id=0,
                                              finish_reason=engine_pb2.FINISH_REASON_STOP))
    (merged,) = drain(queue)
    assert list(first.new_token_ids) == [1]
    assert list(merged.new_token_ids) == [2, 3]
    assert (merged.finish_reason, merged.stop_token_id) == (engine_pb2.FINISH_REASON_STOP, 0)


def test_engine_lost_is_queued_after_the_outputs_and_never_merged():
    queue = StreamQueue(1)
    for token in range(3):
        queue.put_nowait(engine_pb2.RequestOutput(request_id="a", new_token_ids=[token]))
    queue.put_nowait(EngineLost("gone"))
    merged, lost = drain(queue)
    assert list(merged.new_token_ids) == [0, 1, 2]
    assert lost == EngineLost("gone")
