"""Speculative decoding, the executors' half: a step's proposals verified against the target model's logits.

The plan lists, after a sequence's last token, K proposed tokens; the forward scores all K + 1 positions at once
(input_batch.py gives such a chunk K + 1 logits rows). Position j's distribution p_j is the target's after
temperature, min-p, top-k and top-p, exactly as the sampler forms it. Proposal d_j is accepted with probability
min(1, p_j(d_j) / q_j(d_j)), q being the proposer's distribution (a point mass for n-gram proposals, so that is
p_j(d_j); a draft model's q_j after the same filters, executor_svc/draft_model.py); the first rejected one is
replaced by a draw from the residual max(0, p_j - q_j), renormalized, and when all K are accepted one more token is
drawn from p_K. Each token then follows the target's distribution given the ones before it (Leviathan et al., 2023;
Chen et al., 2023): speculation changes the speed, never what is sampled. Greedy rows accept d_j exactly when it is
p_j's argmax and yield that argmax, so their output is the non-speculative engine's, token for token.

A seeded row draws its two uniforms at generated position n from mix_seed(seed, n): its tokens depend on its
seed, its proposals and its history only, not on its neighbours or its place in the batch.
"""
from __future__ import annotations

from dataclasses import dataclass
from itertools import chain
from typing import Callable

import numpy as np
import torch

from executor_svc.sampler import SamplingBatch, mix_seed, tempered_and_filtered
from executor_svc.sampling_row import SamplingRow
from executor_svc.seq_mirror import ScheduledChunk
from kernels.speculative_verdict import verdict

Upload = Callable[[dict[str, np.ndarray], str], dict[str, torch.Tensor]]  # PinnedStaging.upload(arrays, group)


@dataclass
class Verdict:
    """What a verifying step yields per sampling chunk, aligned with the step's sampling chunks."""

    token_ids: torch.Tensor  # int64 [S]: the token drawn after the chunk's accepted proposals (its only one without)
    num_accepted: torch.Tensor  # int64 [S]: how many leading proposals were accepted
    logprobs: tuple | None = None  # as SamplerOutput's, [S] rows, for chunks without proposals that asked for them
    both: torch.Tensor | None = None  # [2, S]: token_ids and num_accepted in one tensor, when they were made so


def target_probs(logits: torch.Tensor, rows: list[SamplingRow], vocab_size: int, upload: Upload | None = None,
                 rng: np.random.Generator | None = None) -> torch.Tensor:
    """float64 [N, V]: each row's sampling distribution: logits / temperature, then min-p, top-k and top-p."""
    empty: list[list[int]] = [[] for _ in rows]
    batch = SamplingBatch.build(rows, empty, empty, vocab_size, logits.device,
                                None if upload is None else lambda arrays: upload(arrays, "verify_options"), rng)
    return tempered_and_filtered(logits.float(), batch).softmax(dim=-1).double()


