"""Who gives way (newest, least-progress, priority; never a sequence about to end while another can), priority
preemption for a waiting request, auto mode per victim, and what each decision counts."""
from __future__ import annotations

import argparse

import pytest

from protos import engine_pb2
from scheduler_svc.common.config import DEFAULT_SWAP_SPACE_GB, EngineConfig, add_engine_args, engine_config_from_args
from scheduler_svc.core.preemption_cost import PreemptionCosts
from scheduler_svc.core.scheduler import Scheduler
from scheduler_svc.core.scheduler_config import SchedulerConfig
from scheduler_svc.core.sequence import Sequence, SequenceStatus
from support.fake_executor import FakeExecutor, check_block_references
from test_async_scheduling import fake_model, token_at

BLOCK = 4
EOS = 0
RUNNING, WAITING, SWAPPED = SequenceStatus.RUNNING, SequenceStatus.WAITING, SequenceStatus.SWAPPED


def scheduler(num_blocks: int, num_host_blocks: int = 0, **config) -> Scheduler:
    return Scheduler(SchedulerConfig(max_num_seqs=6, max_num_batched_tokens=64, max_model_len=96, block_size=BLOCK,
                                     num_blocks=num_blocks, eos_token_ids=(EOS,), num_host_blocks=num_host_blocks,
                                     **config))


def seq(seq_id: int, prompt_len: int, max_tokens: int = 30, priority: int = 0) -> Sequence:
    prompt = [1 + (seq_id * 7 + i) % 50 for i in range(prompt_len)]
    return Sequence(seq_id=seq_id, request_id=f"r{seq_id}", token_ids=prompt, num_prompt_tokens=prompt_len,
                    sampling=engine_pb2.SamplingOptions(), priority=priority,
                    stopping=engine_pb2.StoppingOptions(max_tokens=max_tokens, ignore_eos=True))


def step(sched: Scheduler, executor: FakeExecutor):
    """One step through the fake executor (every read checked against the reader's own tokens)."""
    out = sched.schedule()
    executor.run(out)
    sched.postprocess(out, {s.seq.seq_id: fake_model(s.seq.seq_id, s.start + s.num_new_tokens)
                            for s in out.scheduled if s.samples})
    check_block_references(sched)
    return out


def drain(sched: Scheduler, executor: FakeExecutor) -> None:
    for _ in range(1000):
        if not sched.has_unfinished():
            return
        assert step(sched, executor).scheduled, "work is left but nothing was scheduled"
    raise AssertionError("did not finish")


def two_sequences_then_short_of_a_block(policy: str, first: Sequence, second: Sequence):
    """first (3 prompt tokens) and second (12) fill 4 of 5 blocks; second's first decode takes the fifth, so
    first's second decode, in the third step, finds none."""
    sched = scheduler(num_blocks=5, preemption_policy=policy)
    executor = FakeExecutor(5, BLOCK, 0, token_at)
    for s in (first, second):
        sched.add(s)
    for _ in range(2):
        step(sched, executor)
    assert sched.block_manager.num_free_blocks == 0 and sched.counters.num_preemptions == 0
    step(sched, executor)
    assert sched.counters.num_preemptions == 1
    return sched, executor


def test_newest_preempts_the_most_recently_admitted():
    short, long = seq(1, 3), seq(2, 12)
    two_sequences_then_short_of_a_block("newest", short, long)
    assert long.status is WAITING and short.status is RUNNING


def test_least_progress_preempts_the_sequence_with_the_fewest_computed_tokens():
    short, long = seq(1, 3), seq(2, 12)
    two_sequences_then_short_of_a_block("least-progress", short, long)
    assert short.status is WAITING and long.status is RUNNING  # 5 computed tokens thrown away, not 14


def test_a_sequence_within_a_few_tokens_of_its_end_is_not_preempted_while_another_victim_exists():
    older, ending = seq(1, 3), seq(2, 12, max_tokens=5)  # 4 tokens from its limit after its first sample
    sched, executor = two_sequences_then_short_of_a_block("newest", older, ending)
    assert older.status is WAITING and ending.status is RUNNING  # newest first would have preempted `ending`
    drain(sched, executor)
    assert ending.epoch == 0 and ending.num_output_tokens == 5  # it finished without ever being preempted


