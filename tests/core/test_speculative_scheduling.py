"""Speculative decoding in the scheduler: who speculates, the lookahead slots, the verdict applied, and the
pause above the configured batch size. Random traffic with proposals is test_scheduler_machine.py's."""
from __future__ import annotations

import pytest

from protos import engine_pb2
from scheduler_svc.core.speculative.policy import backoff_steps
from scheduler_svc.core.speculative.speculator import can_speculate
from scheduler_svc.core.step_plan import build_step_plan
from test_scheduler import make_scheduler, make_seq

REPEATING = [5, 6, 7, 8, 9, 5, 6, 7]  # "5 6 7" occurred before, followed by 8 9 5 6 7


def speculating_scheduler(**overrides):
    return make_scheduler(speculative_method="ngram", num_speculative_tokens=3, **overrides)


def decode_ready(sched, prompt=REPEATING, **seq_args):
    """A running sequence past its prefill, its first token known."""
    seq = make_seq(prompt, **seq_args)
    seq.speculate = True
    sched.add(seq)
    while seq.num_output_tokens == 0:  # (chunked prefill: as many steps as the budget needs)
        out = sched.schedule()
        sched.postprocess(out, {s.seq.seq_id: 8 for s in out.scheduled if s.samples})
    return seq


def test_a_decoding_sequence_verifies_the_continuation_of_its_earlier_ngram_in_lookahead_slots():
    sched = speculating_scheduler()
    seq = decode_ready(sched)  # ... 5 6 7 8: "6 7 8" continues with 9 5 6
    out = sched.schedule()
    (s,) = out.scheduled
    assert list(s.proposal) == [9, 5, 6] and s.num_new_tokens == 4 and seq.verifying
    # counted as if all are accepted (a verification planned before the verdict starts there), until the verdict
    assert seq.num_computed_tokens == 9 + 3 and len(seq.block_table) * 4 >= 9 + 3
    free_before = sched.block_manager.num_free_blocks
    (update,) = sched.postprocess(out, {seq.seq_id: 1}, accepted={seq.seq_id: [9]})
    assert update.accepted_token_ids == [9] and update.new_token_id == 1
    assert seq.token_ids[-3:] == [8, 9, 1] and seq.num_computed_tokens == 10 and not seq.verifying
    assert len(seq.block_table) == 3 and sched.block_manager.num_free_blocks == free_before + 0
    assert sched.stats()["accepted_per_position"] == [1, 0, 0]


def test_rejected_lookahead_blocks_go_back_and_the_executors_hear_of_it():
    sched = speculating_scheduler(block_size=2)
    seq = decode_ready(sched)
    out = sched.schedule()
    plan = build_step_plan(1, out)
    assert len(seq.block_table) == 6 and list(plan.cached.proposed_token_ids) == [9, 5, 6]  # 9 known, 3 proposed
    sched.postprocess(out, {seq.seq_id: 1})  # none accepted
    assert len(seq.block_table) == 5 and seq.blocks_kept == 5 and seq.speculation_backoff == backoff_steps(1)
    out = sched.schedule()
    plan = build_step_plan(2, out)
    assert list(plan.cached.num_blocks_kept) == [5] and seq.blocks_kept == -1
    assert list(plan.cached.chunk_starts) == [9] and not seq.start_unsent  # the executors' count moves back too
    assert not out.scheduled[0].proposal and not plan.cached.proposed_token_ids  # backing off: a plain decode


def chained(sched, seq):
    """Plan a verification, then (its verdict unknown) the sequence's next step."""
    first = sched.schedule()
    second = sched.schedule()
    (s1,), (s2,) = first.scheduled, second.scheduled
    return first, s1, second, s2


def test_with_async_scheduling_the_next_verification_is_planned_on_a_guess_before_the_verdict():
    sched = speculating_scheduler(chain_verifications=True)
    seq = decode_ready(sched)  # ... 5 6 7 8: proposes 9 5 6, then guesses 7 after them and proposes 8 9 5
    first, s1, second, s2 = chained(sched, seq)
    assert list(s1.proposal) == [9, 5, 6] and s2.start == 12 and s2.guess == 7 and list(s2.proposal) == [8, 9, 5]
    assert seq.num_placeholders == 8 and seq.num_computed_tokens == 16 and len(seq.block_table) * 4 >= 16
    plan = build_step_plan(2, second, send_last_token=False)
    assert list(plan.cached.guessed_token_ids) == [7] and list(plan.cached.chunk_starts) == [-1]
    sched.postprocess(first, {seq.seq_id: 7}, accepted={seq.seq_id: [9, 5, 6]})  # all accepted: it stands
    assert not s2.void and seq.num_computed_tokens == 16 and seq.num_placeholders == 4
    (update,) = sched.postprocess(second, {seq.seq_id: 6}, accepted={seq.seq_id: [8, 9, 5]})
    assert update.accepted_token_ids == [8, 9, 5] and seq.output_token_ids == [8, 9, 5, 6, 7, 8, 9, 5, 6]
    assert seq.num_computed_tokens == 16 and seq.num_placeholders == 0 and not seq.verifying


