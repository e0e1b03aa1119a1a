"""Beam search in the scheduler: the continuations it keeps, and the beams it forks with copy-on-write.

A fake model gives each token history fixed logprobs, so the scheduler's search, run step by step with a
small KV pool (forks, copies, preemption), must return exactly what a whole-vocabulary transcription of
HF transformers' beam search returns. A fake executor keeps which token each KV slot holds, so a beam
that reads a slot another beam wrote is caught.
"""
from __future__ import annotations

import math
import random
import zlib

from hypothesis import given, settings, strategies as st

from protos import engine_pb2
from scheduler_svc.core.groups.beam_search import LENGTH, STOP, BeamSearch
from scheduler_svc.core.scheduler import Scheduler
from scheduler_svc.core.scheduler_config import SchedulerConfig
from scheduler_svc.core.sequence import Sequence
from support.fake_executor import FakeExecutor, check_block_references

VOCAB = 9
EOS = 0
BLOCK = 4


def fake_logprobs(history: tuple[int, ...], salt: int) -> list[float]:
    """Log-softmax of logits fixed by the token history, as a deterministic model would give."""
    logits = [(zlib.crc32(repr((salt, history, v)).encode()) % 10_000) / 1_000 for v in range(VOCAB)]
    top = max(logits)
    norm = top + math.log(sum(math.exp(x - top) for x in logits))
    return [x - norm for x in logits]


def reference_beam_search(prompt: list[int], width: int, max_tokens: int, length_penalty: float, salt: int,
                          stop_ids: frozenset[int], min_tokens: int) -> list[tuple[tuple[int, ...], float]]:
    """HF transformers' _beam_search (early_stopping=False) over the whole vocabulary, one request."""
    keep = max(2, 1 + len(stop_ids)) * width
    running = [(tuple(), 0.0)] + [(tuple(), -1e9)] * (width - 1)  # HF starts with one live beam
    finished: list[tuple[tuple[int, ...], float]] = []  # (tokens, score), best first, <= width
    for gen in range(max_tokens):
        cands = []
        for beam_index, (tokens, cum) in enumerate(running):
            lps = fake_logprobs(tuple(prompt) + tokens, salt)
            for v in range(VOCAB):
                lp = lps[v] if (v not in stop_ids or gen + 1 >= min_tokens) else -math.inf
                cands.append((cum + lp, beam_index * VOCAB + v, tokens + (v,)))
        cands.sort(key=lambda c: (-c[0], c[1]))
        cands = cands[:keep]
        at_length = gen + 1 >= max_tokens
        hits = [at_length or c[2][-1] in stop_ids for c in cands]
        next_running = [c for c, h in zip(cands, hits) if not h][:width]
        for rank, (c, h) in enumerate(zip(cands, hits)):
            if h and rank < width:
                finished.append((c[2], c[0] / (gen + 1) ** length_penalty))
        finished = sorted(finished, key=lambda f: -f[1])[:width]
        if at_length or not next_running:
            break
        running = [(c[2], c[0]) for c in next_running]
        if len(finished) == width and running[0][1] / (gen + 1) ** length_penalty <= finished[-1][1]:
            break
    return finished


def member(seq_id: int, group: str, prompt: list[int], width: int, n: int, max_tokens: int,
           length_penalty: float = 1.0, min_tokens: int = 0, logprobs: int = 0) -> Sequence:
    return Sequence(seq_id=seq_id, request_id=f"{group}#{seq_id}", token_ids=list(prompt), num_prompt_tokens=len(prompt),
                    sampling=engine_pb2.SamplingOptions(logprobs=logprobs),
                    stopping=engine_pb2.StoppingOptions(max_tokens=max_tokens, min_tokens=min_tokens),
                    group_id=group, beam_options=engine_pb2.BeamSearchOptions(
                        beam_width=width, length_penalty=length_penalty, num_requests=n))


def drive(sched: Scheduler, executor: FakeExecutor, salt: int, max_steps: int = 2000) -> list:
    """Run schedule / execute / postprocess until nothing is left; return every update."""
    updates = []
    for _ in range(max_steps):
        if not sched.has_unfinished():
            return updates
        out = sched.schedule()
        assert out.scheduled, "work is left but nothing could be scheduled"
        executor.run(out)
        sampled, candidates = {}, {}
        for s in out.scheduled:
            if s.samples:
                history = tuple(s.seq.token_ids[: s.start + s.num_new_tokens])
                lps = fake_logprobs(history, salt)
                order = sorted(range(VOCAB), key=lambda v: -lps[v])
                sampled[s.seq.seq_id] = order[0]
                k = s.seq.sampling.logprobs
                candidates[s.seq.seq_id] = (order[:k], [lps[v] for v in order[:k]])
        updates += sched.postprocess(out, sampled, candidates)
        check_block_references(sched)
    raise AssertionError("the engine did not finish")


