"""Prometheus counters follow the scheduler's cumulative ones: preemption decisions, recomputed tokens,
swapped bytes and each kind's estimated and measured cost; structured output (constrained requests,
compile errors, masked steps, mask time and rank 0's wait for late masks); counted again from 0 when
the scheduler restarts."""
from __future__ import annotations

from prometheus_client import generate_latest

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
    assert value(metrics, "nanoserve_structured_output_requests_total") == 6
    assert value(metrics, "nanoserve_grammar_compile_errors_total") == 1
    assert value(metrics, "nanoserve_token_masked_steps_total") == 34
    assert abs(value(metrics, "nanoserve_token_mask_seconds_total") - 0.06) < 1e-9
    assert value(metrics, "nanoserve_preemptions_total") == 2
    assert value(metrics, "nanoserve_late_mask_wait_seconds_total") == 1.0
    assert b"nanoserve_token_mask_seconds_total" in generate_latest(metrics.registry)


def step_counts(counts: list[int], seconds: float) -> engine_pb2.SchedulerStats:
    return stats(step_seconds_bounds=[0.01, 0.1, 1.0], step_seconds_counts=counts, decode_step_seconds=seconds)


def test_the_step_duration_histogram_follows_the_schedulers_buckets_and_survives_its_restart():
    metrics = Metrics()
    name = "nanoserve_step_duration_seconds"
    assert value(metrics, f"{name}_count") is None  # nothing before the first stats
    metrics.update_from_stats(step_counts([5, 2, 0, 1], 3.0))
    metrics.update_from_stats(step_counts([9, 3, 1, 1], 4.5))
    assert [value(metrics, f"{name}_bucket", le=le) for le in ("0.01", "0.1", "1.0", "+Inf")] == [9, 12, 13, 14]
    assert value(metrics, f"{name}_count") == 14 and value(metrics, f"{name}_sum") == 4.5
    metrics.update_from_stats(step_counts([2, 0, 0, 0], 0.01))  # a new scheduler, counting from 0
    assert [value(metrics, f"{name}_bucket", le=le) for le in ("0.01", "0.1", "1.0", "+Inf")] == [11, 14, 15, 16]
    assert abs(value(metrics, f"{name}_sum") - 4.51) < 1e-9
    assert b"nanoserve_step_duration_seconds_bucket" in generate_latest(metrics.registry)


def test_speculative_decoding_counters_and_acceptance_per_position_follow_the_scheduler():
    m = Metrics()
    m.update_from_stats(stats(num_speculative_steps=10, num_proposed_tokens=40, num_accepted_tokens=18,
                              accepted_per_position=[8, 5, 3, 2]))
    m.update_from_stats(stats(num_speculative_steps=20, num_proposed_tokens=80, num_accepted_tokens=30,
                              accepted_per_position=[14, 9, 5, 2]))
    assert value(m, "nanoserve_speculative_steps_total") == 20
    assert value(m, "nanoserve_speculative_proposed_tokens_total") == 80
    assert value(m, "nanoserve_speculative_accepted_tokens_total") == 30
    assert [value(m, "nanoserve_speculative_accepted_tokens_per_position_total", position=str(i))
            for i in range(4)] == [14, 9, 5, 2]
    assert value(m, "nanoserve_speculative_mean_accepted_length") == 1 + 30 / 20
    m.update_from_stats(stats(num_speculative_steps=1, num_proposed_tokens=4, num_accepted_tokens=1,
                              accepted_per_position=[1, 0, 0, 0]))  # a restarted scheduler
    assert value(m, "nanoserve_speculative_accepted_tokens_total") == 31
    assert value(m, "nanoserve_speculative_accepted_tokens_per_position_total", position="0") == 15


def test_get_stats_reports_speculative_decoding_and_its_mean_accepted_length():
    from scheduler_svc.frontend.api_messages import stats as public_stats

    s = public_stats(stats(num_speculative_steps=4, num_proposed_tokens=12, num_accepted_tokens=6,
                           accepted_per_position=[3, 2, 1]))
    assert (s.num_speculative_steps, s.num_proposed_tokens, s.num_accepted_tokens) == (4, 12, 6)
    assert list(s.accepted_per_position) == [3, 2, 1] and s.mean_accepted_length == 2.5
    assert public_stats(stats()).mean_accepted_length == 0


def test_usage_counts_the_proposed_and_accepted_tokens_of_every_completion():
    from scheduler_svc.frontend.api_messages import usage
    from scheduler_svc.text.output_tracker import OutputTracker

    trackers = [OutputTracker(None, [1, 2, 3], []) for _ in range(2)]
    for tracker, (proposed, accepted) in zip(trackers, [(8, 5), (4, 1)]):
        tracker.apply(engine_pb2.RequestOutput(new_token_ids=[7, 8], finish_reason=engine_pb2.FINISH_REASON_LENGTH,
                                               num_proposed_tokens=proposed, num_accepted_tokens=accepted))
    u = usage(3, trackers)
    assert (u.completion_tokens, u.speculative_proposed_tokens, u.speculative_accepted_tokens) == (4, 12, 6)
