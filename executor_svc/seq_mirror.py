"""The executor's mirror of the scheduler's sequences, kept in step by applying each plan's deltas.

Executors never decide anything (invariant 1): they copy block ids and tokens they are told about.
Torch-free: the mirrors are plain Python and numpy.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from itertools import repeat

import numpy as np

from executor_svc.sampling_row import SamplingRow
from protos import engine_pb2


@dataclass(slots=True)
class MirroredSeq:
    seq_id: int
    token_ids: list[int]
    num_prompt_tokens: int
    block_table: list[int]
    num_computed_tokens: int
    sampling: engine_pb2.SamplingOptions | SamplingRow  # a SamplingRow for sequences the executor makes up
    # tokens launched steps will append, not appended yet (on the device), counted as the scheduler planned them:
    # a verification's proposals as if all are accepted (a short verdict leaves them counted until the next plan
    # sets the sequence's start: chunk_starts)
    num_pending: int = 0
    steps: list = field(default_factory=list)  # its launched sampling chunks not appended yet, oldest first
    # block_table as an int32 array with spare room, so building a step's block tables is a memcpy a row
    block_array: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int32))
    sampling_row: SamplingRow | None = None  # `sampling` read once, for the per-step sampling batch
    # draft method: its leading tokens whose K/V the draft model holds in its own pool (computed by this mirror:
    # a new mirror, after a preemption or on a prefix hit, starts again from 0, so the draft pool needs no swaps)
    draft_computed: int = 0

    def __post_init__(self) -> None:
        self.sampling_row = SamplingRow.of(self.sampling)
        self.block_array = np.zeros(max(16, 2 * len(self.block_table)), dtype=np.int32)
        self.block_array[: len(self.block_table)] = self.block_table

    def add_blocks(self, block_ids: list[int]) -> None:
        start = len(self.block_table)
        self.block_table += block_ids
        if len(self.block_table) > len(self.block_array):
            grown = np.zeros(2 * len(self.block_table), dtype=np.int32)
            grown[:start] = self.block_array[:start]
            self.block_array = grown
        self.block_array[start: len(self.block_table)] = block_ids

    def cut_blocks(self, num_blocks: int) -> None:
        """Keep the first num_blocks blocks (the scheduler gave back lookahead blocks a verification did not fill)."""
        del self.block_table[num_blocks:]


@dataclass(slots=True)
class ScheduledChunk:
    """One sequence's work in a step: compute tokens [start, end) and sample if end is the last."""

    seq: MirroredSeq
    start: int
    end: int
    token_mask: np.ndarray | None = None  # structured output: int32 [ceil(V / 32)], bit t set = token t allowed
    mask_words: np.ndarray | None = None  # the message's whole int32 [R, W] array: token_mask is its row mask_row
    mask_row: int = -1
    late_mask: bool = False  # its mask comes after the plan (LateTokenMasks), before the step samples
    # speculative decoding: tokens proposed after the sequence's last one, the step's last inputs, each verified
    proposal: list[int] | tuple[int, ...] = ()
    # async verification: the token its pending input is guessed to be (-1: none), whether its input was pending
    # when it was planned, and what settle() found once the step before it was appended: void (its input is not at
    # its start: it yields nothing), or its guess failed (its proposals are dropped, its first row sampled plainly)
    guess: int = -1
    pending_input: bool = False
    void: bool = False
    proposals_dropped: bool = False
    # draft method: how many tokens the draft model proposes after its last one (executor_svc/draft_model.py fills
    # proposal with them, and draft_probs, [num_draft, V] on rank 0, with the distributions they were drawn from)
    num_draft: int = 0
    draft_probs: object = None

    @property
    def num_proposed(self) -> int:
        """Its proposals, drawn already or still to be drawn from the draft model."""
        return self.num_draft or len(self.proposal)

    @property
    def samples(self) -> bool:
        return self.end - self.num_proposed == len(self.seq.token_ids) + self.seq.num_pending

    @property
    def needs_pending_token(self) -> bool:
        """Its last known input is the token the previous step sampled, still on the device."""
        return self.end - self.num_proposed > len(self.seq.token_ids)


