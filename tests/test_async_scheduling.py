"""Async scheduling: planning step N+1 before step N's tokens are back gives exactly the tokens of
planning one step at a time, through chunked prefill, preemption and prefix hits, and frees every block."""
from __future__ import annotations

from collections import deque

from hypothesis import given, settings
from hypothesis import strategies as st

from protos import engine_pb2
from scheduler_svc.scheduler import Scheduler, SchedulerConfig
from scheduler_svc.sequence import Sequence

EOS = 0


def fake_model(seq_id: int, position: int) -> int:
    """The token sampled at a position: deterministic, so both pipelines must agree; EOS now and then."""
    return EOS if (seq_id * 13 + position * 7) % 41 == 0 else 1 + (seq_id * 31 + position * 7) % 50


def run(requests, depth: int, num_blocks: int, budget: int) -> tuple[dict[str, list[int]], int]:
    sched = Scheduler(SchedulerConfig(max_num_seqs=6, max_num_batched_tokens=budget, max_model_len=96,
                                      block_size=4, num_blocks=num_blocks, eos_token_ids=(EOS,)))
    seqs = []
    for i, (prompt, max_tokens) in enumerate(requests):
        seq = Sequence(seq_id=i + 1, request_id=f"r{i}", token_ids=list(prompt), num_prompt_tokens=len(prompt),
                       sampling=engine_pb2.SamplingOptions(),
                       stopping=engine_pb2.StoppingOptions(max_tokens=max_tokens))
        sched.add(seq)
        seqs.append(seq)
    in_flight: deque = deque()
    for _ in range(10_000):
        if not (sched.has_unfinished() or in_flight):
            break
        if sched.has_unfinished() and len(in_flight) < depth:
            out = sched.schedule()
            if out.scheduled:
                assert all(0 < s.seq.num_placeholders <= depth for s in out.scheduled if s.samples)
                in_flight.append(out)
                continue
        assert in_flight, "nothing scheduled and nothing in flight: the queue is wedged"
        out = in_flight.popleft()
        sampled = {s.seq.seq_id: fake_model(s.seq.seq_id, s.start + s.num_new_tokens)
                   for s in out.scheduled if s.samples}
        sched.postprocess(out, sampled)
    else:
        raise AssertionError("did not finish")
    assert sched.block_manager.num_free_blocks == num_blocks
    for seq in seqs:
        assert seq.is_finished and seq.num_placeholders == 0
        assert seq.num_output_tokens <= seq.stopping.max_tokens
    return {s.request_id: s.output_token_ids for s in seqs}, sched.counters.num_preemptions


prompt_st = st.lists(st.integers(1, 60), min_size=1, max_size=30)
shared_st = st.lists(st.integers(1, 60), min_size=0, max_size=12)


@settings(max_examples=60, deadline=None)
@given(shared=shared_st, tails=st.lists(st.tuples(prompt_st, st.integers(1, 20)), min_size=1, max_size=6),
       num_blocks=st.integers(12, 40), budget=st.integers(4, 48))
def test_planning_ahead_gives_the_same_tokens_as_planning_one_step_at_a_time(shared, tails, num_blocks, budget):
    requests = [(shared + prompt, max_tokens) for prompt, max_tokens in tails]
    one_at_a_time, _ = run(requests, 1, num_blocks, budget)
    assert run(requests, 2, num_blocks, budget)[0] == one_at_a_time
    assert run(requests, 3, num_blocks, budget)[0] == one_at_a_time


def test_planning_ahead_survives_preemption():
    requests = [([i + 1] * 20, 40) for i in range(6)]
    one_at_a_time, preempted_sync = run(requests, 1, 20, 16)
    ahead, preempted_async = run(requests, 2, 20, 16)
    assert preempted_sync > 0 and preempted_async > 0
    assert ahead == one_at_a_time