def scheduler(num_blocks: int, max_num_seqs: int = 16, budget: int = 64) -> Scheduler:
    return Scheduler(SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, max_model_len=256,
                                     block_size=BLOCK, num_blocks=num_blocks, eos_token_ids=(EOS,)))


def test_a_stop_token_ranked_within_the_width_finishes_a_hypothesis_and_the_rest_continue():
    search = BeamSearch("g", width=2, length_penalty=1.0, num_requests=1, stop_token_ids=frozenset({EOS}),
                        max_output_tokens=10)
    beam = member(1, "g", [5, 6], 2, 1, 10)
    search.beams = [beam]
    search.reports[beam.seq_id] = ([EOS, 3, 4, 7], [-0.1, -0.5, -1.0, -2.0])
    round_ = search.select(0)
    assert not round_.done
    assert [(c.token_id, c.cum_logprob) for c in round_.continuations] == [(3, -0.5), (4, -1.0)]
    assert [(h.output_token_ids, h.finish_reason, h.stop_token_id) for h in search.finished] == [((EOS,), STOP, EOS)]


def test_a_stop_token_ranked_past_the_width_is_not_a_hypothesis():
    search = BeamSearch("g", width=1, length_penalty=1.0, num_requests=1, stop_token_ids=frozenset({EOS}),
                        max_output_tokens=10)
    beam = member(1, "g", [5], 1, 1, 10)
    search.beams = [beam]
    search.reports[beam.seq_id] = ([3, EOS], [-0.2, -0.3])
    round_ = search.select(0)
    assert [c.token_id for c in round_.continuations] == [3] and search.finished == []


def test_at_the_length_limit_the_best_width_continuations_end_with_length():
    search = BeamSearch("g", width=2, length_penalty=2.0, num_requests=2, stop_token_ids=frozenset({EOS}),
                        max_output_tokens=2)
    a, b = member(1, "g", [5], 2, 2, 2), member(2, "g", [5], 2, 2, 2)
    a.token_ids.append(3)
    b.token_ids.append(4)
    a.cum_logprob, b.cum_logprob = -1.0, -1.5
    search.beams = [a, b]
    search.reports = {1: ([6, 7], [-1.0, -3.0]), 2: ([8, 6], [-0.1, -0.2])}
    round_ = search.select(1)
    assert round_.done and round_.continuations == []
    assert [(h.output_token_ids, h.finish_reason) for h in search.finished] == [((4, 8), LENGTH), ((4, 6), LENGTH)]
    assert search.finished[0].score == (-1.5 - 0.1) / 2 ** 2.0


@settings(max_examples=60, deadline=None)
@given(width=st.integers(1, 4), n_frac=st.floats(0, 1), max_tokens=st.integers(1, 9),
       prompt_len=st.integers(1, 11), spare_blocks=st.integers(0, 6), salt=st.integers(0, 10**6),
       length_penalty=st.sampled_from([0.0, 1.0, 2.0, -0.5]), min_tokens=st.integers(0, 3),
       num_plain=st.integers(0, 3), budget=st.sampled_from([3, 8, 64]), logprobs=st.sampled_from([0, 1, 3, 12]))
