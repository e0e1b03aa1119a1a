"""The scheduler: admission, chunked prefill, preemption, aborts and stop conditions, as a specification.
Random traffic (groups, swap, steps in flight) is test_scheduler_machine.py's state machine."""
from __future__ import annotations

import itertools

import pytest

from protos import engine_pb2
from scheduler_svc.core.scheduler import Scheduler
from scheduler_svc.core.scheduler_config import SchedulerConfig
from scheduler_svc.core.sequence import Sequence, SequenceStatus
from support.fake_executor import FakeExecutor
from test_beam_search import drive, member

STOP, LENGTH, ABORT = engine_pb2.FINISH_REASON_STOP, engine_pb2.FINISH_REASON_LENGTH, engine_pb2.FINISH_REASON_ABORT
EOS = 0
_ids = itertools.count()


def make_seq(prompt, max_tokens=100, min_tokens=0, stop_token_ids=(), ignore_eos=False, priority=0,
             group_id="") -> Sequence:
    seq_id = next(_ids)
    stopping = engine_pb2.StoppingOptions(max_tokens=max_tokens, min_tokens=min_tokens,
                                          stop_token_ids=list(stop_token_ids), ignore_eos=ignore_eos)
    return Sequence(seq_id=seq_id, request_id=f"r{seq_id}", token_ids=list(prompt), num_prompt_tokens=len(prompt),
                    sampling=engine_pb2.SamplingOptions(), stopping=stopping, priority=priority, group_id=group_id)


def make_scheduler(**overrides) -> Scheduler:
    config = dict(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64, block_size=4, num_blocks=32,
                  eos_token_ids=(EOS,))
    return Scheduler(SchedulerConfig(**(config | overrides)))


def step(sched: Scheduler, token: int = 7):
    """One iteration where every sequence that reaches its end samples `token`."""
    out = sched.schedule()
    sampled = {s.seq.seq_id: token for s in out.scheduled if s.samples}
    return out, sched.postprocess(out, sampled)


def item(out, seq):
    """The ScheduledSeq of `seq` in a step."""
    return next(s for s in out.scheduled if s.seq is seq)


def chunks(out) -> dict[int, int]:
    return {s.seq.seq_id: s.num_new_tokens for s in out.scheduled}


# ---------------------------------------------------------------- prefix caching

def test_a_prefix_hit_skips_the_cached_tokens():
    sched = make_scheduler()
    a = make_seq(range(1, 11))
    sched.add(a)
    step(sched)
    b = make_seq([*range(1, 9), 50, 51, 52])
    sched.add(b)
    out = sched.schedule()
    assert chunks(out)[b.seq_id] == 3
    assert item(out, b).start == 8 and b.num_cached_tokens == 8
    assert b.block_table[:2] == a.block_table[:2]
    assert sched.stats()["prefix_cache_hit_tokens"] == 8


def test_an_identical_prompt_still_computes_its_last_token():
    sched = make_scheduler()
    sched.add(make_seq(range(1, 9)))
    step(sched)
    b = make_seq(range(1, 9))
    sched.add(b)
    out = sched.schedule()
    assert item(out, b).start == 4 and chunks(out)[b.seq_id] == 4


def test_blocks_are_hashed_only_after_their_step_succeeded():
    sched = make_scheduler()
    a = make_seq(range(1, 10))
    sched.add(a)
    out = sched.schedule()
    assert sched.block_manager.pool.hash_to_block == {}  # in flight: not findable yet
    sched.postprocess(out, {a.seq_id: 7})
    assert len(sched.block_manager.pool.hash_to_block) == 2 and len(a.block_hashes) == 2


def test_prefix_caching_can_be_disabled():
    sched = make_scheduler(enable_prefix_caching=False)
    sched.add(make_seq(range(1, 11)))
    step(sched)
    b = make_seq(range(1, 11))
    sched.add(b)
    out = sched.schedule()
    assert chunks(out)[b.seq_id] == 10 and b.num_cached_tokens == 0


# ---------------------------------------------------------------- batching and budgets

