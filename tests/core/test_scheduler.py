"""The scheduler: admission, chunked prefill, preemption, aborts and stop conditions, as a specification."""
from __future__ import annotations

import itertools

import pytest
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from protos import engine_pb2
from scheduler_svc.core.prefix_cache import hash_block
from scheduler_svc.core.scheduler import Scheduler
from scheduler_svc.core.scheduler_config import SchedulerConfig
from scheduler_svc.core.sequence import Sequence, SequenceStatus

STOP, LENGTH, ABORT = engine_pb2.FINISH_REASON_STOP, engine_pb2.FINISH_REASON_LENGTH, engine_pb2.FINISH_REASON_ABORT
EOS = 0
_ids = itertools.count()


def make_seq(prompt, max_tokens=100, min_tokens=0, stop_token_ids=(), ignore_eos=False, priority=0) -> Sequence:
    seq_id = next(_ids)
    stopping = engine_pb2.StoppingOptions(max_tokens=max_tokens, min_tokens=min_tokens,
                                          stop_token_ids=list(stop_token_ids), ignore_eos=ignore_eos)
    return Sequence(seq_id=seq_id, request_id=f"r{seq_id}", token_ids=list(prompt), num_prompt_tokens=len(prompt),
                    sampling=engine_pb2.SamplingOptions(), stopping=stopping, priority=priority)


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


# ---------------------------------------------------------------- stateful: random traffic on a tiny pool

BLOCK_SIZE = 2
PREFIXES = [(), (1, 2, 3, 4), (1, 2, 3, 4, 5, 6), (3, 3)]


def chained_hash(tokens) -> int | None:
    h = None
    for i in range(0, len(tokens), BLOCK_SIZE):
        h = hash_block(h, tuple(tokens[i : i + BLOCK_SIZE]))
    return h


