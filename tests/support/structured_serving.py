"""Serving a scheduler with structured output as the engine loop does, with a fake executor that draws each
constrained sample among the tokens its mask allows (tests/core/test_structured_output.py). With async
scheduling a step's late masks are filled once the step before it is applied, as EngineCore sends them."""
from __future__ import annotations

import dataclasses
import time
from collections import deque
from types import SimpleNamespace

import llguidance
import numpy as np
from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask

from executor_svc.seq_mirror import mask_table
from protos import engine_pb2
from scheduler_svc.core.scheduler import Scheduler
from scheduler_svc.core.scheduler_output import SchedulerOutput
from scheduler_svc.core.sequence import Sequence
from scheduler_svc.core.step_plan import build_step_plan
from scheduler_svc.core.structured.grammars import grammar_of
from support.fake_executor import FakeExecutor, check_block_references

VOCAB = 49152
EOS = 2
FREE_TOKEN = 7  # what the fake model samples for an unconstrained sequence

def masks_of(masks: engine_pb2.TokenBitmasks | None) -> dict[int, np.ndarray]:
    """A step's masks by sequence id."""
    if masks is None:
        return {}
    words, rows = mask_table(masks)
    return {seq_id: words[row] for seq_id, row in zip(masks.seq_ids, rows)}


def allowed_tokens(words: np.ndarray) -> np.ndarray:
    return np.nonzero(np.unpackbits(words.view(np.uint8), bitorder="little"))[0]


def reference_mask(lltokenizer, seq: Sequence) -> np.ndarray:
    """The grammar's mask after exactly the sequence's output tokens, from a fresh matcher."""
    matcher = llguidance.LLMatcher(lltokenizer, grammar_of(seq.constraint))
    assert matcher.consume_tokens(seq.output_token_ids)
    mask = allocate_token_bitmask(1, VOCAB)
    fill_next_token_bitmask(matcher, mask)
    return mask[0]


def masks_of_plan(plan: engine_pb2.StepPlan) -> dict[int, np.ndarray]:
    return masks_of(plan.token_bitmasks if plan.HasField("token_bitmasks") else None)