def test_behind_two_plain_decodes_in_flight_a_sequence_waits_a_step_then_proposes_on_a_guess():
    """With three steps in flight, planning plain decodes ahead forever would never let it propose (the second
    step's input is unknown and unguessed): it sits out a step, then guesses the one decode left in flight."""
    sched = speculating_scheduler(chain_verifications=True)
    seq = decode_ready(sched)
    seq.speculation_backoff = 2  # (after a rejection) two plain decodes, planned ahead of each other
    first, second = sched.schedule(), sched.schedule()
    assert [s.proposal for s in first.scheduled + second.scheduled] == [(), ()]
    assert sched.schedule().scheduled == []  # wants to propose, but cannot guess what the first decode yields
    sched.postprocess(first, {seq.seq_id: 9})  # ... 7 8 9; the second decode is still in flight
    (s,) = sched.schedule().scheduled
    assert s.guess == 5 and list(s.proposal) == [6, 7, 8]  # "8 9" continued "5 6 7 8" before


def test_a_short_verdict_voids_the_step_planned_on_it_and_moves_the_count_back():
    sched = speculating_scheduler(chain_verifications=True, block_size=2)
    seq = decode_ready(sched)
    first, s1, second, s2 = chained(sched, seq)
    blocks = len(seq.block_table)
    (update,) = sched.postprocess(first, {seq.seq_id: 3}, accepted={seq.seq_id: [9]})  # 5 rejected
    assert s2.void and update.accepted_token_ids == [9] and update.new_token_id == 3
    assert seq.num_computed_tokens == 10 and seq.num_placeholders == 0 and seq.start_unsent
    assert len(seq.block_table) == blocks  # the void step in flight still writes its blocks: none goes back yet
    sched.check_result(second, {})  # a void step yields nothing, and need not
    (void,) = sched.postprocess(second, {})
    assert void.new_token_id is None and not void.finish_reason and seq.output_token_ids == [8, 9, 3]
    out = sched.schedule()
    (s3,) = out.scheduled
    assert s3.start == 10 and s3.guess == -1  # its every token is known again
    assert list(build_step_plan(3, out, send_last_token=False).cached.chunk_starts) == [10]


def test_a_stop_token_among_the_accepted_proposals_ends_the_request_there():
    sched = speculating_scheduler()
    seq = decode_ready(sched, stop_token_ids=[5])
    out = sched.schedule()
    (update,) = sched.postprocess(out, {seq.seq_id: 2}, accepted={seq.seq_id: [9, 5, 6]})
    assert update.finish_reason == engine_pb2.FINISH_REASON_STOP and update.accepted_token_ids == [9]
    assert update.new_token_id == 5 and seq.output_token_ids == [8, 9, 5] and seq.block_table == []


def test_proposals_stop_at_the_length_limit_and_the_step_budget():
    sched = speculating_scheduler()
    seq = decode_ready(sched, max_tokens=3)  # one generated: room for two more, so at most one proposal
    assert list(sched.schedule().scheduled[0].proposal) == [9]
    tight = speculating_scheduler(max_num_batched_tokens=2)
    seq = decode_ready(tight)
    assert list(tight.schedule().scheduled[0].proposal) == [9]


def test_a_reply_accepting_what_was_not_proposed_is_refused_whole():
    sched = speculating_scheduler()
    seq = decode_ready(sched)
    out = sched.schedule()
    with pytest.raises(ValueError, match="not a prefix"):
        sched.check_result(out, {seq.seq_id: 1}, accepted={seq.seq_id: [4]})


def test_speculation_pauses_while_more_sequences_run_than_the_configured_batch_size():
    sched = speculating_scheduler(speculative_max_batch_size=1)
    a, b = make_seq(REPEATING), make_seq(REPEATING)
    for seq in (a, b):
        seq.speculate = True
        sched.add(seq)
    out = sched.schedule()  # both prefill
    sched.postprocess(out, {a.seq_id: 8, b.seq_id: 8})
    out = sched.schedule()
    assert len(out.scheduled) == 2 and not any(s.proposal for s in out.scheduled)
    sched.postprocess(out, {a.seq_id: 9, b.seq_id: 9})
    sched.abort(b.request_id)
    (alone,) = sched.schedule().scheduled
    assert list(alone.proposal) == [5, 6, 7]