def test_chunked_prefill_mixes_decodes_and_several_prefill_chunks_in_one_step():
    sched = make_scheduler(max_num_batched_tokens=10)
    a = make_seq([1, 2, 3])
    sched.add(a)
    step(sched)
    b, c = make_seq([4, 5, 6, 7, 8, 9]), make_seq(range(10, 18))
    sched.add(b)
    sched.add(c)
    out, updates = step(sched)
    assert chunks(out) == {a.seq_id: 1, b.seq_id: 6, c.seq_id: 3}
    assert [s.is_new for s in out.scheduled] == [False, True, True]
    assert {u.seq.seq_id: u.new_token_id for u in updates} == {a.seq_id: 7, b.seq_id: 7, c.seq_id: None}
    out, _ = step(sched)
    assert chunks(out) == {a.seq_id: 1, b.seq_id: 1, c.seq_id: 5}
    assert out.num_batched_tokens == 7 and c.num_computed_tokens == 8


def test_a_long_prompt_is_split_into_chunks_that_respect_the_token_budget():
    sched = make_scheduler(max_num_batched_tokens=4)
    a = make_seq(range(1, 11))
    sched.add(a)
    sizes = []
    while a.num_output_tokens == 0:
        out, updates = step(sched)
        sizes.append(out.num_batched_tokens)
    assert sizes == [4, 4, 2] and a.token_ids[-1] == 7


def test_no_more_than_max_num_seqs_run():
    sched = make_scheduler(max_num_seqs=2)
    seqs = [make_seq([i + 1, i + 2]) for i in range(3)]
    for seq in seqs:
        sched.add(seq)
    out = sched.schedule()
    assert [s.seq for s in out.scheduled] == seqs[:2] and sched.stats()["num_waiting"] == 1


def test_lower_priority_value_is_admitted_first():
    sched = make_scheduler(max_num_seqs=1)
    late, urgent = make_seq([1, 2], priority=1), make_seq([3, 4], priority=0)
    sched.add(late)
    sched.add(urgent)
    assert [s.seq for s in sched.schedule().scheduled] == [urgent]


def test_admission_stops_at_the_first_waiting_sequence_that_does_not_fit():
    sched = make_scheduler(num_blocks=4, block_size=2)
    sched.add(make_seq([1, 2, 3, 4, 5]))  # 3 blocks
    step(sched)
    big, small = make_seq([6, 7, 8]), make_seq([9])
    sched.add(big)
    sched.add(small)
    out = sched.schedule()
    assert big.status is small.status is SequenceStatus.WAITING and len(out.scheduled) == 1


# ---------------------------------------------------------------- preemption

def test_preemption_picks_the_most_recently_admitted_sequence():
    sched = make_scheduler(num_blocks=6, block_size=2)
    a, b, c = make_seq([1, 2, 3]), make_seq([4, 5, 6]), make_seq([7, 8, 9])
    for seq in (a, b, c):
        sched.add(seq)
    step(sched)
    step(sched)  # 5 tokens each; the next decode needs a third block per sequence
    out = sched.schedule()
    assert out.preempted_seq_ids == [c.seq_id] and chunks(out) == {a.seq_id: 1, b.seq_id: 1}
    assert c.status is SequenceStatus.WAITING and c.block_table == [] and c.num_computed_tokens == 0
    assert sched.waiting[0] is c and not c.in_executor
    assert sched.stats()["num_preemptions"] == 1


def test_a_preempted_sequence_resumes_in_full_with_the_same_tokens():
    sched = make_scheduler(num_blocks=6, block_size=2)
    a, b = make_seq([1, 2, 3, 4, 5]), make_seq([6, 7, 8, 9])
    sched.add(a)
    sched.add(b)
    step(sched)
    step(sched)
    out, _ = step(sched)
    assert out.preempted_seq_ids == [b.seq_id]
    tokens = list(b.token_ids)
    sched.abort(a.request_id)
    out = sched.schedule()
    (resumed,) = out.scheduled
    assert resumed.seq is b and resumed.is_new and b.token_ids == tokens
    assert resumed.start + resumed.num_new_tokens == len(tokens) and resumed.samples
    assert out.finished_seq_ids == [a.seq_id]


