"""A draft model under tensor parallelism on the CPU (gloo, two executor processes): each rank runs its shard of
the draft, rank 0 draws the proposals and every rank gets them; greedy tokens equal one rank's without
speculation. The random draft is rejected almost always, so sequences back off to plain decodes planned ahead of
their samples, and rank 1 may see a drafting plan before it appended the step before (it appends first)."""
from __future__ import annotations

import pytest

from scheduler_svc.entrypoints.llm import LLM
from scheduler_svc.frontend.sampling_params import SamplingParams
from support.tiny_checkpoints import tiny_checkpoint

# 4 q heads, 2 KV heads, intermediate 128 and a vocabulary of 256 in both: every shard divides by 2
ENGINE = dict(device="cpu", num_gpu_blocks=64, block_size=16, max_model_len=256)
PROMPTS = [[7 + 11 * i + j for j in range(8)] for i in range(4)]
GREEDY = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)


def greedy(model: str, **engine) -> tuple[list[list[int]], object]:
    with LLM(model, **ENGINE, **engine) as llm:
        tokens = [r.outputs[0].token_ids for r in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
        return tokens, llm.stats()


@pytest.mark.parametrize("draft", ["itself", "a random llama"])
def test_a_draft_at_two_tensor_parallel_ranks_gives_the_greedy_tokens_of_one_rank(tmp_path_factory, draft):
    target = tiny_checkpoint("qwen3", tmp_path_factory)
    reference, _ = greedy(target)
    proposer = target if draft == "itself" else tiny_checkpoint("llama", tmp_path_factory)
    tokens, stats = greedy(target, tensor_parallel_size=2, speculative_method="draft", draft_model=proposer,
                           num_speculative_tokens=3)
    assert tokens == reference
    assert stats.num_speculative_steps > 0
    if draft == "itself":
        assert stats.num_accepted_tokens == stats.num_proposed_tokens > 0
    else:
        assert stats.num_accepted_tokens <= 0.2 * stats.num_proposed_tokens
