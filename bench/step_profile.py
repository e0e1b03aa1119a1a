"""Where one decode step's time goes inside the executor (no scheduler, no sockets).

Builds the model runner in-process (Qwen3-0.6B architecture or SmolLM2-135M's, random weights, unless --model),
fakes a batch of decode sequences with the given context, and times the executor's calls with device syncs:
prepare inputs (alone), launch (prepare, forward, logits and, in a decode graph, sampling), sample (the eager
sampler when needed, or the verification, and the host copy) and finalize.

With --verify K it also times, at each batch size, a step where every sequence verifies K proposed tokens
(speculative decoding: B (K + 1) one-token rows, in the decode graphs when they fit), next to the plain decode
step of the same sequences: the ratio is what a verification costs (scheduler_svc/core/speculative/policy.py's
VERIFY_STEP_COST and VERIFY_ROW_COST). --temperature 0 takes the greedy verdict, > 0 rejection sampling.
With --prefill N, a mixed step: the same decodes beside a prompt's N-token chunk (on CUDA in the piecewise
graphs, attention eager; eager with --cuda-graph-max-tokens 0).

    python bench/step_profile.py [--batch 256 | --batch 1,4,16] [--context 600] [--steps 30] [--verify 4] [--prefill 64]
                                 [--shape qwen3-0.6b|smollm2-135m] [engine flags]
"""
from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from bench.nanovllm_workload import QWEN3_0_6B  # noqa: E402
from executor_svc.model_runner import ModelRunner  # noqa: E402
from executor_svc.seq_mirror import MirroredSeq, ScheduledChunk  # noqa: E402
from protos import engine_pb2  # noqa: E402
from scheduler_svc.common.config import add_engine_args, engine_config_from_args  # noqa: E402

# SmolLM2-135M-Instruct's architecture (the embedded model): where a decode step is launch-bound
SMOLLM2_135M = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 576, "intermediate_size": 1536,
    "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64, "vocab_size": 49152,
    "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "rope_theta": 100000.0, "tie_word_embeddings": True,
    "hidden_act": "silu", "torch_dtype": "bfloat16", "bos_token_id": 1, "eos_token_id": 2,
}
SHAPES = {"qwen3-0.6b": QWEN3_0_6B, "smollm2-135m": SMOLLM2_135M}
PHASES = ("prepare", "launch host", "launch", "sample", "finalize", "total")