def test_nothing_is_admitted_in_a_step_that_preempted():
    sched = make_scheduler(num_blocks=5, block_size=2)
    a, b = make_seq([1, 2, 3]), make_seq([4, 5, 6])
    sched.add(a)
    sched.add(b)
    step(sched)
    step(sched)
    sched.add(make_seq([9]))
    out = sched.schedule()
    assert out.preempted_seq_ids == [b.seq_id] and not any(s.is_new for s in out.scheduled)


def test_a_sequence_that_outgrows_the_pool_finishes_with_length():
    sched = make_scheduler(num_blocks=2, block_size=2)
    a = make_seq([1, 2])
    sched.add(a)
    while not a.is_finished:
        step(sched)
    assert a.finish_reason == LENGTH and a.num_tokens == 4
    assert sched.stats()["free_kv_blocks"] == 2


# ---------------------------------------------------------------- aborts and validation

def test_an_aborted_sequence_frees_its_blocks_immediately():
    sched = make_scheduler()
    a = make_seq(range(1, 10))
    sched.add(a)
    step(sched)
    assert sched.abort(a.request_id) is a
    assert a.finish_reason == ABORT and a.is_finished and a.block_table == []
    assert sched.stats()["free_kv_blocks"] == 32 and not sched.has_unfinished()
    assert sched.abort(a.request_id) is None and sched.abort("nope") is None
    assert sched.finished_to_drop == [a.seq_id]


def test_aborting_a_sequence_in_flight_is_skipped_by_postprocess():
    sched = make_scheduler()
    a, b = make_seq([1, 2, 3]), make_seq([4, 5])
    sched.add(a)
    sched.add(b)
    out = sched.schedule()
    sched.abort(a.request_id)
    updates = sched.postprocess(out, {a.seq_id: 7, b.seq_id: 8})
    assert [u.seq for u in updates] == [b] and a.token_ids == [1, 2, 3]
    assert sched.schedule().finished_seq_ids == [a.seq_id]


def test_finished_ids_wait_for_a_step_that_runs():
    sched = make_scheduler()
    a = make_seq([1, 2])
    sched.add(a)
    step(sched)
    sched.abort(a.request_id)
    empty = sched.schedule()
    assert empty.scheduled == [] and empty.finished_seq_ids == []
    sched.add(make_seq([3]))
    assert sched.schedule().finished_seq_ids == [a.seq_id]


def test_aborting_a_waiting_sequence_never_reaches_the_executors():
    sched = make_scheduler()
    a = make_seq([1, 2])
    sched.add(a)
    sched.abort(a.request_id)
    assert sched.schedule().finished_seq_ids == [] and sched.stats()["num_aborted"] == 1


@pytest.mark.parametrize("prompt_len, limits, message", [
    (16, dict(max_model_len=16), "max_model_len=16"),
    (16, dict(num_blocks=2, block_size=8), "num_blocks=2 x block_size=8"),
])
def test_a_prompt_that_can_never_run_is_rejected_naming_the_limit(prompt_len, limits, message):
    sched = make_scheduler(**limits)
    with pytest.raises(ValueError, match=message):
        sched.add(make_seq(range(prompt_len)))
    assert not sched.has_unfinished()


def test_a_request_id_in_flight_cannot_be_added_twice():
    sched = make_scheduler()
    a = make_seq([1])
    sched.add(a)
    with pytest.raises(ValueError, match="already in flight"):
        sched.add(Sequence(seq_id=999, request_id=a.request_id, token_ids=[2], num_prompt_tokens=1,
                           sampling=a.sampling, stopping=a.stopping))


def test_a_missing_sample_is_an_error_and_changes_nothing():
    sched = make_scheduler()
    a = make_seq([1, 2])
    sched.add(a)
    out = sched.schedule()
    with pytest.raises(ValueError, match="no token was sampled"):
        sched.postprocess(out, {})
    assert a.token_ids == [1, 2] and a.num_placeholders == 1 and a.block_hashes == []