def serve(sched: Scheduler, seqs: list[Sequence], lltokenizer=None, depth: int = 1, seed: int = 0,
          max_steps: int = 2000, aborts: dict[int, Sequence] | None = None, lates: list | None = None) -> list:
    """Run to the end with `depth` plans in flight, in the engine's order: when a step's result is applied, the
    late masks of the next step in flight are filled (the engine sends them to rank 0) and its late rows are
    drawn; a step's forward runs once every sample of the step before it is drawn. As in EngineCore, the late
    rows' matchers take the step's tokens and their masks are filled before the rest of the result is applied.
    Every constrained sample is drawn among the tokens its mask allows (checked against the grammar after
    exactly the output tokens when lltokenizer is given); a late row whose sequence ended is dropped, never
    masked. aborts: plan number -> sequence aborted right after that plan is sent. lates: collects the
    LateTokenMasks. The plans, in order."""
    rng = np.random.default_rng(seed)
    for seq in seqs:
        sched.add(seq)
    cfg = sched.config
    drawn: dict[int, list[int]] = {}  # seq_id -> tokens drawn by steps not yet applied, in step order
    live: dict[int, Sequence] = {}

    def token_at(mirror, pos: int) -> int:
        seq = live[mirror.seq_id]
        return seq.token_ids[pos] if pos < len(seq.token_ids) else drawn[seq.seq_id][pos - len(seq.token_ids)]

    executor = FakeExecutor(cfg.num_blocks, cfg.block_size, cfg.num_host_blocks, token_at)
    in_flight, to_run, plans = deque(), deque(), []  # in flight: (step id, out, sampled, late rows not drawn yet)

    def draw(seq: Sequence, mask: np.ndarray, sampled: dict[int, int]) -> None:
        if lltokenizer is not None:
            assert np.array_equal(mask, reference_mask(lltokenizer, seq))
        sampled[seq.seq_id] = int(rng.choice(allowed_tokens(mask)))
        drawn.setdefault(seq.seq_id, []).append(sampled[seq.seq_id])

    def run_forwards() -> None:  # a step's forward runs once every step before it has all its samples
        while to_run:
            before = [late for step_id, _, _, late in in_flight if step_id < to_run[0][0]]
            if any(before):
                return
            out = to_run.popleft()[1]  # a sequence that ended since: its writes and reads no longer matter
            executor.run(dataclasses.replace(out, scheduled=[s for s in out.scheduled
                                                             if not live[s.seq.seq_id].is_finished]))

    for _ in range(max_steps):
        sched.admit_compiled_grammars()
        out = sched.schedule() if len(in_flight) < depth else None
        if out is not None and out.scheduled:
            plan = engine_pb2.StepPlan.FromString(build_step_plan(len(plans) + 1, out).SerializeToString())
            plans.append(plan)
            masks, late, sampled = masks_of_plan(plan), set(plan.late_mask_seq_ids), {}
            assert late == {seq.seq_id for seq in out.late_masked} and not late & set(masks)
            for s in out.scheduled:
                seq = s.seq
                if not s.samples or seq.seq_id in late:
                    continue  # a late row is drawn when its mask comes
                assert (seq.seq_id in masks) == (seq.constraint is not None)
                if seq.constraint is None:
                    sampled[seq.seq_id] = FREE_TOKEN
                    drawn.setdefault(seq.seq_id, []).append(FREE_TOKEN)
                else:
                    draw(seq, masks[seq.seq_id], sampled)
            in_flight.append((len(plans), out, sampled, late))
            live.update((s.seq.seq_id, s.seq) for s in out.scheduled)
            to_run.append((len(plans), as_mirrored(out)))
            run_forwards()
            if aborts and len(plans) in aborts:
                sched.abort(aborts[len(plans)].request_id)
            continue
        if in_flight:
            _, out, sampled, late = in_flight.popleft()
            assert not late, "a step is applied only after its late masks came"
            for seq_id in sampled:
                drawn[seq_id].pop(0)
            msg = None
            if in_flight and in_flight[0][1].late_masked:  # the late rows' matchers first, then the rest
                sched.check_result(out, sampled)
                sched.accept_ahead(out, sampled, in_flight[0][1].late_masked)
                msg = engine_pb2.LateTokenMasks()
                sched.structured.late_masks(msg, in_flight[0][0], in_flight[0][1].late_masked)
                msg = engine_pb2.LateTokenMasks.FromString(msg.SerializeToString())
            sched.postprocess(out, sampled)
            check_block_references(sched)
            if msg is not None:  # drawn against the sequences as postprocess left them
                next_id, next_out, next_sampled, next_late = in_flight[0]
                if lates is not None:
                    lates.append(msg)
                by_id = {seq.seq_id: seq for seq in next_out.late_masked}
                assert set(msg.masks.seq_ids) | set(msg.dropped_seq_ids) == next_late
                assert all(by_id[i].is_finished for i in msg.dropped_seq_ids)
                for seq_id, mask in masks_of(msg.masks if msg.HasField("masks") else None).items():
                    assert not by_id[seq_id].is_finished
                    draw(by_id[seq_id], mask, next_sampled)
                for seq_id in msg.dropped_seq_ids:  # sampled free by the executor; the scheduler discards it
                    next_sampled[seq_id] = FREE_TOKEN
                    drawn.setdefault(seq_id, []).append(FREE_TOKEN)
                next_late.clear()
                run_forwards()
        elif not sched.has_unfinished():
            return plans
        else:
            time.sleep(0.002)  # a grammar is compiling
    raise AssertionError("the requests never finished")


def as_mirrored(out: SchedulerOutput) -> SchedulerOutput:
    """The step as the executors hold it once it is sent: each sequence's block table as it was then."""
    return dataclasses.replace(out, scheduled=[dataclasses.replace(s, seq=SimpleNamespace(
        seq_id=s.seq.seq_id, block_table=list(s.seq.block_table))) for s in out.scheduled])