def test_priority_preempts_the_lowest_priority_even_when_it_was_admitted_first():
    for policy, victim in (("newest", "high"), ("priority", "low")):
        sched = scheduler(num_blocks=5, preemption_policy=policy)
        executor = FakeExecutor(5, BLOCK, 0, token_at)
        low, high = seq(1, 12, priority=1), seq(2, 3, priority=0)
        sched.add(low)
        step(sched, executor)
        sched.add(high)
        while not sched.counters.num_preemptions:
            step(sched, executor)
        gone = {"low": low, "high": high}[victim]
        assert gone.status is WAITING and sched.counters.num_priority_preemptions == 0, policy


def full_engine_then_a_high_priority_request(policy: str, **config):
    """Two low-priority requests hold every block; then a high-priority one arrives. Returns the scheduler,
    executor, requests and the step planned right after the arrival."""
    sched = scheduler(num_blocks=10, preemption_policy=policy, **config)
    executor = FakeExecutor(10, BLOCK, sched.config.num_host_blocks, token_at)
    lows = [seq(1, 15, max_tokens=20, priority=1), seq(2, 15, max_tokens=20, priority=1)]
    for s in lows:
        sched.add(s)
    while sched.block_manager.num_free_blocks > 1:
        step(sched, executor)
    high = seq(3, 10, max_tokens=8, priority=0)
    sched.add(high)
    return sched, executor, lows, high, step(sched, executor)


@pytest.mark.parametrize("config", [dict(), dict(num_host_blocks=16, preemption_mode="swap")],
                         ids=["recompute", "swap"])
def test_a_high_priority_request_is_admitted_while_the_engine_is_full_and_the_preempted_one_finishes_the_same(config):
    sched, executor, lows, high, out = full_engine_then_a_high_priority_request("priority", **config)
    assert high in {s.seq for s in out.scheduled}, "admitted in the step planned right after it arrived"
    assert sched.counters.num_priority_preemptions >= 1
    assert any(s.status is not RUNNING for s in lows)
    drain(sched, executor)
    for s in (*lows, high):  # what each gets served alone: the fake model's token at each position
        n = s.num_prompt_tokens
        assert s.output_token_ids == [fake_model(s.seq_id, p) for p in range(n, n + s.stopping.max_tokens)]


def test_without_the_priority_policy_a_high_priority_request_waits_for_room():
    sched, _, lows, high, out = full_engine_then_a_high_priority_request("newest")
    assert high not in {s.seq for s in out.scheduled} and sched.counters.num_preemptions == 0
    assert all(s.status is RUNNING for s in lows)


def test_a_waiting_request_of_equal_priority_preempts_nothing():
    sched = scheduler(num_blocks=10, preemption_policy="priority")
    executor = FakeExecutor(10, BLOCK, 0, token_at)
    for s in (seq(1, 15, priority=1), seq(2, 15, priority=1)):
        sched.add(s)
    while sched.block_manager.num_free_blocks > 1:
        step(sched, executor)
    sched.add(seq(3, 10, priority=1))
    step(sched, executor)
    assert sched.counters.num_preemptions == 0


# ---------------------------------------------------------------- auto, and what is counted

def preempt_after_prefill(sched: Scheduler, victim: Sequence) -> FakeExecutor:
    executor = FakeExecutor(sched.config.num_blocks, BLOCK, sched.config.num_host_blocks, token_at)
    sched.add(victim)
    step(sched, executor)
    sched.preempt(victim, [])
    return executor


