"""The scheduler's side of structured output under async scheduling, with no model: how long rank 0 would wait
for a step's late token masks, and what the step loop costs, at the H200 workload's scale on this CPU.

EngineCore runs in-process over a transport that serializes every message as ZeroMQ would. A fake rank 0
answers each plan at once, and a plan with late rows once their LateTokenMasks come; it draws each constrained
token at random inside its mask (a random-weight model is nearly as random) and 7 for a free one. Half of
bench/structured.py's throughput workload is constrained by its nested schema, over the synthetic 151,936-token
vocabulary. Reported: the critical path, from a result reaching the scheduler to the next step's late masks
sent (serialized), and to the next plan sent; a step's length if the forward took --gpu-step-ms and rank 0
waited for both (max of the three); the scheduler's own time per step, the fake rank 0's left out; the mask
fill per step.

    python bench/structured_loop.py [--num-seqs 256] [--max-output-len 1024] [--mask-fill-threads N]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

from bench.nanovllm_workload import workload  # noqa: E402
from bench.structured import NESTED, QWEN3_EOS, QWEN3_VOCAB, percentile  # noqa: E402
from bench.synthetic_tokenizer import write_synthetic_tokenizer  # noqa: E402
from executor_svc.seq_mirror import SequenceMirrors, mask_table  # noqa: E402
from protos import engine_pb2  # noqa: E402
from scheduler_svc.common.config import EngineConfig  # noqa: E402
from scheduler_svc.core.engine_core import EngineCore  # noqa: E402


FREE_TOKEN = 7


class FakeRank0:
    """Rank 0 without a model: mirrors the plans and answers them, holding a step with late rows until its
    masks come."""

    def __init__(self, reply) -> None:
        self.reply, self.mirrors, self.held, self.epoch = reply, SequenceMirrors(), {}, 0
        self.rng = np.random.default_rng(0)

    def receive(self, payload: bytes) -> None:
        msg = engine_pb2.SchedulerToExecutor.FromString(payload)
        kind = msg.WhichOneof("kind")
        if kind == "plan":
            self.epoch = msg.epoch
            chunks = self.mirrors.apply(msg.plan)
            sampling, masks = [c for c in chunks if c.samples], self.masks_of(msg.plan, "token_bitmasks")
            self.mirrors.commit(chunks)
            if msg.plan.late_mask_seq_ids:
                self.held[msg.plan.step_id] = (sampling, masks)
            else:
                self.answer(msg.plan.step_id, sampling, masks)
        elif kind == "late_masks":
            sampling, masks = self.held.pop(msg.late_masks.step_id)
            self.answer(msg.late_masks.step_id, sampling, {**masks, **self.masks_of(msg.late_masks, "masks")})

    @staticmethod
    def masks_of(msg, name: str) -> dict[int, np.ndarray]:
        if not msg.HasField(name):
            return {}
        masks = getattr(msg, name)
        words, rows = mask_table(masks)
        return {seq_id: words[row].view("<u4") for seq_id, row in zip(masks.seq_ids, rows)}

    def draw(self, row: np.ndarray) -> int:
        word = int(self.rng.choice(np.flatnonzero(row)))
        bits = np.flatnonzero((int(row[word]) >> np.arange(32)) & 1)
        return 32 * word + int(self.rng.choice(bits))

    def answer(self, step_id: int, sampling, masks: dict[int, np.ndarray]) -> None:
        result = engine_pb2.StepResult(step_id=step_id)
        for chunk in sampling:
            seq_id = chunk.seq.seq_id
            token = self.draw(masks[seq_id]) if seq_id in masks else FREE_TOKEN
            result.sampled.append(engine_pb2.SampledToken(seq_id=seq_id, token_id=token))
            self.mirrors.append_sampled(seq_id, token)
        self.reply(engine_pb2.ExecutorToScheduler(result=result, epoch=self.epoch).SerializeToString())


class TimedTransport:
    """Messages to rank 0 are serialized and queued; poll() lets the fake rank 0 answer them (its time kept
    apart), then hands the core what came back, noting when each result arrived."""

    def __init__(self) -> None:
        self.inbox: list[tuple[bool, bytes]] = []  # (from an executor, payload)
        self.to_rank0: list[bytes] = []
        self.rank0 = FakeRank0(lambda payload: self.inbox.append((True, payload)))
        self.rank0_seconds = 0.0
        self.result_at = None
        self.critical_ms: list[float] = []
        self.after_result: dict[str, float] = {}  # since the last result: ms until the late masks, the next plan
        self.late_steps: list[dict[str, float]] = []  # those of each result that had late masks after it

    def send_frontend(self, identity: bytes, msg: engine_pb2.SchedulerToFrontend) -> None:
        msg.SerializeToString()

    def send_executor(self, rank: int, msg: engine_pb2.SchedulerToExecutor) -> None:
        self.to_rank0.append(msg.SerializeToString())
        kind = msg.WhichOneof("kind")
        if self.result_at is None or kind not in ("late_masks", "plan") or kind in self.after_result:
            return
        self.after_result[kind] = (time.perf_counter() - self.result_at) * 1e3
        if kind == "late_masks":
            self.critical_ms.append(self.after_result[kind])

    def poll(self, timeout_ms: int, core: EngineCore) -> None:
        t0 = time.perf_counter()
        while self.to_rank0:
            self.rank0.receive(self.to_rank0.pop(0))
        self.rank0_seconds += time.perf_counter() - t0
        while self.inbox:
            from_executor, payload = self.inbox.pop(0)
            if from_executor:
                if "late_masks" in self.after_result:
                    self.late_steps.append(self.after_result)
                self.result_at, self.after_result = time.perf_counter(), {}
                core.on_executor(b"rank0", payload)
            else:
                core.on_frontend(b"bench", payload)


def run(core: EngineCore, transport: TimedTransport, requests: list[engine_pb2.AddRequest]) -> None:
    for request in requests:
        transport.inbox.append((False, engine_pb2.FrontendToScheduler(add=request).SerializeToString()))
    core.run_once(idle_poll_ms=0)
    while core.scheduler.has_unfinished() or core.in_flight or transport.inbox or transport.to_rank0:
        core.run_once(idle_poll_ms=0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-seqs", type=int, default=256)
    parser.add_argument("--max-input-len", type=int, default=1024)
    parser.add_argument("--max-output-len", type=int, default=1024)
    parser.add_argument("--min-len", type=int, default=100)
    parser.add_argument("--mask-fill-threads", type=int, default=0, help="0: the engine's default (mask_fill.py)")
    parser.add_argument("--gpu-step-ms", type=float, default=4.5,
                        help="the forward a step's late masks and next plan must beat (H200: ~4.5 ms)")
    parser.add_argument("--out", default="bench/results/structured_loop.json")
    args = parser.parse_args()
    tokenizer_dir = tempfile.mkdtemp(prefix="structured-loop-")
    write_synthetic_tokenizer(tokenizer_dir, QWEN3_VOCAB, QWEN3_EOS)
    transport = TimedTransport()
    core = EngineCore(EngineConfig(model=tokenizer_dir, max_num_seqs=512, max_num_batched_tokens=16384,
                                   mask_fill_threads=args.mask_fill_threads, executor_timeout_s=3600,
                                   frontend_timeout_s=3600), transport)  # the fake rank 0 sends no heartbeats
    core.on_executor(b"rank0", engine_pb2.ExecutorToScheduler(handshake=engine_pb2.ExecutorHandshake(
        rank=0, world_size=1, num_blocks=40000, block_size=16, model_name="fake", architecture="Fake",
        vocab_size=QWEN3_VOCAB, max_position_embeddings=4096, eos_token_ids=[QWEN3_EOS], dtype="bfloat16",
        device="cpu", attention_backend="torch", pid=os.getpid())).SerializeToString())
    schema = json.dumps(NESTED)

    def request(i: int, prompt: list[int], max_tokens: int, constrained: bool) -> engine_pb2.AddRequest:
        add = engine_pb2.AddRequest(request_id=str(i), prompt_token_ids=prompt,
                                    stopping=engine_pb2.StoppingOptions(max_tokens=max_tokens, ignore_eos=True))
        if constrained:
            add.constraint.json_schema = schema
        return add

    run(core, transport, [request(-1, list(range(1, 12)), 8, True)])  # loads the tokenizer, compiles the schema
    transport.critical_ms.clear()
    transport.late_steps.clear()
    before = core.scheduler.stats()
    prompts, max_tokens = workload(args.num_seqs, args.max_input_len, args.max_output_len, 0, args.min_len,
                                   args.min_len)
    t0, transport.rank0_seconds = time.perf_counter(), 0.0
    run(core, transport, [request(i, p, m, i % 2 == 1) for i, (p, m) in enumerate(zip(prompts, max_tokens))])
    elapsed = time.perf_counter() - t0
    after = core.scheduler.stats()
    steps = after["num_steps"] - before["num_steps"]
    masked = after["num_masked_steps"] - before["num_masked_steps"]
    crit = transport.critical_ms
    result = {"num_seqs": args.num_seqs, "steps": steps,
              "mask_fill_threads": core.scheduler.structured.filler.num_threads,
              "scheduler_ms_per_step": 1e3 * (elapsed - transport.rank0_seconds) / steps,
              "critical_ms": {"median": statistics.median(crit), "mean": statistics.mean(crit),
                              "p99": percentile(crit, 0.99), "n": len(crit)},
              "mask_fill_ms_per_masked_step": 1e3 * (after["token_mask_seconds"] - before["token_mask_seconds"])
              / max(1, masked)}
    # rank 0 samples once the forward and the masks are in, then starts the next forward once its plan is in
    g = args.gpu_step_ms
    modelled = [max(g, r["late_masks"], r.get("plan", 0.0)) for r in transport.late_steps]
    plan_ms = [r["plan"] for r in transport.late_steps if "plan" in r]
    result["next_plan_ms"] = {"median": statistics.median(plan_ms), "mean": statistics.mean(plan_ms),
                              "p99": percentile(plan_ms, 0.99), "n": len(plan_ms)}
    result["modelled_step_ms"] = {"gpu_step_ms": g, "mean": statistics.mean(modelled),
                                  "ratio_to_gpu_step": g / statistics.mean(modelled)}
    c = result["critical_ms"]
    print(f"scheduler loop: {args.num_seqs} seqs, half constrained, vocabulary {QWEN3_VOCAB}, mask fill threads "
          f"{result['mask_fill_threads']}: {steps} steps")
    print(f"  result in -> late masks sent: median {c['median']:.2f} ms, mean {c['mean']:.2f}, p99 {c['p99']:.2f} "
          f"over {c['n']} steps")
    p, m = result["next_plan_ms"], result["modelled_step_ms"]
    print(f"  result in -> next plan sent: median {p['median']:.2f} ms, mean {p['mean']:.2f}, p99 {p['p99']:.2f}")
    print(f"  a step, if the forward takes {g} ms and rank 0 waits for both: mean {m['mean']:.2f} ms "
          f"({m['ratio_to_gpu_step']:.3f}x of the forward's pace)")
    print(f"  scheduler {result['scheduler_ms_per_step']:.2f} ms/step (fake rank 0 left out), of which mask fill "
          f"{result['mask_fill_ms_per_masked_step']:.2f} ms per masked step")
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    core.scheduler.close()


if __name__ == "__main__":
    main()
