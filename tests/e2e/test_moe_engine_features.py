"""Mixture-of-experts models keep the engine's other features, through the real scheduler and executor processes,
on the tiny random Qwen3-MoE (a dense layer mixed in) and Mixtral checkpoints of test_moe_equivalence.py (whose
routers spread the tokens over every expert):

- async scheduling on and off: greedy tokens equal HF transformers (fp32, same weights; the near-tie rule);
- forks: n = 3 greedy samples each equal HF's greedy tokens; n = 3 seeded samples each equal the single request
  with that sample's seed (seed + i);
- beam search: the hypotheses equal HF transformers' beam search, as for the dense models
  (test_beam_search_equivalence.py);
- fp8 and int8 KV pools: preemption, chunked prefill and forks give the tokens of the same quantized engine run
  unpressured, the rule test_fp8_kv_engine.py holds the dense models to;
- structured output: JSON-schema constrained requests (greedy, seeded, n = 2) parse and validate.

Each engine serves its whole batch at once: forks, seeded samples, beams and plain greedy requests share one.
"""
from __future__ import annotations

import json
import random
import shutil

import jsonschema
import pytest

from scheduler_svc.entrypoints.llm import LLM
from scheduler_svc.frontend.sampling_params import SamplingParams
from support.hf_reference import assert_greedy_matches, hf_beam_search
from support.tiny_checkpoints import make_tiny_qwen3_moe, tiny_checkpoint
from test_engine_equivalence import GREEDY, NEW_TOKENS
from test_moe_equivalence import moe_case  # noqa: F401 (a fixture: the checkpoint, prompts and HF's greedy tokens)

BEAM_TOKENS = 10
BEAMS = [(0, 4, 4), (1, 3, 2), (2, 2, 1)]  # (prompt index, width, hypotheses returned)
FORKED = [3, 4, 5]  # prompts sampled n = 3 times, greedy and seeded
SEED = 77


def config_eos(model_dir: str) -> int:
    with open(f"{model_dir}/config.json") as f:
        return json.load(f)["eos_token_id"]


def seeded(seed: int, n: int = 1) -> SamplingParams:
    return SamplingParams(temperature=1.0, top_p=0.95, seed=seed, n=n, max_tokens=NEW_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def mixed_batch(moe_case):  # noqa: F811
    """One engine with async scheduling on: every prompt greedy, some forked three times greedy and seeded, beside
    the single seeded requests those forks must equal, and beam searches."""
    path, prompts, _ = moe_case
    requests = [(p, GREEDY) for p in prompts]
    requests += [(prompts[i], SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, n=3,
                                             logprobs=5)) for i in FORKED]
    requests += [(prompts[i], seeded(SEED + 10 * i, n=3)) for i in FORKED]
    requests += [(prompts[i], seeded(SEED + 10 * i + j)) for i in FORKED for j in range(3)]
    requests += [(prompts[i], SamplingParams(beam_width=w, n=n, max_tokens=BEAM_TOKENS)) for i, w, n in BEAMS]
    with LLM(path, async_scheduling=True) as llm:
        results = llm.generate([p for p, _ in requests], [s for _, s in requests], use_tqdm=False)
        stats = llm.stats()
    outputs = [r.outputs for r in results]
    n, f = len(prompts), len(FORKED)
    return {"greedy": [o[0] for o in outputs[:n]], "forked_greedy": outputs[n: n + f],
            "forked_seeded": outputs[n + f: n + 2 * f], "single_seeded": [o[0] for o in outputs[n + 2 * f: n + 5 * f]],
            "beams": [[list(h.token_ids) for h in o] for o in outputs[n + 5 * f:]], "stats": stats}


def test_moe_greedy_equals_transformers_with_async_scheduling_on_and_off(moe_case, mixed_batch):  # noqa: F811
    path, prompts, ref = moe_case
    assert_greedy_matches(mixed_batch["greedy"], ref)
    with LLM(path, async_scheduling=False) as llm:
        outs = [r.outputs[0] for r in llm.generate(prompts, GREEDY, use_tqdm=False)]
        stats = llm.stats()
    assert_greedy_matches(outs, ref)
    assert stats.free_kv_blocks == stats.total_kv_blocks


def test_moe_forked_greedy_samples_each_equal_transformers(moe_case, mixed_batch):  # noqa: F811
    _, _, ref = moe_case
    for i, samples in zip(FORKED, mixed_batch["forked_greedy"]):
        assert len(samples) == 3
        assert_greedy_matches(samples, [ref[i]] * 3)
        assert samples[0].token_ids == samples[1].token_ids == samples[2].token_ids


def test_moe_forked_seeded_samples_each_equal_the_single_request_with_their_seed(mixed_batch):
    singles = iter(mixed_batch["single_seeded"])
    for samples in mixed_batch["forked_seeded"]:
        got = [s.token_ids for s in samples]
        assert got == [next(singles).token_ids for _ in range(3)]
        assert len({tuple(t) for t in got}) == 3, "three seeds should sample three different continuations"
    stats = mixed_batch["stats"]
    assert stats.free_kv_blocks == stats.total_kv_blocks and stats.num_running == 0


