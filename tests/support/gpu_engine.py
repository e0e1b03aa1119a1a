"""A small Qwen3 engine on CUDA for the GPU tests of tests/e2e (test_gpu_engine*.py): a random checkpoint with
production head shapes, prompts, and generate() through the offline LLM."""
from __future__ import annotations

import random

from scheduler_svc.frontend.sampling_params import SamplingParams
from support.tiny_checkpoints import make_tiny_qwen3

NEW_TOKENS = 32
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=5)


def make_gpu_qwen3(path: str) -> str:
    # realistic head_dim 128 and GQA 2:1 so the kernels run their production tile shapes
    return make_tiny_qwen3(path, hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=128,
                           vocab_size=1024, max_position_embeddings=2048)


def gpu_prompts() -> list[list[int]]:
    rng = random.Random(11)
    return [[rng.randrange(1024) for _ in range(rng.randint(1, 300))] for _ in range(24)]


def generate(model: str, prompts, params: SamplingParams = GREEDY, all_outputs: bool = False, **engine_args):
    """First completion per prompt (or, with all_outputs, every completion) and the stats."""
    from scheduler_svc.entrypoints.llm import LLM

    engine_args.setdefault("num_gpu_blocks", 4096)  # skip sizing the pool to the whole GPU
    with LLM(model, device="cuda", **engine_args) as llm:
        results = llm.generate(prompts, params, use_tqdm=False)
        stats = llm.stats()
    if all_outputs:
        return [r.outputs for r in results], stats
    return [r.outputs[0] for r in results], stats