# ---------------------------------------------------------------- stop conditions

def run_to_end(seq, tokens, **overrides):
    sched = make_scheduler(**overrides)
    sched.add(seq)
    updates = []
    for token in tokens:
        updates += step(sched, token)[1]
        if seq.is_finished:
            break
    return sched, updates


def test_eos_stops_with_reason_stop_and_frees_blocks():
    a = make_seq([1, 2, 3])
    sched, updates = run_to_end(a, [5, EOS, 6])
    assert a.output_token_ids == [5, EOS] and a.finish_reason == STOP and a.stop_token_id == EOS
    assert updates[-1].finish_reason == STOP and sched.stats()["free_kv_blocks"] == 32
    assert sched.finished_to_drop == [a.seq_id]  # the executors drop it with the next step


def test_ignore_eos_keeps_going_until_max_tokens():
    a = make_seq([1, 2, 3], max_tokens=3, ignore_eos=True)
    run_to_end(a, [EOS] * 5)
    assert a.output_token_ids == [EOS] * 3 and a.finish_reason == LENGTH


def test_eos_and_stop_ids_are_ignored_before_min_tokens():
    a = make_seq([1, 2, 3], min_tokens=2, stop_token_ids=[9])
    run_to_end(a, [EOS, 9, 5])
    assert a.output_token_ids == [EOS, 9] and a.finish_reason == STOP and a.stop_token_id == 9


def test_a_stop_token_id_stops_even_with_ignore_eos():
    a = make_seq([1, 2, 3], stop_token_ids=[9, 11], ignore_eos=True)
    run_to_end(a, [EOS, 11, 5])
    assert a.output_token_ids == [EOS, 11] and a.stop_token_id == 11


def test_max_tokens_finishes_with_length():
    a = make_seq([1, 2, 3], max_tokens=2)
    _, updates = run_to_end(a, [5] * 5)
    assert a.output_token_ids == [5, 5] and [u.finish_reason for u in updates] == [0, LENGTH]


def test_max_model_len_finishes_with_length():
    a = make_seq([1, 2, 3], max_tokens=0)  # 0 means no max_tokens of its own
    run_to_end(a, [5] * 10, max_model_len=6)
    assert a.num_tokens == 6 and a.finish_reason == LENGTH


def test_stats_are_the_fields_of_scheduler_stats():
    sched, _ = run_to_end(make_seq([1, 2, 3], max_tokens=2), [5, 5])
    stats = engine_pb2.SchedulerStats(**sched.stats())
    assert stats.num_finished == 1 and stats.num_generated_tokens == 2 and stats.num_steps == 2


# ---------------------------------------------------------------- found by test_scheduler_machine.py, now fixed

def set_up(condition: bool, what: str) -> None:
    """A reproduction's setup: if it no longer reaches the state the bug needed, say so rather than pass."""
    if not condition:
        pytest.fail(f"this no longer sets up the bug: {what}")


def run_step(sched: Scheduler, executor: FakeExecutor, sampled: dict) -> None:
    """One step through the fake executor (which asserts every read sees the reader's own tokens)."""
    out = sched.schedule()
    executor.run(out)
    sched.postprocess(out, {s.seq.seq_id: sampled[s.seq.request_id] for s in out.scheduled if s.samples})