def test_moe_beam_search_equals_transformers(moe_case, mixed_batch):  # noqa: F811
    path, prompts, _ = moe_case
    eos = config_eos(path)
    refs = [hf_beam_search(path, prompts[i], w, n, BEAM_TOKENS, eos) for i, w, n in BEAMS]
    assert any(len({tuple(h) for h in ref}) > 1 for ref in refs)
    assert mixed_batch["beams"] == refs


# ---------------------------------------------------------------------------------------------
# fp8 and int8 KV pools (Qwen3-MoE)
# ---------------------------------------------------------------------------------------------


def kv_prompts() -> list[list[int]]:
    rng = random.Random(13)
    return [[rng.randrange(256) for _ in range(rng.randint(1, 60))] for _ in range(8)]


@pytest.mark.parametrize("kv_cache_dtype", ["fp8", "int8"])
def test_moe_quantized_kv_under_preemption_chunked_prefill_and_forks_gives_the_unpressured_tokens(
        tmp_path_factory, kv_cache_dtype):
    path = tiny_checkpoint("qwen3_moe", tmp_path_factory)
    prompts = kv_prompts()
    greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    forked = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, n=3)
    with LLM(path, kv_cache_dtype=kv_cache_dtype, block_size=4, num_gpu_blocks=4096,
             enable_prefix_caching=False) as llm:
        unpressured = [r.outputs[0].token_ids for r in llm.generate(prompts, greedy, use_tqdm=False)]
        stats = llm.stats()
    assert stats.num_preemptions == 0
    # a pool of 24 blocks of 4 for 8 sequences of up to 76 tokens, a budget of 16 tokens a step, and each of the first
    # three prompts sampled three times (the later samples fork the first's quantized blocks and copy the last one)
    with LLM(path, kv_cache_dtype=kv_cache_dtype, block_size=4, num_gpu_blocks=24, max_num_batched_tokens=16,
             preemption_mode="recompute", enable_prefix_caching=False) as llm:
        results = llm.generate(prompts + prompts[:3], [greedy] * len(prompts) + [forked] * 3, use_tqdm=False)
        stats = llm.stats()
    assert stats.num_preemptions > 0 and stats.num_partial_prefill_chunks > 0 and stats.num_mixed_steps > 0
    assert [r.outputs[0].token_ids for r in results[:len(prompts)]] == unpressured
    assert [[s.token_ids for s in r.outputs] for r in results[len(prompts):]] == [[t] * 3 for t in unpressured[:3]]
    assert stats.free_kv_blocks == stats.total_kv_blocks


# ---------------------------------------------------------------------------------------------
# structured output (Qwen3-MoE with SmolLM2's tokenizer)
# ---------------------------------------------------------------------------------------------

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age", "size", "tags"], "properties": {
    "name": {"type": "string", "maxLength": 8}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "size": {"enum": ["S", "M", "L"]}, "done": {"type": "boolean"},
    "tags": {"type": "array", "maxItems": 2, "items": {"enum": ["new", "old"]}}}}


@pytest.fixture(scope="module")
def moe_with_tokenizer(tmp_path_factory, embedded_model) -> str:
    """The tiny Qwen3-MoE at SmolLM2's vocabulary, with its tokenizer (structured output compiles grammars over it)."""
    path = str(tmp_path_factory.mktemp("qwen3_moe_tokenizer"))
    make_tiny_qwen3_moe(path, vocab_size=49152, eos_token_id=2)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(f"{embedded_model}/{name}", path)
    return path


def test_moe_json_schema_constrained_outputs_validate(moe_with_tokenizer):
    rng = random.Random(3)
    prompts = [[rng.randrange(49152) for _ in range(rng.randint(4, 40))] for _ in range(4)]
    params = [SamplingParams(temperature=0.0, max_tokens=96, json_schema=SCHEMA),
              SamplingParams(temperature=1.0, seed=5, max_tokens=96, json_schema=SCHEMA),
              SamplingParams(temperature=1.0, seed=6, n=2, max_tokens=96, json_schema=SCHEMA),
              SamplingParams(temperature=0.0, max_tokens=16)]  # a free request in the same batch
    with LLM(moe_with_tokenizer) as llm:
        results = llm.generate(prompts, params, use_tqdm=False)
        stats = llm.stats()
    constrained = [out for r in results[:3] for out in r.outputs]
    assert len(constrained) == 4
    for out in constrained:
        assert out.finish_reason == "stop", f"{out.finish_reason} after {out.text!r}"
        jsonschema.validate(json.loads(out.text), SCHEMA)
    assert len(results[3].outputs[0].token_ids) == 16
    assert stats.num_constrained_requests == len(constrained) and stats.num_grammar_compile_errors == 0
    assert stats.num_token_masks > 0 and stats.num_late_token_masks > 0  # async scheduling: masks after their plan
    assert stats.free_kv_blocks == stats.total_kv_blocks
