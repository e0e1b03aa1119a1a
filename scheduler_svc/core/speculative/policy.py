"""How many tokens a sequence proposes in a step, from how well its proposals have fared: speculation where it
pays, plain decodes where it does not.

Each sequence keeps decayed counts of its proposals' verdicts in two parts, since an n-gram's first predicted token
is far likelier right than the ones after it (SmolLM2 chatting on the H200: the first proposal accepted in 84% of
verdicts, the second in 31%, 2026-12-03 6760fc6): `first` = the chance that a proposal's first token is accepted
(after a right guess of a chained step's input: a wrong guess drops the proposals, a miss), and `later` = the chance
that each token after it is, given the ones before it were (the acceptance of a geometric run). Both start from an
optimistic prior so that a new sequence tries. Proposing k tokens then yields 1 + first (1 + later + ... +
later^(k-1)) tokens on average. It costs the sequence its step plus, when verification is planned ahead of its
verdict (async scheduling), one void step whenever the verdict is short (probability 1 - first later^(k-1): the
step planned on all k being accepted yields nothing, DESIGN.md section 14); and it costs every running sequence the
verification's host work, which they all wait for: VERIFY_SEQ_OVERHEAD per verifying sequence, VERIFY_STEP_OVERHEAD
once for a step with any verification (measured on the H200: DESIGN.md section 14). So a sequence proposes the k
that yields the most tokens per step counting its share, or nothing when no k beats a plain decode; and a step
verifies only when its proposals together save more sequence-steps than the step's own overhead costs the whole
batch. Copying runs (editing, quoting) get up to K tokens; plain chat, whose later tokens are mostly rejected, one
or two (each longer proposal would void the next step more often than it gains), and larger batches where only a
few sequences would gain stop paying verifications.

A verdict that accepts nothing backs the sequence off exponentially (2, 4, ... up to 32 plain decodes); a
sequence that declines (no k pays) waits DECLINE_STEPS decodes, and its counts decay meanwhile towards the
prior, so it tries again later. Finding nothing to propose costs no step, so it backs nothing off.
"""
from __future__ import annotations

from functools import lru_cache

from scheduler_svc.core.sequence import Sequence

# Prior of a sequence with no verdicts yet, for both estimates: worth PRIOR_WEIGHT verdicts at PRIOR_ACCEPTANCE.
PRIOR_ACCEPTANCE = 0.75
PRIOR_WEIGHT = 4.0
DECAY = 0.7  # each verdict keeps this share of the counts: recent verdicts weigh most
DECLINE_DECAY = 0.85  # and each declined step this share, so the prior slowly takes over again
# What verification adds to a step, in plain decode steps (H200, SmolLM2, 2026-12-03 aa8ed94: ~0.17 ms once for a
# step with any verification, ~0.02-0.05 ms per verifying sequence, on ~1.15 ms steps), and per proposed token (its
# row). Every running sequence waits for the first two. bench/step_profile.py --verify times the executor's share.
VERIFY_STEP_OVERHEAD = 0.15
VERIFY_SEQ_OVERHEAD = 0.03
VERIFY_ROW_COST = 0.01
MIN_GAIN = 1.02  # a proposal must beat a plain decode by this much (tokens per step) to be made
MAX_BACKOFF_STEPS = 32  # after consecutive verdicts that accepted nothing: 2, 4, 8, ... capped here
DECLINE_STEPS = 4  # plain decodes after a step where no k paid


def _estimate(hits: float, misses: float) -> float:
    hits += PRIOR_ACCEPTANCE * PRIOR_WEIGHT
    return hits / (hits + misses + (1.0 - PRIOR_ACCEPTANCE) * PRIOR_WEIGHT)


def acceptance(seq: Sequence) -> tuple[float, float]:
    """(first, later): the estimated chance that a proposal's first token is accepted, and that each later one is,
    given the ones before it were."""
    return (_estimate(seq.speculation_first_hits, seq.speculation_first_misses),
            _estimate(seq.speculation_hits, seq.speculation_misses))


def tokens_and_cost(first: float, later: float, k: int, planned_ahead: bool, batch: int = 1) -> tuple[float, float]:
    """Proposing k tokens, the first accepted with chance `first` and each after it with chance `later` given the
    ones before it were, in a step of `batch` running sequences: the tokens it yields on average, and what it costs
    in sequence-steps (its own step, the void step a short verdict costs when planned ahead, and its overhead, which
    every running sequence waits for); a plain decode: (1, 1)."""
    if k <= 0:
        return 1.0, 1.0
    run = first  # the chance that the proposals up to this one are all accepted
    tokens = 1.0 + run
    for _ in range(k - 1):
        run *= later
        tokens += run
    cost = 1.0 + VERIFY_ROW_COST * k + batch * VERIFY_SEQ_OVERHEAD + (1.0 - run if planned_ahead else 0.0)
    return tokens, cost


