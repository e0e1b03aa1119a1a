"""Beam search end to end, through the scheduler and executor processes: the hypotheses equal
HF transformers' beam search on the same weights in fp32, also when the KV pool forces preemption,
and with a model that has two EOS ids."""
from __future__ import annotations

import pytest

from support.hf_reference import hf_beam_search
from scheduler_svc.entrypoints.llm import LLM
from scheduler_svc.frontend.sampling_params import SamplingParams
from scheduler_svc.text.tokenizer import Tokenizer
from test_engine_equivalence import TOPICS
from support.tiny_checkpoints import tiny_checkpoint

EOS = 2  # SmolLM2's <|im_end|>
MAX_TOKENS = 14


@pytest.fixture(scope="module")
def beam_case(embedded_model):
    tokenizer = Tokenizer(embedded_model)
    prompts = [tokenizer.encode_chat([{"role": "user", "content": t}]) for t in TOPICS[:3]]
    cases = [(prompts[0], 4, 4, 1.0), (prompts[1], 3, 2, 0.5), (prompts[2], 2, 1, 1.0)]
    refs = [hf_beam_search(embedded_model, p, w, n, MAX_TOKENS, EOS, lp) for p, w, n, lp in cases]
    return cases, refs


def run_beams(model_dir: str, cases, **engine_args):
    params = [SamplingParams(beam_width=w, n=n, length_penalty=lp, max_tokens=MAX_TOKENS) for _, w, n, lp in cases]
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    with LLM(model_dir, **engine_args) as llm:
        # a plain greedy request runs beside the searches
        results = llm.generate([p for p, *_ in cases] + [cases[0][0]], params + [greedy], use_tqdm=False)
        stats = llm.stats()
    return [[list(o.token_ids) for o in r.outputs] for r in results[:-1]], results[-1], stats


def test_beam_search_hypotheses_equal_transformers(embedded_model, beam_case):
    cases, refs = beam_case
    assert any(h[-1] == EOS for ref in refs for h in ref), "some hypothesis should end with EOS"
    assert any(len(set(map(tuple, ref))) > 1 for ref in refs)
    outs, greedy, stats = run_beams(embedded_model, cases)
    assert outs == refs
    assert len(greedy.outputs[0].token_ids) == MAX_TOKENS
    assert stats.free_kv_blocks == stats.total_kv_blocks and stats.num_running == 0


def test_beam_search_equals_transformers_when_the_kv_pool_forces_preemption(embedded_model, beam_case):
    cases, refs = beam_case
    longest = max(len(p) for p, *_ in cases) + MAX_TOKENS
    outs, _, stats = run_beams(embedded_model, cases, num_gpu_blocks=4 * -(-longest // 16))
    assert stats.num_preemptions > 0, "the pool was meant to be too small for every beam at once"
    assert outs == refs
    assert stats.free_kv_blocks == stats.total_kv_blocks


def test_beam_search_with_two_eos_ids_equals_transformers(tmp_path_factory):
    path = tiny_checkpoint("qwen3", tmp_path_factory)  # eos ids 4 and 5: three candidates per beam kept
    prompts = [[(11 * i + j) % 250 + 6 for i in range(5 + 9 * j)] for j in range(4)]
    widths = [(4, 4), (3, 1), (2, 2), (5, 3)]
    refs = [hf_beam_search(path, p, w, n, 10, [4, 5], 1.0) for p, (w, n) in zip(prompts, widths)]
    with LLM(path) as llm:
        results = llm.generate(prompts, [SamplingParams(beam_width=w, n=n, max_tokens=10) for w, n in widths],
                               use_tqdm=False)
    assert [[list(o.token_ids) for o in r.outputs] for r in results] == refs


def test_a_one_beam_search_returns_the_tokens_and_logprobs_of_greedy_sampling(embedded_model, beam_case):
    cases, _ = beam_case
    prompt = cases[0][0]
    with LLM(embedded_model) as llm:
        beam, greedy = llm.generate([prompt, prompt], [
            SamplingParams(beam_width=1, max_tokens=MAX_TOKENS, logprobs=3),
            SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=3)], use_tqdm=False)
    b, g = beam.outputs[0], greedy.outputs[0]
    assert list(b.token_ids) == list(g.token_ids) and len(b.logprobs) == len(g.token_ids)
    for x, y in zip(b.logprobs, g.logprobs):
        assert x.sampled_rank == y.sampled_rank == 1 and list(x.top_token_ids) == list(y.top_token_ids)
        assert abs(x.sampled_logprob - y.sampled_logprob) < 1e-4
