"""Swap or recompute (preemption_cost.decide): auto takes the cheaper estimate, on either side of the crossover
that the fixed cost per copy sets; host-pool room and prefix-cache hits are counted; the prefill rate and the
prefill-step premium are fitted to the steps that run."""
from __future__ import annotations

import math
import random

import pytest
from hypothesis import given, settings, strategies as st

from scheduler_svc.core.preemption_cost import (FIT_HALF_LIFE_SAMPLES, MAX_PREFILL_TOKENS_PER_S, PreemptionCosts,
                                                decide, recompute_seconds, swap_seconds)
from scheduler_svc.core.kv_cache_manager import cdiv

BLOCK_TOKENS = 16
BLOCK_BYTES = 2 * 28 * BLOCK_TOKENS * 8 * 128 * 2  # Qwen3-0.6B's bf16 KV block
H200 = dict(block_bytes=BLOCK_BYTES, host_link_bytes_per_s=55e9, copy_fixed_s=12e-6)  # BRIEF.md's pinned PCIe


def costs_at_crossover(factor: float) -> PreemptionCosts:
    """H200 copy costs, and a prefill rate at which recomputing a block's tokens costs `factor` times swapping
    the block out and in."""
    per_block_swap = swap_seconds(1, PreemptionCosts(**H200))
    return PreemptionCosts(**H200, prefill_tokens_per_s=BLOCK_TOKENS / (factor * per_block_swap))


def auto(num_blocks: int, costs: PreemptionCosts, num_cached_tokens: int = 0, num_free_host_blocks: int = 10_000):
    return decide("auto", num_blocks, num_free_host_blocks, num_blocks * BLOCK_TOKENS, num_cached_tokens, costs)


@pytest.mark.parametrize("num_blocks", [1, 8, 512])
def test_auto_swaps_just_above_the_crossover_and_recomputes_just_below_it_at_any_length(num_blocks):
    assert auto(num_blocks, costs_at_crossover(1.05)).swap  # recomputing costs 5% more
    assert not auto(num_blocks, costs_at_crossover(0.95)).swap  # recomputing costs 5% less


def test_the_fixed_cost_per_copy_moves_the_crossover():
    fast_prefill = costs_at_crossover(1.05)  # swap wins with 12 us per copy ...
    costly_copies = PreemptionCosts(**(H200 | dict(copy_fixed_s=10 * H200["copy_fixed_s"])),
                                    prefill_tokens_per_s=fast_prefill.prefill_tokens_per_s)
    assert auto(64, fast_prefill).swap and not auto(64, costly_copies).swap  # ... and loses at 120 us


def test_the_estimates_are_bytes_over_bandwidth_plus_the_fixed_cost_per_copy_and_tokens_over_the_rate():
    costs = PreemptionCosts(block_bytes=1000, host_link_bytes_per_s=1e6, copy_fixed_s=0.5, prefill_tokens_per_s=20)
    d = decide("auto", 3, 10, 40, 0, costs)
    assert d.swap_s == pytest.approx(6 * (1000 / 1e6) + 6 * 0.5)  # 3 blocks out now and in later
    assert d.recompute_s == pytest.approx(40 / 20)


@pytest.mark.parametrize("mode", ["auto", "swap"])
def test_without_host_room_for_every_block_the_victim_is_recomputed(mode):
    costs = costs_at_crossover(100.0)  # swapping would be far cheaper
    for free in (0, 7):
        assert not decide(mode, 8, free, 8 * BLOCK_TOKENS, 0, costs).swap
    assert decide(mode, 8, 8, 8 * BLOCK_TOKENS, 0, costs).swap


def test_tokens_the_prefix_cache_will_give_back_are_not_counted_as_recompute():
    costs = costs_at_crossover(2.0)  # recomputing everything costs twice the swap
    assert auto(16, costs).swap
    assert not auto(16, costs, num_cached_tokens=12 * BLOCK_TOKENS).swap  # a quarter left: half the swap
    assert recompute_seconds(100, 100, costs) == 0.0 and recompute_seconds(100, 150, costs) == 0.0