class SequenceMirrors:
    def __init__(self) -> None:
        self.seqs: dict[int, MirroredSeq] = {}

    def apply(self, plan: engine_pb2.StepPlan) -> list[ScheduledChunk]:
        """Apply the plan's deltas and return this step's chunks in plan order."""
        for seq_id in plan.finished_seq_ids:
            self.seqs.pop(seq_id, None)
        for seq_id in plan.preempted_seq_ids:
            self.seqs.pop(seq_id, None)
        chunks: list[ScheduledChunk] = []
        for new in plan.new_seqs:
            seq = MirroredSeq(
                seq_id=new.seq_id,
                token_ids=list(new.token_ids),
                num_prompt_tokens=new.num_prompt_tokens,
                block_table=list(new.block_ids),
                num_computed_tokens=new.num_computed_tokens,
                sampling=new.sampling,
            )
            self.seqs[seq.seq_id] = seq
            chunks.append(self._chunk(seq, new.num_scheduled_tokens))
        self._apply_cached(plan.step_id, plan.cached, chunks)
        if plan.HasField("token_bitmasks"):
            attach_token_masks(plan.step_id, plan.token_bitmasks, chunks)
        if plan.late_mask_seq_ids:
            mark_late_masks(plan.step_id, plan.late_mask_seq_ids, chunks)
        return chunks

    def _apply_cached(self, step_id: int, cached: engine_pb2.CachedSequences, chunks: list[ScheduledChunk]) -> None:
        """The deltas of the sequences mirrored already: block cuts, new blocks, and proposals to verify."""
        n = len(cached.seq_ids)
        num_proposed, kept = list(cached.num_proposed_tokens), list(cached.num_blocks_kept)
        guesses, starts = list(cached.guessed_token_ids), list(cached.chunk_starts)
        if (guesses or starts) and not (len(guesses) == len(starts) == n):
            raise RuntimeError(f"plan {step_id}: {len(guesses)} guesses and {len(starts)} starts for {n} seqs")
        if not guesses:
            guesses, starts = repeat(-1), repeat(-1)
        proposed, new_blocks = list(cached.proposed_token_ids), list(cached.new_block_ids)
        drafted = list(cached.num_draft_tokens) or repeat(0)
        if cached.num_draft_tokens and len(cached.num_draft_tokens) != n:
            raise RuntimeError(f"plan {step_id}: {len(cached.num_draft_tokens)} draft counts for {n} seqs")
        if num_proposed or kept:  # speculative decoding; otherwise both are left out
            num_proposed, kept = num_proposed or [0] * n, kept or [-1] * n
            if len(num_proposed) != n or len(kept) != n or sum(num_proposed) != len(proposed) or min(num_proposed) < 0:
                raise RuntimeError(f"plan {step_id}: proposals for {len(num_proposed)} seqs ({sum(num_proposed)} "
                                   f"tokens, {len(proposed)} sent) and {len(kept)} block cuts, for {n} seqs")
        else:
            num_proposed, kept = repeat(0), repeat(-1)
        offset = at = 0
        for seq_id, num_scheduled, num_new, last_token, k, keep, guess, start, num_draft in zip(
                cached.seq_ids, cached.num_scheduled_tokens, cached.num_new_blocks, cached.last_token_ids,
                num_proposed, kept, guesses, starts, drafted):
            seq = self._mirrored(step_id, seq_id)
            if start >= 0:  # a short verdict moved it back: every step of it still in flight is void
                if start >= len(seq.token_ids) or start < seq.num_prompt_tokens - 1:
                    raise RuntimeError(f"seq {seq_id}: start {start} is not a token it has ({len(seq.token_ids)})")
                seq.num_computed_tokens, seq.num_pending = start, 0
            if keep >= 0:
                seq.cut_blocks(keep)
            if num_new:
                seq.add_blocks(new_blocks[offset:offset + num_new])
                offset += num_new
            if last_token >= 0 and seq.token_ids[-1] != last_token:
                raise RuntimeError(f"seq {seq_id}: the scheduler's last token {last_token} is not "
                                   f"the one this executor sampled ({seq.token_ids[-1]})")
            chunks.append(self._chunk(seq, num_scheduled, proposed[at:at + k] if k else (), guess, num_draft))
            at += k

    def _mirrored(self, step_id: int, seq_id: int) -> MirroredSeq:
        seq = self.seqs.get(seq_id)
        if seq is None:
            raise RuntimeError(f"plan {step_id} names seq {seq_id} that this executor does not mirror")
        return seq

    @staticmethod
    def _chunk(seq: MirroredSeq, num_scheduled: int, proposal: list[int] | tuple[int, ...] = (),
               guess: int = -1, num_draft: int = 0) -> ScheduledChunk:
        start, end = seq.num_computed_tokens, seq.num_computed_tokens + num_scheduled
        chunk = ScheduledChunk(seq, start, end, proposal=proposal, guess=guess, num_draft=num_draft)
        if num_scheduled <= chunk.num_proposed or end - chunk.num_proposed > len(seq.token_ids) + seq.num_pending:
            raise RuntimeError(
                f"seq {seq.seq_id}: cannot compute tokens [{start}, {end}) of {len(seq.token_ids)}")
        chunk.pending_input = chunk.needs_pending_token
        if num_draft and (proposal or not chunk.samples or chunk.pending_input or end - start != num_draft + 1):
            raise RuntimeError(f"seq {seq.seq_id}: {num_draft} draft proposals in tokens [{start}, {end}): they follow "
                               "a one-token decode of its last known token only")
        if proposal and (not chunk.samples or chunk.pending_input and (guess < 0 or end - start != len(proposal) + 1)):
            raise RuntimeError(f"seq {seq.seq_id}: proposals to verify after a chunk that does not sample, or "
                               "after a pending token without a guess of it")
        return chunk

    def commit(self, chunks: list[ScheduledChunk]) -> None:
        """The forward is launched: the chunks' tokens have K/V in the pool; samples are pending. Proposals count
        as computed only once accepted (append_sampled)."""
        for chunk in chunks:
            if chunk.samples:
                chunk.seq.num_pending += 1 + chunk.num_proposed
                chunk.seq.steps.append(chunk)
            chunk.seq.num_computed_tokens = chunk.end  # as if its proposals are accepted, as the scheduler counts

    @staticmethod
    def settle(chunks: list[ScheduledChunk]) -> None:
        """Once the step before is appended (every rank alike, before sampling): a chunk planned on a pending
        input that is not at its start is void; one whose input is not the token it guessed drops its proposals.
        chunks: a step's sampling chunks (`samples` no longer says so once they are committed)."""
        for c in chunks:
            if c.pending_input:
                tokens = c.seq.token_ids
                c.void = c.start != len(tokens) - 1
                c.proposals_dropped = bool(c.proposal) and not c.void and tokens[c.start] != c.guess

    def append_sampled(self, seq_id: int, token_id: int, accepted: list[int] | tuple[int, ...] = ()) -> None:
        """A sampled token reached the host, after the proposals its step accepted (whose K/V that step wrote);
        -1 for a void chunk, which appends nothing. The sequence may be gone (finished or preempted since)."""
        seq = self.seqs.get(seq_id)
        if seq is not None and seq.steps:
            step = seq.steps.pop(0)
            if token_id < 0:
                return
            if step.num_draft:  # the draft computed its input and its own proposals but the last: those accepted hold
                seq.draft_computed = step.start + 1 + min(len(accepted), step.num_draft - 1)
            if accepted:
                seq.token_ids += accepted
            seq.token_ids.append(token_id)
            seq.num_pending = max(0, seq.num_pending - 1 - len(accepted))