def test_auto_swaps_a_victim_whose_tokens_cost_more_to_recompute_and_recomputes_one_the_prefix_cache_holds():
    costs = PreemptionCosts(block_bytes=1000, host_link_bytes_per_s=1e6, copy_fixed_s=0.0, prefill_tokens_per_s=1000)
    # swapping a block out and in costs 2 ms; recomputing its 4 tokens 4 ms
    sched = scheduler(num_blocks=40, num_host_blocks=40, preemption_mode="auto", preemption_costs=costs)
    alone = seq(1, 16)
    shared = [seq(2, 16), seq(3, 16)]
    shared[1].token_ids[:12] = shared[0].token_ids[:12]  # three full blocks in common
    executor = FakeExecutor(40, BLOCK, 40, token_at)
    for s in (alone, shared[0]):
        sched.add(s)
    step(sched, executor)
    sched.add(shared[1])  # its first three blocks come from the prefix cache, shared with shared[0]
    step(sched, executor)
    sched.preempt(alone, [])
    sched.preempt(shared[1], [])
    assert alone.status is SWAPPED  # 17 computed tokens in 5 blocks: 10 ms of copies against 17 ms of prefill
    assert shared[1].status is WAITING  # 12 of its 16 will hit: 4 ms of prefill against 8 ms of copies
    c = sched.counters
    assert c.estimated_swap_seconds == pytest.approx(10e-3) and c.estimated_recompute_seconds == pytest.approx(4e-3)


def test_a_preemption_by_recompute_counts_the_tokens_computed_again_without_the_prefix_hits():
    sched = scheduler(num_blocks=40, preemption_mode="recompute",
                      preemption_costs=PreemptionCosts(prefill_tokens_per_s=100.0))
    victim = seq(1, 10)
    executor = preempt_after_prefill(sched, victim)  # 11 tokens known, 10 computed; two full blocks hashed
    drain(sched, executor)
    c = sched.counters
    assert c.num_recompute_preemptions == 1 and c.num_swap_outs == 0
    assert c.num_recomputed_tokens == 10 - 8  # the two hashed blocks came back from the prefix cache
    assert c.measured_recompute_seconds == pytest.approx(2 / 100.0)


def test_a_swap_counts_its_bytes_out_and_in_over_every_rank():
    sched = scheduler(num_blocks=40, num_host_blocks=40, preemption_mode="swap", world_size=2,
                      preemption_costs=PreemptionCosts(block_bytes=512))
    victim = seq(1, 10)
    executor = preempt_after_prefill(sched, victim)  # 10 computed tokens: 3 blocks
    assert sched.counters.num_swapped_bytes == 3 * 512 * 2
    drain(sched, executor)
    assert sched.counters.num_swapped_bytes == 2 * 3 * 512 * 2 and sched.counters.num_recomputed_tokens == 0


# ---------------------------------------------------------------- the flags and their defaults

def test_by_default_cuda_preempts_in_auto_mode_with_a_host_pool_and_the_cpu_recomputes_unless_asked():
    default = EngineConfig(model="m")
    assert default.resolved_preemption_mode("cuda") == "auto"
    assert 0 < default.host_pool_gb("cuda") <= DEFAULT_SWAP_SPACE_GB
    assert default.resolved_preemption_mode("cpu") == "recompute" and default.host_pool_gb("cpu") == 0
    assert EngineConfig(model="m", num_host_blocks=8).resolved_preemption_mode("cpu") == "swap"  # a pool asked for
    asked = EngineConfig(model="m", preemption_mode="auto")
    assert asked.resolved_preemption_mode("cpu") == "auto" and asked.host_pool_gb("cpu") > 0
    assert EngineConfig(model="m", preemption_mode="recompute").host_pool_gb("cuda") == 0
    assert EngineConfig(model="m", preemption_mode="recompute", swap_space_gb=1.5).host_pool_gb("cuda") == 1.5


def test_the_preemption_flags_parse_travel_to_other_roles_and_refuse_unknown_values():
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    config = engine_config_from_args(parser.parse_args(
        ["--model", "m", "--preemption-mode", "swap", "--preemption-policy", "least-progress"]))
    assert (config.preemption_mode, config.preemption_policy) == ("swap", "least-progress")
    again = engine_config_from_args(parser.parse_args(config.to_argv()))
    assert (again.preemption_mode, again.preemption_policy, again.swap_space_gb) == ("swap", "least-progress", None)
    with pytest.raises(ValueError, match="--preemption-policy"):
        EngineConfig(model="m", preemption_policy="oldest")
    with pytest.raises(ValueError, match="--preemption-mode"):
        EngineConfig(model="m", preemption_mode="never")
