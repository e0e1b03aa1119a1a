"""Swap or recompute (preemption_cost.decide): auto takes the cheaper estimate, on either side of the crossover
that the fixed cost per copy sets; host-pool room and prefix-cache hits are counted; the prefill rate follows
the steps that run."""
from __future__ import annotations

import math

import pytest

from scheduler_svc.core.preemption_cost import PreemptionCosts, decide, recompute_seconds, swap_seconds
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


def test_the_prefill_rate_follows_prefill_steps_and_ignores_decode_steps():
    costs = PreemptionCosts(prefill_tokens_per_s=1000.0)
    costs.observe_step(num_tokens=256, num_prefill_tokens=0, seconds=0.001)  # decodes: says nothing of prefill
    costs.observe_step(num_tokens=300, num_prefill_tokens=40, seconds=0.001)  # mostly decodes
    assert costs.prefill_tokens_per_s == 1000.0
    for _ in range(40):
        costs.observe_step(num_tokens=2048, num_prefill_tokens=2000, seconds=1.0)
    assert costs.prefill_tokens_per_s == pytest.approx(2048, rel=1e-3)
    unknown = PreemptionCosts()
    unknown.observe_step(num_tokens=512, num_prefill_tokens=512, seconds=0.5)
    assert unknown.prefill_tokens_per_s == 1024  # the first sample is taken whole


def test_the_premium_of_a_decode_step_carrying_prefill_is_learned_from_steps_and_charged_once_per_recompute():
    costs = PreemptionCosts(**H200, prefill_tokens_per_s=900_000.0)  # the H200's calibrated rate (session 7)
    for _ in range(40):  # a graph-replayed decode step of 5 ms, then one carrying 90 prefill tokens in 11.1 ms
        costs.observe_step(num_tokens=256, num_prefill_tokens=0, seconds=0.005)
        costs.observe_step(num_tokens=346, num_prefill_tokens=90, seconds=0.0111)
    assert costs.decode_step_s == pytest.approx(0.005)
    assert costs.prefill_step_premium_s == pytest.approx(0.0111 - 0.005 - 90 / 900_000.0, rel=1e-3)
    tokens = 700  # a victim that computed 700 tokens, 44 blocks: swapping them out and in is ~3 ms
    assert recompute_seconds(tokens, 0, costs) == pytest.approx(tokens / 900_000.0 + costs.prefill_step_premium_s)
    assert auto(cdiv(tokens, BLOCK_TOKENS), costs).swap  # with the premium, recompute is the dearer
    assert not auto(cdiv(tokens, BLOCK_TOKENS), PreemptionCosts(**H200, prefill_tokens_per_s=900_000.0)).swap


def test_a_premium_that_measures_below_zero_counts_as_none_and_noise_is_not_biased_up():
    costs = PreemptionCosts(prefill_tokens_per_s=1000.0)
    for noise in [0.001, -0.001] * 50:  # a CPU: no graphs, a step carrying prefill costs just its tokens
        costs.observe_step(num_tokens=10, num_prefill_tokens=0, seconds=0.1)
        costs.observe_step(num_tokens=12, num_prefill_tokens=2, seconds=0.1 + 2 / 1000.0 + noise)
    assert abs(costs.prefill_step_premium_s) < 0.001
    below = PreemptionCosts(prefill_tokens_per_s=1000.0, prefill_step_premium_s=-0.5)
    assert recompute_seconds(100, 0, below) == pytest.approx(0.1)
