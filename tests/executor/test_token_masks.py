"""Structured output on the executor: a plan's token bitmasks reach the chunks of their sequences, and the
sampler never picks a token a row's mask forbids (greedy, random, filtered, penalized, on the CPU and CUDA),
leaves unmasked rows alone, and keeps logprobs raw."""
from __future__ import annotations

import re

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from executor_svc.model_runner import ModelRunner
from executor_svc.sampler import Sampler, SamplingBatch, apply_token_masks
from executor_svc.seq_mirror import SequenceMirrors, attach_token_masks, draw_masks
from protos import engine_pb2
from scheduler_svc.common.config import EngineConfig
from support.tiny_checkpoints import make_tiny_llama

CUDA = pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")])
DEVICES = ["cpu", CUDA]


def bitmask(allowed, vocab: int) -> np.ndarray:
    """int32 words as the scheduler sends them: bit t % 32 of word t // 32 set for each allowed token t."""
    bits = np.zeros(-(-vocab // 32) * 32, dtype=np.uint8)
    bits[list(allowed)] = 1
    return np.packbits(bits, bitorder="little").view("<i4").copy()


def sample(logits: torch.Tensor, options, masks, device: str, outputs=None):
    batch = SamplingBatch.build(options, [[1, 2]] * len(options), outputs or [[]] * len(options),
                                logits.shape[-1], torch.device(device), token_masks=masks)
    return Sampler()(logits.to(device), batch)


@pytest.mark.parametrize("vocab", [64, 50, 151_936])
def test_token_t_is_bit_t_mod_32_of_word_t_div_32(vocab):
    allowed = sorted({0, 5, 31, 32, 33, vocab - 1, vocab // 2})
    logits = torch.zeros(2, vocab)
    words = torch.from_numpy(bitmask(allowed, vocab))[None]
    masked = apply_token_masks(logits, torch.tensor([1]), words)
    assert torch.equal(logits, torch.zeros(2, vocab))  # a new tensor: the logits given stay as they were
    assert torch.isfinite(masked[0]).all()  # the unmasked row
    assert torch.nonzero(torch.isfinite(masked[1])).flatten().tolist() == allowed


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("options", [
    engine_pb2.SamplingOptions(temperature=0.0),
    engine_pb2.SamplingOptions(temperature=1.5),
    engine_pb2.SamplingOptions(temperature=1.0, top_k=3, top_p=0.9),
    engine_pb2.SamplingOptions(temperature=0.8, seed=7, repetition_penalty=1.3, presence_penalty=0.5),
], ids=["greedy", "temperature", "filters", "penalties-and-seed"])
def test_a_masked_row_samples_only_allowed_tokens_and_its_neighbours_are_untouched(device, options):
    vocab, rows = 300, 64
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(rows, vocab, generator=gen) * 4
    allowed = [[int(t) for t in torch.randperm(vocab, generator=gen)[:5]] for _ in range(rows)]
    masks = [bitmask(a, vocab) if i % 2 else None for i, a in enumerate(allowed)]
    greedy_free = engine_pb2.SamplingOptions(temperature=0.0)
    opts = [options if i % 2 else greedy_free for i in range(rows)]
    out = sample(logits, opts, masks, device, outputs=[[3, 4]] * rows).token_ids.cpu()
    for i in range(1, rows, 2):
        assert int(out[i]) in allowed[i]
    assert torch.equal(out[0::2], logits[0::2].argmax(-1))  # greedy rows without a mask: the plain argmax


@pytest.mark.parametrize("device", DEVICES)
def test_greedy_under_a_mask_is_the_argmax_of_the_allowed_tokens(device):
    logits = torch.randn(4, 100, generator=torch.Generator().manual_seed(1))
    allowed = [[2, 40, 77], [0], [99, 98], list(range(50, 100))]
    out = sample(logits, [engine_pb2.SamplingOptions(temperature=0.0)] * 4,
                 [bitmask(a, 100) for a in allowed], device).token_ids.cpu()
    assert out.tolist() == [max(a, key=lambda t, r=r: logits[r, t]) for r, a in enumerate(allowed)]


@pytest.mark.parametrize("device", DEVICES)
def test_a_masked_draw_follows_the_distribution_renormalized_over_the_allowed_tokens(device):
    torch.manual_seed(0)
    vocab, draws, allowed = 40, 12000, [3, 9, 10, 31, 32]
    row = torch.randn(1, vocab, generator=torch.Generator().manual_seed(2))
    logits = row.expand(draws, vocab).contiguous()
    out = sample(logits, [engine_pb2.SamplingOptions(temperature=1.0)] * draws,
                 [bitmask(allowed, vocab)] * draws, device).token_ids.cpu()
    probs = row[0, allowed].softmax(-1)
    counts = torch.tensor([(out == t).sum() for t in allowed]).double()
    assert int(counts.sum()) == draws
    chi_square = float(((counts - probs * draws) ** 2 / (probs * draws)).sum())
    assert chi_square < 25.0  # 4 degrees of freedom: exceeded with probability below 1e-4


def test_logprobs_stay_those_of_the_raw_distribution():
    logits = torch.randn(1, 64, generator=torch.Generator().manual_seed(3))
    out = sample(logits, [engine_pb2.SamplingOptions(temperature=0.0, logprobs=2)], [bitmask([5], 64)], "cpu")
    raw = logits.log_softmax(-1)
    assert int(out.token_ids[0]) == 5
    assert torch.allclose(out.sampled_logprobs, raw[:, 5])
    assert out.top_token_ids[0].tolist() == raw[0].topk(2).indices.tolist()


# ---------------------------------------------------------------- through the plan mirrors and the model runner


def plan_with_masks(step_id: int, seqs, masks: dict[int, np.ndarray], num_words: int, **fields) -> engine_pb2.StepPlan:
    plan = engine_pb2.StepPlan(step_id=step_id, **fields)
    plan.new_seqs.extend(seqs)
    if masks:
        plan.token_bitmasks.CopyFrom(engine_pb2.TokenBitmasks(
            seq_ids=list(masks), num_words=num_words, words=b"".join(m.tobytes() for m in masks.values())))
    return plan


def new_seq(seq_id: int, prompt: list[int], block: int) -> engine_pb2.NewSequence:
    return engine_pb2.NewSequence(seq_id=seq_id, token_ids=prompt, num_prompt_tokens=len(prompt), block_ids=[block],
                                  num_scheduled_tokens=len(prompt), sampling=engine_pb2.SamplingOptions())


def test_the_plans_masks_reach_the_chunks_of_their_sequences_and_no_other():
    mask = bitmask([4, 5], 64)
    chunks = SequenceMirrors().apply(plan_with_masks(1, [new_seq(1, [1, 2], 0), new_seq(2, [3], 1)], {2: mask}, 2))
    assert chunks[0].token_mask is None and np.array_equal(chunks[1].token_mask, mask)


@settings(max_examples=40, deadline=None)
@given(num_chunks=st.integers(1, 12), data=st.data())
def test_the_fused_draw_gets_each_rows_own_mask_and_the_messages_words_uncopied(num_chunks, data):
    """draw_masks: every masked row points at exactly its own mask and free rows at -1; when all masks came in
    one message its array is used as it is, and masks from two messages are stacked."""
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    vocab = 100
    chunks = SequenceMirrors().apply(plan_with_masks(1, [new_seq(i + 1, [1, 2], i) for i in range(num_chunks)], {}, 4))
    message_of = data.draw(st.lists(st.sampled_from([0, 1, 2]), min_size=num_chunks, max_size=num_chunks))
    first, second = ([i for i, m in enumerate(message_of) if m == k] for k in (1, 2))  # 0: a free row
    masks = {}
    for group in (first, second):  # each group arrives as one message, rows in a shuffled order
        if group:
            order = list(rng.permutation(group))
            for i in order:
                masks[i] = bitmask(rng.choice(vocab, size=int(rng.integers(1, vocab)), replace=False), vocab)
            message = engine_pb2.TokenBitmasks(seq_ids=[i + 1 for i in order], num_words=4,
                                               words=b"".join(masks[i].tobytes() for i in order))
            attach_token_masks(1, message, chunks)
    got = draw_masks(chunks)
    if not masks:
        assert got is None
        return
    rows, words = got
    assert rows.dtype == np.int32 and words.dtype == np.int32 and words.shape[1] == 4
    for i, chunk in enumerate(chunks):
        if i in masks:
            assert np.array_equal(words[rows[i]], masks[i])
        else:
            assert rows[i] == -1
    if not (first and second):  # one message: its own array, not a copy
        assert words is next(c.mask_words for c in chunks if c.token_mask is not None)


def test_a_mask_sent_once_for_several_sequences_reaches_each_of_them():
    shared, own = bitmask([4, 5], 64), bitmask([9], 64)
    seqs = [new_seq(i, [1, 2], i) for i in (1, 2, 3, 4)]
    plan = plan_with_masks(1, seqs, {}, 2)
    plan.token_bitmasks.CopyFrom(engine_pb2.TokenBitmasks(seq_ids=[4, 1, 3], num_words=2, rows=[0, 1, 0],
                                                          words=shared.tobytes() + own.tobytes()))
    chunks = SequenceMirrors().apply(plan)
    assert chunks[1].token_mask is None
    for chunk, mask in ((chunks[0], own), (chunks[2], shared), (chunks[3], shared)):
        assert np.array_equal(chunk.token_mask, mask)
    rows, words = draw_masks(chunks)
    assert rows.tolist() == [1, -1, 0, 0] and words is chunks[0].mask_words  # the two rows as they came


@pytest.mark.parametrize("words, seq_ids, rows, why", [
    (b"\0" * 12, [1], [], "hold 12 bytes and 0 rows, not masks of 2 words for 1 seqs"),
    (b"\0" * 8, [9], [], "for seqs [9] that the step does not run"),
    (b"\0" * 8, [1, 2], [0], "hold 8 bytes and 1 rows, not masks of 2 words for 2 seqs"),  # a row list too short
    (b"\0" * 8, [1, 2], [0, 1], "name rows up to 1 of 1 for 2 seqs"),  # a row past the words
    (b"\0" * 24, [1, 2], [0, 1], "name rows up to 1 of 3 for 2 seqs"),  # more masks than sequences
    (b"\0" * 8, [1, 1], [0, 0], "name a seq twice"),
])
def test_masks_that_do_not_fit_the_plan_fail_the_step(words, seq_ids, rows, why):
    plan = plan_with_masks(1, [new_seq(1, [1, 2], 0), new_seq(2, [3], 1)], {}, 2)
    plan.token_bitmasks.CopyFrom(engine_pb2.TokenBitmasks(seq_ids=seq_ids, num_words=2, words=words, rows=rows))
    with pytest.raises(RuntimeError, match=re.escape(why)):
        SequenceMirrors().apply(plan)


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> str:
    return make_tiny_llama(str(tmp_path_factory.mktemp("masks") / "llama"))


def run_prefill_and_decode(runner: ModelRunner, allowed_by_step: dict[int, list[int]]) -> dict[int, list[int]]:
    """Two sequences of one prompt, a prefill step then a decode step; seq 2 masked where allowed_by_step
    says. The tokens each sampled."""
    vocab, mirrors, sampled = runner.facts.vocab_size, SequenceMirrors(), {1: [], 2: []}
    for step in (1, 2):
        masks = {2: bitmask(allowed_by_step[step], vocab)} if step in allowed_by_step else {}
        plan = plan_with_masks(step, [new_seq(1, [5, 6, 7], 0), new_seq(2, [5, 6, 7], 1)] if step == 1 else [],
                               masks, -(-vocab // 32))
        if step == 2:
            plan.cached.CopyFrom(engine_pb2.CachedSequences(seq_ids=[1, 2], num_scheduled_tokens=[1, 1],
                                                            num_new_blocks=[0, 0], last_token_ids=[-1, -1]))
        chunks = mirrors.apply(plan)
        inputs = runner.launch(chunks)
        mirrors.commit(chunks)
        for token in runner.finalize(runner.sample(inputs)):
            mirrors.append_sampled(token.seq_id, token.token_id)
            sampled[token.seq_id].append(token.token_id)
    return sampled


@pytest.mark.parametrize("device", DEVICES)
def test_the_runner_samples_a_masked_sequence_inside_its_mask_and_leaves_the_other_alone(tiny_llama, device):
    """On CUDA the decode step runs in a CUDA graph that samples in place; a masked row is drawn again from the
    graph's logits with its mask (the prefill step, eager, goes through the sampler)."""
    runner = ModelRunner(EngineConfig(model=tiny_llama, device=device, dtype="float32", block_size=16,
                                      num_gpu_blocks=8, max_num_seqs=4, attention_backend="torch"))
    free = run_prefill_and_decode(runner, {})
    masked = run_prefill_and_decode(runner, {1: [10, 200], 2: [3]})
    assert masked[1] == free[1] and free[1] == free[2]  # greedy: the same prompt, the same tokens
    assert masked[2][0] in (10, 200) and masked[2][1] == 3
