"""Structured output on the scheduler, with llguidance and the embedded model's tokenizer but no model: a fake
executor samples a random token among those each mask allows (support/structured_serving.py). Every mask sent,
in the plan or late, is the grammar's mask after exactly the sequence's output tokens, through chunked
prefill, preemption by recompute and by swap, parallel samples, aborts in flight and async scheduling, where
a constrained sequence decodes in every step; grammars compile off the loop, once per text."""
from __future__ import annotations

import json
import threading
import time

import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from protos import engine_pb2
from scheduler_svc.core.scheduler import Scheduler
from scheduler_svc.core.scheduler_config import SchedulerConfig
from scheduler_svc.core.sequence import Sequence
from scheduler_svc.core.structured import mask_fill
from scheduler_svc.core.structured.compiler import GrammarCompiler, tokenizer_loader
from scheduler_svc.core.structured.grammars import INVALID, grammar_of
from scheduler_svc.core.structured.structured_outputs import StructuredOutputs
from support.fake_executor import check_block_references
from support.structured_serving import EOS, FREE_TOKEN, VOCAB, allowed_tokens, masks_of, masks_of_plan, serve

PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 6},
    "age": {"type": "integer", "minimum": 0, "maximum": 99},
    "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2}},
    "required": ["name", "age"], "additionalProperties": False}


def json_constraint(schema: dict) -> engine_pb2.Constraint:
    return engine_pb2.Constraint(json_schema=json.dumps(schema))


@pytest.fixture(scope="module")
def lltokenizer(embedded_model):
    return tokenizer_loader(embedded_model, VOCAB, (EOS,))()


def make_scheduler(model_dir: str, num_blocks: int = 256, num_host_blocks: int = 0, budget: int = 256,
                   max_num_seqs: int = 8, mask_fill_threads: int = 0) -> Scheduler:
    return Scheduler(SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, max_model_len=512,
                                     block_size=4, num_blocks=num_blocks, eos_token_ids=(EOS,),
                                     num_host_blocks=num_host_blocks, vocab_size=VOCAB, tokenizer_dir=model_dir,
                                     mask_fill_threads=mask_fill_threads))


def new_seq(sched: Scheduler, prompt_len: int = 6, constraint=None, max_tokens: int = 48, first_token: int = 100,
            **fields) -> Sequence:
    seq_id = sched.new_seq_id()
    return Sequence(seq_id=seq_id, request_id=f"r{seq_id}", token_ids=list(range(first_token, first_token + prompt_len)),
                    num_prompt_tokens=prompt_len, sampling=engine_pb2.SamplingOptions(),
                    stopping=engine_pb2.StoppingOptions(max_tokens=max_tokens), constraint=constraint, **fields)


def wait_compiled(sched: Scheduler, timeout_s: float = 30.0) -> list:
    """Poll the compiler as the engine loop does until nothing is compiling; the failures."""
    failed, deadline = [], time.monotonic() + timeout_s
    while sched.structured.compiling:
        assert time.monotonic() < deadline, "grammars never compiled"
        failed += sched.admit_compiled_grammars()
        time.sleep(0.002)
    return failed


def text_of(tokenizer, seq: Sequence) -> str:
    return tokenizer.decode_str([t for t in seq.output_token_ids if t != EOS])


@pytest.mark.parametrize("depth", [1, 2], ids=["sync", "async"])
@pytest.mark.parametrize("num_host_blocks", [0, 64], ids=["recompute", "swap"])
def test_every_mask_is_the_grammars_after_exactly_the_output_tokens_through_preemption(
        embedded_model, lltokenizer, num_host_blocks, depth):
    # 5 sequences of 8 to 14 prompt tokens and about 25 outputs on 24 blocks of 4: they preempt one another
    sched = make_scheduler(embedded_model, num_blocks=24, num_host_blocks=num_host_blocks, budget=16)
    seqs = [new_seq(sched, prompt_len=8 + 2 * i, constraint=json_constraint(PERSON), first_token=100 + 50 * i)
            for i in range(4)]
    seqs.append(new_seq(sched, prompt_len=10, max_tokens=30, first_token=400))  # a free one among them
    serve(sched, seqs, lltokenizer, depth=depth, seed=1)
    assert sched.counters.num_preemptions > 0
    assert (sched.counters.num_swap_outs > 0) == (num_host_blocks > 0)
    for seq in seqs[:4]:
        assert seq.finish_reason == engine_pb2.FINISH_REASON_STOP
        jsonschema.validate(json.loads(text_of(lltokenizer, seq)), PERSON)
    assert seqs[4].output_token_ids == [FREE_TOKEN] * 30


