"""Async scheduling: planning step N+1 before step N's tokens are back gives exactly the tokens of
planning one step at a time, through chunked prefill, preemption and prefix hits, and frees every block.
A fake executor checks every read of every step against the reader's own history."""
from __future__ import annotations

from collections import deque

from hypothesis import given, settings
from hypothesis import strategies as st

from support.fake_executor import FakeExecutor, check_block_references
from protos import engine_pb2
from scheduler_svc.core.scheduler import Scheduler
from scheduler_svc.core.scheduler_config import SchedulerConfig
from scheduler_svc.core.sequence import Sequence

EOS = 0


def fake_model(seq_id: int, position: int) -> int:
    """The token sampled at a position: deterministic, so both pipelines must agree; EOS now and then."""
    return EOS if (seq_id * 13 + position * 7) % 41 == 0 else 1 + (seq_id * 31 + position * 7) % 50


def token_at(seq: Sequence, pos: int) -> int:
    """What the executors hold at a position, also for a sample still in flight."""
    return seq.token_ids[pos] if pos < seq.num_prompt_tokens else fake_model(seq.seq_id, pos)


def run(requests, depth: int, num_blocks: int, budget: int, num_host_blocks: int = 0, **config):
    """Serve the requests ((prompt, max_tokens) or (prompt, max_tokens, priority)) with `depth` planned steps in
    flight; the outputs by request id, and the scheduler. config: more SchedulerConfig fields."""
    sched = Scheduler(SchedulerConfig(max_num_seqs=6, max_num_batched_tokens=budget, max_model_len=96,
                                      block_size=4, num_blocks=num_blocks, eos_token_ids=(EOS,),
                                      num_host_blocks=num_host_blocks, **config))
    executor = FakeExecutor(num_blocks, 4, num_host_blocks, token_at)
    seqs = []
    for i, (prompt, max_tokens, *priority) in enumerate(requests):
        seq = Sequence(seq_id=i + 1, request_id=f"r{i}", token_ids=list(prompt), num_prompt_tokens=len(prompt),
                       sampling=engine_pb2.SamplingOptions(), priority=priority[0] if priority else 0,
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
                executor.run(out)
                in_flight.append(out)
                continue
        assert in_flight, "nothing scheduled and nothing in flight: the queue is wedged"
        out = in_flight.popleft()
        sampled = {s.seq.seq_id: fake_model(s.seq.seq_id, s.start + s.num_new_tokens)
                   for s in out.scheduled if s.samples}
        sched.postprocess(out, sampled)
        check_block_references(sched)
    else:
        raise AssertionError("did not finish")
    assert sched.block_manager.num_free_blocks == num_blocks and not sched.swapped
    if num_host_blocks:
        assert sched.block_manager.host_pool.num_free_blocks == num_host_blocks
    for seq in seqs:
        assert seq.is_finished and seq.num_placeholders == 0
        assert seq.num_output_tokens <= seq.stopping.max_tokens
    return {s.request_id: s.output_token_ids for s in seqs}, sched


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
    one_at_a_time, sync = run(requests, 1, 20, 16)
    ahead, planned = run(requests, 2, 20, 16)
    assert sync.counters.num_preemptions > 0 and planned.counters.num_preemptions > 0
    assert ahead == one_at_a_time
