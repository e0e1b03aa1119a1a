"""On CUDA, speculative decoding with a draft model: the draft's one-token forwards replay its decode CUDA graphs,
and greedy output equals the same engine with --enforce-eager and the engine without speculation, token for
token in fp32, with the embedded SmolLM2 as target (NANOSERVE_MODEL_DIR may point at a copy) and as its own draft
(every proposal accepted) or with a tiny random draft of its vocabulary (almost none accepted)."""
from __future__ import annotations

import pytest
import torch

from scheduler_svc.frontend.sampling_params import SamplingParams
from scheduler_svc.text.tokenizer import Tokenizer
from support.gpu_engine import generate

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

GREEDY = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
ASKS = ["Repeat this text exactly: The committee met on Tuesday to review the budget and the library's plans.",
        "What is the capital of France?", "Write a short poem about the sea.", "Explain what a CPU does.",
        "Continue this code:\ndef add(a, b):\n    return a + b\n\ndef sub(a, b):\n", "How do airplanes fly?"]
ENGINE = dict(dtype="float32", max_num_seqs=16)


@pytest.fixture(scope="module")
def chat_prompts(embedded_model) -> list[list[int]]:
    tokenizer = Tokenizer(embedded_model)
    return [tokenizer.encode_chat([{"role": "user", "content": ask}]) for ask in ASKS]


def tokens(outputs) -> list[list[int]]:
    return [o.token_ids for o in outputs]


def test_a_draft_under_cuda_graphs_gives_the_eager_and_the_plain_greedy_tokens(embedded_model, chat_prompts):
    plain, _ = generate(embedded_model, chat_prompts, GREEDY, **ENGINE)
    graphs, stats = generate(embedded_model, chat_prompts, GREEDY, speculative_method="draft",
                             draft_model=embedded_model, num_speculative_tokens=4, **ENGINE)
    eager, _ = generate(embedded_model, chat_prompts, GREEDY, speculative_method="draft", draft_model=embedded_model,
                        num_speculative_tokens=4, enforce_eager=True, **ENGINE)
    assert tokens(graphs) == tokens(plain) == tokens(eager)
    assert stats.num_accepted_tokens >= 0.95 * stats.num_proposed_tokens > 0


def test_a_random_draft_under_cuda_graphs_is_almost_never_accepted_and_exact(embedded_model, chat_prompts, tmp_path):
    from support.tiny_checkpoints import make_tiny_draft

    plain, _ = generate(embedded_model, chat_prompts, GREEDY, **ENGINE)
    # head_dim 64, as the kernels' production tiles expect
    random_draft = make_tiny_draft(str(tmp_path / "draft"), embedded_model, hidden_size=256, intermediate_size=512,
                                   num_attention_heads=4, num_key_value_heads=2)
    graphs, stats = generate(embedded_model, chat_prompts, GREEDY, speculative_method="draft",
                             draft_model=random_draft, num_speculative_tokens=3, **ENGINE)
    assert tokens(graphs) == tokens(plain)
    assert stats.num_speculative_steps > 0 and stats.num_accepted_tokens <= 0.1 * stats.num_proposed_tokens


def test_a_self_draft_in_bfloat16_accepts_nearly_every_proposal(embedded_model, chat_prompts):
    """bf16 results depend on the batch shape, so a self-draft's proposals are rejected only at near-ties."""
    _, stats = generate(embedded_model, chat_prompts, GREEDY, speculative_method="draft", draft_model=embedded_model,
                        num_speculative_tokens=4, dtype="bfloat16", max_num_seqs=16)
    assert stats.num_accepted_tokens >= 0.9 * stats.num_proposed_tokens > 0