def runs_of(plans: list, seq: Sequence) -> list[int]:
    """The plans (0-based) that run the sequence."""
    return [i for i, p in enumerate(plans) if seq.seq_id in set(p.cached.seq_ids) | {n.seq_id for n in p.new_seqs}]


@pytest.mark.parametrize("depth", [2, 3])
def test_with_async_scheduling_a_constrained_sequence_decodes_in_every_step_with_late_masks(
        embedded_model, lltokenizer, depth):
    sched = make_scheduler(embedded_model)
    constrained, free = new_seq(sched, constraint=json_constraint(PERSON)), new_seq(sched, max_tokens=12)
    lates = []
    plans = serve(sched, [constrained, free], lltokenizer, depth=depth, seed=2, lates=lates)
    runs = runs_of(plans, constrained)
    assert runs == list(range(runs[0], runs[0] + len(runs))), "no step without it from its first to its last"
    assert len(runs) >= constrained.num_output_tokens  # (plus a sample discarded after it ended, if planned)
    # its first sample's mask rides in the plan; each later one comes late, once the token before it is known
    assert [p for p in plans if p.HasField("token_bitmasks")] == [plans[runs[0]]]
    assert sum(constrained.seq_id in m.masks.seq_ids for m in lates) == constrained.num_output_tokens - 1
    jsonschema.validate(json.loads(text_of(lltokenizer, constrained)), PERSON)


def test_with_async_scheduling_a_half_constrained_batch_takes_as_many_steps_as_an_all_free_one(embedded_model):
    letters = engine_pb2.Constraint(regex="[a-z]{400}")  # 24 tokens of letters can never complete it

    def steps(constrain_half: bool) -> int:
        sched = make_scheduler(embedded_model)
        seqs = [new_seq(sched, max_tokens=24, constraint=letters if constrain_half and i % 2 else None,
                        first_token=100 + 10 * i) for i in range(8)]
        for seq in seqs:
            sched.add(seq)
        wait_compiled(sched)  # all start together
        plans = serve(sched, [], depth=2, seed=4)
        assert all(seq.num_output_tokens == 24 for seq in seqs)
        return len(plans)

    free, half = steps(False), steps(True)
    assert half <= free + 1  # not the 2x of planning a constrained sequence every other step


def test_a_late_mask_of_a_sequence_aborted_in_flight_is_dropped_and_the_others_carry_on(
        embedded_model, lltokenizer):
    sched = make_scheduler(embedded_model)
    victim, other = (new_seq(sched, constraint=json_constraint(PERSON), first_token=t) for t in (100, 200))
    free = new_seq(sched, max_tokens=20, first_token=300)
    for seq in (victim, other, free):
        sched.add(seq)
    wait_compiled(sched)  # all run from the first plan: the victim's rows from the second on are late
    lates = []
    plans = serve(sched, [], lltokenizer, depth=2, seed=5, aborts={4: victim}, lates=lates)
    assert victim.seq_id in plans[3].late_mask_seq_ids  # aborted while plan 4 and its late row are in flight
    dropped = [m for m in lates if victim.seq_id in m.dropped_seq_ids]
    assert len(dropped) == 1 and victim.seq_id not in dropped[0].masks.seq_ids  # never masked, never waited on
    assert victim.finish_reason == engine_pb2.FINISH_REASON_ABORT
    assert not any(victim.seq_id in m.masks.seq_ids or victim.seq_id in m.dropped_seq_ids
                   for m in lates[lates.index(dropped[0]) + 1:])
    jsonschema.validate(json.loads(text_of(lltokenizer, other)), PERSON)
    assert free.output_token_ids == [FREE_TOKEN] * 20


def test_masks_ride_in_the_plan_only_for_constrained_sequences_that_sample(embedded_model):
    # a 20-token prompt in chunks of 8: its first two chunks sample nothing, so they carry no mask
    sched = make_scheduler(embedded_model, budget=9)
    constrained = new_seq(sched, prompt_len=20, constraint=json_constraint(PERSON))
    free = new_seq(sched, prompt_len=1, max_tokens=8)
    plans = serve(sched, [free, constrained])
    with_masks = [p for p in plans if p.HasField("token_bitmasks")]
    assert all(list(p.token_bitmasks.seq_ids) == [constrained.seq_id] for p in with_masks)
    assert all(p.token_bitmasks.num_words == VOCAB // 32 and len(p.token_bitmasks.words) == VOCAB // 8
               for p in with_masks)
    assert len(with_masks) == constrained.num_output_tokens  # one mask per sampled token
    first_sample = next(i for i, p in enumerate(plans) if p.HasField("token_bitmasks"))
    assert first_sample >= 2 and not plans[0].HasField("token_bitmasks")


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(depth=st.integers(1, 3), budget=st.sampled_from([5, 9, 64]), num_blocks=st.sampled_from([22, 256]),
       num_host_blocks=st.sampled_from([0, 32]), n=st.integers(1, 3), seed=st.integers(0, 2**16),
       aborts=st.dictionaries(st.integers(1, 40), st.integers(0, 4), max_size=2))
