"""Swap or recompute: what preempting one sequence costs each way, and the decision.

Swapping moves the victim's computed blocks to the host pool now and back later: one copy per block each
way (the host pool is block-major), each paying a fixed cost (DMA set-up, driver work) plus its bytes over
the host link. Recomputing throws its KV away and later runs its computed tokens through prefill again,
less those the prefix cache will still hold. Both grow with the sequence's length, so under a linear model
their ratio would be constant; the crossover comes from the fixed cost per copy, which does not shrink
with the block. The executors measure the constants at start-up (executor_svc/copy_costs.py) and send
them in their handshake; the prefill rate is then refined from the steps the scheduler sees run, and so is
the premium a decode step pays for carrying prefill (on the H200 swap beat recompute by 1.10x on nano-vLLM's
workload at a third of the blocks while the prefill rate alone made recompute 5x cheaper: bench/RESULTS.md).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

PREFILL_EWMA_WEIGHT = 0.2  # weight of each new step sample in the running estimates
MIN_PREFILL_SAMPLE_TOKENS = 32  # shorter prefill steps are dominated by fixed per-step costs


def _ewma(old: float, sample: float, first: bool) -> float:
    return sample if first else (1 - PREFILL_EWMA_WEIGHT) * old + PREFILL_EWMA_WEIGHT * sample


@dataclass
class PreemptionCosts:
    """The cost model's constants, per rank (ranks copy their own shards at once)."""

    block_bytes: int = 0  # one KV block: K and V of every layer
    host_link_bytes_per_s: float = 0.0  # block copies between the KV pool and the host pool; 0: not measured
    copy_fixed_s: float = 0.0  # fixed cost of one such copy
    prefill_tokens_per_s: float = 0.0  # calibrated at start-up, then refined from steps; 0: not known yet
    # What a decode step costs more for carrying a little prefill, beyond those tokens at the prefill rate:
    # on CUDA such a step runs eagerly instead of as a decode graph (BRIEF: ~6 ms of launches for 28 layers),
    # which a recomputed victim's prefill pays once. Measured from steps: 0 until both kinds have run.
    prefill_step_premium_s: float = 0.0
    decode_step_s: float = 0.0  # running estimate of a decode-only step; 0: none seen yet
    _premium_seen: bool = field(default=False, repr=False)

    def observe_step(self, num_tokens: int, num_prefill_tokens: int, seconds: float) -> None:
        """Refine the estimates from a step that ran: decode-only steps give the decode step's time, steps that
        are mostly prefill the prefill rate, decode steps carrying a little prefill the premium."""
        if seconds <= 0:
            return
        if num_prefill_tokens == 0:
            self.decode_step_s = _ewma(self.decode_step_s, seconds, self.decode_step_s <= 0)
        elif num_prefill_tokens >= max(MIN_PREFILL_SAMPLE_TOKENS, num_tokens // 2):
            rate = num_tokens / seconds
            self.prefill_tokens_per_s = _ewma(self.prefill_tokens_per_s, rate, self.prefill_tokens_per_s <= 0)
        elif self.decode_step_s > 0 and self.prefill_tokens_per_s > 0:
            # a raw sample (noise either side of 0 averages out; clamping each one would bias it up)
            premium = seconds - self.decode_step_s - num_prefill_tokens / self.prefill_tokens_per_s
            self.prefill_step_premium_s = _ewma(self.prefill_step_premium_s, premium, not self._premium_seen)
            self._premium_seen = True


@dataclass(frozen=True)
class Decision:
    swap: bool  # else recompute
    swap_s: float  # estimated cost of swapping out now and in later (inf when unknown)
    recompute_s: float  # estimated cost of recomputing later (inf when unknown)


def swap_seconds(num_blocks: int, costs: PreemptionCosts) -> float:
    """Out now and in later: 2 x num_blocks copies, each its fixed cost plus one block over the host link."""
    if costs.host_link_bytes_per_s <= 0:
        return math.inf
    num_copies = 2 * num_blocks
    return num_copies * costs.block_bytes / costs.host_link_bytes_per_s + num_copies * costs.copy_fixed_s


def recompute_seconds(num_computed_tokens: int, num_cached_tokens: int, costs: PreemptionCosts) -> float:
    """The computed tokens the prefix cache will not give back, run through prefill again, in a step that pays
    the prefill-step premium once (several victims sharing that step makes this an overestimate)."""
    num_tokens = max(0, num_computed_tokens - num_cached_tokens)
    if num_tokens == 0:
        return 0.0
    if costs.prefill_tokens_per_s <= 0:
        return math.inf
    return num_tokens / costs.prefill_tokens_per_s + max(0.0, costs.prefill_step_premium_s)


def decide(mode: str, num_blocks: int, num_free_host_blocks: int, num_computed_tokens: int, num_cached_tokens: int,
           costs: PreemptionCosts) -> Decision:
    """Swap or recompute one victim holding num_blocks blocks of num_computed_tokens computed tokens, of which
    num_cached_tokens will hit the prefix cache when it is admitted again.

    recompute: always. swap: whenever the host pool has room. auto: the cheaper estimate, when there is room
    (an unknown cost counts as infinite; with both unknown it swaps, as swap mode would).
    """
    swap_s = swap_seconds(num_blocks, costs)
    recompute_s = recompute_seconds(num_computed_tokens, num_cached_tokens, costs)
    fits = 0 < num_blocks <= num_free_host_blocks
    if mode == "recompute" or not fits:
        swap = False
    elif mode == "swap":
        swap = True
    else:
        swap = swap_s < recompute_s or swap_s == recompute_s == math.inf
    return Decision(swap, swap_s, recompute_s)
