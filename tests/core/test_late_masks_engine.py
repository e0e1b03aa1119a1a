"""Late token masks through the scheduler's loop (EngineCore, loopback transport): with two steps in flight a
constrained request decodes in every step, rank 0 gets each later mask right after the step before is
applied, and a failed step's sequences are dropped from the next step's late masks, never masked or waited
for, while the engine keeps serving."""
from __future__ import annotations

import llguidance
import numpy as np
import pytest
from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask

from protos import engine_pb2
from scheduler_svc.common.config import EngineConfig
from scheduler_svc.core.engine_core import EngineCore
from scheduler_svc.core.structured.compiler import tokenizer_loader
from scheduler_svc.core.structured.grammars import grammar_of
from support.loopback_engine import FakeExecutor, LoopbackTransport, pump
from support.structured_serving import EOS, VOCAB, allowed_tokens, masks_of

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


def masking_engine(model_dir: str, fail: set[int] = frozenset(), depth: int = 2) -> tuple[EngineCore, LoopbackTransport,
                                                                                         MaskingExecutor]:
    transport = LoopbackTransport()
    core = EngineCore(EngineConfig(model=model_dir, block_size=4, max_num_seqs=8, max_num_batched_tokens=64,
                                   max_steps_in_flight=depth), transport)
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


@pytest.mark.parametrize("depth", [2, 3])
def test_a_constrained_request_decodes_every_step_with_its_later_masks_sent_late(embedded_model, depth):
    core, transport, executor = masking_engine(embedded_model, depth=depth)
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


class OrderWatchingExecutor(MaskingExecutor):
    """Notes, as each LateTokenMasks comes after a step that sampled a free sequence, how many of its tokens
    rank 0 has sent and how many the scheduler has applied."""

    def __init__(self, transport: LoopbackTransport, core: EngineCore, request_id: str) -> None:
        super().__init__(transport)
        self.core, self.request_id = core, request_id
        self.free_sent, self.answered_free, self.seen = 0, False, []

    def free(self):
        return self.core.scheduler.requests.get((FRONT, self.request_id))

    def receive(self, msg: engine_pb2.SchedulerToExecutor) -> None:
        if msg.WhichOneof("kind") == "late_masks" and self.answered_free and self.free() is not None:
            self.seen.append((self.free_sent, self.free().num_output_tokens))
        super().receive(msg)

    def answer(self, step_id: int, sampling, masks: dict[int, np.ndarray]) -> None:
        free = self.free()
        self.answered_free = free is not None and any(c.seq.seq_id == free.seq_id for c in sampling)
        self.free_sent += self.answered_free
        super().answer(step_id, sampling, masks)


def test_the_late_masks_go_to_rank_0_before_the_rest_of_the_step_is_applied(embedded_model):
    core, transport, _ = masking_engine(embedded_model)
    watcher = OrderWatchingExecutor(transport, core, "f")
    watcher.epoch = transport.executors[0].epoch
    transport.executors[0] = watcher
    transport.from_frontend(FRONT, add("c", [100, 101, 102], 12, LETTERS))
    while not core.scheduler.running:  # its grammar compiles first: the free one starts beside it, not before
        core.run_once(idle_poll_ms=1)
    transport.from_frontend(FRONT, add("f", [200, 201], 8))
    pump(core, 20000)
    assert outputs(transport, "f")[0] == [7] * 8 and len(outputs(transport, "c")[0]) == 12
    assert len(watcher.seen) >= 6
    # each time, the step rank 0 just answered has not touched the free sequence yet: only the late rows' matchers
    assert all(applied == sent - 1 for sent, applied in watcher.seen)


@pytest.fixture(scope="module")
def lltokenizer(embedded_model):
    return tokenizer_loader(embedded_model, VOCAB, (EOS,))()


def first_allowed(lltokenizer, constraint: engine_pb2.Constraint) -> int:
    """The token MaskingExecutor samples first under the constraint: the smallest its mask allows."""
    matcher = llguidance.LLMatcher(lltokenizer, grammar_of(constraint))
    mask = allocate_token_bitmask(1, VOCAB)
    fill_next_token_bitmask(matcher, mask)
    return int(allowed_tokens(mask[0])[0])


@pytest.mark.parametrize("ending", ["grammar", "stop token"])
def test_a_late_row_whose_sequence_the_answered_token_ends_is_dropped_not_masked(embedded_model, lltokenizer,
                                                                                 ending):
    core, transport, executor = masking_engine(embedded_model)
    if ending == "grammar":  # the matcher stops on the token that completes the text
        request = add("c", [100, 101, 102], 20, engine_pb2.Constraint(regex="[a-z]{5}"))
    else:  # the stop rules end it before the grammar sees the token
        request = add("c", [100, 101, 102], 20, LETTERS)
        request.add.stopping.stop_token_ids.append(first_allowed(lltokenizer, LETTERS))
        request.add.stopping.min_tokens = 3
    transport.from_frontend(FRONT, request)
    while not core.scheduler.running:  # its grammar compiles first
        core.run_once(idle_poll_ms=1)
    transport.from_frontend(FRONT, add("f", [200, 201], 20))  # keeps the steps coming
    pump(core, 20000)
    tokens, reason, _ = outputs(transport, "c")
    assert reason == engine_pb2.FINISH_REASON_STOP
    if ending == "grammar":
        assert len(lltokenizer.decode_str(tokens)) == 5 and len(tokens) > 1
    else:
        assert len(tokens) == 3
    masked = [m.step_id for m in executor.late_received if m.masks.seq_ids]
    dropped = [m.step_id for m in executor.late_received if m.dropped_seq_ids]
    assert len(masked) == len(tokens) - 1 and masked == list(range(masked[0], masked[0] + len(masked)))
    # while a constrained sequence runs two steps are planned ahead (EngineCore._depth): the rows planned past
    # its last token are never masked
    assert dropped == [masked[-1] + 1, masked[-1] + 2]
