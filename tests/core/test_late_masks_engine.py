"""Late token masks through the scheduler's loop (EngineCore, loopback transport): with two steps in flight a
constrained request decodes in every step, rank 0 gets each later mask right after the step before is
applied, and a failed step's sequences are dropped from the next step's late masks, never masked or waited
for, while the engine keeps serving."""
from __future__ import annotations

import numpy as np

from protos import engine_pb2
from scheduler_svc.common.config import EngineConfig
from scheduler_svc.core.engine_core import EngineCore
from support.loopback_engine import FakeExecutor, LoopbackTransport, pump
from support.structured_serving import VOCAB, allowed_tokens, masks_of

FRONT = b"frontend-a"
LETTERS = engine_pb2.Constraint(regex="[a-z]{400}")  # never complete within max_tokens


class MaskingExecutor(FakeExecutor):
    """Rank 0 that draws each constrained sample inside its mask (the smallest allowed token), holding a step
    with late rows until its LateTokenMasks come, as rank 0 waits before sampling; fails the steps in fail."""

    def __init__(self, transport: LoopbackTransport, fail: set[int] = frozenset()) -> None:
        super().__init__(transport)
        self.fail, self.held, self.late_received, self.masked = fail, {}, [], {}

    def join(self) -> None:
        self.transport.from_executor(b"rank0", self.handshake(vocab_size=VOCAB))

    def receive(self, msg: engine_pb2.SchedulerToExecutor) -> None:
        kind = msg.WhichOneof("kind")
        if kind == "late_masks":
            self.late_received.append(msg.late_masks)
            step_id, chunks = self.held.pop(msg.late_masks.step_id)
            masks = masks_of(msg.late_masks.masks if msg.late_masks.HasField("masks") else None)
            self.answer(step_id, chunks, masks)
        elif kind == "plan":
            self.epoch = self.epoch or msg.epoch
            plan = msg.plan
            chunks = self.mirrors.apply(plan)
            sampling = [c for c in chunks if c.samples]
            self.mirrors.commit(chunks)
            masks = masks_of(plan.token_bitmasks if plan.HasField("token_bitmasks") else None)
            if plan.late_mask_seq_ids:
                self.held[plan.step_id] = (plan.step_id, sampling)
                self.masked[plan.step_id] = masks
            else:
                self.answer(plan.step_id, sampling, masks)
        else:
            super().receive(msg)

    def answer(self, step_id: int, sampling, masks: dict[int, np.ndarray]) -> None:
        masks = {**self.masked.pop(step_id, {}), **masks}
        result = engine_pb2.StepResult(step_id=step_id)
        if step_id in self.fail:
            result.error = "device fault"
        else:
            for c in sampling:
                seq_id = c.seq.seq_id
                token = int(allowed_tokens(masks[seq_id])[0]) if seq_id in masks else 7
                result.sampled.append(engine_pb2.SampledToken(seq_id=seq_id, token_id=token))
                self.mirrors.append_sampled(seq_id, token)
        self.transport.from_executor(b"rank0", engine_pb2.ExecutorToScheduler(result=result, epoch=self.epoch))


def masking_engine(model_dir: str, fail: set[int] = frozenset()) -> tuple[EngineCore, LoopbackTransport,
                                                                          MaskingExecutor]:
    transport = LoopbackTransport()
    core = EngineCore(EngineConfig(model=model_dir, block_size=4, max_num_seqs=8, max_num_batched_tokens=64,
                                   max_steps_in_flight=2), transport)
    executor = MaskingExecutor(transport, fail)
    transport.executors[0] = executor
    executor.join()
    pump(core)
    return core, transport, executor


def add(request_id: str, prompt: list[int], max_tokens: int, constraint=None) -> engine_pb2.FrontendToScheduler:
    request = engine_pb2.AddRequest(request_id=request_id, prompt_token_ids=prompt,
                                    stopping=engine_pb2.StoppingOptions(max_tokens=max_tokens))
    if constraint is not None:
        request.constraint.CopyFrom(constraint)
    return engine_pb2.FrontendToScheduler(add=request)


def outputs(transport: LoopbackTransport, request_id: str) -> tuple[list[int], int, str]:
    outs = [o for o in transport.outputs_for(FRONT) if o.request_id == request_id]
    return [t for o in outs for t in o.new_token_ids], outs[-1].finish_reason, outs[-1].error


def test_a_constrained_request_decodes_every_step_with_its_later_masks_sent_late(embedded_model):
    core, transport, executor = masking_engine(embedded_model)
    transport.from_frontend(FRONT, add("c", [100, 101, 102], 8, LETTERS))
    transport.from_frontend(FRONT, add("f", [200, 201], 8))
    pump(core, 20000)
    tokens, reason, _ = outputs(transport, "c")
    assert reason == engine_pb2.FINISH_REASON_LENGTH and len(tokens) == 8
    assert outputs(transport, "f")[0] == [7] * 8
    stats = core.scheduler.stats()
    # the first mask rides in its plan; the 7 after it come late, one message for each of the next 7 steps
    assert stats["num_token_masks"] == 8 and stats["num_late_token_masks"] == 7
    steps = [m.step_id for m in executor.late_received]
    assert steps == list(range(steps[0], steps[0] + 7))  # every step, not every other one


def test_a_failed_steps_sequences_are_dropped_from_the_next_late_masks_and_the_engine_serves_on(embedded_model):
    core, transport, executor = masking_engine(embedded_model, fail={3})
    transport.from_frontend(FRONT, add("a", [100, 101, 102], 8, LETTERS))
    transport.from_frontend(FRONT, add("b", [150, 151], 8, LETTERS))
    pump(core, 20000)
    for request_id in ("a", "b"):
        _, reason, error = outputs(transport, request_id)
        assert reason == engine_pb2.FINISH_REASON_ERROR and "device fault" in error
    after_failure = [m for m in executor.late_received if m.step_id == 4]
    assert len(after_failure) == 1 and not after_failure[0].HasField("masks")
    assert len(after_failure[0].dropped_seq_ids) == 2  # both, sampled free and discarded: nobody waits on them
    transport.from_frontend(FRONT, add("next", [300, 301], 5, LETTERS))
    pump(core, 20000)
    tokens, reason, _ = outputs(transport, "next")
    assert reason == engine_pb2.FINISH_REASON_LENGTH and len(tokens) == 5 and not executor.held
