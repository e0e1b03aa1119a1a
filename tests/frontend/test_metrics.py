"""Prometheus follows the scheduler's cumulative counters: preemption decisions, recomputed tokens, swapped
bytes and the estimated and measured cost of each kind, also across a scheduler restart."""
from __future__ import annotations

from protos import engine_pb2
from scheduler_svc.frontend.metrics import Metrics


def value(metrics: Metrics, name: str, **labels) -> float:
    return metrics.registry.get_sample_value(name, labels or None)


def test_preemption_decisions_tokens_bytes_and_costs_follow_the_scheduler_counters():
    m = Metrics()
    m.update_from_stats(engine_pb2.SchedulerStats(
        num_preemptions=5, num_swap_outs=3, num_recompute_preemptions=2, num_priority_preemptions=1,
        num_recomputed_tokens=40, num_swapped_bytes=6000, estimated_swap_seconds=0.5, measured_swap_seconds=0.25,
        estimated_recompute_seconds=0.125, measured_recompute_seconds=0.0625, prefill_tokens_per_s=900.0))
    m.update_from_stats(engine_pb2.SchedulerStats(
        num_preemptions=7, num_swap_outs=4, num_recompute_preemptions=3, num_priority_preemptions=1,
        num_recomputed_tokens=50, num_swapped_bytes=8000, estimated_swap_seconds=1.0, measured_swap_seconds=0.5,
        estimated_recompute_seconds=0.25, measured_recompute_seconds=0.125, prefill_tokens_per_s=1000.0))
    assert value(m, "nanoserve_preemptions_total") == 7
    assert value(m, "nanoserve_preemption_decisions_total", kind="swap") == 4
    assert value(m, "nanoserve_preemption_decisions_total", kind="recompute") == 3
    assert value(m, "nanoserve_priority_preemptions_total") == 1
    assert value(m, "nanoserve_recomputed_tokens_total") == 50
    assert value(m, "nanoserve_swapped_bytes_total") == 8000
    assert value(m, "nanoserve_preemption_cost_seconds_total", kind="swap", source="estimated") == 1.0
    assert value(m, "nanoserve_preemption_cost_seconds_total", kind="swap", source="measured") == 0.5
    assert value(m, "nanoserve_preemption_cost_seconds_total", kind="recompute", source="estimated") == 0.25
    assert value(m, "nanoserve_preemption_cost_seconds_total", kind="recompute", source="measured") == 0.125
    assert value(m, "nanoserve_prefill_tokens_per_second") == 1000.0


def test_a_restarted_scheduler_counting_from_zero_again_adds_to_the_counters():
    m = Metrics()
    m.update_from_stats(engine_pb2.SchedulerStats(num_preemptions=5, num_recomputed_tokens=100))
    m.update_from_stats(engine_pb2.SchedulerStats(num_preemptions=2, num_recomputed_tokens=30))  # a new scheduler
    assert value(m, "nanoserve_preemptions_total") == 7
    assert value(m, "nanoserve_recomputed_tokens_total") == 130
