"""The sampler: penalties, structured-output token masks, temperature, min-p / top-k / top-p, then a random draw.

Everything runs on the logits' device with no per-token host sync. On CUDA the draw is the fused
Gumbel-max kernel (kernels/sampling.py) keyed by a per-row noise seed; on the CPU it is inverse-CDF
sampling in torch, one uniform per row. Both pick token i with probability p_i. Logprobs come from the raw
logits, as in vLLM. A seeded row's noise comes from (seed, generated-token count) alone, so its
tokens do not depend on its neighbours, its batch position, or on being preempted and recomputed.
"""

from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from executor_svc.sampling_row import SamplingRow, plain_sampling_columns
from protos import engine_pb2

try:
    from kernels.sampling import sample_tokens
except ImportError:  # no Triton: the CPU path only
    sample_tokens = None

_MASK64 = (1 << 64) - 1


def mix_seed(seed: int, step: int) -> int:
    """A 64-bit generator seed from (request seed, generated-token count): splitmix64."""
    z = (seed + (step + 1) * 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


Upload = Callable[[dict[str, np.ndarray]], dict[str, torch.Tensor]]


def plain_upload(device: torch.device) -> Upload:
    """Host arrays -> device tensors, blocking; the model runner passes its pinned, one-copy one.
    A copy from pageable memory waits for the whole stream, so the GPU step path never uses this."""
    return lambda arrays: {name: torch.from_numpy(a).to(device) for name, a in arrays.items()}


def _pad(rows: list[list[int]], pad: int) -> np.ndarray:
    """Ragged token lists -> int64 [B, max_len] padded with `pad`."""
    padded = np.full((len(rows), max(1, max(map(len, rows)))), pad, dtype=np.int64)
    for i, row in enumerate(rows):
        padded[i, :len(row)] = row
    return padded


@dataclass
class SamplingBatch:
    """Per-step sampling tensors; a feature's tensor is None when no row uses it."""

    greedy: torch.Tensor                # bool [B]
    temperature: torch.Tensor           # float32 [B], 0.0 on greedy rows
    top_k: torch.Tensor | None          # int64 [B], vocab_size where off
    top_p: torch.Tensor | None          # float32 [B], 1.0 where off
    min_p: torch.Tensor | None          # float32 [B], 0.0 where off
    presence_penalty: torch.Tensor | None   # float32 [B]; the three penalties share one flag
    frequency_penalty: torch.Tensor | None  # float32 [B]
    repetition_penalty: torch.Tensor | None  # float32 [B], 1.0 where off
    prompt_token_ids: torch.Tensor | None   # int64 [B, Lp], padded with vocab_size; repetition only
    output_token_ids: torch.Tensor | None   # int64 [B, Lo], padded with vocab_size
    noise_seeds: torch.Tensor           # int64 [B]: each row's noise seed, mix_seed(seed, count) if seeded
    masked_rows: torch.Tensor | None    # int64 [R]: rows with a structured-output token mask
    mask_words: torch.Tensor | None     # int32 [R, ceil(V / 32)]: bit t % 32 of word t // 32 set = token t allowed
    seeded_rows: torch.Tensor | None    # int64 [S], rows that own a seed
    generator_seeds: list[int]          # [S], mix_seed(seed, generated count) per seeded row
    all_greedy: bool
    any_greedy: bool
    max_logprobs: int                   # 0: nobody wants logprobs
    vocab_size: int

    @property
    def any_penalties(self) -> bool:
        return self.repetition_penalty is not None

    @property
    def any_filters(self) -> bool:
        return self.top_k is not None or self.top_p is not None or self.min_p is not None

    @staticmethod
    def build(options: "list[engine_pb2.SamplingOptions | SamplingRow]", prompt_token_ids: list[list[int]],
              output_token_ids: list[list[int]], vocab_size: int, device: torch.device,
              upload: Upload | None = None, rng: np.random.Generator | None = None,
              token_masks: "list[np.ndarray | None] | None" = None) -> "SamplingBatch":
        """`upload` moves the host arrays to the device in one go (default: blocking copies); `rng`
        draws the noise seeds of unseeded rows (default: a fresh OS-seeded generator); `token_masks`
        holds each row's structured-output bitmask, or None for a free row."""
        upload = upload or plain_upload(device)
        rng = rng or np.random.default_rng()
        rows = [SamplingRow.of(o) for o in options]
        n = len(rows)

        def column(dtype, values) -> np.ndarray:
            return np.fromiter(values, dtype=dtype, count=n)

        host = {"greedy": column(np.bool_, (r.greedy for r in rows)), **plain_sampling_columns(rows, rng)}
        greedy = host["greedy"]
        flags = dict.fromkeys(("top_k", "top_p", "min_p", "repetition", "penalties"), False)
        seeded, generator_seeds = [], []
        if not all(r.plain for r in rows):  # the per-step cost of the common case stays at three columns
            rand = ~greedy
            top_k = column(np.int64, (r.top_k if 0 < r.top_k < vocab_size else vocab_size for r in rows))
            top_p = column(np.float32, (r.top_p for r in rows))
            min_p = column(np.float32, (r.min_p for r in rows))
            rep = column(np.float32, (r.repetition_penalty for r in rows))
            pres = column(np.float32, (r.presence_penalty for r in rows))
            freq = column(np.float32, (r.frequency_penalty for r in rows))
            # Filters only matter on random rows; greedy rows ignore them.
            flags["top_k"] = bool(((top_k < vocab_size) & rand).any())
            flags["top_p"] = bool(((top_p < 1) & rand).any())
            flags["min_p"] = bool(((min_p > 0) & rand).any())
            flags["repetition"] = bool((rep != 1).any())
            flags["penalties"] = flags["repetition"] or bool(pres.any()) or bool(freq.any())
            for name, array in (("top_k", top_k), ("top_p", top_p), ("min_p", min_p)):
                if flags[name]:
                    host[name] = array
            if flags["penalties"]:
                host.update(presence_penalty=pres, frequency_penalty=freq, repetition_penalty=rep,
                            output_token_ids=_pad(output_token_ids, vocab_size))
            if flags["repetition"]:
                host["prompt_token_ids"] = _pad(prompt_token_ids, vocab_size)
            seeded = [i for i, r in enumerate(rows) if r.seed is not None]
            generator_seeds = [mix_seed(rows[i].seed, len(output_token_ids[i])) for i in seeded]
            for i, seed in zip(seeded, generator_seeds):
                host["noise_seeds"][i] = seed - (1 << 64) if seed >= 1 << 63 else seed  # as int64
            if seeded:
                host["seeded_rows"] = np.asarray(seeded, dtype=np.int64)
        masked = [i for i, m in enumerate(token_masks or ()) if m is not None]
        if masked:  # uploaded with the rest, in the same copy
            host["masked_rows"] = np.asarray(masked, dtype=np.int64)
            host["mask_words"] = np.stack([token_masks[i] for i in masked]).astype(np.int32, copy=False)
        dev = upload(host)
        return SamplingBatch(
            greedy=dev["greedy"], temperature=dev["temperature"], top_k=dev.get("top_k"), top_p=dev.get("top_p"),
            min_p=dev.get("min_p"), presence_penalty=dev.get("presence_penalty"),
            frequency_penalty=dev.get("frequency_penalty"), repetition_penalty=dev.get("repetition_penalty"),
            prompt_token_ids=dev.get("prompt_token_ids"), output_token_ids=dev.get("output_token_ids"),
            noise_seeds=dev["noise_seeds"], seeded_rows=dev.get("seeded_rows"), generator_seeds=generator_seeds,
            masked_rows=dev.get("masked_rows"), mask_words=dev.get("mask_words"),
            all_greedy=bool(greedy.all()), any_greedy=bool(greedy.any()),
            max_logprobs=min(vocab_size, max([0] + [r.logprobs for r in rows])), vocab_size=vocab_size,
        )


def build_for_sequences(rows: list[SamplingRow], token_ids: list[list[int]], num_prompt_tokens: list[int],
                        vocab_size: int, device: torch.device, upload: Upload | None = None,
                        rng: np.random.Generator | None = None,
                        token_masks: "list[np.ndarray | None] | None" = None) -> SamplingBatch:
    """SamplingBatch.build from whole token lists, slicing prompt/output only when a row needs them
    (penalties or a seed): copying every sequence's tokens each step would cost more than sampling."""
    needs_prompt = any(r.needs_prompt for r in rows)
    needs_output = needs_prompt or any(r.needs_output for r in rows)
    empty: list[int] = []
    prompts = [t[:n] for t, n in zip(token_ids, num_prompt_tokens)] if needs_prompt else [empty] * len(rows)
    outputs = [t[n:] for t, n in zip(token_ids, num_prompt_tokens)] if needs_output else [empty] * len(rows)
    return SamplingBatch.build(rows, prompts, outputs, vocab_size, device, upload, rng, token_masks)


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
    logits = logits - batch.presence_penalty[:, None] * (output_counts > 0)
    # an extreme penalty can overflow one row (x / 1e-45 is inf, and inf - inf is NaN): keep that row's
    # order but finite, so it samples like any other and never poisons the batch (the validators bound
    # the penalties; this is the executor's own guard)
    return torch.nan_to_num(logits, nan=float("-inf"), posinf=torch.finfo(logits.dtype).max)


def apply_token_masks(logits: torch.Tensor, rows: torch.Tensor, words: torch.Tensor) -> torch.Tensor:
    """Structured output: in each masked row, every token its bitmask does not allow becomes -inf (a new
    tensor: the caller's logits, perhaps a CUDA graph's output, stay as they were).

    words int32 [R, W] hold bit t % 32 of word t // 32 for token t; read as little-endian bytes, byte k of a
    row holds tokens 8k .. 8k + 7 in bits 0..7, so unpacking bytes keeps token order with a quarter of the
    intermediate memory of unpacking words. Tokens past 32 W (none when W = ceil(V / 32)) are disallowed.
    No host sync: it runs on the logits' device and can be launched ahead of the draw."""
    num_rows, vocab_size = rows.shape[0], logits.shape[-1]
    shifts = torch.arange(8, dtype=torch.uint8, device=words.device)
    bits = (words.contiguous().view(torch.uint8)[:, :, None] >> shifts) & 1
    allowed = bits.view(num_rows, -1)[:, :vocab_size].bool()
    if allowed.shape[1] < vocab_size:
        allowed = torch.nn.functional.pad(allowed, (0, vocab_size - allowed.shape[1]), value=False)
    return logits.index_put((rows,), logits[rows].masked_fill(~allowed, float("-inf")))


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


def tempered_and_filtered(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """logits / temperature (greedy rows untempered), then min-p, top-k and top-p as -inf."""
    logits = logits / batch.temperature.masked_fill(batch.greedy, 1.0)[:, None]
    if batch.min_p is not None:
        logits = apply_min_p(logits, batch.min_p)
    if batch.top_k is not None or batch.top_p is not None:
        logits = apply_top_k_top_p(logits, batch.top_k, batch.top_p)
    return logits


class Sampler:
    """logits [B, V] + SamplingBatch -> SamplerOutput, all on the logits' device."""

    def __init__(self):
        self._generators: dict[torch.device, torch.Generator] = {}

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        """Logprobs describe the raw distribution, before penalties and token masks (as in vLLM)."""
        if logits.is_cuda and not batch.any_penalties and not batch.any_filters:
            # the common case on CUDA: one pass over the logits, no fp32 copy
            raw_logprobs = logits.float().log_softmax(dim=-1) if batch.max_logprobs > 0 else None
            if batch.mask_words is not None:  # masked tokens are -inf, which the fused draw never picks
                logits = apply_token_masks(logits, batch.masked_rows, batch.mask_words)
            token_ids = sample_tokens(logits, batch.temperature, batch.noise_seeds)
            return self._with_logprobs(token_ids, raw_logprobs, batch)
        logits = logits.float()
        raw_logprobs = logits.log_softmax(dim=-1) if batch.max_logprobs > 0 else None
        if batch.any_penalties:
            logits = apply_penalties(logits, batch)
        if batch.mask_words is not None:  # after the penalties, which keep a row finite; before every filter
            logits = apply_token_masks(logits, batch.masked_rows, batch.mask_words)
        if logits.is_cuda:
            # every CUDA row goes through the one Gumbel-max kernel with its own noise seed, so a
            # seeded row's token never depends on which options its neighbours use; dropped tokens
            # are -inf, which never wins, and the logits are already tempered (T = 1, 0 when greedy)
            token_ids = sample_tokens(tempered_and_filtered(logits, batch), (~batch.greedy).float(),
                                      batch.noise_seeds)
        elif batch.all_greedy:
            token_ids = logits.argmax(dim=-1)
        else:
            token_ids = self._sample_random(logits, batch)
            if batch.any_greedy:
                token_ids = torch.where(batch.greedy, logits.argmax(dim=-1), token_ids)
        return self._with_logprobs(token_ids, raw_logprobs, batch)

    @staticmethod
    def _with_logprobs(token_ids: torch.Tensor, raw_logprobs: torch.Tensor | None,
                       batch: SamplingBatch) -> SamplerOutput:
        if raw_logprobs is None:
            return SamplerOutput(token_ids, None, None, None, None)

        chosen = raw_logprobs.gather(-1, token_ids[:, None])
        rank = (raw_logprobs >= chosen).sum(dim=-1)  # 1-based; ties count ahead of the chosen token
        top_logprobs, top_token_ids = raw_logprobs.topk(batch.max_logprobs, dim=-1)
        return SamplerOutput(token_ids, chosen.squeeze(-1), rank, top_token_ids, top_logprobs)

    def _sample_random(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """Inverse CDF: the first token whose cumulative probability passes u * total, u ~ U[0, 1)
        per row. One uniform per row: a race would draw one exponential per token, which took 90%
        of the CPU sampler's time at a 49k vocabulary."""
        cdf = tempered_and_filtered(logits, batch).softmax(dim=-1).double().cumsum(dim=-1)
        u = torch.rand(cdf.shape[0], 1, dtype=torch.float64, device=cdf.device)
        if batch.seeded_rows is not None:
            u.index_copy_(0, batch.seeded_rows, self._seeded_uniforms(batch, cdf.device))
        # u <= 1 - 2^-53 keeps u * total strictly below the total in float64, so the first cdf above it
        # belongs to a token with probability (a dropped token never raises the cdf)
        token_ids = torch.searchsorted(cdf, u * cdf[:, -1:], right=True).squeeze(-1)
        return token_ids.clamp_(max=cdf.shape[-1] - 1)  # a row with no finite mass must still name a token

    def _seeded_uniforms(self, batch: SamplingBatch, device: torch.device) -> torch.Tensor:
        """One U[0, 1) per seeded sequence, from its own seed: independent of the batch."""
        generator = self._generators.get(device)
        if generator is None:
            generator = self._generators[device] = torch.Generator(device=device)
        rows = []
        for seed in batch.generator_seeds:
            generator.manual_seed(seed)  # host-side state, read at kernel launch: no sync
            rows.append(torch.rand(1, dtype=torch.float64, device=device, generator=generator))
        return torch.stack(rows)
