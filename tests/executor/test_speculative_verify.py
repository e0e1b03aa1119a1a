"""Verifying proposals (speculative decoding): greedy rows keep the argmax, and rejection sampling keeps the
target's distribution, checked by chi-square on a tiny model's logits; the same check rejects wrong rules."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from executor_svc.sampler import Sampler, SamplingBatch
from executor_svc.seq_mirror import MirroredSeq, ScheduledChunk
from executor_svc.speculative_verify import (draws_decide, plain_rows, rejection_sample, target_probs,
                                             verdict_from_draws, verify_chunks)
from protos import engine_pb2
from support.tiny_checkpoints import tiny_checkpoint

PROMPT = [5, 17, 42, 9, 100, 5, 17, 42]
DRAWS = 20_000


def host_upload(arrays, group=""):
    return {name: torch.from_numpy(a.copy()) for name, a in arrays.items()}


def chunk(seq_id: int, options: engine_pb2.SamplingOptions, proposal: list[int], prompt=PROMPT) -> ScheduledChunk:
    seq = MirroredSeq(seq_id, list(prompt), len(prompt), [0] * 4, len(prompt) - 1, options)
    return ScheduledChunk(seq, len(prompt) - 1, len(prompt) + len(proposal), proposal=proposal)


def chi_square_p(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """p-value of observed counts against expected probabilities; cells expecting fewer than 5 are pooled."""
    expected = probs.double() * counts.sum()
    big = expected >= 5
    obs = torch.cat([counts[big].double(), counts[~big].double().sum().reshape(1)])
    exp = torch.cat([expected[big], expected[~big].sum().reshape(1)])
    if exp[-1] < 5:  # nothing worth a cell left over
        obs, exp = obs[:-1], exp[:-1]
    stat = ((obs - exp) ** 2 / exp).sum()
    df = len(obs) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), stat / 2))


@pytest.fixture(scope="module")
def tiny_logits(tmp_path_factory):
    """A tiny random Llama's logits after PROMPT, and two proposals: the second most likely next token (so some
    are accepted and some not) and then the likeliest after it. Returns (logits [3, V] for the proposals'
    positions and the one after, proposals)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoint("llama", tmp_path_factory)).eval()
    with torch.no_grad():
        first = model(torch.tensor([PROMPT])).logits[0, -1]
        d1 = int(first.topk(2).indices[1])
        second = model(torch.tensor([PROMPT + [d1]])).logits[0, -1]
        d2 = int(second.argmax())
        logits = model(torch.tensor([PROMPT + [d1, d2]])).logits[0, -3:]
    return logits.float(), [d1, d2]


FILTERS = {"temperature 1": {}, "top-k": dict(top_k=12), "top-p": dict(top_p=0.8), "min-p": dict(min_p=0.05)}


def verify_many(logits: torch.Tensor, proposal: list[int], options: engine_pb2.SamplingOptions, n: int):
    """n verifications of the same rows, one chunk each: (first new token, second new token or -1) per chunk."""
    chunks = [chunk(i, options, proposal) for i in range(n)]
    verdict = verify_chunks(logits.repeat(n, 1), chunks, logits.shape[1], host_upload, None, {})
    accepted, last = verdict.num_accepted, verdict.token_ids
    d = torch.tensor(proposal)
    first = torch.where(accepted >= 1, d[0], last)
    second = torch.where(accepted >= 2, d[1], torch.where(accepted == 1, last, -1))
    return first, second, accepted


@pytest.mark.parametrize("name", list(FILTERS))
def test_rejection_sampling_keeps_the_target_distribution_at_each_position(tiny_logits, name):
    logits, proposal = tiny_logits
    options = engine_pb2.SamplingOptions(temperature=1.0, **FILTERS[name])
    probs = target_probs(logits, [chunk(0, options, proposal).seq.sampling_row] * 3, logits.shape[1])
    torch.manual_seed(0)
    first, second, accepted = verify_many(logits, proposal, options, DRAWS)
    assert 0.02 < (accepted >= 1).float().mean() < 0.98, "the proposal should be accepted only sometimes"
    vocab = logits.shape[1]
    assert chi_square_p(torch.bincount(first, minlength=vocab), probs[0]) > 1e-3
    # given the first proposal was accepted, the second token follows the target at the next position
    after = second[first == proposal[0]]
    assert chi_square_p(torch.bincount(after, minlength=vocab), probs[1]) > 1e-3
    # and every dropped token stays dropped
    assert probs[0][first].min() > 0 and probs[1][after].min() > 0