def time_steps(runner: ModelRunner, seqs: list[MirroredSeq], steps: int, verify: int,
               cprofile: bool = False, prefill: MirroredSeq | None = None) -> dict[str, float]:
    """Median ms of each phase over `steps` steps (after 3 untimed): plain decodes, each appending its token, or
    with verify > 0 verifications of `verify` proposals per sequence at the same positions again and again.
    prefill: a sequence whose whole prompt goes into every step beside them, as a chunk (a mixed step)."""
    sync = torch.cuda.synchronize if runner.device.type == "cuda" else (lambda: None)
    phases: dict[str, list[float]] = {k: [] for k in PHASES}

    def chunks() -> list[ScheduledChunk]:
        extra = [ScheduledChunk(prefill, 0, len(prefill.token_ids))] if prefill is not None else []
        if not verify:
            return [ScheduledChunk(s, len(s.token_ids) - 1, len(s.token_ids)) for s in seqs] + extra
        # proposals after the last token: the next tokens of a repeating pattern (random weights reject most)
        return [ScheduledChunk(s, len(s.token_ids) - 1, len(s.token_ids) + verify,
                               proposal=[(s.seq_id * 7 + len(s.token_ids) + j) % 1000 for j in range(verify)])
                for s in seqs] + extra

    def step(record: bool) -> None:
        """The executor's own calls, each synced: launch = prepare + forward + logits (and, in a single-rank
        decode graph, the sampling), and "launch host" the time until it returns; sample = the eager sampler
        when the graph did not sample, or the verification, and the copy of the ids to the host; finalize = the
        ids into reply messages."""
        step_chunks = chunks()
        sync()
        t0 = time.perf_counter()
        runner.prepare_inputs(step_chunks)  # timed alone; launch repeats it
        sync()
        t1 = time.perf_counter()
        inputs = runner.launch(step_chunks)
        t1h = time.perf_counter()  # the host's share: launch returns before the device finishes
        sync()
        t2 = time.perf_counter()
        pending = runner.sample(inputs)
        sync()
        t3 = time.perf_counter()
        tokens = [t.token_id for t in runner.finalize(pending)]
        t4 = time.perf_counter()
        if not verify:  # the prefill chunk's token (last) is dropped: it runs the same prompt again
            for s, t in zip(seqs, tokens):
                s.token_ids.append(t)
                s.num_computed_tokens += 1
        if record:
            for k, dt in zip(phases, (t1 - t0, t1h - t1, t2 - t1, t3 - t2, t4 - t3, t4 - t1)):
                phases[k].append(dt * 1e3)

    for _ in range(3):
        step(False)
    for _ in range(steps):
        step(True)
    if cprofile:
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(5):
            step(False)
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(15)
    return {k: statistics.median(v) for k, v in phases.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", default="256", help="batch size, or a comma-separated list of them")
    parser.add_argument("--context", type=int, default=600)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--temperature", type=float, default=0.6)
    parser.add_argument("--verify", type=int, default=0, help="also time steps verifying this many proposals each")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-0.6b", help="without --model: random "
                        "weights of this architecture")
    parser.add_argument("--prefill", type=int, default=0, help="also time mixed steps: the decodes beside a prefill "
                        "chunk of this many tokens")
    parser.add_argument("--out", default=None, help="write the medians as JSON here")
    parser.add_argument("--cprofile", action="store_true", help="also print the top python functions")
    add_engine_args(parser)
    args = parser.parse_args()
    batches = [int(b) for b in args.batch.split(",")]
    tmp = None
    if not args.model:
        tmp = tempfile.TemporaryDirectory()
        with open(os.path.join(tmp.name, "config.json"), "w") as f:
            json.dump(SHAPES[args.shape], f)
        args.model, args.load_format = tmp.name, "dummy"
    config = engine_config_from_args(args)
    bs = config.block_size
    # room for the plain steps' tokens and a verification's proposals past them
    blocks_per_seq = -(-(args.context + 3 * args.steps + 16 + args.verify) // bs)
    config.max_num_seqs = max(config.max_num_seqs, max(batches) * (args.verify + 1))  # graphs hold every row
    prefill_blocks = -(-args.prefill // bs)
    config.num_gpu_blocks = config.num_gpu_blocks or max(batches) * blocks_per_seq + prefill_blocks + 8
    runner = ModelRunner(config)
    results = []
    with torch.inference_mode():
        for batch in batches:
            seqs = [MirroredSeq(i, [(i * 7 + t) % 1000 for t in range(args.context)], args.context // 2,
                                list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq)), args.context - 1,
                                engine_pb2.SamplingOptions(temperature=args.temperature, top_p=1.0))
                    for i in range(batch)]
            plain = time_steps(runner, seqs, args.steps, 0, args.cprofile)
            row = {"batch": batch, "context": args.context, "plain": plain}
            print(f"\ndecode step, batch {batch}, context {args.context}, {runner.device}, graphs "
                  f"{'on' if runner.graphs else 'off'}, temperature {args.temperature}; median ms")
            print(f"{'':>8}" + " ".join(f"{k:>12}" for k in PHASES))
            print(f"{'plain':>8}" + " ".join(f"{v:>12.3f}" for v in plain.values()))
            if args.verify:
                verify = time_steps(runner, seqs, args.steps, args.verify, args.cprofile)
                row["verify"], row["num_proposed"] = verify, args.verify
                row["ratio"] = verify["total"] / plain["total"]
                print(f"{'K=' + str(args.verify):>8}" + " ".join(f"{v:>12.3f}" for v in verify.values()))
                print(f"a verifying step ({batch * (args.verify + 1)} rows) costs {row['ratio']:.2f}x a plain one")
            if args.prefill:
                first = max(batches) * blocks_per_seq  # the blocks after the decoding sequences'
                chunk_seq = MirroredSeq(10**6, [(7 * t) % 1000 for t in range(args.prefill)], args.prefill,
                                        list(range(first, first + prefill_blocks)), 0,
                                        engine_pb2.SamplingOptions(temperature=args.temperature, top_p=1.0))
                mixed = time_steps(runner, seqs, args.steps, 0, args.cprofile, prefill=chunk_seq)
                row["mixed"], row["prefill"] = mixed, args.prefill
                row["mixed_ratio"] = mixed["total"] / plain["total"]
                print(f"{'+' + str(args.prefill):>8}" + " ".join(f"{v:>12.3f}" for v in mixed.values()))
                print(f"a mixed step (a {args.prefill}-token chunk beside them) costs {row['mixed_ratio']:.2f}x")
            if not args.verify:
                kv_bytes = runner.kv_pool.layout.bytes_per_block // bs * batch * args.context
                print(f"KV bytes per step {kv_bytes / 1e9:.2f} GB -> launch at "
                      f"{kv_bytes / plain['launch'] / 1e9:.2f} TB/s")
            results.append(row)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"shape": None if tmp is None else args.shape, "device": str(runner.device),
                       "graphs": runner.graphs is not None, "temperature": args.temperature, "rows": results}, f,
                      indent=1)
    if tmp:
        tmp.cleanup()


if __name__ == "__main__":
    main()
