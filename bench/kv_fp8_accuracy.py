"""Accuracy of the quantized KV caches (fp8, int8) on real weights (the embedded SmolLM2 by default), per
scale method.

The reference is the engine with a KV cache of the model's dtype (bf16 on the GPU, fp32 on the CPU):
its greedy trajectory of N chat prompts x T tokens is teacher-forced through an engine with
--kv-cache-dtype fp8 or int8 and each --kv-cache-scales. One prefill over prompt + trajectory gives the
next-token distribution at every generated position; its K/V are read back from the pool, so fp8
reads are what it sees, as in decode. Reported per --kv-cache-rotation and method:

- top-1: how often fp8's argmax is the reference's (teacher-forced, same positions); "ties ok" also
  counts a flip at a true near-tie (each token in the other's top 5 and within 0.02 nats, under both
  distributions: the project's rule for greedy output), and "miss gap" is the reference's median
  top-2 gap at the misses;
- KL(ref || fp8) per token, mean and p99, in nats;
- greedy exact-match length: fp8 decoding on its own, the tokens before it first leaves the
  reference trajectory (mean over prompts; "full" is the share that never does).

Targets (issue 13): top-1 >= 98%, mean KL <= 0.01.

    python bench/kv_fp8_accuracy.py                                   # GPU: 64 prompts x 128 tokens
    python bench/kv_fp8_accuracy.py --device cpu --num-prompts 8 --new-tokens 32
    python bench/kv_fp8_accuracy.py --device cpu --methods calibrated-per-head --rotations none hadamard
    python bench/kv_fp8_accuracy.py --device cpu --kv-cache-dtypes int8 --methods auto
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from executor_svc.model_runner import ModelRunner  # noqa: E402
from executor_svc.sampling_row import GREEDY_ROW  # noqa: E402
from executor_svc.seq_mirror import MirroredSeq, ScheduledChunk  # noqa: E402
from scheduler_svc.common.config import KV_CACHE_ROTATIONS, KV_CACHE_SCALES, EngineConfig  # noqa: E402
from scheduler_svc.common.model_paths import default_model_dir  # noqa: E402
from scheduler_svc.text.tokenizer import Tokenizer  # noqa: E402

TOP1_TARGET, MEAN_KL_TARGET = 0.98, 0.01
DEFAULT_ROTATION = EngineConfig.__dataclass_fields__["kv_cache_rotation"].default
SUBJECTS = ["the moon", "volcanoes", "honey bees", "the printing press", "black holes", "the Roman army",
            "coffee", "earthquakes", "the human heart", "rainbows", "glaciers", "the internet", "chess",
            "tides", "penguins", "electric cars"]
QUESTIONS = ["Tell me three facts about {}.", "Explain {} to a ten-year-old.", "Write a short poem about {}.",
             "What would happen if {} disappeared?"]


def chat_prompts(model_dir: str, n: int) -> list[list[int]]:
    """n chat-formatted questions (subjects x question kinds), none of them calibration text."""
    tokenizer = Tokenizer(model_dir)
    pairs = [(q, s) for q in QUESTIONS for s in SUBJECTS][:n]
    return [tokenizer.encode_chat([{"role": "user", "content": q.format(s)}]) for q, s in pairs]


def make_runner(model_dir: str, device: str, kv_cache_dtype: str, kv_cache_scales: str, num_blocks: int,
                block_size: int = 16, kv_cache_rotation: str = DEFAULT_ROTATION) -> ModelRunner:
    config = EngineConfig(model=model_dir, device=device, kv_cache_dtype=kv_cache_dtype,
                          kv_cache_scales=kv_cache_scales, kv_cache_rotation=kv_cache_rotation,
                          num_gpu_blocks=num_blocks, block_size=block_size,
                          enforce_eager=True, max_num_seqs=256)
    return ModelRunner(config)


def _sequences(token_lists: list[list[int]], num_prompt: list[int], block_size: int) -> list[MirroredSeq]:
    """Fresh sequences on disjoint runs of blocks 0.. (room for the longest list plus one token)."""
    per_seq = -(-(max(len(t) for t in token_lists) + 1) // block_size)
    return [MirroredSeq(i, list(t), p, list(range(i * per_seq, (i + 1) * per_seq)), 0, GREEDY_ROW)
            for i, (t, p) in enumerate(zip(token_lists, num_prompt))]


@torch.inference_mode()
def greedy(runner: ModelRunner, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """Greedy continuations, decoded step by step as the engine decodes (prefill, then one token a step)."""
    seqs = _sequences([p + [0] * new_tokens for p in prompts], [len(p) for p in prompts], runner.block_size)
    for seq, p in zip(seqs, prompts):
        seq.token_ids = list(p)
    chunks = [ScheduledChunk(s, 0, len(s.token_ids)) for s in seqs]
    for _ in range(new_tokens):
        inputs = runner.launch(chunks)
        for chunk, token in zip(inputs.sampling_chunks, inputs.logits.argmax(-1).tolist()):
            chunk.seq.num_computed_tokens = chunk.end
            chunk.seq.token_ids.append(token)
        chunks = [ScheduledChunk(s, len(s.token_ids) - 1, len(s.token_ids)) for s in seqs]
    return [s.token_ids[len(p):] for s, p in zip(seqs, prompts)]


@torch.inference_mode()
def teacher_forced_logprobs(runner: ModelRunner, prompts: list[list[int]],
                            trajectories: list[list[int]], fp32_logits: bool = False) -> torch.Tensor:
    """log-softmax [N, T, vocab] (float32, CPU) of the next token at each trajectory position, from one
    prefill over prompt + trajectory (its last token excluded). fp32_logits takes the same final hidden
    states through the lm_head in fp32, not the model's dtype: bf16 logits step by 0.125 at magnitude 16-32,
    coarser than the near-tie rule's 0.02 nats."""
    tokens = [p + t[:-1] for p, t in zip(prompts, trajectories)]
    seqs = _sequences(tokens, [len(p) for p in prompts], runner.block_size)
    inputs = runner.prepare_inputs([ScheduledChunk(s, 0, len(s.token_ids)) for s in seqs])
    hidden = runner.model(inputs.input_ids, inputs.positions, inputs.meta)
    starts = inputs.meta.cu_seqlens_q[:-1].long()
    num_new = len(trajectories[0])
    rows = torch.cat([starts[i] + len(p) - 1 + torch.arange(num_new, device=starts.device)
                      for i, p in enumerate(prompts)])
    if fp32_logits:
        logits = hidden[rows].float() @ runner.model.lm_head.weight.float().t()
    else:
        logits = runner.model.compute_logits(hidden[rows]).float()
    return torch.log_softmax(logits, -1).view(len(prompts), num_new, -1).cpu()


