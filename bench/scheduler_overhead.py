"""CPU cost of one scheduling iteration with a no-op executor.

Per decode step: schedule, build the StepPlan, serialize it, deserialize it on the executor side
(together: the scheduling iteration the target is about), then, reported apart, apply the plan's
deltas to the executor's mirrors and postprocess the sampled tokens.

    python bench/scheduler_overhead.py [--seqs 64 256 1024] [--context 1000] [--steps 50]
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from executor_svc.seq_mirror import SequenceMirrors  # noqa: E402  (no torch: mirrors are plain python)
from protos import engine_pb2  # noqa: E402
from scheduler_svc.core.scheduler import Scheduler  # noqa: E402
from scheduler_svc.core.scheduler_config import SchedulerConfig  # noqa: E402
from scheduler_svc.core.sequence import Sequence  # noqa: E402
from scheduler_svc.core.step_plan import build_step_plan  # noqa: E402


def run(num_seqs: int, context: int, steps: int, block_size: int) -> dict:
    rng = random.Random(0)
    blocks_per_seq = (context + steps + 64) // block_size + 2
    sched = Scheduler(SchedulerConfig(
        max_num_seqs=num_seqs, max_num_batched_tokens=max(8192, num_seqs), max_model_len=context + steps + 256,
        block_size=block_size, num_blocks=num_seqs * blocks_per_seq, enable_prefix_caching=True))
    for i in range(num_seqs):
        n = rng.randint(int(context * 0.9), int(context * 1.1))
        seq = Sequence(seq_id=i + 1, request_id=str(i), token_ids=[rng.randrange(50000) for _ in range(n)],
                       num_prompt_tokens=n, sampling=engine_pb2.SamplingOptions(temperature=0),
                       stopping=engine_pb2.StoppingOptions(max_tokens=10**6, ignore_eos=True), arrival_order=i)
        sched.add(seq)
    mirrors = SequenceMirrors()

    def one_step(times: dict | None) -> int:
        t0 = time.perf_counter()
        out = sched.schedule()
        t1 = time.perf_counter()
        plan = build_step_plan(one_step.step, out)
        t2 = time.perf_counter()
        wire = engine_pb2.SchedulerToExecutor(plan=plan).SerializeToString()
        t3 = time.perf_counter()
        plan = engine_pb2.SchedulerToExecutor.FromString(wire).plan
        t_decoded = time.perf_counter()
        chunks = mirrors.apply(plan)
        sampling = [c.seq.seq_id for c in chunks if c.samples]
        mirrors.commit(chunks)
        t4 = time.perf_counter()
        sampled = {seq_id: rng.randrange(50000) for seq_id in sampling}
        for seq_id, token in sampled.items():
            mirrors.append_sampled(seq_id, token)
        sched.postprocess(out, sampled)
        t5 = time.perf_counter()
        one_step.step += 1
        if times is not None:
            for key, dt in zip(("schedule", "build_plan", "serialize", "deserialize", "executor_apply",
                                "postprocess"),
                               (t1 - t0, t2 - t1, t3 - t2, t_decoded - t3, t4 - t_decoded, t5 - t4)):
                times[key].append(dt * 1e3)
            times["iteration"].append((t_decoded - t0) * 1e3)
            times["total"].append((t5 - t0) * 1e3)
            times["bytes"].append(len(wire))
        return sum(item.num_new_tokens for item in out.scheduled)

    one_step.step = 1
    while any(s.num_computed_tokens < s.num_prompt_tokens for s in sched.running) or sched.waiting:
        one_step(None)  # prefill everything first
    times = {k: [] for k in ("schedule", "build_plan", "serialize", "deserialize", "executor_apply",
                             "postprocess", "iteration", "total", "bytes")}
    for _ in range(steps):
        one_step(times)
    return {"num_seqs": num_seqs, **{k: statistics.median(v) for k, v in times.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seqs", type=int, nargs="+", default=[64, 256, 1024])
    parser.add_argument("--context", type=int, default=1000)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--out", default="bench/results/scheduler_overhead.json")
    args = parser.parse_args()
    rows = [run(n, args.context, args.steps, args.block_size) for n in args.seqs]
    print(f"decode step, context ~{args.context}, block {args.block_size}; median ms per step")
    print("iteration = schedule + build_plan + serialize + deserialize (target <= 1 ms at 256); "
          "total adds executor_apply and postprocess")
    cols = ["schedule", "build_plan", "serialize", "deserialize", "executor_apply", "postprocess", "iteration",
            "total"]
    print(f"{'seqs':>6} " + " ".join(f"{c:>12.12}" for c in cols) + f" {'plan bytes':>11}")
    for r in rows:
        print(f"{r['num_seqs']:>6} " + " ".join(f"{r[c]:>12.3f}" for c in cols) + f" {int(r['bytes']):>11}")
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"context": args.context, "block_size": args.block_size, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