def test_swap_mode_swaps_whenever_there_is_room_and_recompute_mode_never_swaps():
    cheap_recompute = costs_at_crossover(0.01)
    assert decide("swap", 4, 4, 64, 0, cheap_recompute).swap
    assert not decide("recompute", 4, 4, 64, 0, costs_at_crossover(100.0)).swap


def test_unmeasured_costs_count_as_infinite_and_auto_then_swaps_as_swap_mode_would():
    no_prefill_rate = PreemptionCosts(**H200)
    assert recompute_seconds(64, 0, no_prefill_rate) == math.inf and auto(4, no_prefill_rate).swap
    no_link = PreemptionCosts(block_bytes=BLOCK_BYTES, prefill_tokens_per_s=1e4)
    assert swap_seconds(4, no_link) == math.inf and not auto(4, no_link).swap
    assert auto(4, PreemptionCosts()).swap  # nothing measured at all


def test_decode_only_steps_set_the_decode_baseline_and_leave_the_calibrated_rate_alone():
    costs = PreemptionCosts(prefill_tokens_per_s=1000.0)
    for _ in range(20):
        costs.observe_step(num_prefill_tokens=0, seconds=0.001)
    assert costs.prefill_tokens_per_s == 1000.0 and costs.prefill_step_premium_s == 0.0
    assert costs.decode_step_s == pytest.approx(0.001)


def test_prefill_steps_before_any_decode_step_give_no_premium_and_keep_the_calibrated_rate():
    costs = PreemptionCosts(prefill_tokens_per_s=1000.0)
    for x in (100, 2000, 16384, 700):  # the first admissions: nothing to measure the time beyond a decode against
        costs.observe_step(num_prefill_tokens=x, seconds=0.5 + x / 2000.0)
    assert costs.prefill_tokens_per_s == 1000.0 and costs.prefill_step_premium_s == 0.0


def test_without_a_calibration_the_rate_is_measured_from_whole_prefill_steps_until_the_fit_determines_it():
    unknown = PreemptionCosts()
    unknown.observe_step(num_prefill_tokens=512, seconds=0.5)
    assert unknown.prefill_tokens_per_s == 1024  # all of the step charged to its tokens, as the calibration does
    assert unknown.prefill_step_premium_s == 0.0


def test_the_premium_of_a_decode_step_carrying_prefill_is_learned_from_steps_and_charged_once_per_recompute():
    costs = PreemptionCosts(**H200, prefill_tokens_per_s=900_000.0)  # the H200's calibrated rate (H200, 2026-12-01, 590fe90)
    for _ in range(40):  # a graph-replayed decode step of 5 ms, then one carrying 90 prefill tokens in 11.1 ms
        costs.observe_step(num_prefill_tokens=0, seconds=0.005)
        costs.observe_step(num_prefill_tokens=90, seconds=0.0111)
    assert costs.decode_step_s == pytest.approx(0.005)
    assert costs.prefill_step_premium_s == pytest.approx(0.0111 - 0.005 - 90 / 900_000.0, rel=1e-3)
    tokens = 700  # a victim that computed 700 tokens, 44 blocks: swapping them out and in is ~3 ms
    assert recompute_seconds(tokens, 0, costs) == pytest.approx(tokens / 900_000.0 + costs.prefill_step_premium_s)
    assert auto(cdiv(tokens, BLOCK_TOKENS), costs).swap  # with the premium, recompute is the dearer
    assert not auto(cdiv(tokens, BLOCK_TOKENS), PreemptionCosts(**H200, prefill_tokens_per_s=900_000.0)).swap


def test_a_premium_that_measures_below_zero_counts_as_none_and_noise_is_not_biased_up():
    costs = PreemptionCosts(prefill_tokens_per_s=1000.0)
    for noise in [0.001, -0.001] * 50:  # a CPU: no graphs, a step carrying prefill costs just its tokens
        costs.observe_step(num_prefill_tokens=0, seconds=0.1)
        costs.observe_step(num_prefill_tokens=2, seconds=0.1 + 2 / 1000.0 + noise)
    assert abs(costs.prefill_step_premium_s) < 0.001
    below = PreemptionCosts(prefill_tokens_per_s=1000.0, prefill_step_premium_s=-0.5)
    assert recompute_seconds(100, 0, below) == pytest.approx(0.1)


