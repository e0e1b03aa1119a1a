"""Offline throughput on nano-vLLM's bench workload, through the real scheduler and executor processes.

Workload: Qwen3-0.6B architecture with random bf16 weights made in-process (no download), 256
sequences, input lengths U[100, 1024] of random token ids, output lengths U[100, 1024], seed 0,
temperature 0.6, ignore_eos, after a warm-up on the same draws from the next seed with outputs cut short
(warm_up_workload).

    python bench/throughput.py [--num-seqs 256] [--model DIR] [--peer transformers] [engine flags]
    python bench/throughput.py --kv-cache-dtype fp8      # the fp8 KV cache (issue 13: >= 35,000 tok/s on the H200)
    python bench/throughput.py --model-shape qwen3-8b --quantization fp8         # FP8 weights, a scale per row
    python bench/throughput.py --model-shape qwen3-8b --fp8-checkpoint block     # FP8 weights in 128 x 128 blocks
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.nanovllm_workload import ENGINE_DEFAULTS, MODEL_SHAPES, dummy_model_dir, workload  # noqa: E402
from scheduler_svc.common.config import add_engine_args, engine_config_from_args  # noqa: E402
from scheduler_svc.entrypoints.llm import LLM  # noqa: E402
from scheduler_svc.frontend.sampling_params import SamplingParams  # noqa: E402


def run_nanoserve(args, prompts, max_tokens) -> dict:
    config = engine_config_from_args(args)
    engine_args = {k: v for k, v in vars(config).items() if k != "model"}
    with LLM(config.model, **engine_args) as llm:
        warm_prompts, warm_tokens = warm_up_workload(args)
        llm.generate(warm_prompts, [SamplingParams(ignore_eos=True, max_tokens=m) for m in warm_tokens],
                     use_tqdm=False)
        before = llm.stats()
        params = [SamplingParams(temperature=args.temperature, ignore_eos=True, max_tokens=m) for m in max_tokens]
        t0 = time.perf_counter()
        results = llm.generate(prompts, params, use_tqdm=not args.no_progress)
        elapsed = time.perf_counter() - t0
        after = llm.stats()
    out_tokens = sum(len(r.outputs[0].token_ids) for r in results)
    assert out_tokens == sum(max_tokens), f"generated {out_tokens} tokens, expected {sum(max_tokens)}"
    return {**offline_figures(out_tokens, elapsed, before, after), "kv_cache_dtype": config.kv_cache_dtype,
            "kv_cache_scales": config.kv_scales_method()}


WARM_UP_OUTPUT = 32  # decode steps of the warm-up workload


def warm_up_workload(args) -> tuple[list[list[int]], list[int]]:
    """Run before the timed run: the same draws from another seed (no prompt shares a cached prefix with the timed
    ones), each output cut at WARM_UP_OUTPUT tokens. Its steps mix prefill chunks with decode rows as the timed run's
    first steps do, so the Triton kernels whose configuration depends on a step's token counts compile there. A
    warm-up of one short request and one full prefill chunk had left some of that in the first timed run on a fresh
    machine: its prefill measured 0.57 s slower than the next run's (bench/RESULTS.md, 2026-12-05)."""
    prompts, max_tokens = workload(args.num_seqs, args.max_input_len, args.max_output_len, args.workload_seed + 1)
    return prompts, [min(m, WARM_UP_OUTPUT) for m in max_tokens]


def offline_figures(out_tokens: int, elapsed: float, before, after) -> dict:
    """One offline run's row, from the scheduler's counters before and after it."""
    delta = lambda name: getattr(after, name) - getattr(before, name)  # noqa: E731
    return {
        "engine": "nanoserve", "output_tokens": out_tokens, "seconds": elapsed,
        "output_tok_per_s": out_tokens / elapsed, "steps": delta("num_steps"),
        "prefill_seconds": delta("prefill_step_seconds"), "decode_seconds": delta("decode_step_seconds"),
        "executor_busy_seconds": delta("executor_busy_seconds"),
        "executor_idle_seconds": delta("executor_idle_seconds"), "preemptions": delta("num_preemptions"),
        "swap_outs": delta("num_swap_outs"), "kv_blocks": after.total_kv_blocks,
        "step_ms": 1000 * elapsed / max(1, delta("num_steps")),  # wall per step: a decoding request's TPOT
    }