def test_every_mask_sent_in_a_plan_or_late_is_the_grammars_after_exactly_the_output_tokens(
        embedded_model, lltokenizer, depth, budget, num_blocks, num_host_blocks, n, seed, aborts):
    """Chunked prefill (budgets of 5 and 9), preemption by recompute and swap (22 blocks of 4), n samples,
    aborts while steps are in flight, up to 3 plans in flight: serve checks each mask against the grammar."""
    sched = make_scheduler(embedded_model, num_blocks=num_blocks, num_host_blocks=num_host_blocks, budget=budget)
    seqs = [new_seq(sched, prompt_len=12, constraint=json_constraint(PERSON), first_token=100, group_id="g")
            for _ in range(n)]
    seqs += [new_seq(sched, prompt_len=8 + i, constraint=json_constraint(PERSON), first_token=200 + 40 * i)
             for i in range(2)]
    seqs.append(new_seq(sched, prompt_len=10, max_tokens=30, first_token=400))
    serve(sched, seqs, lltokenizer, depth=depth, seed=seed,
          aborts={step: seqs[i % len(seqs)] for step, i in aborts.items()})
    check_block_references(sched)
    assert sched.block_manager.num_free_blocks == num_blocks and not sched.structured.matchers
    for seq in seqs:
        if seq.finish_reason == engine_pb2.FINISH_REASON_STOP:
            jsonschema.validate(json.loads(text_of(lltokenizer, seq)), PERSON)
        else:
            assert seq.finish_reason in (engine_pb2.FINISH_REASON_ABORT, engine_pb2.FINISH_REASON_LENGTH)


def test_a_grammar_gets_as_many_lexers_as_fill_threads_and_its_sequences_are_spread_over_them(embedded_model):
    sched = make_scheduler(embedded_model, mask_fill_threads=3)
    seqs = [new_seq(sched, constraint=json_constraint(PERSON), first_token=100 + 10 * i) for i in range(7)]
    for seq in seqs:
        sched.add(seq)
    wait_compiled(sched)  # the sequences start on the first lexer; the compiler adds the others after it
    grammar = grammar_of(json_constraint(PERSON))
    deadline = time.monotonic() + 30
    while len(sched.structured.compiler.get(grammar).initial_states) < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    states = sched.structured.compiler.get(grammar).initial_states
    assert len(states) == 3 and len({id(m) for m in states}) == 3  # compiled three times, not copied
    entry = sched.structured._in_use[grammar]
    assert entry.num_started == 0  # a sequence takes its lexer at its first mask, when the others may be ready
    out = sched.schedule()  # every prompt in one step: seven first masks
    assert out.token_bitmasks is not None and len(out.token_bitmasks.seq_ids) == 7
    assert entry.templates == states and entry.num_started == 7  # round robin over all three
    # the filler is told each row's lexer, to hand the pool one lexer's rows together
    assert [sched.structured._lexer_of[seq.seq_id] for seq in seqs] == [0, 1, 2, 0, 1, 2, 0]
    one = make_scheduler(embedded_model, mask_fill_threads=1)
    one.add(new_seq(one, constraint=json_constraint(PERSON)))
    wait_compiled(one)
    assert len(one.structured.compiler.get(grammar_of(json_constraint(PERSON))).initial_states) == 1


@pytest.mark.parametrize("depth", [1, 2], ids=["sync", "async"])
def test_the_mask_fill_pool_changes_no_mask_and_no_output(embedded_model, lltokenizer, depth):
    num = mask_fill.PARALLEL_FROM_ROWS + 1

    def run(threads: int) -> tuple[list, list[list[int]]]:
        sched = make_scheduler(embedded_model, max_num_seqs=16, mask_fill_threads=threads)
        seqs = [new_seq(sched, constraint=json_constraint(PERSON), first_token=100 + 20 * i) for i in range(num)]
        seqs.append(new_seq(sched, max_tokens=20, first_token=400))
        for seq in seqs:
            sched.add(seq)
        wait_compiled(sched)  # all start together: their masks are filled together, enough rows for the pool
        lates: list = []
        plans = serve(sched, [], lltokenizer, depth=depth, seed=6, lates=lates)
        rows = [len(p.token_bitmasks.seq_ids) for p in plans] + [len(m.masks.seq_ids) for m in lates]
        assert max(rows) >= mask_fill.PARALLEL_FROM_ROWS and sched.structured.filler.num_threads == threads
        return plans + lates, [seq.output_token_ids for seq in seqs]

    (serial_msgs, serial_outputs), (pooled_msgs, pooled_outputs) = run(1), run(4)
    assert pooled_msgs == serial_msgs and pooled_outputs == serial_outputs
    for tokens in serial_outputs[:num]:
        jsonschema.validate(json.loads(lltokenizer.decode_str([t for t in tokens if t != EOS])), PERSON)


