"""The draft model's one-token steps through its decode graphs' static inputs propose what its eager steps propose.
On the CPU the graph is replayed by running its captured forward over the same static buffers (no CUDA): the
staging, the gather of each step's input from the previous draw, positions, slots and block tables are the
graphs' own; tests/e2e/test_gpu_draft_speculation.py runs the real graphs on CUDA."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from executor_svc.cuda_graphs import DecodeGraphs
from executor_svc.seq_mirror import MirroredSeq, ScheduledChunk
from protos import engine_pb2
from support.tiny_checkpoints import tiny_checkpoint

BLOCK = 16


class ReplayedByForward(DecodeGraphs):
    """DecodeGraphs whose replay is its captured forward run again, eagerly, over the same static buffers."""

    def capture(self) -> None:
        self.graphs = {bs: None for bs in self.buckets}

    def run(self, bs: int, b: int) -> torch.Tensor:
        self._forward(bs)
        return self.hidden[:b]


@pytest.fixture(scope="module")
def draft(tmp_path_factory):
    from executor_svc.draft_model import DraftModel
    from executor_svc.pinned_staging import PinnedStaging
    from scheduler_svc.common.config import EngineConfig

    config = EngineConfig(model=tiny_checkpoint("llama", tmp_path_factory), device="cpu", block_size=BLOCK,
                          speculative_method="draft", draft_model=tiny_checkpoint("qwen2", tmp_path_factory),
                          num_speculative_tokens=4, max_num_batched_tokens=40)
    model = DraftModel(config, 256, torch.float32, torch.device("cpu"), 0, 1, PinnedStaging(torch.device("cpu")))
    model.allocate(32, 512)
    return model


def chunks_of(prompts: list[list[int]], k: int) -> list[ScheduledChunk]:
    """One decode per prompt (its last token the input), k draft proposals each, on blocks of its own."""
    chunks = []
    for i, prompt in enumerate(prompts):
        blocks = list(range(4 * i, 4 * i + 4))
        seq = MirroredSeq(i, list(prompt), len(prompt), blocks, len(prompt) - 1, engine_pb2.SamplingOptions())
        chunks.append(ScheduledChunk(seq, len(prompt) - 1, len(prompt) + k, num_draft=k))
    return chunks


def verdict_then_next(chunks: list[ScheduledChunk], accepted: list[int], k: int) -> list[ScheduledChunk]:
    """Apply a verdict (each chunk's leading proposals accepted, then token 1), as the mirrors do, and the next
    decode's chunks with k draft proposals: the draft catches up on a token or two (DESIGN.md)."""
    nxt = []
    for c, a in zip(chunks, accepted):
        seq = c.seq
        seq.token_ids += [*c.proposal[:a], 1]
        seq.draft_computed = c.start + 1 + min(a, c.num_draft - 1)
        start = len(seq.token_ids) - 1
        nxt.append(ScheduledChunk(seq, start, start + 1 + k, num_draft=k))
    return nxt


def two_rounds(draft, prompts: list[list[int]], cut_last: bool) -> list[list[int]]:
    """Both rounds' proposals: after the prompts (a long catch-up: eager), then after a verdict (short)."""
    rng = np.random.default_rng(0)
    first = chunks_of(prompts, 4)
    if cut_last:  # a row cut short leaves the later steps, whose batch shrinks
        first[2].num_draft, first[2].end = 2, first[2].end - 2
    draft.propose(first, {}, rng)
    second = verdict_then_next(first, [2, 4, 0], 3)  # catch-ups of 1, 2 and 1 tokens
    draft.propose(second, {}, rng)
    return [c.proposal for c in first + second]


def test_graph_steps_propose_what_eager_steps_propose(draft, monkeypatch):
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 256, size=n).tolist() for n in (5, 23, 40)]  # the one-token steps pad 3 rows to 4
    draft.graphs = None
    eager = two_rounds(draft, prompts, cut_last=False)  # the 68-token catch-up also splits at the 40-token budget
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda t: t)  # (the graphs' host buffers; no CUDA here)
    draft.graphs = ReplayedByForward(draft.model, 8, 512, BLOCK, draft.facts.hidden_size, torch.float32,
                                     torch.device("cpu"), host_buffers=5)
    draft.graphs.capture()
    try:
        graphs = two_rounds(draft, prompts, cut_last=True)
    finally:
        draft.graphs = None
    assert graphs[:2] == eager[:2] and graphs[2] == eager[2][:2]
    assert graphs[3:] == eager[3:]  # the short catch-ups ran as one-token rows in the graph
    assert len({tuple(p) for p in eager[:3]}) == 3 and all(len(p) == 3 for p in eager[3:])


@pytest.mark.parametrize("moved_back", [False, True])
def test_a_rank_behind_rank_0_appends_its_pending_step_before_a_plan_that_needs_its_tokens(tmp_path_factory,
                                                                                           moved_back):
    """Only rank 0 answers the scheduler, so rank 1 may read the next plan while its copy of the step before is
    still pending. A plan that drafts for a sequence (the draft needs every token on the host), or that moves its
    start back after a short verdict (the start must be a token it has), makes it append that step first."""
    from executor_svc.executor import StepLoop
    from executor_svc.model_runner import ModelRunner
    from executor_svc.seq_mirror import SequenceMirrors
    from scheduler_svc.common.config import EngineConfig
    from test_token_masks import new_seq

    model = tiny_checkpoint("llama", tmp_path_factory)
    runner = ModelRunner(EngineConfig(model=model, device="cpu", block_size=BLOCK, num_gpu_blocks=8, max_num_seqs=4,
                                      speculative_method="draft", draft_model=model, num_speculative_tokens=2))
    loop = StepLoop(runner, SequenceMirrors(), None, 1)  # rank 1: it sends nothing
    loop.run_plan(engine_pb2.StepPlan(step_id=1, new_seqs=[new_seq(1, [5, 6, 7], 0)]))  # its token still pending
    cached = engine_pb2.CachedSequences(seq_ids=[1], num_new_blocks=[0], last_token_ids=[-1])
    if moved_back:  # a plain decode of the token pending here, its start sent as after a short verdict
        cached.num_scheduled_tokens.append(1)
        cached.guessed_token_ids.append(-1)
        cached.chunk_starts.append(3)
    else:  # two proposals drafted after it
        cached.num_scheduled_tokens.append(3)
        cached.num_draft_tokens.append(2)
    loop.run_plan(engine_pb2.StepPlan(step_id=2, cached=cached))
    loop.reply_pending()
    seq = loop.mirrors.seqs.get(1)
    assert seq is not None, "the step failed (the mirror was dropped)"
    assert len(seq.token_ids) == 3 + 1 + (1 if moved_back else 3)  # the self-draft's proposals are all accepted