def run_transformers_peer(model_dir: str, prompts, max_tokens, temperature: float) -> dict:
    """transformers' own continuous batching on the same workload, in this process."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.generation import GenerationConfig

    config = AutoConfig.from_pretrained(model_dir)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
    gen = GenerationConfig(max_new_tokens=max(max_tokens), do_sample=True, temperature=temperature,
                           eos_token_id=-1, pad_token_id=0)
    model.generate_batch(inputs=[list(range(1, 12))], generation_config=gen, progress_bar=False)  # warm-up
    t0 = time.perf_counter()
    out_tokens = 0
    # the manager API takes a max_new_tokens per request, as the workload needs
    manager = model.init_continuous_batching(generation_config=gen)
    manager.start()
    for i, (p, m) in enumerate(zip(prompts, max_tokens)):
        manager.add_request(input_ids=p, request_id=str(i), max_new_tokens=m)
    for _ in prompts:
        result = manager.get_result(timeout=600)
        out_tokens += len(result.generated_tokens)
    manager.stop(block=True)
    elapsed = time.perf_counter() - t0
    return {"engine": "transformers", "output_tokens": out_tokens, "seconds": elapsed,
            "output_tok_per_s": out_tokens / elapsed}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-seqs", type=int, default=256)
    parser.add_argument("--max-input-len", type=int, default=1024)
    parser.add_argument("--max-output-len", type=int, default=1024)
    parser.add_argument("--workload-seed", type=int, default=0)
    parser.add_argument("--temperature", type=float, default=0.6)
    parser.add_argument("--peer", choices=["none", "transformers"], default="none")
    parser.add_argument("--model-shape", choices=sorted(MODEL_SHAPES), default="qwen3-0.6b",
                        help="the random-weight model when --model is not given")
    parser.add_argument("--fp8-checkpoint", choices=["block"], default=None,
                        help="with --model-shape: random weights in an FP8 checkpoint's format (block: the fine-grained "
                             "128 x 128 blocks of Qwen3-*-FP8 and DeepSeek), quantized at load, to time its kernels")
    parser.add_argument("--no-progress", action="store_true")
    parser.add_argument("--out", default="bench/results/throughput.json")
    add_engine_args(parser)
    parser.set_defaults(**ENGINE_DEFAULTS)
    args = parser.parse_args()
    tmp = None
    if not args.model:  # the Qwen3-0.6B architecture with random weights, made in-process
        shape = MODEL_SHAPES[args.model_shape]
        if args.fp8_checkpoint == "block":
            shape = {**shape, "quantization_config": {"quant_method": "fp8", "activation_scheme": "dynamic",
                                                      "weight_block_size": [128, 128]}}
        tmp = dummy_model_dir(shape)
        args.model = tmp.name
        args.load_format = "dummy"
    prompts, max_tokens = workload(args.num_seqs, args.max_input_len, args.max_output_len, args.workload_seed)
    rows = [run_nanoserve(args, prompts, max_tokens)]
    if args.peer == "transformers":
        rows.append(run_transformers_peer(args.model, prompts, max_tokens, args.temperature))
    print(f"\nthroughput: {args.num_seqs} seqs, input U[100,{args.max_input_len}], output U[100,{args.max_output_len}], "
          f"KV cache {args.kv_cache_dtype} ({rows[0]['kv_blocks']} blocks)")
    print(f"{'engine':>13} {'out tokens':>10} {'seconds':>8} {'tok/s':>9} {'steps':>6} {'prefill s':>9} "
          f"{'decode s':>9} {'exec busy':>9} {'exec idle':>9} {'preempt':>7} {'swapped':>7}")
    for r in rows:
        print(f"{r['engine']:>13} {r['output_tokens']:>10} {r['seconds']:>8.2f} {r['output_tok_per_s']:>9.0f} "
              f"{r.get('steps', 0):>6} {r.get('prefill_seconds', 0):>9.2f} {r.get('decode_seconds', 0):>9.2f} "
              f"{r.get('executor_busy_seconds', 0):>9.2f} {r.get('executor_idle_seconds', 0):>9.2f} "
              f"{r.get('preemptions', 0):>7} {r.get('swap_outs', 0):>7}")
    if len(rows) == 2:
        print(f"ratio nanoserve / transformers: {rows[0]['output_tok_per_s'] / rows[1]['output_tok_per_s']:.1f}x")
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"num_seqs": args.num_seqs, "rows": rows}, f, indent=2)
    if tmp:
        tmp.cleanup()


if __name__ == "__main__":
    main()
