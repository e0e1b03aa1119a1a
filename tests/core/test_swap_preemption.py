"""Preemption by swap: a preempted sequence's KV goes to the executors' host pool and comes back with
swap-in copies, so it resumes where it stopped. Tokens equal those of an unpressured run, with and
without planning ahead, and every read sees the reader's own history (test_async_scheduling's driver,
with its fake executor)."""
from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from protos import engine_pb2
from scheduler_svc.common.config import PREEMPTION_MODES, PREEMPTION_POLICIES
from scheduler_svc.core.preemption_cost import PreemptionCosts
from scheduler_svc.core.scheduler import Scheduler
from scheduler_svc.core.scheduler_config import SchedulerConfig
from scheduler_svc.core.sequence import Sequence, SequenceStatus
from test_async_scheduling import run as serve

BLOCK = 4
EOS = 0


def make_scheduler(num_blocks: int, num_host_blocks: int) -> Scheduler:
    return Scheduler(SchedulerConfig(max_num_seqs=6, max_num_batched_tokens=64, max_model_len=96,
                                     block_size=BLOCK, num_blocks=num_blocks, eos_token_ids=(EOS,),
                                     num_host_blocks=num_host_blocks))


def run(requests, num_blocks: int, num_host_blocks: int, depth: int = 1, budget: int = 64, **config):
    return serve(requests, depth, num_blocks, budget, num_host_blocks, **config)


prompt_st = st.lists(st.integers(1, 60), min_size=1, max_size=30)


@settings(max_examples=60, deadline=None)
@given(requests=st.lists(st.tuples(prompt_st, st.integers(1, 30)), min_size=1, max_size=6),
       spare=st.integers(0, 10), num_host_blocks=st.integers(0, 40), depth=st.sampled_from([1, 2]),
       budget=st.sampled_from([5, 16, 64]))
def test_swapping_preempted_sequences_gives_the_tokens_of_an_unpressured_run(requests, spare, num_host_blocks,
                                                                             depth, budget):
    longest = max(-(-(len(p) + m) // BLOCK) for p, m in requests)
    relaxed, _ = run(requests, num_blocks=400, num_host_blocks=0)
    pressed, _ = run(requests, num_blocks=longest + spare, num_host_blocks=num_host_blocks, depth=depth,
                     budget=budget)
    assert pressed == relaxed


@settings(max_examples=60, deadline=None)
@given(requests=st.lists(st.tuples(prompt_st, st.integers(1, 30), st.integers(0, 2)), min_size=1, max_size=6),
       spare=st.integers(0, 10), num_host_blocks=st.integers(0, 40), depth=st.sampled_from([1, 2, 3]),
       budget=st.sampled_from([5, 16, 64]), mode=st.sampled_from(PREEMPTION_MODES),
       policy=st.sampled_from(PREEMPTION_POLICIES), rate=st.sampled_from([0.0, 0.5, 2.0]))
def test_every_preemption_mode_and_policy_gives_the_tokens_of_an_unpressured_run(requests, spare, num_host_blocks,
                                                                                depth, budget, mode, policy, rate):
    longest = max(-(-(len(p) + m) // BLOCK) for p, m, _ in requests)
    relaxed, _ = run(requests, num_blocks=400, num_host_blocks=0)
    # swapping a block out and in costs 3 s; recomputing its 4 tokens 4 / rate: auto goes either way
    costs = PreemptionCosts(block_bytes=1, host_link_bytes_per_s=1.0, copy_fixed_s=0.5, prefill_tokens_per_s=rate)
    pressed, _ = run(requests, num_blocks=longest + spare, num_host_blocks=num_host_blocks, depth=depth,
                     budget=budget, preemption_mode=mode, preemption_policy=policy, preemption_costs=costs)
    assert pressed == relaxed


def test_a_swapped_sequence_resumes_where_it_stopped_with_its_kv_copied_back():
    requests = [(list(range(1, 13)), 20), (list(range(20, 32)), 20)]
    outs, sched = run(requests, num_blocks=9, num_host_blocks=16)
    assert sched.counters.num_swap_outs > 0 and sched.counters.num_swap_outs == sched.counters.num_preemptions
    relaxed, _ = run(requests, num_blocks=400, num_host_blocks=0)
    assert outs == relaxed


def test_the_first_resumed_step_computes_only_what_was_not_computed_before_the_swap():
    sched = make_scheduler(num_blocks=8, num_host_blocks=8)
    a = Sequence(seq_id=1, request_id="a", token_ids=list(range(1, 11)), num_prompt_tokens=10,
                 sampling=engine_pb2.SamplingOptions(), stopping=engine_pb2.StoppingOptions(max_tokens=20))
    sched.add(a)
    out = sched.schedule()
    sched.postprocess(out, {1: 7})
    sched.preempt(a, [])
    assert a.status is SequenceStatus.SWAPPED and not a.block_table and len(a.host_block_table) == 3
    assert sched.block_manager.num_free_blocks == 8
    out = sched.schedule()  # the swap-out rides on this plan, before the swap-in that undoes it
    assert out.swap_out and out.swap_in and [h for _, h in out.swap_out] == [h for h, _ in out.swap_in]
    (item,) = out.scheduled
    assert item.is_new and item.start == 10 and item.num_new_tokens == 1


def test_without_host_room_preemption_falls_back_to_recompute():
    requests = [(list(range(1, 13)), 20), (list(range(20, 32)), 20)]
    outs, sched = run(requests, num_blocks=9, num_host_blocks=1)
    assert sched.counters.num_preemptions > 0 and sched.counters.num_swap_outs == 0
    assert outs == run(requests, num_blocks=400, num_host_blocks=0)[0]