@pytest.mark.parametrize("depth", [1, 2], ids=["sync", "async"])
def test_parallel_samples_each_follow_their_own_matcher(embedded_model, lltokenizer, depth):
    sched = make_scheduler(embedded_model)
    samples = [new_seq(sched, constraint=json_constraint(PERSON), group_id="g") for _ in range(3)]  # one prompt
    serve(sched, samples, lltokenizer, depth=depth, seed=3)
    texts = [text_of(lltokenizer, s) for s in samples]
    for text in texts:
        jsonschema.validate(json.loads(text), PERSON)
    assert len(set(texts)) > 1
    assert sched.stats()["num_grammar_compiles"] == 1


def test_a_grammar_is_compiled_once_for_every_request_that_uses_it(embedded_model):
    sched = make_scheduler(embedded_model)
    other = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
             "additionalProperties": False}
    seqs = [new_seq(sched, constraint=json_constraint(PERSON)) for _ in range(3)]
    seqs.append(new_seq(sched, constraint=json_constraint(other)))
    serve(sched, seqs)
    seqs.append(new_seq(sched, constraint=json_constraint(PERSON), first_token=300))  # (serve's executor is new)
    serve(sched, seqs[-1:])  # after the first ones ended: from the cache
    stats = sched.stats()
    assert stats["num_grammar_compiles"] == 2 and stats["num_constrained_requests"] == 5
    assert stats["num_token_masks"] == sum(s.num_output_tokens for s in seqs)  # one mask per constrained sample
    assert 0 < stats["num_masked_steps"] <= stats["num_steps"] and stats["token_mask_seconds"] > 0


class GatedTokenizer:
    """A tokenizer loader that blocks until the test opens the gate: a grammar that takes long to compile."""

    def __init__(self, model_dir: str) -> None:
        self.gate = threading.Event()
        self.load = tokenizer_loader(model_dir, VOCAB, (EOS,))

    def __call__(self):
        assert self.gate.wait(30)
        return self.load()


def test_a_request_whose_grammar_compiles_waits_without_holding_back_the_others(embedded_model):
    sched = make_scheduler(embedded_model)
    gated = GatedTokenizer(embedded_model)
    sched.structured = StructuredOutputs(GrammarCompiler(gated), VOCAB)
    constrained, free = new_seq(sched, constraint=json_constraint(PERSON)), new_seq(sched, max_tokens=5)
    sched.add(constrained)
    sched.add(free)
    for _ in range(5):  # the free request runs to its end while the grammar compiles
        sched.admit_compiled_grammars()
        out = sched.schedule()
        assert [s.seq for s in out.scheduled] == [free]
        sched.postprocess(out, {free.seq_id: FREE_TOKEN})
    assert free.is_finished and not constrained.is_finished and sched.structured.compiling
    gated.gate.set()
    assert wait_compiled(sched) == []
    out = sched.schedule()
    assert [s.seq for s in out.scheduled] == [constrained] and out.token_bitmasks is not None


def test_a_grammar_that_does_not_compile_ends_its_request_with_the_compilers_message(embedded_model):
    sched = make_scheduler(embedded_model)
    bad, free = new_seq(sched, constraint=engine_pb2.Constraint(regex="[a-")), new_seq(sched, max_tokens=3)
    sched.add(bad)
    sched.add(free)
    failed = wait_compiled(sched)
    assert [seq for seq, _ in failed] == [bad] and bad.is_finished
    assert failed[0][1].startswith("invalid constraint: ") and "unclosed character class" in failed[0][1]
    assert sched.stats()["num_grammar_compile_errors"] == 1
    serve(sched, [])
    assert free.output_token_ids == [FREE_TOKEN] * 3
    again = new_seq(sched, constraint=engine_pb2.Constraint(regex="[a-"))
    with pytest.raises(ValueError, match="(?s)invalid constraint: .*unclosed character class"):
        sched.add(again)  # the failure is cached: refused at once