def test_the_chi_square_check_rejects_biased_acceptance_rules(tiny_logits):
    """The check above would fail for a wrong rule: accepting every proposal, or accepting with p(d) but
    redrawing from the whole distribution instead of the residual (which favours the proposal)."""
    logits, proposal = tiny_logits
    options = engine_pb2.SamplingOptions(temperature=1.0)
    probs = target_probs(logits, [chunk(0, options, proposal).seq.sampling_row] * 3, logits.shape[1])
    torch.manual_seed(0)
    u = torch.rand(DRAWS, 2, dtype=torch.float64)
    d = proposal[0]
    always = torch.full((DRAWS,), d)
    redraw_all = torch.where(u[:, 0] < probs[0, d], d, torch.multinomial(probs[0], DRAWS, replacement=True))
    vocab = logits.shape[1]
    for wrong in (always, redraw_all):
        assert chi_square_p(torch.bincount(wrong, minlength=vocab), probs[0]) < 1e-6
    # and the check is fair: the plain sampler's own draws over the same logits pass it
    batch = SamplingBatch.build([options] * DRAWS, [[]] * DRAWS, [[]] * DRAWS, vocab, torch.device("cpu"))
    drawn = Sampler()(logits[:1].expand(DRAWS, -1), batch).token_ids
    assert chi_square_p(torch.bincount(drawn, minlength=vocab), probs[0]) > 1e-3


def test_greedy_rows_accept_the_argmax_only_and_yield_it():
    torch.manual_seed(1)
    logits = torch.randn(4, 50)
    best = logits.argmax(dim=-1)
    greedy = torch.ones(4, dtype=torch.bool)
    drafts = torch.tensor([int(best[0]), int(best[1]), (int(best[2]) + 1) % 50, -1])
    probs = logits.double().softmax(dim=-1)
    accepted, yielded = rejection_sample(probs, greedy, drafts, torch.rand(4, 2, dtype=torch.float64))
    assert accepted.tolist() == [True, True, False, False]
    assert yielded.tolist() == best.tolist()


def test_a_greedy_verification_stops_at_the_first_wrong_proposal():
    torch.manual_seed(2)
    logits = torch.randn(4, 50)
    best = logits.argmax(dim=-1).tolist()
    proposal = [best[0], best[1], (best[2] + 1) % 50]
    verdict = verify_chunks(logits, [chunk(7, engine_pb2.SamplingOptions(temperature=0.0), proposal)], 50,
                            host_upload, None, {})
    assert verdict.num_accepted.tolist() == [2] and verdict.token_ids.tolist() == [best[2]]


def test_a_seeded_verification_depends_on_its_seed_alone(tiny_logits):
    logits, proposal = tiny_logits
    seeded = engine_pb2.SamplingOptions(temperature=1.0, seed=1234)
    free = engine_pb2.SamplingOptions(temperature=1.0)

    def run(neighbours: int):
        chunks = [chunk(i, free, proposal) for i in range(neighbours)] + [chunk(99, seeded, proposal)]
        verdict = verify_chunks(logits.repeat(len(chunks), 1), chunks, logits.shape[1], host_upload, None, {})
        return verdict.num_accepted[-1].item(), verdict.token_ids[-1].item()

    assert run(0) == run(5) == run(17)
    other = [chunk(99, engine_pb2.SamplingOptions(temperature=1.0, seed=s), proposal) for s in range(40)]
    verdicts = verify_chunks(logits.repeat(40, 1), other, logits.shape[1], host_upload, None, {})
    assert len(set(zip(verdicts.num_accepted.tolist(), verdicts.token_ids.tolist()))) > 1