def mask_table(masks: engine_pb2.TokenBitmasks) -> tuple[np.ndarray, list[int]]:
    """A TokenBitmasks message as (its words, int32 [R, W], a view of the message's bytes; the row of each of its
    seq_ids). Raises RuntimeError for one whose sizes or rows do not fit together."""
    data = masks.words  # each read of a bytes field copies it out of the message: read it once
    num_masks, num_words = len(masks.seq_ids), masks.num_words
    rows = list(masks.rows) if masks.rows else list(range(num_masks))
    num_rows = len(data) // (num_words * 4) if num_words > 0 else 0
    if num_words <= 0 or len(data) != num_rows * num_words * 4 or len(rows) != num_masks:
        raise RuntimeError(f"token_bitmasks hold {len(data)} bytes and {len(masks.rows)} rows, not masks of "
                           f"{num_words} words for {num_masks} seqs")
    if rows and max(rows) >= num_rows or num_rows > num_masks:
        raise RuntimeError(f"token_bitmasks name rows up to {max(rows, default=-1)} of {num_rows} for {num_masks} seqs")
    return np.frombuffer(data, dtype="<i4").reshape(num_rows, num_words), rows


def attach_token_masks(step_id: int, masks: engine_pb2.TokenBitmasks, chunks: list[ScheduledChunk]) -> None:
    """Give each constrained chunk that samples its row of the bitmasks (a view, no copy)."""
    try:
        words, rows = mask_table(masks)
    except RuntimeError as exc:
        raise RuntimeError(f"plan {step_id}: {exc}") from None
    row_of = dict(zip(masks.seq_ids, rows))
    if len(row_of) != len(rows):
        raise RuntimeError(f"plan {step_id}: token_bitmasks name a seq twice")
    for chunk in chunks:
        row = row_of.pop(chunk.seq.seq_id, None)
        if row is not None:
            if not (chunk.samples or chunk.late_mask):  # (a late one was checked with its plan, committed since)
                raise RuntimeError(f"plan {step_id}: seq {chunk.seq.seq_id} has a token mask but does not sample")
            chunk.token_mask, chunk.mask_words, chunk.mask_row = words[row], words, row
    if row_of:
        raise RuntimeError(f"plan {step_id}: token masks for seqs {sorted(row_of)} that the step does not run")


