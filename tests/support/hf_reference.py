"""Reference outputs from HF transformers in fp32, and the comparison rule for greedy equality."""
from __future__ import annotations

import functools
import inspect

import torch


@functools.lru_cache(maxsize=4)
def _load(model_dir: str, device: str = "cpu"):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return model.to(device).eval()


def _cache_keyword(model) -> str:
    """transformers renamed past_key_values to cache (5.2x); accept both."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


@torch.inference_mode()
def hf_greedy(model_dir: str, prompts: list[list[int]], max_new_tokens: int, device: str = "cpu") -> list[list[int]]:
    """Greedy continuation of each prompt, one at a time (no padding), EOS ignored. `device` "cuda" runs the fp32
    reference on the GPU (TF32 off, torch's default for matmuls): the GPU tests' MoE references, whose experts
    transformers loops over, took minutes on a CPU shared with other test files."""
    assert not torch.backends.cuda.matmul.allow_tf32, "an fp32 reference must not multiply in TF32"
    model = _load(model_dir, device)
    cache_kw = _cache_keyword(model)
    outputs = []
    for ids in prompts:
        past, cur, out = None, torch.tensor([ids], device=device), []
        for _ in range(max_new_tokens):
            res = model(input_ids=cur, use_cache=True, **{cache_kw: past})
            past = getattr(res, cache_kw, None)
            if past is None:
                past = res.past_key_values
            token = int(res.logits[0, -1].argmax())
            out.append(token)
            cur = torch.tensor([[token]], device=device)
        outputs.append(out)
    return outputs


def assert_greedy_matches(ours, ref: list[list[int]], max_flip_fraction: float = 0.25) -> int:
    """Our greedy tokens equal the reference; where a near-tie flips a token, the reference token
    must be among our top-5 logprobs at that step (the sequences then diverge, so comparison stops).
    `ours` holds CompletionOutputs with logprobs requested. Returns the number of flipped sequences."""
    flips = 0
    for i, (out, expected) in enumerate(zip(ours, ref)):
        got = out.token_ids
        assert len(got) == len(expected), f"seq {i}: {len(got)} tokens, reference has {len(expected)}"
        for pos, (a, b) in enumerate(zip(got, expected)):
            if a != b:
                top5 = list(out.logprobs[pos].top_token_ids[:5])
                assert b in top5, f"seq {i} pos {pos}: got {a}, reference {b} not in our top-5 {top5}"
                flips += 1
                break
    assert flips <= max(1, int(max_flip_fraction * len(ref))), f"{flips} of {len(ref)} sequences flipped"
    return flips


@torch.inference_mode()
def hf_beam_search(model_dir: str, prompt: list[int], width: int, num_returned: int, max_new_tokens: int,
                   eos_token_id: int | list[int], length_penalty: float = 1.0) -> list[list[int]]:
    """transformers' beam search (early_stopping=False): the best hypotheses' generated tokens, best first,
    each cut after its first EOS (the rest is padding)."""
    from transformers import GenerationConfig

    model = _load(model_dir)
    eos_ids = [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id)
    config = GenerationConfig(num_beams=width, num_return_sequences=num_returned, max_new_tokens=max_new_tokens,
                              do_sample=False, early_stopping=False, length_penalty=length_penalty,
                              eos_token_id=eos_token_id, pad_token_id=eos_ids[0])
    out = model.generate(torch.tensor([prompt]), generation_config=config, attention_mask=torch.ones(1, len(prompt),
                                                                                                  dtype=torch.long))
    hypotheses = []
    for row in out[:, len(prompt):].tolist():
        ends = [i for i, t in enumerate(row) if t in eos_ids]
        hypotheses.append(row[: ends[0] + 1] if ends else row)
    return hypotheses