def test_verification_rows_score_each_proposal_as_transformers_does(tmp_path_factory):
    """A verifying step run as one-token rows (the decode path, and on CUDA the decode graphs) gives each
    position the logits of the varlen path and of transformers over the prompt and the proposals."""
    from transformers import AutoModelForCausalLM

    from executor_svc.input_batch import device_inputs, host_inputs, verification_rows
    from executor_svc.model_loader import load_model
    from executor_svc.pinned_staging import PinnedStaging
    from kernels.attention.torch_backend import TorchAttentionBackend

    path = tiny_checkpoint("llama", tmp_path_factory)
    model, _ = load_model(path, torch.float32, torch.device("cpu"), TorchAttentionBackend())
    bs, staging = 4, PinnedStaging(torch.device("cpu"))
    gen = torch.Generator().manual_seed(3)
    for attn in model.attention_layers():  # a pool of garbage, as a reused one holds
        attn.k_cache = torch.randn(32, bs, attn.num_kv_heads, attn.head_dim, generator=gen)
        attn.v_cache = torch.randn(32, bs, attn.num_kv_heads, attn.head_dim, generator=gen)
    prompts, proposals = [PROMPT, [7, 3, 250, 3, 7]], [[11, 12, 13], [4]]
    tables = [[9, 2, 30, 14], [5, 21, 7]]

    def run(chunks, rows: bool):
        host = verification_rows(chunks, bs, {}) if rows else host_inputs(chunks, bs, {})
        inputs = device_inputs(host, staging, bs, None)
        hidden = model(inputs.input_ids, inputs.positions, inputs.meta)
        return model.compute_logits(hidden[inputs.logits_indices])

    with torch.no_grad():
        # the prompts but their last token, computed first
        prefill = [ScheduledChunk(MirroredSeq(i, p, len(p), t, 0, engine_pb2.SamplingOptions()), 0, len(p) - 1)
                   for i, (p, t) in enumerate(zip(prompts, tables))]
        run(prefill, rows=False)
        chunks = [chunk(i, engine_pb2.SamplingOptions(), d, prompt=p) for i, (p, d) in enumerate(zip(prompts, proposals))]
        for c, t in zip(chunks, tables):  # the blocks the prefill wrote
            c.seq.cut_blocks(0)
            c.seq.add_blocks(t)
        as_rows = run(chunks, rows=True)
        as_varlen = run(chunks, rows=False)
        hf = AutoModelForCausalLM.from_pretrained(path).eval()
        ref = torch.cat([hf(torch.tensor([p + d])).logits[0, len(p) - 1:] for p, d in zip(prompts, proposals)])
    assert as_rows.shape == (len(proposals[0]) + len(proposals[1]) + 2, 256)
    torch.testing.assert_close(as_rows, as_varlen, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(as_rows, ref.float(), atol=1e-4, rtol=1e-4)


def plain_sampler(options: engine_pb2.SamplingOptions, vocab: int):
    """verify_chunks' sample_plain: the ordinary sampler over the given rows."""
    def sample(rows: torch.Tensor, chunks: list[ScheduledChunk]):
        n = len(chunks)
        return Sampler()(rows, SamplingBatch.build([options] * n, [[]] * n, [[]] * n, vocab, torch.device("cpu")))
    return sample


def test_a_chunk_whose_guess_failed_draws_from_the_target_not_the_residual(tiny_logits):
    """Async verification: a chunk whose pending input was not the token guessed drops its proposals; its token
    must follow p_0 itself (a draw from the residual p_0 - onehot(d_0) would never yield d_0)."""
    logits, proposal = tiny_logits
    options = engine_pb2.SamplingOptions(temperature=1.0)
    vocab = logits.shape[1]
    probs = target_probs(logits, [chunk(0, options, proposal).seq.sampling_row], vocab)
    chunks = [chunk(i, options, proposal) for i in range(DRAWS)]
    for c in chunks:
        c.proposals_dropped = True
    torch.manual_seed(0)
    verdict = verify_chunks(logits.repeat(DRAWS, 1), chunks, vocab, host_upload, plain_sampler(options, vocab), {})
    assert int(verdict.num_accepted.sum()) == 0
    drawn = torch.bincount(verdict.token_ids, minlength=vocab)
    assert drawn[proposal[0]] > 0 and chi_square_p(drawn, probs[0]) > 1e-3


def test_a_dropped_chunk_and_a_verified_one_share_a_step():
    torch.manual_seed(3)
    logits = torch.randn(8, 50)  # rows 0-3: the verified chunk's, rows 4-7: the dropped one's
    best = logits.argmax(dim=-1).tolist()
    greedy = engine_pb2.SamplingOptions(temperature=0.0)
    verified, dropped = chunk(1, greedy, best[:3]), chunk(2, greedy, [best[4], best[5], best[6]])
    dropped.proposals_dropped = True  # all its proposals are right, but its guess was not
    verdict = verify_chunks(logits, [verified, dropped], 50, host_upload, plain_sampler(greedy, 50), {})
    assert verdict.num_accepted.tolist() == [3, 0] and verdict.token_ids.tolist() == [best[3], best[4]]


GREEDY = engine_pb2.SamplingOptions(temperature=0.0)


@st.composite
def greedy_steps(draw):
    """A step of greedy chunks: each with 0..5 proposals that follow the argmax for a drawn number of rows and
    then go wrong (or not), some void or with a failed guess; with logits to match."""
    vocab = 11
    chunks, logits = [], []
    for i in range(draw(st.integers(1, 5))):
        k = draw(st.integers(0, 5))
        rows = torch.randn(k + 1, vocab, generator=torch.Generator().manual_seed(draw(st.integers(0, 2**16))))
        best = rows.argmax(dim=-1).tolist()
        right = draw(st.integers(0, k))
        proposal = best[:right] + [(b + 1) % vocab for b in best[right:k]]
        c = chunk(i, GREEDY, proposal)
        c.void = bool(k) and draw(st.booleans()) and draw(st.booleans())
        c.proposals_dropped = bool(k) and not c.void and draw(st.booleans()) and draw(st.booleans())
        chunks.append(c)
        logits.append(rows)
    return torch.cat(logits), chunks


@settings(max_examples=60, deadline=None)
@given(greedy_steps())
def test_the_greedy_verdict_from_row_argmaxes_equals_the_full_verification(step):
    logits, chunks = step
    assert plain_rows(chunks)
    full = verify_chunks(logits, chunks, logits.shape[1], host_upload, plain_sampler(GREEDY, logits.shape[1]), {})
    fast = verdict_from_draws(logits.argmax(dim=-1), chunks, host_upload)
    assert fast.num_accepted.tolist() == full.num_accepted.tolist()
    # a void chunk yields nothing, so its token is free; every other one must match
    live = [i for i, c in enumerate(chunks) if not c.void]
    assert [fast.token_ids.tolist()[i] for i in live] == [full.token_ids.tolist()[i] for i in live]


def test_a_step_with_filtered_seeded_logprob_or_masked_rows_takes_the_full_verification():
    plain = chunk(0, GREEDY, [1, 2])
    assert plain_rows([plain, chunk(1, engine_pb2.SamplingOptions(temperature=0.7), [1])])
    assert not plain_rows([plain, chunk(2, engine_pb2.SamplingOptions(temperature=0.7, top_k=5), [1])])
    assert not plain_rows([plain, chunk(3, engine_pb2.SamplingOptions(temperature=0.7, seed=3), [1])])
    assert not plain_rows([plain, chunk(4, engine_pb2.SamplingOptions(temperature=0.0, logprobs=2), [])])
    masked = chunk(5, GREEDY, [])
    masked.late_mask = True
    assert not plain_rows([plain, masked])


def test_greedy_rows_are_decided_by_their_argmaxes_without_a_graph_and_sampled_ones_by_the_graphs_draws():
    """A verifying step beside a prefill chunk runs eagerly (no decode graph, so no draws): its greedy rows still need
    only their argmax; temperature rows need the graph's draws, else the full verification; a draft's q never takes
    the draw rule."""
    greedy, hot = chunk(0, GREEDY, [1, 2]), chunk(1, engine_pb2.SamplingOptions(temperature=0.7), [3])
    assert draws_decide([greedy, chunk(2, GREEDY, [])], drawn=False)
    assert not draws_decide([greedy, hot], drawn=False)
    assert draws_decide([greedy, hot], drawn=True)
    assert not draws_decide([greedy, chunk(3, engine_pb2.SamplingOptions(temperature=0.7, top_p=0.5), [1])],
                            drawn=True)
    drafted = chunk(4, GREEDY, [5])
    drafted.draft_probs = torch.full((1, 8), 1 / 8)
    assert not draws_decide([greedy, drafted], drawn=True)


def test_the_verdict_from_one_draw_per_row_keeps_the_target_distribution(tiny_logits):
    """What a decode graph does for plain sampled rows: each row drawn from its own distribution (here by
    torch.multinomial), a proposal accepted while the draws equal the proposals; for point-mass (n-gram) proposals
    this is rejection sampling, so the tokens follow the target at each position."""
    logits, proposal = tiny_logits
    options = engine_pb2.SamplingOptions(temperature=1.0)
    vocab = logits.shape[1]
    probs = target_probs(logits, [chunk(0, options, proposal).seq.sampling_row] * 3, vocab)
    chunks = [chunk(i, options, proposal) for i in range(DRAWS)]
    assert plain_rows(chunks)
    torch.manual_seed(0)
    draws = torch.multinomial(probs.repeat(DRAWS, 1).float(), 1).squeeze(1)
    verdict = verdict_from_draws(draws, chunks, host_upload)
    accepted, last = verdict.num_accepted, verdict.token_ids
    d = torch.tensor(proposal)
    first = torch.where(accepted >= 1, d[0], last)
    second = torch.where(accepted >= 2, d[1], torch.where(accepted == 1, last, -1))
    assert 0.02 < (accepted >= 1).float().mean() < 0.98, "the proposal should be accepted only sometimes"
    assert chi_square_p(torch.bincount(first, minlength=vocab), probs[0]) > 1e-3
    after = second[first == proposal[0]]
    assert chi_square_p(torch.bincount(after, minlength=vocab), probs[1]) > 1e-3


@pytest.fixture(scope="module")
def draft_model(tmp_path_factory):
    """A draft model (the tiny Qwen2: another distribution over the tiny Llama's 256 tokens) on the CPU, its pool
    of 1 block; every draw below shares that block, as all run the same prompt."""
    from executor_svc.draft_model import DraftModel
    from executor_svc.pinned_staging import PinnedStaging
    from scheduler_svc.common.config import EngineConfig

    config = EngineConfig(model=tiny_checkpoint("llama", tmp_path_factory), device="cpu",
                          speculative_method="draft", draft_model=tiny_checkpoint("qwen2", tmp_path_factory),
                          num_speculative_tokens=1, max_num_batched_tokens=16384)
    draft = DraftModel(config, 256, torch.float32, torch.device("cpu"), 0, 1, PinnedStaging(torch.device("cpu")))
    draft.allocate(1, 512)
    return draft


def drafted_chunks(draft, options: engine_pb2.SamplingOptions, n: int) -> list[ScheduledChunk]:
    """n sequences of PROMPT, each with one proposal drawn by the draft model (and its q row)."""
    chunks = []
    for i in range(n):
        seq = MirroredSeq(i, list(PROMPT), len(PROMPT), [0], len(PROMPT) - 1, options)
        chunks.append(ScheduledChunk(seq, len(PROMPT) - 1, len(PROMPT) + 1, num_draft=1))
    draft.propose(chunks, {}, np.random.default_rng(0))
    return chunks


@pytest.mark.parametrize("name", ["temperature 1", "top-k"])
def test_a_draft_models_draws_keep_the_target_distribution(tiny_logits, draft_model, name):
    """Proposals drawn from the draft's own distribution q (not a point mass): d ~ q, accepted with min(1, p/q),
    else a draw from max(0, p - q): the first token follows the target's p. Redrawing the rejected ones from p
    instead is detectably biased, so the check has the power to see a wrong residual."""
    logits, _ = tiny_logits
    options = engine_pb2.SamplingOptions(temperature=1.0, **FILTERS[name])
    row = chunk(0, options, []).seq.sampling_row
    probs = target_probs(logits[:1], [row], logits.shape[1])[0]
    torch.manual_seed(3)
    chunks = drafted_chunks(draft_model, options, DRAWS)
    drafts = torch.tensor([c.proposal[0] for c in chunks])
    q = torch.stack([c.draft_probs[0] for c in chunks])
    assert torch.allclose(q, q[:1].expand_as(q)) and q.shape == (DRAWS, 256)
    vocab = logits.shape[1]
    # the draws follow q, which is far from p
    assert chi_square_p(torch.bincount(drafts, minlength=vocab), q[0]) > 1e-3
    assert (q[0] - probs).abs().sum() > 0.5
    rows = logits[:2].repeat(DRAWS, 1)  # each chunk's proposal row and the row after it
    verdict = verify_chunks(rows, chunks, vocab, host_upload, None, {})
    accepted = verdict.num_accepted
    first = torch.where(accepted >= 1, drafts, verdict.token_ids)
    # q is used: a proposal is accepted with probability sum(min(p, q)) (a point-mass rule would accept sum(q p))
    rate = accepted.float().mean().item()
    assert 0.05 < rate < 0.95 and abs(rate - torch.minimum(q[0], probs).sum().item()) < 0.02
    assert abs(rate - (q[0] * probs).sum().item()) > 0.1
    assert chi_square_p(torch.bincount(first, minlength=vocab), probs) > 1e-3
    # the same acceptances with the rejected ones redrawn from p rather than from the residual max(0, p - q)
    wrong_first = torch.where(accepted >= 1, drafts, torch.multinomial(probs, DRAWS, replacement=True))
    assert chi_square_p(torch.bincount(wrong_first, minlength=vocab), probs) < 1e-6


def test_a_draft_proposes_its_argmax_for_greedy_rows_without_distributions(draft_model):
    greedy = drafted_chunks(draft_model, engine_pb2.SamplingOptions(temperature=0.0), 3)
    point_mass = drafted_chunks(draft_model, engine_pb2.SamplingOptions(temperature=1.0, top_k=1), 1)[0]
    assert [c.proposal for c in greedy] == [point_mass.proposal] * 3
    assert all(c.draft_probs is None for c in greedy) and point_mass.draft_probs[0].max() == 1.0
