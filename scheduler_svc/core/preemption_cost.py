"""Swap or recompute: what preempting one sequence costs each way, and the decision.

Swapping moves the victim's computed blocks to the host pool now and back later: one copy per block each
way (the host pool is block-major), each paying a fixed cost (DMA set-up, driver work) plus its bytes over
the host link. Recomputing throws its KV away and later runs its computed tokens through prefill again,
less those the prefix cache will still hold, in a step that pays a premium for carrying prefill at all (on
CUDA it runs eagerly, not as a decode graph). The executors measure the copy constants and a prefill rate at
start-up (executor_svc/copy_costs.py) and send them in their handshake. The scheduler then fits, over the
steps it sees run, a step's time beyond a decode-only step as premium + prefill tokens / rate: a least-squares
line rather than a sorting of steps by kind, because a victim's re-prefill rides with the decodes of a mixed
step, and charging those steps to either constant alone misread workload (c) (bench/RESULTS.md: the premium
came out ~0.1 ms, auto recomputed every victim at 13,772 tok/s while swap made 16,136).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

DECODE_EWMA_WEIGHT = 0.2  # weight of each new decode-only step in its running time
# The fit forgets at this half-life (in steps carrying prefill): long enough that the few large prefill steps
# of a burst of admissions still anchor the slope among hundreds of small mixed steps, short enough to follow
# a change of batch shape within a few seconds of serving.
FIT_HALF_LIFE_SAMPLES = 200
FIT_DECAY = 0.5 ** (1 / FIT_HALF_LIFE_SAMPLES)
MIN_FIT_SAMPLES = 8.0  # decayed weight below which the line is not trusted, whatever its spread
MAX_SLOPE_REL_ERROR = 0.1  # the fitted seconds per token must be known within 10%, else the rate stays put
MAX_PREFILL_TOKENS_PER_S = 1e12  # a fitted slope near 0 must not make recomputing free (message_checks' bound)


@dataclass
class DecayedSums:
    """Exponentially weighted sufficient statistics of (x, y) samples: each new one weighs 1, older ones
    FIT_DECAY times less per sample since."""

    w: float = 0.0
    x: float = 0.0
    y: float = 0.0
    xx: float = 0.0
    xy: float = 0.0
    yy: float = 0.0

    def add(self, x: float, y: float) -> None:
        d = FIT_DECAY
        self.w, self.x, self.y = d * self.w + 1, d * self.x + x, d * self.y + y
        self.xx, self.xy, self.yy = d * self.xx + x * x, d * self.xy + x * y, d * self.yy + y * y


@dataclass(frozen=True)
class Line:
    intercept: float
    slope: float
    slope_error: float  # the slope's standard error


def fit_line(s: DecayedSums) -> Line | None:
    """Weighted least squares y = intercept + slope * x; None with too few samples or no spread in x."""
    if s.w < MIN_FIT_SAMPLES:
        return None
    mean_x, mean_y = s.x / s.w, s.y / s.w
    sxx = s.xx - s.x * mean_x  # sum of w (x - mean_x)^2
    if not sxx > 1e-9 * s.xx:  # no spread beyond rounding: every sample of one size
        return None
    sxy, syy = s.xy - s.x * mean_y, s.yy - s.y * mean_y
    slope = sxy / sxx
    residual = max(0.0, syy - slope * sxy)  # weighted sum of squared residuals
    return Line(mean_y - slope * mean_x, slope, math.sqrt(residual / (s.w - 2) / sxx))


@dataclass
class PreemptionCosts:
    """The cost model's constants, per rank (ranks copy their own shards at once)."""

    block_bytes: int = 0  # one KV block: K and V of every layer
    host_link_bytes_per_s: float = 0.0  # block copies between the KV pool and the host pool; 0: not measured
    copy_fixed_s: float = 0.0  # fixed cost of one such copy
    # Marginal prefill tokens per second: calibrated at start-up, then the fit's slope once it is determined
    # (lacking a calibration, a step's prefill tokens over its whole time until then); 0: not known yet
    prefill_tokens_per_s: float = 0.0
    # What a step costs more for carrying any prefill, beyond those tokens at the prefill rate: on CUDA such a
    # step runs eagerly instead of as a decode graph (BRIEF: ~6 ms of launches for 28 layers), which a
    # recomputed victim's prefill pays once. The fit's intercept (at the current rate while the slope is not
    # determined), clamped at 0; 0 until a prefill step has run after a decode-only one.
    prefill_step_premium_s: float = 0.0
    decode_step_s: float = 0.0  # running time of a decode-only step; 0: none seen yet
    _calibrated_rate: float | None = field(default=None, repr=False)  # prefill_tokens_per_s before any step
    _fitted_rate: float = field(default=0.0, repr=False)  # the last determined slope's rate; 0: none yet
    _beyond_decode: DecayedSums = field(default_factory=DecayedSums, repr=False)  # (prefill tokens, s - decode)
    _whole_step: DecayedSums = field(default_factory=DecayedSums, repr=False)  # (prefill tokens, s)

    def observe_step(self, num_prefill_tokens: int, seconds: float) -> None:
        """Refine the estimates from a step that ran: a decode-only step the decode step's time, one carrying
        prefill a sample of the line premium + prefill tokens / rate over the time beyond a decode step."""
        if not (seconds > 0 and math.isfinite(seconds)) or num_prefill_tokens < 0:
            return
        if self._calibrated_rate is None:
            self._calibrated_rate = max(0.0, self.prefill_tokens_per_s)
        if num_prefill_tokens == 0:
            first = self.decode_step_s <= 0
            self.decode_step_s = seconds if first else _ewma(self.decode_step_s, seconds)
            return
        self._whole_step.add(num_prefill_tokens, seconds)
        if self.decode_step_s > 0:
            self._beyond_decode.add(num_prefill_tokens, seconds - self.decode_step_s)
        self._refit()

    def _refit(self) -> None:
        line = fit_line(self._beyond_decode)
        if line is not None and line.slope > 0 and line.slope_error <= MAX_SLOPE_REL_ERROR * line.slope:
            self._fitted_rate = min(1 / line.slope, MAX_PREFILL_TOKENS_PER_S)
            self.prefill_tokens_per_s = self._fitted_rate
            self.prefill_step_premium_s = max(0.0, line.intercept)
            return
        # the slope is not determined (yet, or no longer): the last determined rate, else the calibrated one,
        # else the whole step charged to its prefill tokens as the calibration does; the premium at that rate
        whole = self._whole_step
        rate = self._fitted_rate or self._calibrated_rate or whole.x / whole.y
        self.prefill_tokens_per_s = min(rate, MAX_PREFILL_TOKENS_PER_S)
        s = self._beyond_decode
        self.prefill_step_premium_s = max(0.0, (s.y - s.x / self.prefill_tokens_per_s) / s.w) if s.w else 0.0


def _ewma(old: float, sample: float) -> float:
    return (1 - DECODE_EWMA_WEIGHT) * old + DECODE_EWMA_WEIGHT * sample


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