NEAR_TIE_NATS = 0.02  # the project's rule for a flipped greedy token: a true near-tie


def near_ties(ref: torch.Tensor, test: torch.Tensor) -> torch.Tensor:
    """Where the argmaxes differ at a true near-tie: each token in the other's top 5, and within
    NEAR_TIE_NATS of it, under both distributions (flattened [N*T] bool)."""
    ref, test = ref.flatten(0, -2), test.flatten(0, -2)
    a, b = ref.argmax(-1, keepdim=True), test.argmax(-1, keepdim=True)
    top5_ref, top5_test = ref.topk(5, -1).indices, test.topk(5, -1).indices
    in_each_other = (top5_ref == b).any(-1) & (top5_test == a).any(-1)
    close = ((ref.gather(-1, a) - ref.gather(-1, b)).squeeze(-1) <= NEAR_TIE_NATS) & \
            ((test.gather(-1, b) - test.gather(-1, a)).squeeze(-1) <= NEAR_TIE_NATS)
    return (a != b).squeeze(-1) & in_each_other & close


def agreement(ref: torch.Tensor, test: torch.Tensor) -> dict:
    """top-1 agreement (also with near-tie flips excused) and per-token KL(ref || test) of two
    [N, T, vocab] log-softmax tensors, and the reference's top-2 gap at the misses."""
    kl = (ref.exp() * (ref - test)).sum(-1).flatten().clamp_min(0.0)
    same = (ref.argmax(-1) == test.argmax(-1)).flatten()
    top2 = ref.flatten(0, -2).topk(2, -1).values
    gaps = (top2[:, 0] - top2[:, 1])[~same]
    excused = same | near_ties(ref, test)
    return {"top1": same.float().mean().item(), "top1_near_ties_excused": excused.float().mean().item(),
            "miss_ref_gap_median": gaps.median().item() if gaps.numel() else 0.0,
            "mean_kl": kl.mean().item(), "p99_kl": torch.quantile(kl.double(), 0.99).item(), "num_tokens": kl.numel()}


