"""Late token masks on the executor: a plan's late rows get their masks from a LateTokenMasks that rank 0 waits
for just before sampling (after the forward is launched). Masks that do not answer the step fail it; masks of
another step or scheduler are never applied; a wait is bounded, so a scheduler that is gone or turns to a
handshake fails the step instead of leaving rank 0 waiting; whatever else comes meanwhile keeps its order."""
from __future__ import annotations

import re
import time

import numpy as np
import pytest
import torch
import zmq

from executor_svc.executor import SchedulerEpoch, StepLoop
from executor_svc.model_runner import ModelRunner
from executor_svc.seq_mirror import SequenceMirrors, attach_late_masks
from protos import engine_pb2
from scheduler_svc.common.config import EngineConfig
from support.tiny_checkpoints import make_tiny_llama
from test_token_masks import bitmask, new_seq

CUDA = pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")])
EPOCH = 77


def token_masks(masks: dict[int, np.ndarray]) -> engine_pb2.TokenBitmasks:
    num_words = len(next(iter(masks.values())))
    return engine_pb2.TokenBitmasks(seq_ids=list(masks), num_words=num_words,
                                    words=b"".join(m.tobytes() for m in masks.values()))


def late(step_id: int, masks: dict[int, np.ndarray], dropped=()) -> engine_pb2.LateTokenMasks:
    msg = engine_pb2.LateTokenMasks(step_id=step_id, dropped_seq_ids=list(dropped))
    if masks:
        msg.masks.CopyFrom(token_masks(masks))
    return msg


def prefill_plan(late_ids=(), masks=None) -> engine_pb2.StepPlan:
    plan = engine_pb2.StepPlan(step_id=1, late_mask_seq_ids=list(late_ids))
    plan.new_seqs.extend([new_seq(1, [1, 2], 0), new_seq(2, [3], 1), new_seq(3, [4], 2)])
    if masks:
        plan.token_bitmasks.CopyFrom(token_masks(masks))
    return plan


# ---------------------------------------------------------------- the mirrors


def test_late_rows_get_their_masks_and_a_dropped_row_samples_free():
    chunks = SequenceMirrors().apply(prefill_plan(late_ids=[2, 3]))
    assert [c.late_mask for c in chunks] == [False, True, True] and all(c.token_mask is None for c in chunks)
    mask = bitmask([4, 5], 64)
    attach_late_masks(late(1, {2: mask}, dropped=[3]), chunks)
    assert chunks[0].token_mask is None and np.array_equal(chunks[1].token_mask, mask)
    assert chunks[2].token_mask is None  # its sequence ended: its token is discarded


@pytest.mark.parametrize("answer, why", [
    (late(1, {2: bitmask([1], 64)}), "answer seqs [2] and drop [], but the step waits for [2, 3]"),
    (late(1, {2: bitmask([1], 64), 3: bitmask([1], 64)}, dropped=[3]), "drop [3], but the step waits for [2, 3]"),
    (late(1, {2: bitmask([1], 64)}, dropped=[3, 9]), "drop [3, 9], but the step waits for [2, 3]"),
    (late(1, {1: bitmask([1], 64)}, dropped=[2, 3]), "token masks for seqs [1] that the step does not run"),
], ids=["missing", "masked-and-dropped", "dropped-elsewhere", "not-late"])
def test_late_masks_that_do_not_answer_exactly_the_late_rows_fail_the_step(answer, why):
    chunks = SequenceMirrors().apply(prefill_plan(late_ids=[2, 3]))
    with pytest.raises(RuntimeError, match=re.escape(why)):
        attach_late_masks(answer, chunks)


@pytest.mark.parametrize("plan, why", [
    (prefill_plan(late_ids=[2], masks={2: bitmask([1], 64)}), "seq 2 has a late token mask but does not sample, "
                                                              "or has a mask in the plan already"),
    (prefill_plan(late_ids=[9]), "late token masks for seqs [9] that the step does not run"),
])
def test_a_late_row_that_the_step_does_not_sample_or_that_has_a_mask_fails_the_plan(plan, why):
    with pytest.raises(RuntimeError, match=re.escape(why)):
        SequenceMirrors().apply(plan)


# ---------------------------------------------------------------- rank 0's step loop


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> str:
    return make_tiny_llama(str(tmp_path_factory.mktemp("late") / "llama"))


