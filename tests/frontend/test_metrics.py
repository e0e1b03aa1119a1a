"""Prometheus counters follow the scheduler's cumulative ones: preemptions and structured output (constrained
requests, compile errors, masked steps, mask time and rank 0's wait for late masks), counted again from 0
when the scheduler restarts."""
from __future__ import annotations

from prometheus_client import generate_latest

from protos import engine_pb2
from scheduler_svc.frontend.metrics import Metrics


def sample(metrics: Metrics, name: str) -> float:
    return metrics.registry.get_sample_value(name)


def stats(**counters) -> engine_pb2.SchedulerStats:
    return engine_pb2.SchedulerStats(total_kv_blocks=10, free_kv_blocks=10, **counters)


def test_structured_output_counters_follow_the_schedulers_and_survive_its_restart():
    metrics = Metrics()
    metrics.update_from_stats(stats(num_constrained_requests=3, num_grammar_compile_errors=1, num_masked_steps=10,
                                    token_mask_seconds=0.02, num_preemptions=2, late_mask_wait_seconds=0.5))
    metrics.update_from_stats(stats(num_constrained_requests=5, num_grammar_compile_errors=1, num_masked_steps=30,
                                    token_mask_seconds=0.05, num_preemptions=2, late_mask_wait_seconds=0.75))
    metrics.update_from_stats(stats(num_constrained_requests=1, num_masked_steps=4, token_mask_seconds=0.01,
                                    late_mask_wait_seconds=0.25))  # restart
    assert sample(metrics, "nanoserve_structured_output_requests_total") == 6
    assert sample(metrics, "nanoserve_grammar_compile_errors_total") == 1
    assert sample(metrics, "nanoserve_token_masked_steps_total") == 34
    assert abs(sample(metrics, "nanoserve_token_mask_seconds_total") - 0.06) < 1e-9
    assert sample(metrics, "nanoserve_preemptions_total") == 2
    assert sample(metrics, "nanoserve_late_mask_wait_seconds_total") == 1.0
    assert b"nanoserve_token_mask_seconds_total" in generate_latest(metrics.registry)