@pytest.mark.parametrize("field, value", [
    ("disable_speculation", True), ("logprobs", 2), ("presence_penalty", 0.5), ("frequency_penalty", 0.5),
    ("repetition_penalty", 1.2), ("constraint", "json_object"), ("beam", 2)])
def test_requests_whose_verdict_would_need_more_than_one_draw_per_position_never_speculate(field, value):
    add = engine_pb2.AddRequest(request_id="r", prompt_token_ids=[1, 2],
                                sampling=engine_pb2.SamplingOptions(temperature=0.7, top_k=5, top_p=0.9, min_p=0.1,
                                                                   seed=3))
    assert can_speculate(add)
    if field == "disable_speculation":
        add.disable_speculation = True
    elif field == "constraint":
        add.constraint.json_object = True
    elif field == "beam":
        add.beam_search.beam_width = value
    else:
        setattr(add.sampling, field, value)
    assert not can_speculate(add)


def test_the_public_opt_out_reaches_the_scheduler():
    from protos import generation_pb2
    from scheduler_svc.frontend.sampling_params import from_api

    params = from_api(generation_pb2.SamplingParams(temperature=0.0, max_tokens=4, disable_speculation=True))
    (add,) = params.add_requests(["r"], [1, 2, 3])
    assert add.disable_speculation and not can_speculate(add)
    (add,) = from_api(generation_pb2.SamplingParams(temperature=0.0, max_tokens=4)).add_requests(["r"], [1, 2, 3])
    assert can_speculate(add)


# ---------------------------------------------------------------------------------------------- a draft model


def test_a_draft_verification_plans_k_drawn_slots_and_learns_the_tokens_from_the_verdict():
    sched = make_scheduler(speculative_method="draft", num_speculative_tokens=3, block_size=2)
    seq = decode_ready(sched, prompt=[11, 12, 13, 14, 15])  # nothing repeats: a draft proposes anyway
    out = sched.schedule()
    (s,) = out.scheduled
    assert s.drafted and len(s.proposal) == 3 and s.num_new_tokens == 4 and seq.verifying
    assert seq.num_computed_tokens == 6 + 3 and len(seq.block_table) * 2 >= 9  # lookahead for the 3 drafted
    plan = build_step_plan(1, out)
    assert list(plan.cached.num_draft_tokens) == [3] and not plan.cached.proposed_token_ids
    assert list(plan.cached.num_scheduled_tokens) == [4]
    (update,) = sched.postprocess(out, {seq.seq_id: 40}, accepted={seq.seq_id: [30, 31]})
    assert update.accepted_token_ids == [30, 31] and seq.token_ids[-3:] == [30, 31, 40]
    assert seq.num_computed_tokens == 8 and not seq.verifying and len(seq.block_table) == 5
    assert len(seq.block_hashes) == 4  # 8 tokens with K/V, all known: the 4 full blocks, no rejected slot
    stats = sched.stats()
    assert (stats["num_proposed_tokens"], stats["num_accepted_tokens"], stats["accepted_per_position"]) == \
        (3, 2, [1, 1, 0])
    assert (seq.num_proposed_tokens, seq.num_accepted_tokens) == (3, 2)


def test_a_reply_accepting_more_drafted_tokens_than_planned_is_refused_whole():
    sched = make_scheduler(speculative_method="draft", num_speculative_tokens=2)
    seq = decode_ready(sched)
    out = sched.schedule()
    with pytest.raises(ValueError, match="3 drafted tokens accepted of 2"):
        sched.check_result(out, {seq.seq_id: 1}, accepted={seq.seq_id: [3, 4, 5]})


def test_draft_verifications_wait_for_their_verdict_under_async_scheduling(embedded_model):
    """A draft proposes from the sequence's true tokens in the executors: no verification is planned on a guess."""
    from scheduler_svc.common.config import EngineConfig
    from scheduler_svc.core.scheduler_config import scheduler_config

    ready = engine_pb2.EngineReady(model=engine_pb2.ExecutorHandshake(vocab_size=49152, num_blocks=64, device="cpu"),
                                   max_model_len=512)
    for method, chained in (("ngram", True), ("draft", False)):
        config = EngineConfig(model=embedded_model, speculative_method=method, async_scheduling=True,
                              draft_model=embedded_model if method == "draft" else None, max_steps_in_flight=2)
        assert scheduler_config(config, ready).chain_verifications is chained
