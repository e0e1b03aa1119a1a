"""Fused token sampling in Triton: temperature, Gumbel noise and argmax in one pass over the logits.

argmax_i(logit_i / T + G_i), with Gumbel noise G_i = -log(-log u_i), draws token i with probability
softmax(logits / T)_i: no softmax, no fp32 copy of the logits. u_i is word i % 4 of Philox keyed by
(the row's seed, i // 4), so a token depends only on its row, T and seed, never on its neighbours.
A row with T < 1e-5 is greedy. A 2D grid (row, chunk) writes one (score, token) per chunk and a tiny
second kernel picks per row, so a small batch still spreads over every SM. Nothing syncs with the
host or is sized by data: it can be captured in a CUDA graph.
"""
from __future__ import annotations

import logging

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from kernels.triton_runtime import INTERPRET, num_sms

log = logging.getLogger("nanoserve.kernels")

GREEDY_TEMPERATURE = 1e-5  # a row whose temperature is below this takes the plain argmax
_GREEDY_TEMPERATURE = tl.constexpr(GREEDY_TEMPERATURE)
_LOG2E = tl.constexpr(1.4426950408889634)
_LN2 = tl.constexpr(0.6931471805599453)
# Triton's default. Philox4x32-7 already passes BigCrush (Salmon et al., SC 2011): 7 would save
# ~10% of this compute-bound kernel's instructions, at the cost of the usual safety margin.
_PHILOX_ROUNDS = tl.constexpr(10)

# Tokens per loop step of a program, as [BLOCK / 4, 4]: one Philox call (4 random words, ~58
# integer ops) serves 4 neighbouring tokens; one call per token would cost 4x that. The sm_90 build
# is then ~38 instructions per token, with 2 SFU log2s: 256 x 151936 tokens take ~45 us of issue
# time on 132 SMs, against ~18 us to read the bf16 logits, so this kernel is bound by its math.
BLOCK = 256 if INTERPRET else 2048
# 8 warps: 8 tokens (2 independent Philox calls) per thread per step. The compiled step is ~300
# instructions per thread in 48 registers, so ~5 programs fit on an SM and their math hides each
# other's loads.
NUM_WARPS = 1 if INTERPRET else 8
# At most 8 steps (16K tokens, 32 KB of bf16) per program: the end-of-program reduction costs about
# a third of a step, and B = 256 still makes ~4 waves of programs, enough to even out the last one.
MAX_TILES_PER_CHUNK = 8


@triton.jit
def _log2(x, FAST_LOG: tl.constexpr):
    if FAST_LOG:  # lg2.approx: one SFU op where libdevice's log2f is a dozen FMAs
        y = libdevice.fast_log2f(x)
    else:  # the interpreter has no libdevice
        y = tl.log2(x)
    return y


@triton.jit
def _uniform(seed, group, GROUPS: tl.constexpr):
    """u [GROUPS, 4] for tokens 4 * group + 0..3: one Philox call keyed by (seed, group) serves 4."""
    u0, u1, u2, u3 = tl.rand4x(seed, group, _PHILOX_ROUNDS)
    # join puts its pair last: ((u0, u2), (u1, u3)) read row-major is u0, u1, u2, u3.
    return tl.reshape(tl.join(tl.join(u0, u2), tl.join(u1, u3)), [GROUPS, 4])


@triton.jit
def _log2_exponential(u, FAST_LOG: tl.constexpr):
    """log2(E) with E = -ln(u) ~ Exp(1); the score is logit * log2(e) / T - log2(E)."""
    # The winning token's E is small (about 1 / V on a flat row), i.e. u is within ~1e-5 of 1,
    # where a fast log2 (absolute error 2^-22) loses most digits of ln(u). There the series
    # -ln(1 - w) = w + w^2/2 + w^3/3 + w^4/4 is exact to fp32 for w < 1/32 (next term < w * 2e-7).
    # w >= 2^-24 keeps E > 0 (tl.rand tops out at 1 - 2^-24 anyway): E = 0 would beat any logit.
    w = tl.maximum(1.0 - u, 5.9604644775390625e-08)
    series = w * (1.0 + w * (0.5 + w * (0.3333333333333333 + w * 0.25)))
    e = tl.where(w < 0.03125, series, -_log2(u, FAST_LOG) * _LN2)
    return _log2(e, FAST_LOG)  # u = 0: E = inf, so that token never wins


