"""Where one decode step's time goes inside the executor (no scheduler, no sockets).

Builds the model runner in-process (Qwen3-0.6B architecture, random weights by default), fakes a
batch of decode sequences with the given context, and times the executor's calls with device syncs:
prepare inputs (alone), launch (prepare, forward, logits and, in a decode graph, sampling), sample
(the eager sampler when needed, and the host copy) and finalize.

    python bench/step_profile.py [--batch 256] [--context 600] [--steps 30] [engine flags]
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

from bench.throughput import QWEN3_0_6B  # noqa: E402
from executor_svc.model_runner import ModelRunner  # noqa: E402
from executor_svc.seq_mirror import MirroredSeq, ScheduledChunk  # noqa: E402
from protos import engine_pb2  # noqa: E402
from scheduler_svc.common.config import add_engine_args, engine_config_from_args  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--context", type=int, default=600)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--temperature", type=float, default=0.6)
    parser.add_argument("--cprofile", action="store_true", help="also print the top python functions")
    add_engine_args(parser)
    args = parser.parse_args()
    tmp = None
    if not args.model:
        tmp = tempfile.TemporaryDirectory()
        with open(os.path.join(tmp.name, "config.json"), "w") as f:
            json.dump(QWEN3_0_6B, f)
        args.model, args.load_format = tmp.name, "dummy"
    config = engine_config_from_args(args)
    bs = config.block_size
    blocks_per_seq = -(-(args.context + args.steps + 1) // bs)
    config.num_gpu_blocks = config.num_gpu_blocks or args.batch * blocks_per_seq + 8
    runner = ModelRunner(config)
    sync = torch.cuda.synchronize if runner.device.type == "cuda" else (lambda: None)
    seqs = [MirroredSeq(i, [(i * 7 + t) % 1000 for t in range(args.context)], args.context // 2,
                        list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq)), args.context - 1,
                        engine_pb2.SamplingOptions(temperature=args.temperature, top_p=1.0))
            for i in range(args.batch)]
    phases = {k: [] for k in ("prepare", "launch host", "launch", "sample", "finalize", "total")}

    def step(record: bool) -> None:
        """The executor's own calls, each synced: launch = prepare + forward + logits (and, in a
        single-rank decode graph, the sampling), and "launch host" the time until it returns;
        sample = the eager sampler when the graph did not
        sample, and the copy of the ids to the host; finalize = the ids into reply messages."""
        chunks = [ScheduledChunk(s, len(s.token_ids) - 1, len(s.token_ids)) for s in seqs]
        sync()
        t0 = time.perf_counter()
        runner.prepare_inputs(chunks)  # timed alone; launch repeats it
        sync()
        t1 = time.perf_counter()
        inputs = runner.launch(chunks)
        t1h = time.perf_counter()  # the host's share: launch returns before the device finishes
        sync()
        t2 = time.perf_counter()
        pending = runner.sample(inputs)
        sync()
        t3 = time.perf_counter()
        tokens = [t.token_id for t in runner.finalize(pending)]
        t4 = time.perf_counter()
        for s, t in zip(seqs, tokens):
            s.token_ids.append(t)
            s.num_computed_tokens += 1
        if record:
            for k, dt in zip(phases, (t1 - t0, t1h - t1, t2 - t1, t3 - t2, t4 - t3, t4 - t1)):
                phases[k].append(dt * 1e3)

    with torch.inference_mode():
        for _ in range(3):
            step(False)
        for _ in range(args.steps):
            step(True)
        if args.cprofile:
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(5):
                step(False)
            prof.disable()
            pstats.Stats(prof).sort_stats("tottime").print_stats(15)
    kv_bytes = runner.kv_pool.layout.bytes_per_block // runner.block_size * args.batch * args.context
    print(f"\ndecode step, batch {args.batch}, context {args.context}, {runner.device}, graphs "
          f"{'on' if runner.graphs else 'off'}; median ms")
    print(" ".join(f"{k:>15}" for k in phases))
    print(" ".join(f"{statistics.median(v):>15.3f}" for v in phases.values()))
    tb_per_s = kv_bytes / statistics.median(phases["launch"]) / 1e9
    print(f"KV bytes per step {kv_bytes / 1e9:.2f} GB -> launch at {tb_per_s:.2f} TB/s")
    if tmp:
        tmp.cleanup()


if __name__ == "__main__":
    main()