class SchedulerMachine(RuleBasedStateMachine):
    """Random adds, steps, tokens and aborts, with a simulated executor that mirrors the plan deltas and
    keeps a fake KV pool (each slot holds the prefix whose K/V it stores), so a wrong block reuse shows up
    as a sequence reading someone else's K/V."""

    enable_prefix_caching = True

    def __init__(self):
        super().__init__()
        self.config = SchedulerConfig(max_num_seqs=3, max_num_batched_tokens=6, max_model_len=14,
                                      block_size=BLOCK_SIZE, num_blocks=8, eos_token_ids=(EOS,),
                                      enable_prefix_caching=self.enable_prefix_caching)
        self.sched = Scheduler(self.config)
        self.out = None  # the step in flight
        self.all_seqs: list[Sequence] = []
        self.terminal_events: dict[int, int] = {}
        self.mirror: dict[int, dict] = {}  # seq_id -> tokens, block_table, num_computed as executors hold them
        self.kv: dict[tuple[int, int], tuple[int, ...]] = {}

    @rule(prefix=st.sampled_from(PREFIXES), suffix=st.lists(st.integers(0, 5), min_size=1, max_size=8),
          max_tokens=st.integers(0, 6), min_tokens=st.integers(0, 2), stop=st.lists(st.integers(1, 5), max_size=2),
          ignore_eos=st.booleans(), priority=st.integers(0, 1))
    def add(self, prefix, suffix, max_tokens, min_tokens, stop, ignore_eos, priority):
        seq = make_seq([*prefix, *suffix], max_tokens, min_tokens, stop, ignore_eos, priority)
        try:
            self.sched.add(seq)
        except ValueError:
            assert seq.num_tokens >= self.config.max_model_len
            return
        self.all_seqs.append(seq)

    @precondition(lambda self: self.out is None)
    @rule()
    def schedule(self):
        out = self.sched.schedule()
        cfg = self.config
        assert out.num_batched_tokens == sum(s.num_new_tokens for s in out.scheduled) <= cfg.max_num_batched_tokens
        assert len(self.sched.running) <= cfg.max_num_seqs
        assert len({s.seq.seq_id for s in out.scheduled}) == len(out.scheduled)
        assert not (out.preempted_seq_ids and any(s.is_new for s in out.scheduled)), "admitted while preempting"
        if out.preempted_seq_ids:
            event("preempted")
        if any(s.is_new and s.start for s in out.scheduled):
            event("admitted with a prefix hit")
        if any(s.is_new for s in out.scheduled) and any(not s.is_new for s in out.scheduled):
            event("prefill and decode mixed")
        for s in out.scheduled:
            seq = s.seq
            assert seq.status is SequenceStatus.RUNNING and s.num_new_tokens >= 1
            assert seq.num_computed_tokens == s.start + s.num_new_tokens
            if s.samples:  # its chunk reached the end: one placeholder token now stands for the sample
                assert s.start + s.num_new_tokens == seq.num_tokens + seq.num_placeholders - 1
            else:
                assert s.start + s.num_new_tokens < seq.num_tokens
            assert seq.num_placeholders == int(s.samples), "one step in flight at most in this machine"
            assert len(seq.block_table) * BLOCK_SIZE >= s.start + s.num_new_tokens
        self.apply_plan(out)
        self.out = out

    def apply_plan(self, out):
        """What the executors do with a plan: drop mirrors, apply deltas, read the K/V they need, write new K/V."""
        for seq_id in out.finished_seq_ids + out.preempted_seq_ids:
            assert self.mirror.pop(seq_id, None) is not None, f"seq {seq_id} dropped but never mirrored"
        for s in out.scheduled:
            seq = s.seq
            if s.is_new:
                assert seq.seq_id not in self.mirror
                self.mirror[seq.seq_id] = dict(tokens=list(seq.token_ids), table=list(seq.block_table),
                                               computed=s.start)
            else:
                m = self.mirror[seq.seq_id]
                assert seq.block_table[: len(m["table"])] == m["table"], "a mirrored block table only grows"
                m["table"] = list(seq.block_table)
                if seq.last_token_unsent:
                    m["tokens"].append(seq.token_ids[-1])
                assert m["tokens"] == seq.token_ids and m["computed"] == s.start
            seq.last_token_unsent = False  # the plan builder's job
            table = seq.block_table
            for p in range(s.start):
                assert self.kv[(table[p // BLOCK_SIZE], p % BLOCK_SIZE)] == tuple(seq.token_ids[: p + 1])
            for p in range(s.start, s.start + s.num_new_tokens):
                self.kv[(table[p // BLOCK_SIZE], p % BLOCK_SIZE)] = tuple(seq.token_ids[: p + 1])
            self.mirror[seq.seq_id]["computed"] += s.num_new_tokens

    @precondition(lambda self: self.out is not None)
    @rule(data=st.data())
    def postprocess(self, data):
        out, self.out = self.out, None
        sampled = {s.seq.seq_id: data.draw(st.integers(0, 5)) for s in out.scheduled
                   if not s.seq.is_finished and s.samples}
        live = [s.seq for s in out.scheduled if not s.seq.is_finished]  # aborted in flight: skipped
        updates = self.sched.postprocess(out, sampled)
        assert [u.seq for u in updates] == live
        for u in updates:
            assert u.new_token_id == sampled.get(u.seq.seq_id)
            if u.new_token_id is not None:
                assert u.finish_reason == self.expected_finish_reason(u.seq, u.new_token_id)
            if u.finish_reason:
                self.record_terminal(u.seq)

    def expected_finish_reason(self, seq, token):
        stopping, num_out = seq.stopping, seq.num_output_tokens
        stops = {*stopping.stop_token_ids, *(() if stopping.ignore_eos else (EOS,))}
        if num_out >= stopping.min_tokens and token in stops:
            assert seq.stop_token_id == token
            return STOP
        if 0 < stopping.max_tokens <= num_out or seq.num_tokens >= self.config.max_model_len:
            return LENGTH
        return 0

    @precondition(lambda self: self.all_seqs)
    @rule(data=st.data())
    def abort(self, data):
        seq = data.draw(st.sampled_from(self.all_seqs))
        was_finished = seq.is_finished
        got = self.sched.abort(seq.request_id)
        assert (got is None) == was_finished
        if got is not None:
            assert got.block_table == [] and got.finish_reason == ABORT
            self.record_terminal(got)

    @rule(data=st.data())
    def drain(self, data):
        """Everything eventually finishes: no request wedges the queue."""
        for _ in range(300):
            if self.out is None and not self.sched.has_unfinished():
                break
            if self.out is None:
                self.schedule()
            self.postprocess(data)
        assert not self.sched.has_unfinished()

    def record_terminal(self, seq):
        self.terminal_events[seq.seq_id] = self.terminal_events.get(seq.seq_id, 0) + 1
        assert self.terminal_events[seq.seq_id] == 1, "exactly one terminal event per request"

    @invariant()
    def ref_counts_match_block_tables(self):
        held = [0] * self.config.num_blocks
        for seq in self.sched.running:
            for b in seq.block_table:
                held[b] += 1
        assert all(seq.block_table == [] for seq in self.sched.waiting)
        assert [blk.ref_count for blk in self.sched.block_manager.pool.blocks] == held

    @invariant()
    def free_and_used_partition_the_pool(self):
        pool = self.sched.block_manager.pool
        assert set(pool.free_queue) == {blk.block_id for blk in pool.blocks if blk.ref_count == 0}
        assert pool.num_free_blocks + pool.num_used_blocks == pool.num_blocks
        if not self.sched.has_unfinished():
            assert pool.num_free_blocks == pool.num_blocks

    @invariant()
    def every_index_entry_names_the_contents_it_hashes(self):
        pool = self.sched.block_manager.pool
        for h, b in pool.hash_to_block.items():
            blk = pool.blocks[b]
            assert blk.block_hash == h == hash_block(blk.parent_hash, blk.token_ids)
            prefix = self.kv[(b, BLOCK_SIZE - 1)]
            assert prefix[-BLOCK_SIZE:] == blk.token_ids and chained_hash(prefix) == h

    @invariant()
    def queues_and_mirrors_agree(self):
        sched = self.sched
        assert all(s.status is SequenceStatus.RUNNING for s in sched.running)
        assert all(s.status is SequenceStatus.WAITING and not s.in_executor for s in sched.waiting)
        keys = [(s.priority, s.arrival_order) for s in sched.waiting]
        assert keys == sorted(keys)
        assert set(sched.requests.values()) == set(sched.running) | set(sched.waiting)
        assert set(self.mirror) == {s.seq_id for s in sched.running if s.in_executor} | set(sched.finished_to_drop)
        for seq in self.all_seqs:
            assert seq.is_finished == (self.terminal_events.get(seq.seq_id, 0) == 1)
            if seq.is_finished:
                assert seq.block_table == [] and seq.finish_reason in (STOP, LENGTH, ABORT)


class SchedulerMachineWithoutPrefixCaching(SchedulerMachine):
    enable_prefix_caching = False


_settings = settings(max_examples=50, stateful_step_count=40, deadline=None,
                     suppress_health_check=[HealthCheck.too_slow])
TestSchedulerMachine = SchedulerMachine.TestCase
TestSchedulerMachine.settings = _settings
TestSchedulerMachineWithoutPrefixCaching = SchedulerMachineWithoutPrefixCaching.TestCase
TestSchedulerMachineWithoutPrefixCaching.settings = settings(_settings, max_examples=25)