def run_steps(costs: PreemptionCosts, steps, premium: float, rate: float, decode_s: float, noise, rng) -> None:
    """Feed costs steps of (prefill tokens, decode rows) that take decode_s, plus premium + tokens / rate when
    they carry prefill, plus noise (the decode rows describe the mix; a step's cost does not see them)."""
    for prefill, _decode_rows in steps:
        seconds = decode_s + (premium + prefill / rate if prefill else 0.0) + rng.uniform(-noise, noise)
        costs.observe_step(prefill, seconds)


def workload_c_steps(rng: random.Random, num_steps: int, prefill_share: float, num_large: int):
    """Decode-only steps of 256 rows, mixed steps of a few hundred prefill tokens riding with ~150 decodes
    (a recomputed victim's re-prefill, a new admission), and num_large full 16k-token prefill steps."""
    steps = [(0, 256) if rng.random() > prefill_share else (rng.randint(100, 1024), rng.randint(100, 200))
             for _ in range(num_steps)]
    for i in rng.sample(range(num_steps), num_large):
        steps[i] = (16384, 0)
    return steps


@settings(max_examples=60, deadline=None)
@given(premium=st.floats(0.0, 0.02), rate=st.floats(1e5, 2e6), decode_s=st.floats(0.002, 0.02),
       calibration_error=st.floats(0.5, 2.0), noise=st.floats(0.0, 1e-4), prefill_share=st.floats(0.2, 0.9),
       num_large=st.integers(3, 12), seed=st.integers(0, 2**32 - 1))
def test_the_fit_recovers_the_premium_and_the_rate_of_any_step_mix(premium, rate, decode_s, calibration_error,
                                                                   noise, prefill_share, num_large, seed):
    rng = random.Random(seed)
    costs = PreemptionCosts(prefill_tokens_per_s=rate * calibration_error)  # the data overrides a poor calibration
    run_steps(costs, [(0, 256)], premium, rate, decode_s, noise, rng)
    run_steps(costs, workload_c_steps(rng, 300, prefill_share, num_large), premium, rate, decode_s, noise, rng)
    assert costs.prefill_tokens_per_s == pytest.approx(rate, rel=0.03)
    assert costs.prefill_step_premium_s == pytest.approx(premium, abs=1e-4)


def test_workload_c_learns_the_premium_that_mixed_steps_pay_and_then_swaps_its_victims():
    rng = random.Random(0)
    rate, premium, decode_s = 600_000.0, 0.007, 0.005
    costs = PreemptionCosts(**H200, prefill_tokens_per_s=900_000.0)  # a calibration above the marginal rate
    steps = [(0, 256)] + [(16384, 0)] * 4  # a decode, then a burst of admissions
    for _ in range(150):  # decodes, with ~600-token re-prefills riding with ~150 decode rows
        steps += [(0, 256), (0, 256), (rng.randint(500, 700), rng.randint(140, 160))]
    run_steps(costs, steps, premium, rate, decode_s, 2e-5, rng)
    assert costs.prefill_step_premium_s == pytest.approx(premium, rel=0.05)  # the classification learned ~0
    assert costs.prefill_tokens_per_s == pytest.approx(rate, rel=0.03)
    tokens = 670  # the victim's re-prefill: ~8 ms to recompute, ~3 ms to swap its 42 blocks out and in
    assert auto(cdiv(tokens, BLOCK_TOKENS), costs).swap


def test_steps_that_take_no_time_a_negative_time_or_no_finite_time_are_ignored():
    costs = PreemptionCosts(prefill_tokens_per_s=1000.0)
    costs.observe_step(num_prefill_tokens=0, seconds=0.01)
    before = repr(costs), costs.prefill_tokens_per_s, costs.prefill_step_premium_s, costs.decode_step_s
    for seconds in (0.0, -1.0, math.nan, math.inf, -math.inf):
        costs.observe_step(num_prefill_tokens=0, seconds=seconds)
        costs.observe_step(num_prefill_tokens=100, seconds=seconds)
    assert (repr(costs), costs.prefill_tokens_per_s, costs.prefill_step_premium_s, costs.decode_step_s) == before


