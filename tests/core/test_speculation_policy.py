"""The speculation policy (core/speculative/policy.py): how many tokens a sequence proposes from how its earlier
proposals fared, and when it backs off."""
from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from scheduler_svc.core.speculative.policy import (DECLINE_STEPS, MAX_BACKOFF_STEPS, VERIFY_STEP_OVERHEAD,
                                                   SpeculationPolicy, acceptance,
                                                   backoff_steps, best_num_tokens, expected_gain, tokens_and_cost)
from test_scheduler import make_seq


def fresh_seq():
    return make_seq([1, 2, 3, 4])


def test_a_new_sequence_proposes_the_most_it_may():
    assert SpeculationPolicy(4, planned_ahead=True).num_tokens(fresh_seq()) == 4


def test_a_sequence_whose_proposals_are_all_accepted_keeps_proposing_k():
    policy, seq = SpeculationPolicy(8, planned_ahead=True), fresh_seq()
    for _ in range(20):
        k = policy.num_tokens(seq)
        assert k == 8
        policy.record(seq, k, k, guess=True)
    first, later = acceptance(seq)
    assert first > 0.85 and later > 0.95  # one observation a verdict for the first, k - 1 for the later ones


def test_a_chatting_sequence_proposes_one_token_where_only_the_first_is_usually_accepted():
    # SmolLM2 chatting on the H200: the first proposal accepted in 84% of verdicts, a later one in about 40%; every
    # longer proposal voids the next step (planned ahead on all being accepted) more often than it gains
    policy, seq = SpeculationPolicy(8, planned_ahead=True), fresh_seq()
    for accepted in [1, 1, 2, 1, 0, 1, 3, 1, 1, 2, 1, 1, 0, 1, 2, 1] * 3:
        policy.record(seq, 8, accepted, guess=True)
        seq.speculation_backoff = 0
    first, later = acceptance(seq)
    assert first > 0.8 and later < 0.5
    assert policy.num_tokens(seq, batch=4) == 1
    # one geometric rate for every position (their mean, ~0.55) would propose 4, which under this curve yields
    # fewer tokens per sequence-step than 1
    k_one_rate = best_num_tokens(0.55, 0.55, 8, True, 4)
    assert k_one_rate > 1
    assert expected_gain(first, later, 1, True, 4) > 1.1 * expected_gain(first, later, k_one_rate, True, 4)


def test_a_sequence_whose_proposals_are_rejected_backs_off_exponentially_then_declines():
    policy, seq = SpeculationPolicy(4, planned_ahead=True), fresh_seq()
    plain_runs, verifications = [], 0
    run = 0
    for _ in range(200):
        k = policy.num_tokens(seq)
        if k:
            verifications += 1
            plain_runs.append(run)
            run = 0
            policy.record(seq, k, 0)
        else:
            run += 1
    # the plain decodes between verifications grow: 2, 4, 8, ... (a decline adds its own wait)
    assert plain_runs[1:4] == sorted(plain_runs[1:4]) and plain_runs[2] >= 4
    assert verifications <= 12  # of 200 steps: chat-like sequences stop paying verifications


def test_finding_nothing_to_propose_costs_no_backoff():
    # the scheduler asks the policy, then the proposer finds nothing: nothing is recorded, nothing backs off
    policy, seq = SpeculationPolicy(4, planned_ahead=True), fresh_seq()
    assert policy.num_tokens(seq) == 4 and seq.speculation_backoff == 0
    assert policy.num_tokens(seq) == 4


def test_a_failed_guess_rejects_the_first_proposal_and_a_right_one_lets_the_proposals_count():
    policy, right, wrong, short = SpeculationPolicy(4, planned_ahead=True), fresh_seq(), fresh_seq(), fresh_seq()
    policy.record(right, 3, 3, guess=True)
    assert (right.speculation_first_hits, right.speculation_first_misses) == (1, 0)
    assert (right.speculation_hits, right.speculation_misses) == (2, 0)
    policy.record(wrong, 3, 0, guess=False)
    assert (wrong.speculation_first_hits, wrong.speculation_first_misses) == (0, 1)
    assert (wrong.speculation_hits, wrong.speculation_misses) == (0, 0) and wrong.speculation_backoff == 2
    policy.record(short, 4, 2)  # the first and one later accepted, then one rejected
    assert (short.speculation_first_hits, short.speculation_hits, short.speculation_misses) == (1, 1, 1)


def test_one_acceptance_resets_the_backoff():
    policy, seq = SpeculationPolicy(4, planned_ahead=True), fresh_seq()
    for _ in range(3):
        policy.record(seq, 4, 0)
    assert seq.speculation_backoff == backoff_steps(3)
    policy.record(seq, 4, 2)
    assert seq.speculation_failures == 0


def test_a_declining_sequence_waits_and_then_tries_again():
    policy, seq = SpeculationPolicy(4, planned_ahead=True), fresh_seq()
    seq.speculation_first_misses = seq.speculation_misses = 10.0  # far below break-even
    assert policy.num_tokens(seq) == 0 and seq.speculation_backoff == DECLINE_STEPS
    assert any(policy.num_tokens(seq) for _ in range(200))