def test_scheduler_beam_search_equals_the_whole_vocabulary_reference(
        width, n_frac, max_tokens, prompt_len, spare_blocks, salt, length_penalty, min_tokens, num_plain, budget,
        logprobs):
    rng = random.Random(salt)
    prompt = [rng.randrange(1, VOCAB) for _ in range(prompt_len)]
    n = 1 + int(n_frac * (width - 1))
    min_tokens = min(min_tokens, max_tokens)
    # from the smallest pool the search is accepted in (so beams preempt each other) upward
    num_blocks = max(3, width * -(-(prompt_len + max_tokens) // BLOCK)) + spare_blocks
    sched = scheduler(num_blocks, budget=budget)
    executor = FakeExecutor(num_blocks, BLOCK)
    members = [member(i + 1, "g", prompt, width, n, max_tokens, length_penalty, min_tokens, logprobs)
               for i in range(n)]
    plain = [Sequence(seq_id=100 + i, request_id=f"p{i}", token_ids=prompt[:1] + [i + 1] * 5, num_prompt_tokens=6,
                      sampling=engine_pb2.SamplingOptions(),
                      stopping=engine_pb2.StoppingOptions(max_tokens=6, ignore_eos=True)) for i in range(num_plain)]
    for seq in members[:1] + plain + members[1:]:  # other traffic arrives between the members
        sched.add(seq)
    updates = drive(sched, executor, salt)

    ref = reference_beam_search(prompt, width, max_tokens, length_penalty, salt, frozenset({EOS}), min_tokens)
    finals = {u.seq.request_id: u for u in updates if u.seq.beam_options is not None}
    assert len(finals) == n and all(u.finish_reason in (STOP, LENGTH) for u in finals.values())
    assert sum(u.finish_reason != 0 for u in updates if u.seq.beam_options is not None) == n  # one terminal each
    for m, (tokens, score) in zip(members, ref):
        assert tuple(m.output_token_ids) == tokens
        if logprobs:  # each token's logprob and rank under the fake model, and the candidates before it
            assert len(m.beam_logprobs) == len(tokens)
            for pos, (token, (lp, rank, top_ids, top_lps)) in enumerate(zip(tokens, m.beam_logprobs)):
                lps = fake_logprobs(tuple(prompt) + tokens[:pos], salt)
                order = sorted(range(VOCAB), key=lambda v: -lps[v])
                assert lp == lps[token] and order[rank - 1] == token
                assert list(top_ids) == order[:logprobs] and list(top_lps) == [lps[v] for v in order[:logprobs]]
            assert math.isclose(sum(x[0] for x in m.beam_logprobs) / len(tokens) ** length_penalty, score,
                                rel_tol=1e-9, abs_tol=1e-9)
        else:
            assert m.beam_logprobs == []
        assert finals[m.request_id].finish_reason == (STOP if tokens[-1] == EOS else LENGTH)
    bm = sched.block_manager
    assert bm.num_free_blocks == bm.num_blocks and not sched.beams.searches and not sched.requests


def test_forked_beams_share_the_prompt_blocks_and_copy_only_the_partial_one():
    sched = scheduler(num_blocks=64)
    executor = FakeExecutor(64, BLOCK)
    prompt = [1, 2, 3, 4, 5, 6, 7, 8, 1, 2]  # two full blocks and a partial one
    sched.add(member(1, "g", prompt, 3, 1, 2))
    out = sched.schedule()
    executor.run(out)
    (root,) = [s.seq for s in out.scheduled]
    lps = fake_logprobs(tuple(prompt), 0)
    order = sorted(range(VOCAB), key=lambda v: -lps[v])
    sched.postprocess(out, {root.seq_id: order[0]}, {root.seq_id: (order[:6], [lps[v] for v in order[:6]])})
    beams = sched.beams.searches[(b"", "g")].beams
    assert len(beams) == 3 and root.is_finished
    assert all(b.block_table[:2] == beams[0].block_table[:2] for b in beams)  # the full blocks stay shared
    out = sched.schedule()
    executor.run(out)
    assert len(out.block_copies) == 2  # three beams write the shared partial block: two copy it
    assert len({b.block_table[2] for b in beams}) == 3
    assert all(s.is_new for s in out.scheduled) and out.finished_seq_ids == [root.seq_id]


def test_aborting_every_member_frees_the_beams():
    sched = scheduler(num_blocks=32)
    a, b = member(1, "g", [1, 2, 3, 4, 5], 2, 2, 8), member(2, "g", [1, 2, 3, 4, 5], 2, 2, 8)
    sched.add(a)
    assert not sched.has_unfinished()  # the search waits for both members
    sched.add(b)
    out = sched.schedule()
    assert len(out.scheduled) == 1
    sched.abort(a.request_id)
    assert sched.beams.searches  # b still wants it
    sched.abort(b.request_id)
    assert not sched.beams.searches and not sched.has_unfinished()
    sched.postprocess(out, {})  # the step in flight comes back for beams that are gone
    assert sched.block_manager.num_free_blocks == 32
    assert sched.schedule().finished_seq_ids == []  # nothing ran, so nothing to drop yet