def assert_sane(costs: PreemptionCosts) -> None:
    for value in (costs.prefill_tokens_per_s, costs.prefill_step_premium_s, costs.decode_step_s):
        assert math.isfinite(value) and value >= 0
    assert costs.prefill_tokens_per_s > 0
    assert math.isfinite(recompute_seconds(1000, 0, costs))


def test_prefill_steps_all_of_one_size_keep_the_calibrated_rate_and_charge_the_rest_to_the_premium():
    costs = PreemptionCosts(prefill_tokens_per_s=1000.0)
    for _ in range(100):  # no spread in the prefill sizes: the slope cannot be told from the intercept
        costs.observe_step(num_prefill_tokens=0, seconds=0.01)
        costs.observe_step(num_prefill_tokens=100, seconds=0.01 + 0.002 + 100 / 1000.0)
    assert_sane(costs)
    assert costs.prefill_tokens_per_s == 1000.0 and costs.prefill_step_premium_s == pytest.approx(0.002)


DOWNHILL = ((100, 0.5), (400, 0.3), (1600, 0.1), (100, 0.2), (1600, 0.2))  # (prefill tokens, seconds beyond)


def test_a_slope_at_or_below_zero_keeps_the_previous_rate():
    calibrated = PreemptionCosts(prefill_tokens_per_s=1000.0)
    calibrated.observe_step(num_prefill_tokens=0, seconds=0.01)
    for _ in range(100):  # bigger prefill steps that run faster: a line sloping down
        for x, extra in DOWNHILL:
            calibrated.observe_step(num_prefill_tokens=x, seconds=0.01 + extra)
            assert_sane(calibrated)
            assert calibrated.prefill_tokens_per_s == 1000.0
    fitted = PreemptionCosts(prefill_tokens_per_s=1000.0)
    for _ in range(50):  # a determined fit first: premium 2 ms, 4000 tokens/s
        fitted.observe_step(num_prefill_tokens=0, seconds=0.01)
        for x in (100, 400, 1600):
            fitted.observe_step(num_prefill_tokens=x, seconds=0.01 + 0.002 + x / 4000.0)
    assert fitted.prefill_tokens_per_s == pytest.approx(4000.0)
    rates = []
    for _ in range(1000):  # then the downhill steps: the fit's slope falls through 0 and stays there
        for x, extra in DOWNHILL:
            fitted.observe_step(num_prefill_tokens=x, seconds=0.01 + extra)
            assert_sane(fitted)
            rates.append(fitted.prefill_tokens_per_s)
    assert min(rates) >= 4000.0 * 0.999 and len(set(rates[-2500:])) == 1


def test_a_slope_near_zero_gives_a_finite_rate():
    costs = PreemptionCosts()
    costs.observe_step(num_prefill_tokens=0, seconds=0.01)
    for i in range(50):
        x = 100 * (1 + i % 5)
        costs.observe_step(num_prefill_tokens=x, seconds=0.01 + 0.003 + x * 1e-16)
    assert_sane(costs)
    assert costs.prefill_tokens_per_s <= MAX_PREFILL_TOKENS_PER_S


def test_the_fit_follows_a_change_of_rate_within_a_few_half_lives():
    rng = random.Random(1)
    costs = PreemptionCosts(prefill_tokens_per_s=1e6)
    run_steps(costs, workload_c_steps(rng, 400, 0.5, 6), 0.006, 1e6, 0.005, 0.0, rng)
    assert costs.prefill_tokens_per_s == pytest.approx(1e6, rel=1e-3)
    run_steps(costs, workload_c_steps(rng, 8 * FIT_HALF_LIFE_SAMPLES, 0.5, 24), 0.006, 5e5, 0.005, 0.0, rng)
    assert costs.prefill_tokens_per_s == pytest.approx(5e5, rel=0.03)
