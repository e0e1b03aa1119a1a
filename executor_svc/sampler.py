"""The sampler: penalties, temperature, min-p / top-k / top-p, and the exponential race.

Everything runs as batched tensor ops on the logits' device: no per-token host sync.
Logprobs come from the raw logits, as in vLLM. A seeded row draws its noise from a
generator seeded with (seed, generated-token count), so its tokens do not depend on
its neighbours, its batch position, or on being preempted and recomputed.
"""

from dataclasses import dataclass

import numpy as np
import torch

from protos import engine_pb2

GREEDY_EPS = 1e-5  # a temperature below this is greedy
_MASK64 = (1 << 64) - 1


def mix_seed(seed: int, step: int) -> int:
    """A 64-bit generator seed from (request seed, generated-token count): splitmix64."""
    z = (seed + (step + 1) * 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def _pad(rows: list[list[int]], pad: int, device: torch.device) -> torch.Tensor:
    """Ragged token lists -> int64 [B, max_len] padded with `pad` (numpy fills rows fastest)."""
    padded = np.full((len(rows), max(1, max(map(len, rows)))), pad, dtype=np.int64)
    for i, row in enumerate(rows):
        padded[i, :len(row)] = row
    return torch.from_numpy(padded).to(device)


@dataclass
class SamplingBatch:
    """Per-step sampling tensors; a feature's tensor is None when no row uses it."""

    greedy: torch.Tensor                # bool [B]
    temperature: torch.Tensor           # float32 [B], 1.0 on greedy rows
    top_k: torch.Tensor | None          # int64 [B], vocab_size where off
    top_p: torch.Tensor | None          # float32 [B], 1.0 where off
    min_p: torch.Tensor | None          # float32 [B], 0.0 where off
    presence_penalty: torch.Tensor | None   # float32 [B]; the three penalties share one flag
    frequency_penalty: torch.Tensor | None  # float32 [B]
    repetition_penalty: torch.Tensor | None  # float32 [B], 1.0 where off
    prompt_token_ids: torch.Tensor | None   # int64 [B, Lp], padded with vocab_size; repetition only
    output_token_ids: torch.Tensor | None   # int64 [B, Lo], padded with vocab_size
    seeded_rows: torch.Tensor | None    # int64 [S], rows that own a seed
    generator_seeds: list[int]          # [S], mix_seed(seed, generated count) per seeded row
    all_greedy: bool
    any_greedy: bool
    max_logprobs: int                   # 0: nobody wants logprobs
    vocab_size: int

    @property
    def any_penalties(self) -> bool:
        return self.repetition_penalty is not None

    @staticmethod
    def build(options: list[engine_pb2.SamplingOptions], prompt_token_ids: list[list[int]],
              output_token_ids: list[list[int]], vocab_size: int,
              device: torch.device) -> "SamplingBatch":
        def floats(values):
            return torch.tensor(values, dtype=torch.float32, device=device)

        greedy = [o.temperature < GREEDY_EPS for o in options]
        top_k = [o.top_k if 0 < o.top_k < vocab_size else vocab_size for o in options]
        top_p = [o.top_p if 0 < o.top_p < 1 else 1.0 for o in options]
        min_p = [o.min_p if 0 < o.min_p <= 1 else 0.0 for o in options]
        rep = [o.repetition_penalty if o.repetition_penalty > 0 else 1.0 for o in options]
        pres = [o.presence_penalty for o in options]
        freq = [o.frequency_penalty for o in options]
        # Filters only matter on random rows; greedy rows ignore them.
        rand = [not g for g in greedy]
        any_top_k = any(k < vocab_size and r for k, r in zip(top_k, rand))
        any_top_p = any(p < 1 and r for p, r in zip(top_p, rand))
        any_min_p = any(p > 0 and r for p, r in zip(min_p, rand))
        any_repetition = any(r != 1 for r in rep)
        any_penalties = any_repetition or any(pres) or any(freq)
        seeded = [i for i, o in enumerate(options) if o.HasField("seed") and rand[i]]

        return SamplingBatch(
            greedy=torch.tensor(greedy, dtype=torch.bool, device=device),
            temperature=floats([1.0 if g else o.temperature for g, o in zip(greedy, options)]),
            top_k=torch.tensor(top_k, dtype=torch.int64, device=device) if any_top_k else None,
            top_p=floats(top_p) if any_top_p else None,
            min_p=floats(min_p) if any_min_p else None,
            presence_penalty=floats(pres) if any_penalties else None,
            frequency_penalty=floats(freq) if any_penalties else None,
            repetition_penalty=floats(rep) if any_penalties else None,
            prompt_token_ids=_pad(prompt_token_ids, vocab_size, device) if any_repetition else None,
            output_token_ids=_pad(output_token_ids, vocab_size, device) if any_penalties else None,
            seeded_rows=torch.tensor(seeded, dtype=torch.int64, device=device) if seeded else None,
            generator_seeds=[mix_seed(options[i].seed, len(output_token_ids[i])) for i in seeded],
            all_greedy=all(greedy),
            any_greedy=any(greedy),
            max_logprobs=min(vocab_size, max([0] + [o.logprobs for o in options])),
            vocab_size=vocab_size,
        )


def build_for_sequences(options: list[engine_pb2.SamplingOptions], token_ids: list[list[int]],
                        num_prompt_tokens: list[int], vocab_size: int, device: torch.device) -> SamplingBatch:
    """SamplingBatch.build from whole token lists, slicing prompt/output only when a row needs them
    (penalties or a seed): copying every sequence's tokens each step would cost more than sampling."""
    needs_prompt = any(o.repetition_penalty > 0 and o.repetition_penalty != 1 for o in options)
    needs_output = needs_prompt or any(o.presence_penalty or o.frequency_penalty or o.HasField("seed")
                                       for o in options)
    empty: list[int] = []
    prompts = [t[:n] for t, n in zip(token_ids, num_prompt_tokens)] if needs_prompt else [empty] * len(options)
    outputs = [t[n:] for t, n in zip(token_ids, num_prompt_tokens)] if needs_output else [empty] * len(options)
    return SamplingBatch.build(options, prompts, outputs, vocab_size, device)


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor                 # int64 [B]
    sampled_logprobs: torch.Tensor | None   # float32 [B], raw logprob of the chosen token
    sampled_ranks: torch.Tensor | None      # int64 [B], 1-based rank in the raw distribution
    top_token_ids: torch.Tensor | None      # int64 [B, max_logprobs]
    top_logprobs: torch.Tensor | None       # float32 [B, max_logprobs]


def token_counts(token_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[B, L] padded (with vocab_size) token ids -> int64 [B, V] occurrence counts."""
    counts = torch.zeros(token_ids.shape[0], vocab_size + 1, dtype=torch.int64, device=token_ids.device)
    counts.scatter_add_(1, token_ids, torch.ones_like(token_ids))
    return counts[:, :vocab_size]


def apply_penalties(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Repetition (prompt + output), then frequency and presence (output only)."""
    output_counts = token_counts(batch.output_token_ids, batch.vocab_size)
    if batch.prompt_token_ids is not None:  # None when every repetition_penalty is 1
        seen = (token_counts(batch.prompt_token_ids, batch.vocab_size) > 0) | (output_counts > 0)
        rep = batch.repetition_penalty[:, None]
        penalized = torch.where(logits > 0, logits / rep, logits * rep)
        logits = torch.where(seen, penalized, logits)
    logits = logits - batch.frequency_penalty[:, None] * output_counts
    return logits - batch.presence_penalty[:, None] * (output_counts > 0)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens whose probability is below min_p times the top token's."""
    probs = logits.softmax(dim=-1)
    threshold = min_p[:, None] * probs.amax(dim=-1, keepdim=True)
    return logits.masked_fill(probs < threshold, float("-inf"))


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None,
                      top_p: torch.Tensor | None) -> torch.Tensor:
    """Keep the k best, then the smallest prefix whose probability reaches top_p (one sort)."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    if top_k is not None:
        position = torch.arange(logits.shape[-1], device=logits.device)
        sorted_logits = sorted_logits.masked_fill(position >= top_k[:, None], float("-inf"))
    if top_p is not None:
        probs = sorted_logits.softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs
        # The top token has mass_before 0 < top_p, so it always stays.
        drop = (mass_before >= top_p[:, None]) & (top_p[:, None] < 1)
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


class Sampler:
    """logits [B, V] + SamplingBatch -> SamplerOutput, all on the logits' device."""

    def __init__(self):
        self._generators: dict[torch.device, torch.Generator] = {}

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        logits = logits.float()
        raw_logprobs = logits.log_softmax(dim=-1) if batch.max_logprobs > 0 else None
        if batch.any_penalties:
            logits = apply_penalties(logits, batch)
        if batch.all_greedy:
            token_ids = logits.argmax(dim=-1)
        else:
            token_ids = self._sample_random(logits, batch)
            if batch.any_greedy:
                token_ids = torch.where(batch.greedy, logits.argmax(dim=-1), token_ids)
        if raw_logprobs is None:
            return SamplerOutput(token_ids, None, None, None, None)

        chosen = raw_logprobs.gather(-1, token_ids[:, None])
        rank = (raw_logprobs >= chosen).sum(dim=-1)  # 1-based; ties count ahead of the chosen token
        top_logprobs, top_token_ids = raw_logprobs.topk(batch.max_logprobs, dim=-1)
        return SamplerOutput(token_ids, chosen.squeeze(-1), rank, top_token_ids, top_logprobs)

    def _sample_random(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        logits = logits / batch.temperature[:, None]
        if batch.min_p is not None:
            logits = apply_min_p(logits, batch.min_p)
        if batch.top_k is not None or batch.top_p is not None:
            logits = apply_top_k_top_p(logits, batch.top_k, batch.top_p)
        probs = logits.softmax(dim=-1)
        # Exponential race: argmax(p / q), q ~ Exp(1), picks token i with probability p_i.
        q = torch.empty_like(probs).exponential_()
        if batch.seeded_rows is not None:
            q.index_copy_(0, batch.seeded_rows, self._seeded_noise(batch, probs.device))
        # exponential_ may round to 0 in float32; p / 0 would be inf (or nan on a dropped token).
        q.clamp_min_(torch.finfo(torch.float32).tiny)
        return (probs / q).argmax(dim=-1)

    def _seeded_noise(self, batch: SamplingBatch, device: torch.device) -> torch.Tensor:
        """One Exp(1) row per seeded sequence, from its own seed: independent of the batch."""
        generator = self._generators.get(device)
        if generator is None:
            generator = self._generators[device] = torch.Generator(device=device)
        rows = []
        for seed in batch.generator_seeds:
            generator.manual_seed(seed)  # host-side state, read at kernel launch: no sync
            rows.append(torch.empty(batch.vocab_size, device=device).exponential_(generator=generator))
        return torch.stack(rows)