def test_without_the_models_tokenizer_a_constrained_request_fails_and_free_ones_still_run(tmp_path):
    sched = make_scheduler(str(tmp_path))
    constrained, free = new_seq(sched, constraint=json_constraint(PERSON)), new_seq(sched, max_tokens=3)
    sched.add(constrained)
    sched.add(free)
    failed = wait_compiled(sched)
    assert [seq for seq, _ in failed] == [constrained] and "tokenizer.json does not exist" in failed[0][1]
    serve(sched, [])
    assert free.output_token_ids == [FREE_TOKEN] * 3


def test_a_completed_grammar_stops_the_sequence_and_eos_is_allowed_only_where_it_accepts(
        embedded_model, lltokenizer):
    sched = make_scheduler(embedded_model)
    exact = new_seq(sched, constraint=engine_pb2.Constraint(choice=engine_pb2.ChoiceList(choices=["yes"])))
    optional_tail = new_seq(sched, constraint=engine_pb2.Constraint(regex="ab(c)?"))
    plans = serve(sched, [exact, optional_tail], lltokenizer)
    assert text_of(lltokenizer, exact) == "yes" and EOS not in exact.output_token_ids  # no EOS needed
    assert exact.finish_reason == engine_pb2.FINISH_REASON_STOP
    assert text_of(lltokenizer, optional_tail) in ("ab", "abc")
    masks = [m[optional_tail.seq_id] for m in map(masks_of_plan, plans) if optional_tail.seq_id in m]
    eos_allowed = [EOS in allowed_tokens(m) for m in masks]
    assert eos_allowed == [text == "ab" for text in prefixes(lltokenizer, optional_tail)]


def prefixes(lltokenizer, seq: Sequence) -> list[str]:
    """The output's text before each of its tokens was sampled."""
    out = seq.output_token_ids
    return [lltokenizer.decode_str(out[:i]) for i in range(len(out))]


def test_max_tokens_ends_a_constrained_request_with_length(embedded_model, lltokenizer):
    sched = make_scheduler(embedded_model)
    seq = new_seq(sched, constraint=engine_pb2.Constraint(regex="a+"), max_tokens=4)
    sched.add(seq)
    wait_compiled(sched)
    a = lltokenizer.tokenize_str("a")[0]
    for _ in range(4):
        out = sched.schedule()
        assert a in allowed_tokens(masks_of(out.token_bitmasks)[seq.seq_id])
        sched.postprocess(out, {seq.seq_id: a})
    assert seq.finish_reason == engine_pb2.FINISH_REASON_LENGTH and seq.output_token_ids == [a] * 4


def test_a_token_the_mask_forbids_fails_the_request_with_the_matchers_error(embedded_model, lltokenizer):
    sched = make_scheduler(embedded_model)
    seq = new_seq(sched, constraint=engine_pb2.Constraint(regex="[0-9]+"))
    sched.add(seq)
    wait_compiled(sched)
    out = sched.schedule()
    letter = lltokenizer.tokenize_str("x")[0]
    (update,) = sched.postprocess(out, {seq.seq_id: letter})  # an executor that ignored the mask
    assert update.finish_reason == engine_pb2.FINISH_REASON_ERROR and "does not fit the grammar" in update.error
    assert seq.is_finished and not sched.structured.matchers


def test_a_grammar_that_outgrows_llguidances_limits_while_it_runs_fails_as_an_invalid_constraint(embedded_model,
                                                                                                  lltokenizer):
    # a{1000000} compiles, and its lexer gives up at the first token its mask allowed
    sched = make_scheduler(embedded_model)
    seq = new_seq(sched, constraint=engine_pb2.Constraint(regex="a{1000000}"))
    sched.add(seq)
    wait_compiled(sched)
    out = sched.schedule()
    allowed = allowed_tokens(masks_of(out.token_bitmasks)[seq.seq_id])
    (update,) = sched.postprocess(out, {seq.seq_id: int(allowed[0])})
    assert update.finish_reason == engine_pb2.FINISH_REASON_ERROR
    assert update.error.startswith(INVALID + "too complex: ") and "\n" not in update.error  # no parser dump
    assert seq.is_finished and not sched.structured.matchers


def test_a_constraint_with_beam_search_is_refused(embedded_model):
    sched = make_scheduler(embedded_model)
    seq = new_seq(sched, constraint=json_constraint(PERSON), group_id="g",
                  beam_options=engine_pb2.BeamSearchOptions(beam_width=2, num_requests=1))
    with pytest.raises(ValueError, match="does not apply to beam search"):
        sched.add(seq)
    assert not sched.requests