class Link:
    """A scheduler's end of rank 0's socket."""

    def __init__(self) -> None:
        self.ctx = zmq.Context()
        self.router = self.ctx.socket(zmq.ROUTER)
        self.router.bind("inproc://late-masks")
        self.dealer = self.ctx.socket(zmq.DEALER)
        self.dealer.setsockopt(zmq.IDENTITY, b"rank0")
        self.dealer.connect("inproc://late-masks")

    def send(self, epoch: int = EPOCH, **kind) -> None:
        self.router.send_multipart([b"rank0", engine_pb2.SchedulerToExecutor(epoch=epoch, **kind).SerializeToString()])

    def result(self) -> engine_pb2.StepResult:
        assert self.router.poll(5000)
        return engine_pb2.ExecutorToScheduler.FromString(self.router.recv_multipart()[1]).result

    def close(self) -> None:
        self.dealer.close()
        self.router.close()
        self.ctx.term()


@pytest.fixture
def link():
    link = Link()
    yield link
    link.close()


def step_loop(tiny_llama: str, link: Link, device: str = "cpu", timeout_s: float = 5.0) -> StepLoop:
    runner = ModelRunner(EngineConfig(model=tiny_llama, device=device, dtype="float32", block_size=16,
                                      num_gpu_blocks=8, max_num_seqs=4, attention_backend="torch"))
    epoch = SchedulerEpoch()
    epoch.value = EPOCH
    return StepLoop(runner, SequenceMirrors(), link.dealer, 0, epoch, late_mask_timeout_s=timeout_s)


def decode_plan(step_id: int, late_ids=(2,)) -> engine_pb2.StepPlan:
    """Seqs 1 and 2 decode on the tokens the prefill sampled (still on the device)."""
    plan = engine_pb2.StepPlan(step_id=step_id, late_mask_seq_ids=list(late_ids))
    plan.cached.CopyFrom(engine_pb2.CachedSequences(seq_ids=[1, 2], num_scheduled_tokens=[1, 1],
                                                    num_new_blocks=[0, 0], last_token_ids=[-1, -1]))
    return plan


def two_prompts(step_id: int = 1) -> engine_pb2.StepPlan:
    plan = engine_pb2.StepPlan(step_id=step_id)
    plan.new_seqs.extend([new_seq(1, [5, 6, 7], 0), new_seq(2, [5, 6, 7], 1)])
    return plan


@pytest.mark.parametrize("device", ["cpu", CUDA])
def test_rank0_samples_a_late_row_inside_its_mask_and_keeps_what_came_meanwhile_in_order(tiny_llama, link, device):
    loop = step_loop(tiny_llama, link, device)
    vocab = loop.runner.facts.vocab_size
    loop.run_plan(two_prompts())
    # while step 2 waits: a late mask of step 1 (a step that failed before it waited), the next plan, its own
    link.send(late_masks=late(1, {2: bitmask([7], vocab)}))
    link.send(plan=engine_pb2.StepPlan(step_id=3))
    link.send(late_masks=late(2, {2: bitmask([11, 12], vocab)}))
    loop.run_plan(decode_plan(2))
    first = link.result()
    loop.reply_pending()
    second = link.result()
    assert (first.step_id, second.step_id, second.error) == (1, 2, "")
    assert 0 < second.late_mask_wait_seconds <= second.execute_seconds
    tokens = {s.seq_id: s.token_id for s in second.sampled}
    assert tokens[2] in (11, 12)  # greedy: seq 1, unmasked, takes the top token of the same prompt
    assert [m.plan.step_id for m in loop.backlog] == [3] and loop.next_message().plan.step_id == 3


def test_a_late_mask_that_never_comes_fails_the_step_within_the_bound(tiny_llama, link):
    loop = step_loop(tiny_llama, link, timeout_s=0.3)
    loop.run_plan(two_prompts())
    t0 = time.monotonic()
    loop.run_plan(decode_plan(2))  # no scheduler answers
    waited = time.monotonic() - t0
    assert link.result().step_id == 1
    loop.reply_pending()
    failed = link.result()
    assert failed.step_id == 2 and "late token masks of step 2 did not come within 0.3s" in failed.error
    assert 0.25 <= failed.late_mask_wait_seconds <= waited < 3 and not failed.sampled  # (poll rounds to ms)
    link.send(late_masks=late(2, {2: bitmask([3], loop.runner.facts.vocab_size)}))  # too late: never applied
    link.send(plan=engine_pb2.StepPlan(step_id=3))
    assert loop.next_message().WhichOneof("kind") == "late_masks"  # the main loop drops it (no branch for it)


def test_a_handshake_request_while_waiting_fails_the_step_at_once_and_is_served_next(tiny_llama, link):
    loop = step_loop(tiny_llama, link, timeout_s=30)
    loop.run_plan(two_prompts())
    link.send(epoch=EPOCH + 1, handshake_request=engine_pb2.HandshakeRequest())  # a new scheduler
    t0 = time.monotonic()
    loop.run_plan(decode_plan(2))
    assert time.monotonic() - t0 < 5
    assert "turned to a handshake_request" in str(loop.pending.error)
    assert loop.next_message().WhichOneof("kind") == "handshake_request"
