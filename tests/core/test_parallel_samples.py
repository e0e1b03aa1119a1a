"""Parallel samples (n > 1) of one prompt compute it once: the first sample prefills it; once that step
has succeeded the others fork its prompt blocks, copy (copy-on-write) the one they write, and compute
only the prompt's last token for their own logits."""
from __future__ import annotations

import zlib

from hypothesis import given, settings, strategies as st

from protos import engine_pb2
from scheduler_svc.core.scheduler import Scheduler
from scheduler_svc.core.scheduler_config import SchedulerConfig
from scheduler_svc.core.sequence import Sequence
from support.fake_executor import FakeExecutor, check_block_references
from support.tiny_checkpoints import tiny_checkpoint

BLOCK = 4


def sample(seq_id: int, prompt: list[int], group: str = "", max_tokens: int = 3) -> Sequence:
    return Sequence(seq_id=seq_id, request_id=f"r{seq_id}", token_ids=list(prompt), num_prompt_tokens=len(prompt),
                    sampling=engine_pb2.SamplingOptions(),
                    stopping=engine_pb2.StoppingOptions(max_tokens=max_tokens, ignore_eos=True), group_id=group)


def scheduler(**overrides) -> Scheduler:
    config = dict(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64, block_size=BLOCK, num_blocks=32)
    return Scheduler(SchedulerConfig(**(config | overrides)))


def run_step(sched: Scheduler, executor: FakeExecutor | None = None):
    out = sched.schedule()
    if executor is not None:
        executor.run(out)
    # each sample draws its own token, so siblings' histories differ after the prompt
    sched.postprocess(out, {s.seq.seq_id: zlib.crc32(repr((s.seq.seq_id, s.seq.token_ids)).encode()) % 50 + 1
                            for s in out.scheduled if s.samples})
    return out


def test_later_samples_fork_the_computed_prompt_and_copy_only_the_block_they_write():
    sched = scheduler()
    executor = FakeExecutor(32, BLOCK)
    prompt = list(range(1, 11))  # 2 full blocks and a partial one
    siblings = [sample(i + 1, prompt, group="g") for i in range(3)]
    for s in siblings:
        sched.add(s)
    first = run_step(sched, executor)
    assert [s.seq for s in first.scheduled] == [siblings[0]]
    second = run_step(sched, executor)
    admitted = {s.seq.seq_id: s for s in second.scheduled if s.is_new}
    assert set(admitted) == {2, 3}
    assert all(s.start == 9 and s.num_new_tokens == 1 for s in admitted.values())
    assert siblings[1].block_table[:2] == siblings[0].block_table[:2] == siblings[2].block_table[:2]
    assert len({s.block_table[2] for s in siblings}) == 3 and len(second.block_copies) == 2
    assert sched.stats()["prefix_cache_hit_tokens"] == 0  # forked, not looked up
    while sched.has_unfinished():
        run_step(sched, executor)
        check_block_references(sched)
    assert len({tuple(s.output_token_ids) for s in siblings}) == 3
    assert sched.block_manager.num_free_blocks == 32


def test_a_waiting_sample_does_not_hold_back_other_requests():
    sched = scheduler()
    a, b = sample(1, list(range(1, 11)), group="g"), sample(2, list(range(1, 11)), group="g")
    other = sample(3, [50, 51, 52, 53, 54])
    for s in (a, b, other):
        sched.add(s)
    out = sched.schedule()
    assert {s.seq.seq_id for s in out.scheduled} == {1, 3}


def test_without_prefix_caching_samples_still_fork_the_prompt():
    sched = scheduler(enable_prefix_caching=False)
    for i in range(3):
        sched.add(sample(i + 1, list(range(1, 11)), group="g"))
    assert len(run_step(sched).scheduled) == 1
    assert [s.num_new_tokens for s in run_step(sched).scheduled] == [1, 1, 1]


def test_samples_wait_for_a_preempted_first_sibling_to_compute_the_prompt_again():
    sched = scheduler(num_blocks=8)
    a, b = sample(1, list(range(1, 11)), group="g", max_tokens=20), sample(2, list(range(1, 11)), group="g")
    big = sample(3, list(range(20, 30)), max_tokens=20)
    sched.add(a)
    run_step(sched)  # a computes its prompt, then is preempted while its first decode is in flight
    out = sched.schedule()
    sched.preempt(a, [])
    sched.postprocess(out, {s.seq.seq_id: 5 for s in out.scheduled if s.samples})
    sched.add(b)
    sched.add(big)
    assert not a.prompt_computed
    assert b not in [s.seq for s in run_step(sched).scheduled]  # b cannot fork a prompt no longer there


@settings(max_examples=40, deadline=None)
@given(n=st.integers(2, 5), prompt_len=st.integers(1, 13), max_tokens=st.integers(1, 8),
       spare_blocks=st.integers(0, 8), budget=st.sampled_from([2, 5, 64]), caching=st.booleans(),
       num_others=st.integers(0, 2))
def test_forked_samples_read_only_their_own_history_under_pressure(n, prompt_len, max_tokens, spare_blocks, budget,
                                                                  caching, num_others):
    per_seq = -(-(prompt_len + max_tokens) // BLOCK)
    num_blocks = per_seq + 1 + spare_blocks
    sched = scheduler(num_blocks=num_blocks, max_num_batched_tokens=budget, enable_prefix_caching=caching)
    executor = FakeExecutor(num_blocks, BLOCK)
    prompt = [(7 * i) % 11 + 1 for i in range(prompt_len)]
    seqs = [sample(i + 1, prompt, group="g", max_tokens=max_tokens) for i in range(n)]
    seqs += [sample(10 + i, prompt[::-1] + [i], max_tokens=max_tokens) for i in range(num_others)]
    for seq in seqs:
        sched.add(seq)
    for _ in range(500):
        if not sched.has_unfinished():
            break
        run_step(sched, executor)  # the fake executor asserts every read sees the reader's own tokens
        check_block_references(sched)
    assert not sched.has_unfinished()
    assert all(s.num_output_tokens == max_tokens for s in seqs)
    assert sched.block_manager.num_free_blocks == num_blocks and sched.samples.num_waiting == 0


def test_greedy_parallel_samples_through_the_engine_match_one_sample_and_share_the_prompt(tmp_path_factory):
    from scheduler_svc.entrypoints.llm import LLM
    from scheduler_svc.frontend.sampling_params import SamplingParams

    path = tiny_checkpoint("llama", tmp_path_factory)
    prompt = [(7 * i) % 250 + 1 for i in range(70)]
    with LLM(path) as llm:
        one = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
        before = llm.stats().num_prefill_tokens
        many = llm.generate([prompt[::-1]], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, n=4),
                            use_tqdm=False)
        prefilled = llm.stats().num_prefill_tokens - before
        reference = llm.generate([prompt[::-1]], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                                 use_tqdm=False)
    assert len(one[0].outputs[0].token_ids) == 8
    outs = [o.token_ids for o in many[0].outputs]
    assert len(outs) == 4 and all(o == reference[0].outputs[0].token_ids for o in outs)
    assert prefilled == 70 + 3, "samples 2..4 fork the prompt and compute only its last token"
