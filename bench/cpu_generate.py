"""CPU throughput of offline generation on the embedded SmolLM2, next to HF transformers' generate,
measured in the same run: batch 16, 128 new tokens (EOS ignored), fp32 and bf16.

    python bench/cpu_generate.py [--batch 16] [--new-tokens 128] [--dtypes float32 bfloat16]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from scheduler_svc.entrypoints.llm import LLM  # noqa: E402
from scheduler_svc.common.model_paths import default_model_dir  # noqa: E402
from scheduler_svc.frontend.sampling_params import SamplingParams  # noqa: E402
from scheduler_svc.text.tokenizer import Tokenizer  # noqa: E402

QUESTIONS = ["What is the capital of France?", "Explain gravity to a child.", "Write a short poem about rain.",
             "List five fruits.", "How does a bicycle work?", "What is a prime number?",
             "Describe the water cycle.", "Who was Ada Lovelace?"]


def prompts(tokenizer: Tokenizer, n: int) -> list[list[int]]:
    return [tokenizer.encode_chat([{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)] + " " * (i // 8)}])
            for i in range(n)]


def run_nanoserve(model: str, batch: list[list[int]], new_tokens: int, dtype: str, cpu_threads: int) -> float:
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    with LLM(model, dtype=dtype, cpu_threads=cpu_threads) as llm:
        llm.generate(batch[:2], SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up
        t0 = time.perf_counter()
        results = llm.generate(batch, params, use_tqdm=False)
        elapsed = time.perf_counter() - t0
    return sum(len(r.outputs[0].token_ids) for r in results) / elapsed


def run_transformers(model: str, batch: list[list[int]], new_tokens: int, dtype: str) -> float:
    import torch
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model, dtype=getattr(torch, dtype)).eval()
    width = max(map(len, batch))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in batch])  # left padding
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
    kwargs = dict(attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                  pad_token_id=0)
    with torch.inference_mode():
        hf.generate(ids[:2], attention_mask=mask[:2], max_new_tokens=4, do_sample=False, pad_token_id=0)
        t0 = time.perf_counter()
        out = hf.generate(ids, **kwargs)
        elapsed = time.perf_counter() - t0
    return (out.shape[1] - width) * len(batch) / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=default_model_dir())
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--cpu-threads", type=int, default=0, help="executor torch threads (0: cores - 1)")
    parser.add_argument("--out", default="bench/results/cpu_generate.json")
    args = parser.parse_args()
    batch = prompts(Tokenizer(args.model), args.batch)
    rows = []
    for dtype in args.dtypes:
        ours = run_nanoserve(args.model, batch, args.new_tokens, dtype, args.cpu_threads)
        theirs = run_transformers(args.model, batch, args.new_tokens, dtype)
        rows.append({"dtype": dtype, "nanoserve_tok_s": ours, "transformers_tok_s": theirs, "ratio": ours / theirs})
    print(f"\nCPU generate, batch {args.batch}, {args.new_tokens} new tokens, {os.cpu_count()} cores, "
          f"executor threads {args.cpu_threads or 'auto'}")
    print(f"{'dtype':>9} {'nanoserve':>10} {'hf':>8} {'ratio':>6}")
    for r in rows:
        print(f"{r['dtype']:>9} {r['nanoserve_tok_s']:>10.1f} {r['transformers_tok_s']:>8.1f} {r['ratio']:>6.2f}")
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
