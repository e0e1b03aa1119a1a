"""Parallel samples (n > 1) of one prompt compute it once: the first sample prefills and caches it,
the others are admitted once its blocks are hashed and reuse them through the prefix cache."""
from __future__ import annotations


from protos import engine_pb2
from scheduler_svc.scheduler import Scheduler, SchedulerConfig
from scheduler_svc.sequence import Sequence
from tiny_checkpoints import tiny_checkpoint

BLOCK = 4


def sample(seq_id: int, prompt: list[int], group: str = "") -> Sequence:
    return Sequence(seq_id=seq_id, request_id=f"r{seq_id}", token_ids=list(prompt), num_prompt_tokens=len(prompt),
                    sampling=engine_pb2.SamplingOptions(), stopping=engine_pb2.StoppingOptions(max_tokens=3),
                    group_id=group)


def scheduler(**overrides) -> Scheduler:
    config = dict(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64, block_size=BLOCK, num_blocks=32)
    return Scheduler(SchedulerConfig(**(config | overrides)))


def run_step(sched: Scheduler):
    out = sched.schedule()
    sched.postprocess(out, {s.seq.seq_id: 9 for s in out.scheduled if s.samples})
    return out


def test_later_samples_wait_for_the_first_to_cache_the_prompt_then_reuse_it():
    sched = scheduler()
    prompt = list(range(1, 11))  # 2 full blocks and a partial one
    siblings = [sample(i + 1, prompt, group="g") for i in range(3)]
    for s in siblings:
        sched.add(s)
    first = run_step(sched)
    assert [s.seq for s in first.scheduled] == [siblings[0]]
    second = run_step(sched)
    admitted = {s.seq.seq_id: s for s in second.scheduled if s.is_new}
    assert set(admitted) == {2, 3}
    assert all(s.start == 8 and s.num_new_tokens == 2 for s in admitted.values())
    assert siblings[1].block_table[:2] == siblings[0].block_table[:2] == siblings[2].block_table[:2]
    assert sched.stats()["prefix_cache_hit_tokens"] == 16


def test_a_waiting_sample_does_not_hold_back_other_requests():
    sched = scheduler()
    a, b = sample(1, list(range(1, 11)), group="g"), sample(2, list(range(1, 11)), group="g")
    other = sample(3, [50, 51, 52, 53, 54])
    for s in (a, b, other):
        sched.add(s)
    out = sched.schedule()
    assert {s.seq.seq_id for s in out.scheduled} == {1, 3}


def test_without_prefix_caching_samples_do_not_wait():
    sched = scheduler(enable_prefix_caching=False)
    for i in range(3):
        sched.add(sample(i + 1, list(range(1, 11)), group="g"))
    assert len(sched.schedule().scheduled) == 3


def test_greedy_parallel_samples_through_the_engine_match_one_sample_and_share_the_prompt(tmp_path_factory):
    from scheduler_svc.llm import LLM
    from scheduler_svc.sampling_params import SamplingParams

    path = tiny_checkpoint("llama", tmp_path_factory)
    prompt = [(7 * i) % 250 + 1 for i in range(70)]
    with LLM(path) as llm:
        one = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
        before = llm.stats().prefix_cache_hit_tokens
        many = llm.generate([prompt[::-1]], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, n=4),
                            use_tqdm=False)
        hits = llm.stats().prefix_cache_hit_tokens - before
        reference = llm.generate([prompt[::-1]], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                                 use_tqdm=False)
    assert len(one[0].outputs[0].token_ids) == 8
    outs = [o.token_ids for o in many[0].outputs]
    assert len(outs) == 4 and all(o == reference[0].outputs[0].token_ids for o in outs)
    assert hits == 3 * (70 // 16) * 16, "samples 2..4 reuse every full block of the prompt"