@triton.jit(do_not_specialize=["tiles_per_chunk", "num_words"])  # one variant for every batch size
def _sample_chunk_kernel(
    logits_ptr, temperature_ptr, seeds_ptr, chunk_score_ptr, chunk_token_ptr, mask_rows_ptr, mask_words_ptr,
    vocab_size, row_stride, tiles_per_chunk, num_words,
    BLOCK: tl.constexpr, FAST_LOG: tl.constexpr, HAS_MASKS: tl.constexpr,
):
    # Program (row, chunk) scores tokens [chunk, chunk + 1) * tiles_per_chunk * BLOCK of its row.
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    num_chunks = tl.num_programs(1)
    GROUPS: tl.constexpr = BLOCK // 4
    temperature = tl.load(temperature_ptr + row)
    seed = tl.load(seeds_ptr + row)
    mask_row = -1
    words_ptr = mask_words_ptr
    if HAS_MASKS:  # structured output: the row's bitmask (bit t % 32 of word t // 32), or -1 for a free row
        mask_row = tl.load(mask_rows_ptr + row)
        words_ptr = mask_words_ptr + tl.maximum(mask_row, 0).to(tl.int64) * num_words
    greedy = temperature < _GREEDY_TEMPERATURE
    # Scores in base 2 (log2 is the cheap log on a GPU); greedy rows never use the scale.
    scale = _LOG2E / tl.where(greedy, 1.0, temperature)
    row_ptr = logits_ptr + row.to(tl.int64) * row_stride
    lane = tl.arange(0, GROUPS)
    best = tl.full([GROUPS, 4], float("-inf"), tl.float32)
    best_token = tl.zeros([GROUPS, 4], tl.int32)  # a valid token even if every score is -inf
    first_group = chunk * tiles_per_chunk * GROUPS
    for t in range(tiles_per_chunk):
        group = first_group + t * GROUPS + lane
        tokens = group[:, None] * 4 + tl.arange(0, 4)[None, :]
        # Masked tokens read -inf, so (as -inf logits do) they never win.
        x = tl.load(row_ptr + tokens, mask=tokens < vocab_size, other=float("-inf")).to(tl.float32)
        if HAS_MASKS:
            if mask_row >= 0:  # a token its mask does not allow reads -inf too
                word = tl.load(words_ptr + tokens // 32, mask=tokens < num_words * 32, other=0)
                x = tl.where(((word >> (tokens % 32)) & 1) != 0, x, float("-inf"))
        if greedy:
            score = x
        else:
            score = x * scale - _log2_exponential(_uniform(seed, group, GROUPS), FAST_LOG)
        # Each lane sees its tokens in increasing order: strict > keeps the lower one on a tie.
        take = score > best
        best = tl.where(take, score, best)
        best_token = tl.where(take, tokens, best_token)
    chunk_best = tl.max(tl.max(best, axis=1), axis=0)
    chunk_token = tl.min(tl.min(tl.where(best == chunk_best, best_token, 2147483647), axis=1), axis=0)
    tl.store(chunk_score_ptr + row * num_chunks + chunk, chunk_best)
    tl.store(chunk_token_ptr + row * num_chunks + chunk, chunk_token)


@triton.jit(do_not_specialize=["num_chunks"])
def _pick_token_kernel(chunk_score_ptr, chunk_token_ptr, out_ptr, num_chunks, out_stride,
                       BLOCK_CHUNKS: tl.constexpr):
    row = tl.program_id(0)
    c = tl.arange(0, BLOCK_CHUNKS)
    mask = c < num_chunks
    score = tl.load(chunk_score_ptr + row * num_chunks + c, mask=mask, other=float("-inf"))
    token = tl.load(chunk_token_ptr + row * num_chunks + c, mask=mask, other=0)
    best = tl.max(score, axis=0)
    # The lowest token among the best chunks: the same tie-break as torch.argmax, whatever the chunking.
    token = tl.min(tl.where(mask & (score == best), token, 2147483647), axis=0)
    tl.store(out_ptr + row * out_stride, token.to(tl.int64))


def _tiles_per_chunk(num_rows: int, vocab_size: int, device: torch.device, chunk_size: int | None) -> int:
    tiles = triton.cdiv(vocab_size, BLOCK)
    if chunk_size is not None:
        return max(1, min(tiles, triton.cdiv(chunk_size, BLOCK)))
    # At least ~4 programs per SM: a small batch splits each row finely (B = 1 runs one step per
    # program on 75 SMs at V = 151936), a big one gets chunks of up to MAX_TILES_PER_CHUNK steps.
    chunks_per_row = max(triton.cdiv(4 * num_sms(device), num_rows), triton.cdiv(tiles, MAX_TILES_PER_CHUNK))
    return triton.cdiv(tiles, min(tiles, chunks_per_row))


def sample_tokens(logits: torch.Tensor, temperature: torch.Tensor, seeds: torch.Tensor,
                  out: torch.Tensor | None = None, chunk_size: int | None = None,
                  mask_rows: torch.Tensor | None = None, mask_words: torch.Tensor | None = None) -> torch.Tensor:
    """One token per row of logits [B, V] (bf16/fp16/fp32, unit last stride, any row stride).

    temperature: float32 [B]; below 1e-5 the row is greedy (argmax of the raw logits, lowest token
    on a tie). seeds: int64 [B], any 64-bit value; a random row returns
    argmax_i(logit_i / T - log(-log u_i)) with u = uniform_noise(seeds, V). Returns int64 [B],
    written into `out` when given. chunk_size (tokens per program) overrides the chunking; the
    tokens do not depend on it.

    Structured output: mask_rows int32 [B] names each row's bitmask in mask_words int32 [R, W] (-1: a free
    row); a token whose bit (t % 32 of word t // 32) is clear, or past 32 W, is never drawn. Read inside
    the same pass, so masking costs no copy of the logits.
    """
    assert logits.dim() == 2 and logits.stride(-1) == 1, "logits [B, V] with a unit last stride"
    num_rows, vocab_size = logits.shape
    assert temperature.shape == (num_rows,) and temperature.dtype == torch.float32 and temperature.is_contiguous()
    assert seeds.shape == (num_rows,) and seeds.dtype == torch.int64 and seeds.is_contiguous()
    assert vocab_size > 0 and temperature.device == seeds.device == logits.device
    if out is None:
        out = torch.empty(num_rows, dtype=torch.int64, device=logits.device)
    assert out.shape == (num_rows,) and out.dtype == torch.int64
    if num_rows == 0:
        return out
    has_masks = mask_rows is not None
    if has_masks:
        assert mask_words is not None and mask_words.dim() == 2 and mask_words.dtype == torch.int32
        assert mask_words.is_contiguous() and mask_words.device == logits.device
        assert mask_rows.shape == (num_rows,) and mask_rows.dtype == torch.int32 and mask_rows.is_contiguous()
    else:
        mask_rows = mask_words = temperature  # never read: HAS_MASKS is off
    tiles_per_chunk = _tiles_per_chunk(num_rows, vocab_size, logits.device, chunk_size)
    num_chunks = triton.cdiv(triton.cdiv(vocab_size, BLOCK), tiles_per_chunk)
    chunk_score = torch.empty(num_rows, num_chunks, dtype=torch.float32, device=logits.device)
    chunk_token = torch.empty(num_rows, num_chunks, dtype=torch.int32, device=logits.device)
    _sample_chunk_kernel[(num_rows, num_chunks)](
        logits, temperature, seeds, chunk_score, chunk_token, mask_rows, mask_words,
        vocab_size, logits.stride(0), tiles_per_chunk, mask_words.shape[-1] if has_masks else 0,
        BLOCK=BLOCK, FAST_LOG=not INTERPRET, HAS_MASKS=has_masks, num_warps=NUM_WARPS,
    )
    _pick_token_kernel[(num_rows,)](
        chunk_score, chunk_token, out, num_chunks, out.stride(0),
        BLOCK_CHUNKS=triton.next_power_of_2(num_chunks), num_warps=1,
    )
    return out


def warm_up(max_rows: int, vocab_size: int, dtype: torch.dtype, device: torch.device) -> bool:
    """Compile every kernel variant a batch of 1..max_rows rows can need (the row count sets the
    chunking, hence the picker's block), so that no step of a running server waits for a compile.

    Returns whether the masked variant (structured output) built and drew inside its masks here. If it did
    not, the caller keeps masked rows on the torch masking path; an unmasked failure propagates."""
    first_rows: dict[int, int] = {}
    for rows in range(1, max_rows + 1):
        tiles = _tiles_per_chunk(rows, vocab_size, device, None)
        chunks = triton.cdiv(triton.cdiv(vocab_size, BLOCK), tiles)
        first_rows.setdefault(triton.next_power_of_2(chunks), rows)
    logits = torch.randn(max(first_rows.values()), vocab_size, device=device).to(dtype)
    allowed = torch.tensor([3, vocab_size - 1], device=device)  # two tokens; bit 31 of a word among them if V > 32
    words = torch.zeros(1, triton.cdiv(vocab_size, 32), dtype=torch.int32, device=device)
    for token in allowed.tolist():
        bit = 1 << token % 32
        words[0, token // 32] |= bit - (1 << 32) if bit >= 1 << 31 else bit  # as int32
    for rows in first_rows.values():
        sample_tokens(logits[:rows], torch.full((rows,), 0.5, device=device),
                      torch.arange(rows, dtype=torch.int64, device=device))
    try:
        for rows in first_rows.values():
            tokens = sample_tokens(logits[:rows], torch.full((rows,), 0.5, device=device),
                                   torch.arange(rows, dtype=torch.int64, device=device),
                                   mask_rows=torch.zeros(rows, dtype=torch.int32, device=device), mask_words=words)
            if not torch.isin(tokens, allowed).all():
                raise RuntimeError(f"drew {tokens.unique().tolist()[:4]} outside the mask {allowed.tolist()}")
    except Exception:  # noqa: BLE001 - a variant that fails here must not take the server down
        log.exception("the masked sampling kernel failed its warm-up: masked rows use the torch masking path")
        return False
    return True


# ---------------------------------------------------------------------------------------------
# The noise itself and a float64 reference, for tests
# ---------------------------------------------------------------------------------------------


@triton.jit
def _uniform_noise_kernel(seeds_ptr, out_ptr, vocab_size, GROUPS: tl.constexpr):
    row = tl.program_id(0)
    group = tl.program_id(1) * GROUPS + tl.arange(0, GROUPS)
    tokens = group[:, None] * 4 + tl.arange(0, 4)[None, :]
    u = _uniform(tl.load(seeds_ptr + row), group, GROUPS)
    tl.store(out_ptr + row.to(tl.int64) * vocab_size + tokens, u, mask=tokens < vocab_size)


def uniform_noise(seeds: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """float32 [B, V]: the u_i in [0, 1) that sample_tokens draws for each row's seed."""
    assert seeds.dim() == 1 and seeds.dtype == torch.int64 and seeds.is_contiguous()
    out = torch.empty(seeds.shape[0], vocab_size, dtype=torch.float32, device=seeds.device)
    if out.numel() > 0:
        grid = (seeds.shape[0], triton.cdiv(vocab_size, BLOCK))
        _uniform_noise_kernel[grid](seeds, out, vocab_size, GROUPS=BLOCK // 4, num_warps=NUM_WARPS)
    return out


def sample_tokens_reference(logits: torch.Tensor, temperature: torch.Tensor, u: torch.Tensor,
                            allowed: torch.Tensor | None = None) -> torch.Tensor:
    """Gumbel-max in float64 from the same u: what sample_tokens computes, up to fp32 rounding.
    allowed: bool [B, V], the tokens each row's mask allows (None: all)."""
    x = logits.double()
    if allowed is not None:
        x = x.masked_fill(~allowed, float("-inf"))
    greedy = temperature < GREEDY_TEMPERATURE
    t = torch.where(greedy, 1.0, temperature.double())[:, None]
    scores = x / t - torch.log(-torch.log(u.double()))
    return torch.where(greedy, x.argmax(dim=-1), scores.argmax(dim=-1))