def rejection_sample(probs: torch.Tensor, greedy: torch.Tensor, drafts: torch.Tensor, uniforms: torch.Tensor,
                     draft_probs: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row: whether its proposal is accepted, and the token it yields where it is the first one rejected (or,
    for a row without a proposal, drafts -1, the token drawn from it).

    probs float64 [N, V]: the target's distributions; greedy bool [N]; drafts int64 [N]; uniforms float64 [N, 2]
    in [0, 1): the acceptance test's and the draw's. draft_probs float64 [N, V]: the proposer's distributions;
    None for point masses (n-gram proposals)."""
    has_draft = drafts >= 0
    d = drafts.clamp(min=0)[:, None]
    p_d = probs.gather(1, d).squeeze(1)
    if draft_probs is None:
        q_d = torch.ones_like(p_d)
        residual = probs.scatter(1, d, 0.0)  # max(0, p - onehot(d)): p without d
    else:
        q_d = draft_probs.gather(1, d).squeeze(1)
        residual = (probs - draft_probs).clamp_(min=0.0)
    residual = torch.where(has_draft[:, None], residual, probs)
    # u < p / q, written without the division: q_d > 0 for a proposal that was drawn from q
    accepted = has_draft & (uniforms[:, 0] * q_d < p_d)
    cdf = residual.cumsum(dim=-1)
    drawn = torch.searchsorted(cdf, uniforms[:, 1:2] * cdf[:, -1:], right=True).squeeze(1)
    drawn = drawn.clamp_(max=probs.shape[1] - 1)
    argmax = probs.argmax(dim=-1)
    accepted = torch.where(greedy, has_draft & (argmax == drafts), accepted)
    return accepted, torch.where(greedy, argmax, drawn)


def row_uniforms(rows: list[SamplingRow], positions: list[int], device: torch.device,
                 generators: dict) -> torch.Tensor:
    """float64 [N, 2] in [0, 1): a seeded row's from mix_seed(seed, its generated position), the others' from the
    device's default generator."""
    uniforms = torch.rand(len(rows), 2, dtype=torch.float64, device=device)
    seeded = [i for i, r in enumerate(rows) if r.seed is not None]
    if seeded:
        generator = generators.get(device)
        if generator is None:
            generator = generators[device] = torch.Generator(device=device)
        own = []
        for i in seeded:
            generator.manual_seed(mix_seed(rows[i].seed, positions[i]))
            own.append(torch.rand(2, dtype=torch.float64, device=device, generator=generator))
        uniforms[torch.tensor(seeded, device=device)] = torch.stack(own)
    return uniforms


def plain_rows(chunks: list[ScheduledChunk]) -> bool:
    """Whether every chunk of a verifying step samples plainly: greedy or temperature alone (no filter, penalty,
    seed or logprobs) and no token mask. Its verdict then needs one draw per row from the row's own distribution
    (verdict_from_draws), which a decode graph makes in place: the argmax for a greedy row."""
    return all(c.seq.sampling_row.plain and c.token_mask is None and not c.late_mask for c in chunks)


def drawable(chunks: list[ScheduledChunk]) -> bool:
    """Whether one draw per logits row can decide a verifying step: its chunks are plain (plain_rows) and carry no
    draft distribution q (a draft's sampled proposals: rejection sampling against q accepts more often than the draw
    rule, exact for any proposer but blind to q)."""
    return plain_rows(chunks) and all(c.draft_probs is None for c in chunks)


def draws_decide(chunks: list[ScheduledChunk], drawn: bool) -> bool:
    """Whether one draw per logits row decides a verifying step's verdict (verdict_from_draws): its chunks are
    drawable and either the rows were drawn (drawn: a decode graph sampled them) or every row is greedy, whose draw
    is its argmax. Otherwise verify_chunks decides, over float64 distributions of the whole vocabulary: milliseconds
    for a step, which a greedy step beside a prefill chunk (the varlen path, no graph) used to pay."""
    return drawable(chunks) and (drawn or all(c.seq.sampling_row.greedy for c in chunks))


def verdict_from_draws(draws: torch.Tensor, chunks: list[ScheduledChunk], upload: Upload) -> Verdict:
    """A step of plain chunks (plain_rows) verified from one independent draw per logits row, x_j ~ p_j (int64
    [rows]: 1 + K rows per chunk with proposals, in chunk order; the argmax for greedy rows): proposal d_j is
    accepted while every one before it was and x_j == d_j, and the chunk yields the draw of the row after its
    accepted ones (a void chunk, or one whose guess failed, its first row's).

    For a point-mass proposal (n-gram) this is rejection sampling itself: d_j is accepted with probability p_j(d_j),
    and a rejected row's draw is p_j given x_j != d_j, i.e. max(0, p_j - onehot(d_j)) renormalized, the residual;
    greedy rows accept exactly the argmax and yield it, the plain sampler's greedy tokens. One upload of one small
    array and one kernel, no host sync, no distributions over the vocabulary."""
    n = len(chunks)
    counts = np.fromiter((len(c.proposal) for c in chunks), dtype=np.int64, count=n)
    first_row = np.zeros(n, dtype=np.int64)
    np.cumsum(1 + counts[:-1], out=first_row[1:])
    k = np.where([c.void or c.proposals_dropped for c in chunks], 0, counts)  # proposals verified
    # each row's draw is compared with the proposal after it; -1 after a chunk's last row (never accepted)
    targets = np.fromiter(chain.from_iterable((*c.proposal, -1) for c in chunks), dtype=np.int64,
                          count=n + int(counts.sum()))
    spec = upload({"spec": np.concatenate([first_row, k, targets])}, "verify")["spec"]
    both = verdict(draws, spec, n, int(k.max()))  # one kernel: kernels/speculative_verdict.py
    return Verdict(both[0], both[1], both=both)


def verify_chunks(logits: torch.Tensor, chunks: list[ScheduledChunk], vocab_size: int, upload: Upload,
                  sample_plain: Callable[[torch.Tensor, list[ScheduledChunk]], object],
                  generators: dict, rng: np.random.Generator | None = None) -> Verdict:
    """Verify a step whose sampling chunks (some with proposals) have their logits rows in order: 1 + K each.

    sample_plain(logits rows, chunks) samples the chunks without proposals with the ordinary sampler (penalties,
    token masks and logprobs are theirs alone: the scheduler never proposes for such rows) and returns its
    SamplerOutput. No host sync."""
    device = logits.device
    first_row = np.cumsum([0] + [1 + len(c.proposal) for c in chunks])
    # a void chunk, or one whose guess of its pending input failed, is sampled plainly from its first row
    spec = [i for i, c in enumerate(chunks) if c.proposal and not (c.void or c.proposals_dropped)]
    verified = set(spec)
    plain = [i for i in range(len(chunks)) if i not in verified]
    if not spec:
        token_ids = torch.empty(len(chunks), dtype=torch.int64, device=device)
        out = sample_plain(logits[torch.as_tensor(first_row[:-1], device=device)], chunks)
        token_ids[:] = out.token_ids
        logprobs = None
        if out.top_token_ids is not None:
            logprobs = (out.sampled_logprobs, out.sampled_ranks, out.top_token_ids, out.top_logprobs)
        return Verdict(token_ids, torch.zeros(len(chunks), dtype=torch.int64, device=device), logprobs)
    rows: list[SamplingRow] = []
    drafts: list[int] = []
    positions: list[int] = []
    spec_rows: list[int] = []
    k_max = max(len(chunks[i].proposal) for i in spec)
    # proposal j of spec chunk c sits at local row start[c] + j; padding points at a row that is never accepted
    for i in spec:
        c = chunks[i]
        k = len(c.proposal)
        spec_rows.extend(range(first_row[i], first_row[i] + k + 1))
        rows.extend([c.seq.sampling_row] * (k + 1))
        drafts.extend(c.proposal)
        drafts.append(-1)
        generated = len(c.seq.token_ids) - c.seq.num_prompt_tokens
        positions.extend(range(generated, generated + k + 1))
    starts = np.cumsum([0] + [len(chunks[i].proposal) + 1 for i in spec])[:-1]
    pad_row = len(spec_rows)  # an extra row whose acceptance is False
    index = np.full((len(spec), k_max), pad_row, dtype=np.int64)
    for n, i in enumerate(spec):
        k = len(chunks[i].proposal)
        index[n, :k] = starts[n] + np.arange(k)
    arrays = {"spec_rows": np.asarray(spec_rows, dtype=np.int64), "drafts": np.asarray(drafts, dtype=np.int64),
              "greedy": np.fromiter((r.greedy for r in rows), dtype=np.bool_, count=len(rows)),
              "index": index, "starts": starts.astype(np.int64), "spec": np.asarray(spec, dtype=np.int64),
              "plain": np.asarray(plain, dtype=np.int64),
              "plain_rows": np.asarray([first_row[i] for i in plain], dtype=np.int64)}
    dev = upload(arrays, "verify")
    probs = target_probs(logits[dev["spec_rows"]], rows, vocab_size, upload, rng)
    accepted, yielded = rejection_sample(probs, dev["greedy"], dev["drafts"],
                                         row_uniforms(rows, positions, device, generators),
                                         _draft_probs([chunks[i] for i in spec], probs.shape[1]))
    padded = torch.cat([accepted, accepted.new_zeros(1)])[dev["index"]]  # [C, K_max]
    num_accepted = padded.long().cumprod(dim=1).sum(dim=1)
    token_ids = torch.empty(len(chunks), dtype=torch.int64, device=device)
    counts = torch.zeros(len(chunks), dtype=torch.int64, device=device)
    token_ids[dev["spec"]] = yielded[dev["starts"] + num_accepted]
    counts[dev["spec"]] = num_accepted
    logprobs = None
    if plain:
        out = sample_plain(logits[dev["plain_rows"]], [chunks[i] for i in plain])
        token_ids[dev["plain"]] = out.token_ids
        if out.top_token_ids is not None:
            logprobs = _scatter_rows(len(chunks), dev["plain"], (out.sampled_logprobs, out.sampled_ranks,
                                                                 out.top_token_ids, out.top_logprobs))
    return Verdict(token_ids, counts, logprobs)


def _draft_probs(chunks: list[ScheduledChunk], vocab_size: int) -> torch.Tensor | None:
    """A draft model's q rows aligned with the verified rows (K per chunk, then a zero row for the token after
    them, which has no proposal); None for n-gram proposals (point masses)."""
    if all(c.draft_probs is None for c in chunks):
        return None
    zero = chunks[0].draft_probs.new_zeros(1, vocab_size)
    return torch.cat([part for c in chunks for part in (c.draft_probs, zero)])


def _scatter_rows(n: int, where: torch.Tensor, parts: tuple) -> tuple:
    """Each [P, ...] tensor as an [n, ...] one with rows `where` filled (the rest zero)."""
    return tuple(t.new_zeros((n, *t.shape[1:])).index_copy_(0, where, t) for t in parts)