def exact_match(reference: list[list[int]], test: list[list[int]]) -> dict:
    lengths = []
    for ref, out in zip(reference, test):
        same = [a == b for a, b in zip(ref, out)] + [False]
        lengths.append(same.index(False))
    return {"mean_match_len": sum(lengths) / len(lengths),
            "full_match": sum(n == len(r) for n, r in zip(lengths, reference)) / len(lengths)}


def greedy_match(runner: ModelRunner, batches: list, trajectories: list, new_tokens: int) -> dict:
    """The runner decoding greedily on its own: how long it stays on the reference trajectories."""
    outs = [o for b in batches for o in greedy(runner, b, new_tokens)]
    return exact_match([t for ts in trajectories for t in ts], outs)


def measure(model_dir: str, device: str, num_prompts: int, new_tokens: int, methods: list[str],
            batch: int, exact_match_len: bool = True, rotations: tuple[str, ...] = (DEFAULT_ROTATION,),
            kv_dtypes: tuple[str, ...] = ("fp8",), noise_floor: bool = False, fp32_logits: bool = False) -> dict:
    """Every (KV dtype, rotation, method) row against the reference engine (int8 skips static scales, which it
    refuses); batches of `batch` prompts at a time. noise_floor adds a first row: the reference engine itself
    over the same trajectories in batches of half the size, whose different GEMM shapes round differently (in
    bf16 on the GPU): how far the reference dtype disagrees with itself."""
    prompts = chat_prompts(model_dir, num_prompts)
    batches = [prompts[i:i + batch] for i in range(0, len(prompts), batch)]
    num_blocks = batch * -(-(max(len(p) for p in prompts) + new_tokens + 1) // 16)
    ref_runner = make_runner(model_dir, device, "auto", "static", num_blocks)
    kv_dtype = str(ref_runner.kv_cache_dtype).removeprefix("torch.")
    trajectories = [greedy(ref_runner, b, new_tokens) for b in batches]
    ref_logprobs = [teacher_forced_logprobs(ref_runner, b, t, fp32_logits) for b, t in zip(batches, trajectories)]
    rows = []
    if noise_floor:
        t0 = time.perf_counter()
        half = max(1, batch // 2)
        rebatched = torch.cat([teacher_forced_logprobs(ref_runner, b[i:i + half], t[i:i + half], fp32_logits)
                               for b, t in zip(batches, trajectories) for i in range(0, len(b), half)])
        rows.append({"kv_cache_dtype": {"bfloat16": "bf16", "float32": "fp32", "float16": "fp16"}.get(kv_dtype, kv_dtype),
                     "rotation": "none", "method": f"rebatched {batch} -> {half}",
                     **agreement(torch.cat(ref_logprobs), rebatched), "seconds": time.perf_counter() - t0})
    del ref_runner
    runs = [(d, r, m) for d in kv_dtypes for r in rotations for m in methods if not (d == "int8" and m == "static")]
    for kv_cache_dtype, rotation, method in runs:
        t0 = time.perf_counter()
        runner = make_runner(model_dir, device, kv_cache_dtype, method, num_blocks, kv_cache_rotation=rotation)
        test = torch.cat([teacher_forced_logprobs(runner, b, t, fp32_logits) for b, t in zip(batches, trajectories)])
        row = {"kv_cache_dtype": kv_cache_dtype, "rotation": rotation, "method": method,
               **agreement(torch.cat(ref_logprobs), test)}
        if exact_match_len:
            row |= greedy_match(runner, batches, trajectories, new_tokens)
        row["seconds"] = time.perf_counter() - t0
        rows.append(row)
        del runner
    return {"model": os.path.basename(model_dir), "device": device, "reference_kv_dtype": kv_dtype,
            "logits": "fp32" if fp32_logits else "model dtype",
            "num_prompts": num_prompts, "new_tokens": new_tokens, "rows": rows}


def print_table(result: dict) -> None:
    print(f"\nquantized KV caches vs {result['reference_kv_dtype']} KV: {result['model']} on {result['device']}, "
          f"{result['num_prompts']} prompts x {result['new_tokens']} tokens, logits in {result['logits']} (targets: top-1 >= "
          f"{TOP1_TARGET:.0%}, mean KL <= {MEAN_KL_TARGET})")
    print(f"{'KV':>5} {'rotation':>9} {'scales':>22} {'top-1':>7} {'ties ok':>7} {'miss gap':>8} {'mean KL':>9} {'p99 KL':>9}"
          f" {'match len':>9} {'full':>5} {'s':>6}")
    for r in result["rows"]:
        print(f"{r.get('kv_cache_dtype', 'fp8'):>5} {r.get('rotation', 'none'):>9} {r['method']:>22} {r['top1']:>7.2%} {r['top1_near_ties_excused']:>7.2%} "
              f"{r['miss_ref_gap_median']:>8.3f} {r['mean_kl']:>9.5f} {r['p99_kl']:>9.5f} "
              f"{r.get('mean_match_len', float('nan')):>9.1f} {r.get('full_match', float('nan')):>5.0%} "
              f"{r['seconds']:>6.1f}")


def add_accuracy_args(p: argparse.ArgumentParser) -> None:
    """The flags every accuracy bench takes: the model, the device, the prompts and tokens, the batch."""
    p.add_argument("--model", default="", help="checkpoint directory (default: the embedded SmolLM2)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cuda", "cpu"])
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--batch", type=int, default=None, help="prompts per forward (default: all on GPU, 4 on CPU)")


def prompts_per_forward(args: argparse.Namespace) -> int:
    """--batch, else all prompts on the GPU and 4 on the CPU (where torch then takes every core but one)."""
    if args.device == "cpu":
        torch.set_num_threads(max(1, (os.cpu_count() or 2) - 1))
    return args.batch or (args.num_prompts if args.device == "cuda" else 4)


def write_result(result: dict, path: str) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(result, f, indent=2)
    print(f"wrote {path}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_accuracy_args(p)
    p.add_argument("--kv-cache-dtypes", nargs="+", choices=["fp8", "int8"], default=["fp8", "int8"])
    p.add_argument("--methods", nargs="+", choices=KV_CACHE_SCALES,
                   default=[m for m in KV_CACHE_SCALES if m != "auto"])
    p.add_argument("--rotations", nargs="+", choices=KV_CACHE_ROTATIONS, default=list(KV_CACHE_ROTATIONS),
                   help="--kv-cache-rotation values to measure, each with every method")
    p.add_argument("--noise-floor", action="store_true",
                   help="first, the reference engine against itself with the prompts batched by half")
    p.add_argument("--fp32-logits", action="store_true",
                   help="score the same final hidden states through the lm_head in fp32 (finer than bf16 logits)")
    p.add_argument("--out", default="bench/results/kv_fp8_accuracy.json")
    args = p.parse_args()
    batch = prompts_per_forward(args)
    result = measure(args.model or default_model_dir(), args.device, args.num_prompts, args.new_tokens,
                     args.methods, batch, rotations=tuple(args.rotations), kv_dtypes=tuple(args.kv_cache_dtypes),
                     noise_floor=args.noise_floor, fp32_logits=args.fp32_logits)
    print_table(result)
    write_result(result, args.out)


if __name__ == "__main__":
    main()