def test_a_forked_sample_never_writes_into_a_block_the_prefix_index_names():
    sched = make_scheduler(max_num_batched_tokens=6)
    executor = FakeExecutor(32, 4)
    leader, sample = make_seq([9], max_tokens=4, group_id="g"), make_seq([9], max_tokens=2, group_id="g")
    long = make_seq(range(20, 40), max_tokens=1)  # its prompt takes the budget the sample would need
    for seq in (leader, sample, long):
        sched.add(seq)
    for token in (5, 6, 4, 3):  # the sample forks at the second step, but is never reached
        run_step(sched, executor, {leader.request_id: token, long.request_id: 1})
    set_up(leader.is_finished and not sample.in_executor and len(sample.block_table) == 1, "a fork never run")
    hashed = sched.block_manager.pool.blocks[sample.block_table[0]].token_ids
    set_up(hashed == (9, 5, 6, 4), "the leader hashed the block the sample holds alone")
    for token in (7, 8):  # the sample computes positions 0 and 1 in that block: its 7 replaces the 5
        run_step(sched, executor, {sample.request_id: token})
    reader = make_seq([9, 5, 6, 4, 1])
    sched.add(reader)
    run_step(sched, executor, {reader.request_id: 2})  # a prefix hit on that block reads 7 where 5 was


def test_a_request_queued_ahead_of_a_beam_search_that_reserves_every_slot_does_not_wedge_it():
    sched = make_scheduler(max_num_seqs=2)
    sched.add(make_seq([1, 2, 3], max_tokens=2))
    sched.add(member(next(_ids), "g", [4, 5, 6], width=2, n=1, max_tokens=2))
    drive(sched, FakeExecutor(32, 4), salt=0)  # asserts something is scheduled while work is left


def test_two_beam_searches_that_each_fit_the_pool_alone_both_finish():
    sched = make_scheduler(num_blocks=4, max_model_len=256)  # each search alone needs every block
    sched.add(member(next(_ids), "a", [1], width=2, n=1, max_tokens=5))
    sched.add(member(next(_ids), "b", [7, 5, 1], width=2, n=1, max_tokens=3))
    drive(sched, FakeExecutor(4, 4), salt=0)  # asserts something is scheduled while work is left


def test_a_sequence_preempted_in_a_step_that_schedules_nothing_is_dropped_by_the_executors():
    sched = make_scheduler(num_blocks=4, block_size=2, max_num_seqs=2)
    a, b = make_seq([1, 2, 3], max_tokens=1), make_seq([4, 5, 6, 7], max_tokens=4)
    sched.add(a)
    sched.add(b)
    first = sched.schedule()  # both prompts: the pool is full and the executors mirror a and b
    idle = sched.schedule()  # planned ahead: a's sample in flight is its last; b needs a block and preempts itself
    set_up(idle.scheduled == [] and b.status is SequenceStatus.WAITING, "b preempted in an empty step")
    sched.postprocess(first, {a.seq_id: 7, b.seq_id: 7})
    sched.abort(b.request_id)
    sched.add(make_seq([8]))
    sent = [first, sched.schedule()]  # only steps that schedule something are sent
    dropped = {i for out in sent for i in out.finished_seq_ids + out.preempted_seq_ids}
    assert b.seq_id in dropped, "the executors mirror b until a plan that runs tells them to drop it"



def test_a_sequence_short_of_blocks_takes_them_from_beams_idle_in_their_round_before_giving_way_itself():
    # Search a's first beam has reported and waits for its round while its sibling is swapped out; search b's
    # beam then needs a block. Newest first, b's beam used to preempt itself: nothing ran and nothing was in
    # flight (with a plain sequence in its place, admitted and preempted again every step, a livelock), and
    # a's idle beam kept the blocks its swapped sibling needed to reach the round.
    sched = make_scheduler(max_num_seqs=5, max_num_batched_tokens=6, max_model_len=14, block_size=2, num_blocks=12,
                           num_host_blocks=8)
    sched.add(member(next(_ids), "a", [3, 3, 0, 0, 0, 0, 0, 0, 0, 0], width=2, n=1, max_tokens=2, length_penalty=0.0))
    sched.add(member(next(_ids), "b", [1, 2, 3, 4, 0, 0, 0, 0, 0, 0, 0, 0], width=1, n=1, max_tokens=2,
                     length_penalty=0.0))
    drive(sched, FakeExecutor(12, 2, 8), salt=0)  # asserts something is scheduled while work is left
    set_up(sched.counters.num_swap_outs > 0 and sched.counters.num_preemptions > sched.counters.num_swap_outs,
           "a beam swapped out, and the idle one preempted by recompute")