def draw_masks(chunks: list[ScheduledChunk]) -> tuple[np.ndarray, np.ndarray] | None:
    """The fused draw's masks for a step's sampling chunks: each row's index into one int32 [R, W] words array
    (-1: a free row, or a late one dropped since) and that array; None when no row is masked. When every mask
    is a row of one message's array (a step's late masks are), that array goes as it came: one copy fewer of
    up to 2.4 MB on rank 0's way from the masks to the next launch."""
    masked = [i for i, c in enumerate(chunks) if c.token_mask is not None]
    if not masked:
        return None
    rows = np.full(len(chunks), -1, dtype=np.int32)
    source = chunks[masked[0]].mask_words
    if source is not None and all(chunks[i].mask_words is source for i in masked):
        rows[masked] = [chunks[i].mask_row for i in masked]
        return rows, source
    rows[masked] = np.arange(len(masked), dtype=np.int32)
    return rows, np.stack([chunks[i].token_mask for i in masked])


def mark_late_masks(step_id: int, seq_ids, chunks: list[ScheduledChunk]) -> None:
    """The chunks whose masks come late: each samples, and has no mask in the plan."""
    late = set(seq_ids)
    for chunk in chunks:
        if chunk.seq.seq_id in late:
            late.discard(chunk.seq.seq_id)
            if not chunk.samples or chunk.token_mask is not None:
                raise RuntimeError(f"plan {step_id}: seq {chunk.seq.seq_id} has a late token mask but does not "
                                   "sample, or has a mask in the plan already")
            chunk.late_mask = True
    if late:
        raise RuntimeError(f"plan {step_id}: late token masks for seqs {sorted(late)} that the step does not run")


def attach_late_masks(late: engine_pb2.LateTokenMasks, chunks: list[ScheduledChunk]) -> None:
    """Give each late chunk its mask; a dropped one (its sequence ended) samples free. Every late chunk must be
    answered, and only those."""
    waiting = [c for c in chunks if c.late_mask]
    if late.HasField("masks"):
        attach_token_masks(late.step_id, late.masks, waiting)
    dropped = set(late.dropped_seq_ids)
    unanswered = [c.seq.seq_id for c in waiting if c.token_mask is None and c.seq.seq_id not in dropped]
    if unanswered or len(dropped) + len(late.masks.seq_ids) != len(waiting):
        raise RuntimeError(f"step {late.step_id}: late token masks answer seqs {sorted(late.masks.seq_ids)} and drop "
                           f"{sorted(dropped)}, but the step waits for {sorted(c.seq.seq_id for c in waiting)}")
