"""The sampler: greedy, temperature, filters, penalties, logprobs and per-request seeds."""

import math

import pytest
import torch

from executor_svc.sampler import (
    Sampler, SamplingBatch, apply_min_p, apply_penalties, apply_top_k_top_p,
)
from protos.engine_pb2 import SamplingOptions

CUDA = pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")])
DEVICES = ["cpu", CUDA]


def build(options, logits_or_vocab, prompts=None, outputs=None, device="cpu"):
    vocab = logits_or_vocab if isinstance(logits_or_vocab, int) else logits_or_vocab.shape[-1]
    prompts = prompts if prompts is not None else [[1, 2, 3]] * len(options)
    outputs = outputs if outputs is not None else [[]] * len(options)
    return SamplingBatch.build(options, prompts, outputs, vocab, torch.device(device))


def random_logits(rows, vocab, seed, scale=3.0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(rows, vocab, generator=gen) * scale


def chi_square(tokens: torch.Tensor, probs: torch.Tensor) -> float:
    counts = torch.bincount(tokens.cpu(), minlength=probs.numel()).double()
    expected = probs.double() * tokens.numel()
    return float(((counts - expected) ** 2 / expected).sum())


# A chi-square with df <= 15 exceeds 45 with probability below 1e-4.
CHI_SQUARE_LIMIT = 45.0


@pytest.mark.parametrize("device", DEVICES)
def test_greedy_rows_pick_the_argmax(device):
    logits = random_logits(32, 500, seed=1).to(device)
    temps = [0.0, 1e-6] * 16
    out = Sampler()(logits, build([SamplingOptions(temperature=t, top_k=5) for t in temps], logits, device=device))
    assert out.token_ids.dtype == torch.int64
    assert torch.equal(out.token_ids, logits.argmax(-1))
    assert out.sampled_logprobs is None and out.top_token_ids is None


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_sampling_frequencies_follow_softmax_of_logits_over_temperature(device, temperature):
    torch.manual_seed(0)
    if device == "cuda":
        torch.cuda.manual_seed(0)
    vocab, draws = 12, 20000
    row = random_logits(1, vocab, seed=2, scale=1.0)
    logits = row.expand(draws, vocab).contiguous().to(device)
    options = [SamplingOptions(temperature=temperature)] * draws
    tokens = Sampler()(logits, build(options, logits, device=device)).token_ids
    expected = torch.softmax(row[0].double() / temperature, -1)
    assert chi_square(tokens, expected) < CHI_SQUARE_LIMIT


def test_seeded_rows_also_follow_the_distribution():
    vocab, draws = 10, 4000
    row = random_logits(1, vocab, seed=3, scale=1.0)
    logits = row.expand(draws, vocab).contiguous()
    options = [SamplingOptions(temperature=1.0, seed=s) for s in range(draws)]
    tokens = Sampler()(logits, build(options, logits)).token_ids
    assert chi_square(tokens, torch.softmax(row[0].double(), -1)) < CHI_SQUARE_LIMIT


def test_a_draw_at_the_top_of_the_cdf_picks_the_last_kept_token_never_a_dropped_one(monkeypatch):
    import executor_svc.sampler as sampler_module

    logits = torch.tensor([[0.5, 3.0, -1.0, 2.0, 0.1, 0.2], [9.0, 0.0, 0.0, 0.0, 0.0, -40.0]])
    kept_last = [3, 4]  # row 0 keeps its top 2 (tokens 1 and 3); row 1's last kept token is 4 (top-k 5)
    real_rand = torch.rand
    # the largest float64 uniform below 1
    monkeypatch.setattr(sampler_module.torch, "rand", lambda *a, **k: real_rand(*a, **k).fill_(1 - 2**-53))
    options = [SamplingOptions(temperature=1.0, top_k=2), SamplingOptions(temperature=1.0, top_k=5)]
    tokens = Sampler()(logits, build(options, logits)).token_ids
    assert tokens.tolist() == kept_last


def test_top_k_never_picks_outside_the_k_best():
    torch.manual_seed(1)
    logits = random_logits(2000, 50, seed=4, scale=0.5)
    ks = torch.randint(1, 8, (2000,), generator=torch.Generator().manual_seed(5)).tolist()
    options = [SamplingOptions(temperature=1.5, top_k=k) for k in ks]
    tokens = Sampler()(logits, build(options, logits)).token_ids
    ranks = (logits > logits.gather(1, tokens[:, None])).sum(1) + 1
    assert (ranks <= torch.tensor(ks)).all()


def reference_top_p_keep(logits: torch.Tensor, top_p: float) -> tuple[set[int], bool]:
    """Float64: the smallest set of best tokens whose mass reaches top_p; and whether it is clear-cut."""
    probs = torch.softmax(logits.double(), -1)
    order = probs.argsort(descending=True).tolist()
    keep, mass = set(), 0.0
    for token in order:
        keep.add(token)
        mass += float(probs[token])
        if mass >= top_p:
            break
    return keep, abs(mass - top_p) > 1e-5 and abs(mass - float(probs[token]) - top_p) > 1e-5


def kept(filtered: torch.Tensor) -> set[int]:
    return set(torch.isfinite(filtered).nonzero().flatten().tolist())


def test_top_p_keeps_the_smallest_set_reaching_top_p():
    logits = random_logits(64, 200, seed=6, scale=2.0)
    top_p = torch.rand(64, generator=torch.Generator().manual_seed(7)) * 0.94 + 0.05
    filtered = apply_top_k_top_p(logits, None, top_p)
    for i in range(64):
        expected, clear = reference_top_p_keep(logits[i], float(top_p[i]))
        if clear:
            assert kept(filtered[i]) == expected
        assert torch.equal(filtered[i][list(expected)], logits[i][list(expected)])


def test_top_p_applies_to_the_top_k_renormalized_distribution():
    logits = random_logits(32, 100, seed=8)
    top_k = torch.randint(1, 30, (32,), generator=torch.Generator().manual_seed(9))
    top_p = torch.rand(32, generator=torch.Generator().manual_seed(10)) * 0.9 + 0.05
    filtered = apply_top_k_top_p(logits, top_k, top_p)
    for i in range(32):
        best = logits[i].topk(int(top_k[i])).indices
        expected, clear = reference_top_p_keep(logits[i][best], float(top_p[i]))
        if clear:
            assert kept(filtered[i]) == {int(best[j]) for j in expected}


def test_top_p_of_one_or_zero_is_off():
    logits = random_logits(2, 300, seed=11, scale=8.0)
    batch = build([SamplingOptions(temperature=1.0, top_p=1.0), SamplingOptions(temperature=1.0, top_p=0.0)], logits)
    assert batch.top_p is None and batch.top_k is None and batch.min_p is None
    assert kept(apply_top_k_top_p(logits, None, torch.tensor([1.0, 0.5]))[0]) == set(range(300))


def test_min_p_drops_tokens_below_min_p_times_the_top_probability():
    logits = random_logits(16, 300, seed=12)
    min_p = torch.rand(16, generator=torch.Generator().manual_seed(13)) * 0.3
    filtered = apply_min_p(logits, min_p)
    probs = torch.softmax(logits.double(), -1)
    for i in range(16):
        ratio = probs[i] / probs[i].max()
        clear = ((ratio - float(min_p[i])).abs() > 1e-5).nonzero().flatten().tolist()
        expected = {t for t in clear if ratio[t] >= float(min_p[i])}
        assert kept(filtered[i]) & set(clear) == expected
    options = [SamplingOptions(temperature=1.0, min_p=0.2)] * 500
    tokens = Sampler()(logits[:1].expand(500, -1).contiguous(), build(options, 300)).token_ids
    assert (probs[0][tokens] >= 0.2 * probs[0].max()).all()


def reference_penalties(logits, prompt, output, rep, freq, pres):
    out = [float(x) for x in logits]
    for token in set(prompt) | set(output):
        out[token] = out[token] / rep if out[token] > 0 else out[token] * rep
    for token in set(output):
        out[token] -= freq * output.count(token) + pres
    return out


@pytest.mark.parametrize("repetition", [True, False])
@pytest.mark.parametrize("seed", range(4))
def test_penalties_match_a_python_reference(seed, repetition):
    gen = torch.Generator().manual_seed(seed)
    rows, vocab = 6, 40
    logits = random_logits(rows, vocab, seed=100 + seed)
    prompts = [torch.randint(0, vocab, (int(torch.randint(1, 12, (1,), generator=gen)),), generator=gen).tolist()
               for _ in range(rows)]
    outputs = [torch.randint(0, vocab, (int(torch.randint(0, 15, (1,), generator=gen)),), generator=gen).tolist()
               for _ in range(rows)]
    knobs = (torch.rand(rows, 3, generator=gen) * torch.tensor([1.5, 2.0, 2.0]) + torch.tensor([0.5, -0.5, -0.5])).tolist()
    knobs[0] = [1.0, 0.0, 0.0]  # a row without penalties stays untouched
    if not repetition:  # then the prompt is not even sent to the device
        knobs = [[1.0, f, p] for _, f, p in knobs]
    options = [SamplingOptions(temperature=0.0, repetition_penalty=r, frequency_penalty=f, presence_penalty=p)
               for r, f, p in knobs]
    batch = build(options, logits, prompts, outputs)
    assert (batch.prompt_token_ids is not None) == repetition
    got = apply_penalties(logits, batch)
    for i, (r, f, p) in enumerate(knobs):
        expected = reference_penalties(logits[i], prompts[i], outputs[i], r, f, p)
        assert torch.allclose(got[i], torch.tensor(expected), atol=1e-5)
    tokens = Sampler()(logits, batch).token_ids
    assert torch.equal(tokens, got.argmax(-1))


def test_no_penalty_means_no_penalty_tensors():
    options = [SamplingOptions(temperature=0.7, repetition_penalty=0.0), SamplingOptions(repetition_penalty=1.0)]
    batch = build(options, 50)
    assert not batch.any_penalties and batch.prompt_token_ids is None and batch.max_logprobs == 0


@pytest.mark.parametrize("device", DEVICES)
def test_logprobs_are_raw_log_softmax_with_correct_ranks(device):
    torch.manual_seed(2)
    logits = random_logits(12, 80, seed=14).to(device)
    options = [SamplingOptions(temperature=t, logprobs=n, repetition_penalty=1.3, top_k=10)
               for t, n in zip([0.0, 1.0, 2.0] * 4, [0, 1, 5, 3] * 3)]
    out = Sampler()(logits, build(options, logits, outputs=[[3, 4]] * 12, device=device))
    reference = torch.log_softmax(logits.cpu().double(), -1)
    tokens = out.token_ids.cpu()
    chosen = reference.gather(1, tokens[:, None]).squeeze(1)
    assert torch.allclose(out.sampled_logprobs.cpu().double(), chosen, atol=1e-5)
    assert torch.equal(out.sampled_ranks.cpu(), (reference > chosen[:, None]).sum(1) + 1)
    top = reference.topk(5, dim=-1)
    assert torch.equal(out.top_token_ids.cpu(), top.indices)
    assert torch.allclose(out.top_logprobs.cpu().double(), top.values, atol=1e-5)


def seeded_token(sampler, row_logits, seed, generated, neighbours, position, device="cpu"):
    """Sample `row_logits` with `seed` at `position` among random neighbour rows."""
    others = random_logits(neighbours, row_logits.numel(), seed=seed + 7 * neighbours + generated)
    logits = torch.cat([others[:position], row_logits[None], others[position:]]).to(device)
    options = [SamplingOptions(temperature=1.0, seed=900 + j) if j % 2 else SamplingOptions(temperature=0.8)
               for j in range(neighbours)]
    options.insert(position, SamplingOptions(temperature=1.0, seed=seed, top_p=0.95))
    outputs = [[5] * (j + 1) for j in range(neighbours)]
    outputs.insert(position, [7] * generated)
    return int(sampler(logits, build(options, logits, outputs=outputs, device=device)).token_ids[position])


@pytest.mark.parametrize("device", DEVICES)
def test_same_seed_and_generated_count_give_the_same_token_in_any_batch(device):
    row = random_logits(1, 1000, seed=15, scale=0.3)[0]
    tokens = []
    for generated in range(12):
        alone = seeded_token(Sampler(), row, 42, generated, neighbours=0, position=0, device=device)
        # Recompute after preemption = a fresh batch with other neighbours at another position.
        mixed = seeded_token(Sampler(), row, 42, generated, neighbours=5, position=3, device=device)
        last = seeded_token(Sampler(), row, 42, generated, neighbours=2, position=2, device=device)
        assert alone == mixed == last
        tokens.append(alone)
    assert len(set(tokens)) > 6  # the generated count moves the noise on


def test_different_seeds_give_different_tokens():
    row = random_logits(1, 1000, seed=16, scale=0.3)
    logits = row.expand(200, -1).contiguous()
    options = [SamplingOptions(temperature=1.0, seed=s) for s in range(200)]
    tokens = Sampler()(logits, build(options, logits, outputs=[[1, 2]] * 200)).token_ids
    assert len(set(tokens.tolist())) > 150


@pytest.mark.parametrize("device", DEVICES)
def test_mixed_batch_of_greedy_seeded_and_unseeded_rows(device):
    torch.manual_seed(3)
    logits = random_logits(9, 300, seed=17, scale=1.0).to(device)
    options = [SamplingOptions(temperature=0.0), SamplingOptions(temperature=1.0, seed=5),
               SamplingOptions(temperature=0.9, top_k=3)] * 3
    outputs = [[1] * i for i in range(9)]
    out = Sampler()(logits, build(options, logits, outputs=outputs, device=device))
    tokens, cpu_logits = out.token_ids.cpu(), logits.cpu()
    assert torch.equal(tokens[0::3], cpu_logits[0::3].argmax(-1))
    for i in (1, 4, 7):  # a seeded row gives the same token when sampled alone
        alone = Sampler()(logits[i:i + 1], build([options[i]], logits, outputs=[outputs[i]], device=device))
        assert int(alone.token_ids[0]) == int(tokens[i])
    for i in (2, 5, 8):
        assert int(tokens[i]) in cpu_logits[i].topk(3).indices.tolist()


def test_half_precision_logits_are_sampled_in_float32():
    logits = random_logits(4, 64, seed=18).bfloat16()
    options = [SamplingOptions(temperature=0.0, logprobs=2), SamplingOptions(temperature=1.0, seed=1)] * 2
    out = Sampler()(logits, build(options, logits))
    assert torch.equal(out.token_ids[0::2], logits[0::2].float().argmax(-1))
    assert out.sampled_logprobs.dtype == torch.float32 and out.top_logprobs.shape == (4, 2)
    assert not math.isnan(float(out.sampled_logprobs.sum()))


def test_plain_rows_build_only_temperature_and_noise_seeds():
    """Temperature-only rows (what a decode graph samples in place) skip every other column."""
    import numpy as np

    from executor_svc.sampling_row import SamplingRow, plain_sampling_columns

    options = [SamplingOptions(temperature=0.0), SamplingOptions(temperature=0.7)]
    rows = [SamplingRow.of(o) for o in options]
    assert all(r.plain for r in rows)
    assert not SamplingRow.of(SamplingOptions(temperature=0.7, top_k=5)).plain
    assert not SamplingRow.of(SamplingOptions(temperature=0.7, seed=3)).plain
    assert not SamplingRow.of(SamplingOptions(temperature=0.0, logprobs=1)).plain
    columns = plain_sampling_columns(rows, np.random.default_rng(0))
    assert columns["temperature"].tolist() == [0.0, np.float32(0.7)]  # greedy rows carry 0
    assert columns["noise_seeds"].dtype == np.int64 and columns["noise_seeds"].shape == (2,)
    batch = build(options, 50)
    assert batch.top_k is None and batch.top_p is None and batch.min_p is None
    assert batch.repetition_penalty is None and batch.seeded_rows is None
    assert batch.temperature.tolist() == columns["temperature"].tolist()


def test_a_seeded_rows_noise_seed_is_its_mixed_seed_as_int64():
    from executor_svc.sampler import mix_seed

    options = [SamplingOptions(temperature=1.0, seed=12345), SamplingOptions(temperature=1.0)]
    batch = build(options, 50, outputs=[[1, 2, 3], []])
    expected = mix_seed(12345, 3)
    assert int(batch.noise_seeds[0]) == (expected - (1 << 64) if expected >= 1 << 63 else expected)
    assert batch.seeded_rows.tolist() == [0] and batch.generator_seeds == [expected]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("draw", range(3))
def test_an_overflowing_penalty_keeps_its_row_in_the_vocabulary_and_leaves_its_neighbours_alone(device, temperature,
                                                                                                draw):
    """The hardening issue's defect 1: repetition_penalty 1e-45 made x / penalty inf and the draw index the
    vocabulary size, which killed the executor. Now the row samples a token it may, and the rows beside it
    get exactly what they get without it."""
    vocab = 50
    torch.manual_seed(draw)
    logits = random_logits(3, vocab, seed=7 + draw).to(device)
    wild = SamplingOptions(temperature=temperature, repetition_penalty=1e-45, logprobs=2)  # unseeded, as reported
    tame = SamplingOptions(temperature=temperature, logprobs=2, seed=4)
    prompts = [[1, 2, 3, 40], [1, 2, 3, 4, 5, 6, 7, 8], [5, 6]]
    both = Sampler()(logits, build([tame, wild, tame], logits, prompts, device=device))
    alone = Sampler()(logits[[0, 2]], build([tame, tame], logits[[0, 2]], [prompts[0], prompts[2]], device=device))
    assert ((both.token_ids >= 0) & (both.token_ids < vocab)).all()
    assert both.token_ids[[0, 2]].tolist() == alone.token_ids.tolist()
    assert torch.isfinite(both.sampled_logprobs).all()
    if temperature == 0.0:  # greedy: the penalised row's best token is one its history inflated to the top
        assert int(both.token_ids[1]) in {t for t in prompts[1] if logits[1, t] > 0} or (logits[1, prompts[1]] <= 0).all()