@given(st.floats(0.0, 1.0), st.floats(0.0, 1.0), st.integers(1, 16), st.booleans(), st.integers(1, 64))
def test_the_chosen_count_is_the_best_within_k_and_beats_a_plain_decode(first, later, max_tokens, planned_ahead,
                                                                         batch):
    k = best_num_tokens(first, later, max_tokens, planned_ahead, batch)
    assert 0 <= k <= max_tokens
    gains = [expected_gain(first, later, j, planned_ahead, batch) for j in range(max_tokens + 1)]
    assert gains[k] == max(gains) or k == 0
    if k:
        assert gains[k] > 1.0


@given(st.floats(0.0, 1.0), st.floats(0.0, 1.0), st.integers(1, 16))
def test_planning_ahead_of_the_verdict_never_makes_proposing_more_attractive(first, later, max_tokens):
    assert best_num_tokens(first, later, max_tokens, True) <= max_tokens
    assert expected_gain(first, later, max_tokens, True) <= expected_gain(first, later, max_tokens, False)
    if best_num_tokens(first, later, max_tokens, False) == 0:
        assert best_num_tokens(first, later, max_tokens, True) == 0


@given(st.floats(0.0, 1.0), st.integers(1, 16), st.booleans())
def test_one_rate_for_every_position_is_the_geometric_run(alpha, k, planned_ahead):
    tokens, cost = tokens_and_cost(alpha, alpha, k, planned_ahead)
    assert abs(tokens - sum(alpha ** j for j in range(k + 1))) < 1e-9
    assert abs(cost - (1.0 + 0.01 * k + 0.03 + ((1.0 - alpha ** k) if planned_ahead else 0.0))) < 1e-9


@given(st.lists(st.tuples(st.integers(1, 8), st.integers(0, 8), st.sampled_from([None, True, False])), max_size=40))
def test_the_estimate_stays_a_probability_and_the_backoff_bounded(verdicts):
    policy, seq = SpeculationPolicy(8, planned_ahead=True), fresh_seq()
    for proposed, accepted, guess in verdicts:
        policy.record(seq, proposed, min(accepted, proposed), guess)
        assert all(0.0 < a < 1.0 for a in acceptance(seq))
        assert 0 <= seq.speculation_backoff <= MAX_BACKOFF_STEPS
        assert 0 <= policy.num_tokens(seq) <= 8


def seqs_with_acceptance(n: int, hits: float, misses: float) -> list:
    """n sequences whose first and later proposals fared alike: hits and misses each."""
    seqs = []
    for i in range(n):
        seq = make_seq([1, 2, 3, 4])
        seq.seq_id = 100 + i
        seq.speculation_hits, seq.speculation_misses = hits, misses
        seq.speculation_first_hits, seq.speculation_first_misses = hits, misses
        seqs.append(seq)
    return seqs


def test_a_batch_of_copying_sequences_verifies_and_a_batch_of_chatting_ones_does_not():
    policy = SpeculationPolicy(8, planned_ahead=True)
    copying = seqs_with_acceptance(16, hits=30.0, misses=1.0)  # alpha ~0.93
    assert set(policy.plan(copying, 16)) == {s.seq_id for s in copying}
    chatting = seqs_with_acceptance(16, hits=1.0, misses=4.0)  # alpha 0.44: most proposals rejected
    assert policy.plan(chatting, 16) == {}


def test_one_sequence_may_verify_alone_in_a_small_batch_but_not_in_a_large_one():
    policy = SpeculationPolicy(8, planned_ahead=True)
    (fresh,) = seqs_with_acceptance(1, hits=0.0, misses=0.0)  # the prior: alpha 0.75
    assert policy.plan([fresh], 1) and policy.plan([fresh], 2)
    # in a step of 64 running sequences its overhead, which all of them wait for, outweighs what it saves
    assert policy.plan([fresh], 64) == {}


@given(st.lists(st.tuples(st.floats(0.0, 40.0), st.floats(0.0, 40.0)), min_size=1, max_size=16),
       st.integers(1, 64))
def test_a_step_verifies_only_when_its_proposals_save_more_than_its_overhead_costs(counts, extra):
    policy = SpeculationPolicy(8, planned_ahead=True)
    seqs = [seqs_with_acceptance(1, h, m)[0] for h, m in counts]
    for i, seq in enumerate(seqs):
        seq.seq_id = i
    batch = len(seqs) + extra - 1
    planned = policy.plan(seqs, batch)
    saved = 0.0
    for seq in seqs:
        if seq.seq_id in planned:
            tokens, cost = tokens_and_cost(*acceptance(seq), planned[seq.seq_id], True, batch)
            assert tokens > cost  # each one that proposes gains on its own
            saved += tokens - cost
    assert not planned or saved > VERIFY_STEP_OVERHEAD * batch
