"""The fused sampling kernel: greedy rows are torch.argmax, random rows are Gumbel-max over its own noise.

On the CPU the kernels run in Triton's interpreter, which has to be on before they are decorated.
So unless TRITON_INTERPRET=1 is already set, one test re-runs this file in a fresh python with it
set, and the interpreter tests skip in this process. The interpreter runs one program at a time
in numpy, so shapes stay tiny and a small chunk size stands in for a big vocabulary. The gpu tests
run the compiled kernels at Qwen3's vocabulary and in a CUDA graph.
"""
from __future__ import annotations

import os

import pytest
from support.interpreter_child import (INTERPRETING, KERNELS_RUN_HERE, assert_module_passes_under_interpreter,
                               interpreter, needs_cuda)
import torch

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

if KERNELS_RUN_HERE:
    # Not imported otherwise: compiled-mode kernels would stick in sys.modules for this process.
    from kernels import sampling as ks

    @triton.jit
    def philox_components_kernel(seed_ptr, out_ptr, GROUPS: tl.constexpr, ROUNDS: tl.constexpr):
        """tl.rand4x's four outputs at offsets 0..GROUPS-1, stored as out[4 * offset + component]."""
        group = tl.arange(0, GROUPS)
        u0, u1, u2, u3 = tl.rand4x(tl.load(seed_ptr), group, ROUNDS)
        tl.store(out_ptr + group * 4, u0)
        tl.store(out_ptr + group * 4 + 1, u1)
        tl.store(out_ptr + group * 4 + 2, u2)
        tl.store(out_ptr + group * 4 + 3, u3)

# The kernel's scores are fp32 and, on a GPU, its log2 is approximate (absolute error 2^-22, a few
# 1e-6 in a score). When the float64 reference's best and the kernel's pick are this close, both
# are right: which one wins is decided by rounding, not by the sampler.
TIE_TOLERANCE = 3e-5


def fresh_generator() -> torch.Generator:
    """Fresh inputs on every run; the seed is printed, and pytest shows it when a test fails."""
    seed = int.from_bytes(os.urandom(8), "little") >> 1
    print(f"torch.Generator seed: {seed}")
    return torch.Generator().manual_seed(seed)


def random_seeds(n: int, gen: torch.Generator) -> torch.Tensor:
    """Distinct int64 seeds over the whole 64-bit range, negative ones included."""
    seeds = torch.randint(-2**63, 2**63 - 1, (n,), generator=gen, dtype=torch.int64)
    assert seeds.unique().numel() == n
    return seeds