def expected_gain(first: float, later: float, k: int, planned_ahead: bool, batch: int = 1) -> float:
    """Tokens per sequence-step (a plain decode: 1) of proposing k tokens (tokens_and_cost)."""
    tokens, cost = tokens_and_cost(first, later, k, planned_ahead, batch)
    return tokens / cost


@lru_cache(maxsize=65536)  # asked per sequence and step, with the estimates rounded to 0.001
def best_num_tokens(first: float, later: float, max_tokens: int, planned_ahead: bool, batch: int = 1) -> int:
    """The k in 0..max_tokens with the most tokens per step; 0 unless it beats a plain decode by MIN_GAIN."""
    best, best_gain = 0, MIN_GAIN
    for k in range(1, max_tokens + 1):
        gain = expected_gain(first, later, k, planned_ahead, batch)
        if gain > best_gain:
            best, best_gain = k, gain
    return best


def backoff_steps(failures: int) -> int:
    """Plain decodes after the failures-th verdict in a row that accepted nothing."""
    return min(2 ** failures, MAX_BACKOFF_STEPS)


class SpeculationPolicy:
    def __init__(self, max_tokens: int, planned_ahead: bool) -> None:
        self.max_tokens = max_tokens  # K, --num-speculative-tokens
        self.planned_ahead = planned_ahead  # verification is planned ahead of its verdict: a short one voids a step

    def plan(self, seqs: list[Sequence], batch: int) -> dict[int, int]:
        """How many tokens each of seqs (the running sequences that may propose in this step, of `batch` running)
        proposes, by seq_id (absent: a plain decode). Empty unless their proposals together are expected to save
        more sequence-steps than the step's verification overhead costs the batch (VERIFY_STEP_OVERHEAD each)."""
        planned, saved = {}, 0.0
        for seq in seqs:
            k = self.num_tokens(seq, batch)
            if k:
                planned[seq.seq_id] = k
                tokens, cost = tokens_and_cost(*acceptance(seq), k, self.planned_ahead, batch)
                saved += tokens - cost
        return planned if saved > batch * VERIFY_STEP_OVERHEAD else {}

    def num_tokens(self, seq: Sequence, batch: int = 1) -> int:
        """How many tokens seq proposes in a step of `batch` running sequences that verifies (0: a plain decode);
        counts down its backoff."""
        if seq.speculation_backoff > 0:
            seq.speculation_backoff -= 1
            return 0
        first, later = acceptance(seq)
        k = best_num_tokens(round(first, 3), round(later, 3), self.max_tokens, self.planned_ahead, batch)
        if k == 0:  # not worth it now: wait, and let the prior weigh more when it tries again
            seq.speculation_backoff = DECLINE_STEPS
            seq.speculation_first_hits *= DECLINE_DECAY
            seq.speculation_first_misses *= DECLINE_DECAY
            seq.speculation_hits *= DECLINE_DECAY
            seq.speculation_misses *= DECLINE_DECAY
        return k

    @staticmethod
    def record(seq: Sequence, num_proposed: int, num_accepted: int, guess: bool | None = None) -> None:
        """A verdict: num_accepted of num_proposed proposals accepted. guess: whether the step's proposals followed
        a right guess of its pending input (None: it had no guess); after a wrong one they were dropped unverified,
        so none was accepted: the first counts as rejected."""
        if num_proposed <= 0:
            return
        accepted = 0 if guess is False else num_accepted
        seq.speculation_first_hits = seq.speculation_first_hits * DECAY + (accepted > 0)
        seq.speculation_first_misses = seq.speculation_first_misses * DECAY + (accepted == 0)
        if accepted > 0:  # the later proposals were verified: accepted - 1 of them, then it stopped or ran out
            seq.speculation_hits = seq.speculation_hits * DECAY + accepted - 1
            seq.speculation_misses = seq.speculation_misses * DECAY + (accepted < num_proposed)
        if accepted == 0:
            seq.speculation_failures += 1
            seq.speculation_backoff = backoff_steps(seq.speculation_failures)
        else:
            seq.speculation_failures = 0