def float64_scores(logits: torch.Tensor, temperature: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """The Gumbel-max scores, logit / T - log(-log u), or the raw logits on greedy rows."""
    x = logits.double()
    greedy = (temperature < ks.GREEDY_TEMPERATURE)[:, None]
    t = torch.where(greedy, 1.0, temperature.double()[:, None])
    return torch.where(greedy, x, x / t - torch.log(-torch.log(u.double())))


def assert_matches_reference(tokens: torch.Tensor, logits: torch.Tensor, temperature: torch.Tensor,
                             seeds: torch.Tensor) -> None:
    """Greedy rows equal torch.argmax exactly; a random row equals the float64 reference built from
    uniform_noise, or else picks a token whose float64 score ties the best within TIE_TOLERANCE."""
    vocab_size = logits.shape[1]
    assert tokens.dtype == torch.int64 and tokens.shape == (logits.shape[0],)
    assert ((tokens >= 0) & (tokens < vocab_size)).all()
    u = ks.uniform_noise(seeds, vocab_size)
    assert u.shape == logits.shape and u.dtype == torch.float32
    assert ((u >= 0) & (u < 1)).all()
    reference = ks.sample_tokens_reference(logits, temperature, u)
    greedy = temperature < ks.GREEDY_TEMPERATURE
    assert torch.equal(tokens[greedy], logits[greedy].argmax(dim=-1))
    scores = float64_scores(logits, temperature, u)
    rows = torch.arange(len(tokens), device=tokens.device)
    best, picked = scores[rows, reference], scores[rows, tokens]
    near_tie = picked >= best - TIE_TOLERANCE * best.abs().clamp_min(1.0)
    bad = ((tokens != reference) & ~near_tie).nonzero().flatten().tolist()
    assert not bad, (f"rows {bad}: picked {tokens[bad].tolist()} (score {picked[bad].tolist()}), "
                     f"reference {reference[bad].tolist()} (score {best[bad].tolist()})")


def random_bitmasks(num_masks: int, vocab_size: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """int32 words [num_masks, ceil(V / 32)] allowing a random subset of each row's tokens (from a handful to
    most, bit 31 included, so some words are negative), and the bool [num_masks, V] they mean."""
    num_words = -(-vocab_size // 32)
    density = torch.rand(num_masks, 1, generator=gen) * 0.9 + 0.005
    allowed = torch.rand(num_masks, num_words * 32, generator=gen) < density
    allowed[:, 0] = True  # never an empty row
    bits = allowed.view(num_masks, num_words, 32).long() << torch.arange(32)
    words = bits.sum(-1).to(torch.int64)
    words = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    return words, allowed[:, :vocab_size]


def assert_masked_draws(logits: torch.Tensor, temperature: torch.Tensor, seeds: torch.Tensor,
                        gen: torch.Generator) -> None:
    """Rows with a bitmask draw what the unmasked kernel draws from logits with the disallowed tokens at -inf
    (the same noise), never a disallowed token, and free rows (mask row -1) draw as without masks."""
    num_rows, vocab_size = logits.shape
    words, allowed = random_bitmasks(3, vocab_size, gen)
    mask_rows = torch.tensor([i % 4 - 1 for i in range(num_rows)], dtype=torch.int32)  # -1, 0, 1, 2, -1, ...
    row_allowed = torch.ones(num_rows, vocab_size, dtype=torch.bool)
    row_allowed[mask_rows >= 0] = allowed[mask_rows[mask_rows >= 0].long()]
    device = logits.device
    tokens = ks.sample_tokens(logits, temperature, seeds, mask_rows=mask_rows.to(device), mask_words=words.to(device))
    pre_masked = logits.masked_fill(~row_allowed.to(device), float("-inf"))
    assert torch.equal(tokens, ks.sample_tokens(pre_masked, temperature, seeds))
    assert row_allowed[torch.arange(num_rows), tokens.cpu()].all(), "a disallowed token was drawn"
    assert_matches_reference(tokens, pre_masked, temperature, seeds)


def chi_square_threshold(dof: int, alpha: float) -> float:
    """x with P(chi2_dof > x) = alpha, by bisection on the regularised upper incomplete gamma."""
    half_dof = torch.tensor(dof / 2, dtype=torch.float64)
    lo, hi = 0.0, 1000.0
    for _ in range(100):
        mid = (lo + hi) / 2
        if torch.special.gammaincc(half_dof, torch.tensor(mid / 2, dtype=torch.float64)) > alpha:
            lo = mid
        else:
            hi = mid
    return hi


# ---------------------------------------------------------------------------------------------
# CPU: the interpreter
# ---------------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.skipif(INTERPRETING, reason="this is the child process")
def test_sampling_kernel_passes_under_the_interpreter():
    assert_module_passes_under_interpreter(__file__, "test_sampling_kernel_passes_under_the_interpreter",
                                           timeout=600)


@interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("chunk_size", [None, 512])  # None: 1 step per chunk; 512: 2 steps per chunk
def test_greedy_rows_return_the_first_maximum_like_torch_argmax(dtype, chunk_size):
    gen = fresh_generator()
    vocab_size = 1000  # 4 steps of 256 tokens; the last one is partly masked
    logits = (torch.randn(5, vocab_size, generator=gen) * 4).to(dtype)
    peak = logits.float().max().item() + 1
    logits[0, vocab_size - 1] = peak  # the maximum is the very last token, in the last chunk
    logits[1, 700] = logits[1, 300] = peak  # a tie: the lower token wins
    logits[2, :600] = float("-inf")  # masked tokens
    logits[3, 5] = peak  # the maximum in the first chunk
    temperature = torch.tensor([0.0, 1e-6, 0.0, 0.0, 0.0])
    tokens = ks.sample_tokens(logits, temperature, random_seeds(5, gen), chunk_size=chunk_size)
    assert torch.equal(tokens, logits.argmax(dim=-1))
    assert tokens[:2].tolist() == [vocab_size - 1, 300]


@interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_random_rows_match_the_float64_reference_beside_greedy_rows(dtype):
    gen = fresh_generator()
    num_rows, vocab_size = 6, 1000
    # A column slice of a wider buffer: the row stride is not the vocabulary size.
    buffer = (torch.randn(num_rows, vocab_size + 13, generator=gen) * 3).to(dtype)
    logits = buffer[:, 5:5 + vocab_size]
    logits[1, torch.randperm(vocab_size, generator=gen)[:900]] = float("-inf")  # 100 tokens left
    logits[4, :] = float("-inf")  # nothing left: any valid token, never an index past the vocabulary
    temperature = torch.rand(num_rows, generator=gen) * 1.7 + 0.3
    temperature[[2, 5]] = 0.0  # greedy rows mixed in
    seeds = random_seeds(num_rows, gen)
    tokens = ks.sample_tokens(logits, temperature, seeds)
    assert_matches_reference(tokens, logits, temperature, seeds)
    assert logits[1, tokens[1]] > float("-inf"), "a masked token is never sampled"
    assert torch.equal(ks.sample_tokens(logits, temperature, seeds, chunk_size=vocab_size), tokens), \
        "one chunk per row or several: the same tokens"


@interpreter
def test_rows_with_a_bitmask_draw_only_allowed_tokens_as_if_the_rest_were_minus_infinity():
    gen = fresh_generator()
    num_rows, vocab_size = 8, 1000  # 32 words: the last word's high bits lie past the vocabulary
    logits = (torch.randn(num_rows, vocab_size, generator=gen) * 3).to(torch.bfloat16)
    temperature = torch.rand(num_rows, generator=gen) * 1.2 + 0.3
    temperature[[1, 6]] = 0.0  # greedy rows, masked and free
    assert_masked_draws(logits, temperature, random_seeds(num_rows, gen), gen)


@interpreter
def test_the_warm_up_builds_the_masked_variant_and_a_failing_one_is_reported_not_raised(monkeypatch):
    assert ks.warm_up(3, 1000, torch.float32, torch.device("cpu"))  # tokens 3 and 999: bit 7 of word 31
    plain = ks.sample_tokens

    def broken_masks(*args, mask_rows=None, **kwargs):
        if mask_rows is not None:
            raise RuntimeError("no masked variant here")
        return plain(*args, **kwargs)

    monkeypatch.setattr(ks, "sample_tokens", broken_masks)
    assert ks.warm_up(3, 1000, torch.float32, torch.device("cpu")) is False  # the runner keeps the torch path


@interpreter
def test_a_seeded_row_gets_the_same_token_wherever_it_sits_in_the_batch():
    gen = fresh_generator()
    vocab_size = 600
    # A high temperature spreads the probability, so the token is decided by the noise.
    row, temperature, seed = torch.randn(vocab_size, generator=gen), 8.0, random_seeds(1, gen)

    def batch_with_row_at(position: int, num_rows: int) -> tuple[torch.Tensor, ...]:
        logits = torch.randn(num_rows, vocab_size, generator=gen)
        temperatures = torch.rand(num_rows, generator=gen) + 0.5
        seeds = random_seeds(num_rows, gen)
        logits[position], temperatures[position], seeds[position] = row, temperature, seed
        return logits, temperatures, seeds

    alone = ks.sample_tokens(*batch_with_row_at(0, 1))
    for position, num_rows, chunk_size in [(3, 5, None), (0, 4, 512), (6, 7, 1024)]:
        tokens = ks.sample_tokens(*batch_with_row_at(position, num_rows), chunk_size=chunk_size)
        assert tokens[position] == alone[0], f"position {position} of {num_rows}, chunk {chunk_size}"
    # The seed does decide it: among a few other seeds some pick another token.
    others = ks.sample_tokens(row.expand(4, -1), torch.full((4,), temperature), random_seeds(4, gen))
    assert (others != alone).any()


@interpreter
def test_sampled_frequencies_follow_softmax_of_logits_over_temperature():
    gen = fresh_generator()
    num_rows, temperature = 320, 3.0
    # 6 probabilities from 0.05 to 0.36, in shuffled token order, plus one masked token.
    levels = torch.linspace(0.0, 6.0, 6, dtype=torch.float64)
    order = torch.randperm(7, generator=gen)
    logits = torch.full((7,), float("-inf"), dtype=torch.float64)
    logits[order[:6]] = levels
    probs = torch.softmax(levels / temperature, dim=0)
    # Each row adds its own shift, which softmax ignores, so the rows are not copies of each other.
    batch = (logits + torch.randn(num_rows, 1, generator=gen, dtype=torch.float64) * 10).float()
    tokens = ks.sample_tokens(batch, torch.full((num_rows,), temperature), random_seeds(num_rows, gen))
    assert not (tokens == order[6]).any(), "the masked token is never sampled"
    counts = (tokens[:, None] == order[None, :6]).sum(dim=0).double()
    assert counts.sum() == num_rows

    def chi_square(p: torch.Tensor) -> float:
        expected = num_rows * p
        return ((counts - expected) ** 2 / expected).sum().item()

    # A correct sampler fails this with probability below 1e-6 (every expected count is above 15,
    # so the chi-square law holds well out in its tail).
    threshold = chi_square_threshold(dof=5, alpha=1e-6)
    assert (num_rows * probs).min() > 15
    assert chi_square(probs) < threshold, f"counts {counts.tolist()} vs expected {(num_rows * probs).tolist()}"
    # And it has the power to see a wrong temperature: for a sampler that ignored T, or divided by
    # T twice, the expected statistic (dof + noncentrality) is at least twice the threshold.
    for wrong_temperature in (1.0, temperature ** 2):
        wrong = torch.softmax(levels / wrong_temperature, dim=0)
        assert 5 + num_rows * ((wrong - probs) ** 2 / probs).sum() > 2 * threshold


@interpreter
def test_noise_of_token_i_is_component_i_mod_4_of_philox_at_i_div_4():
    seeds = random_seeds(2, fresh_generator())
    expected = torch.empty(64)
    philox_components_kernel[(1,)](seeds, expected, GROUPS=16, ROUNDS=ks._PHILOX_ROUNDS)
    u = ks.uniform_noise(seeds, 61)
    assert torch.equal(u[0], expected[:61])
    assert not torch.equal(u[1], u[0]), "another seed, other noise"


@interpreter
def test_tokens_are_written_into_a_given_out_and_an_empty_batch_is_fine():
    gen = fresh_generator()
    logits, temperature = torch.randn(3, 300, generator=gen), torch.tensor([0.0, 1.0, 0.5])
    seeds = random_seeds(3, gen)
    buffer = torch.full((6,), -7, dtype=torch.int64)
    out = buffer[::2]  # a strided view
    assert ks.sample_tokens(logits, temperature, seeds, out=out) is out
    assert (buffer[1::2] == -7).all(), "only the view's elements are written"
    assert torch.equal(out, ks.sample_tokens(logits, temperature, seeds))
    empty = ks.sample_tokens(torch.randn(0, 300), torch.zeros(0), torch.zeros(0, dtype=torch.int64))
    assert empty.shape == (0,) and empty.dtype == torch.int64


# ---------------------------------------------------------------------------------------------
# GPU: compiled kernels at Qwen3's vocabulary
# ---------------------------------------------------------------------------------------------

QWEN3_VOCAB = 151936


def qwen3_batch(num_rows: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """bf16 logits of LM-head scale, temperatures in [0.3, 1.5] with rows 1, 5, 9... greedy."""
    logits = (torch.randn(num_rows, QWEN3_VOCAB, generator=gen) * 4).to(torch.bfloat16).cuda()
    temperature = torch.rand(num_rows, generator=gen) * 1.2 + 0.3
    temperature[1::4] = 0.0
    return logits, temperature.cuda(), random_seeds(num_rows, gen).cuda()


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("num_rows", [1, 7, 256])
def test_gpu_qwen3_vocabulary_matches_the_float64_reference(num_rows):
    gen = fresh_generator()
    logits, temperature, seeds = qwen3_batch(num_rows, gen)
    tokens = ks.sample_tokens(logits, temperature, seeds)
    assert_matches_reference(tokens, logits, temperature, seeds)
    assert torch.equal(ks.sample_tokens(logits[-1:], temperature[-1:], seeds[-1:]), tokens[-1:]), \
        "alone, with other chunking, the last row gets the same token"


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("num_rows", [7, 256])
def test_gpu_qwen3_vocabulary_with_bitmasks_draws_only_allowed_tokens(num_rows):
    gen = fresh_generator()
    assert_masked_draws(*qwen3_batch(num_rows, gen), gen)


@pytest.mark.gpu
@needs_cuda
def test_gpu_sampling_replayed_from_a_cuda_graph_follows_new_inputs():
    gen = fresh_generator()
    static = qwen3_batch(64, gen)
    out = torch.empty(64, dtype=torch.int64, device="cuda")
    ks.sample_tokens(*static, out=out)  # compile outside the graph
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ks.sample_tokens(*static, out=out)
    for _ in range(2):
        for tensor, new in zip(static, qwen3_batch(64, gen)):
            tensor.copy_(new)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, ks.sample_tokens(*static))
