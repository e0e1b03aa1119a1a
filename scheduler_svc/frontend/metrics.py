"""Prometheus metrics of the front end: per-request latencies and tokens, and the scheduler's gauges.

Latencies are measured here, where the client's time is spent; queue and cache figures come from
the scheduler's counters, polled every second.
"""
from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import HistogramMetricFamily

from protos import engine_pb2

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160)
TOKEN_TIME_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)


class Metrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()  # one per server, so tests can run several
        r = self.registry
        self.ttft = Histogram("nanoserve_time_to_first_token_seconds", "Request arrival to its first token",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("nanoserve_time_per_output_token_seconds", "Mean time between output tokens",
                              buckets=TOKEN_TIME_BUCKETS, registry=r)
        self.e2e = Histogram("nanoserve_e2e_request_latency_seconds", "Request arrival to its last token",
                             buckets=LATENCY_BUCKETS, registry=r)
        self.prompt_tokens = Counter("nanoserve_prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.generation_tokens = Counter("nanoserve_generation_tokens", "Tokens generated", registry=r)
        self.requests = Counter("nanoserve_requests", "Requests that ended, by outcome", ["outcome"], registry=r)
        self.stalled_streams = Counter("nanoserve_streams_stalled",
                                       "Streams ended because their client read nothing for --stream-stall-timeout-s",
                                       registry=r)
        self.running = Gauge("nanoserve_num_requests_running", "Sequences being generated", registry=r)
        self.waiting = Gauge("nanoserve_num_requests_waiting", "Sequences waiting for admission", registry=r)
        self.swapped = Gauge("nanoserve_num_requests_swapped", "Preempted sequences whose KV is in the host pool",
                             registry=r)
        self.kv_usage = Gauge("nanoserve_kv_cache_usage_ratio", "Fraction of KV blocks held by requests", registry=r)
        self.prefix_hit_rate = Gauge("nanoserve_prefix_cache_hit_rate",
                                     "Prompt tokens found in the prefix cache / looked up, since start", registry=r)
        self.preemptions = Counter("nanoserve_preemptions", "Sequences preempted", registry=r)
        decisions = Counter("nanoserve_preemption_decisions", "Preemptions by how the victim kept its work", ["kind"],
                            registry=r)
        cost = Counter("nanoserve_preemption_cost_seconds", "Cost of the preemptions chosen, as the cost model "
                       "estimated it and as measured (swap copies; recomputed tokens at the measured prefill rate)",
                       ["kind", "source"], registry=r)
        self.prefill_rate = Gauge("nanoserve_prefill_tokens_per_second", "The preemption cost model's prefill rate",
                                  registry=r)
        self.prefill_premium = Gauge("nanoserve_prefill_step_premium_seconds", "What a decode step pays more for "
                                     "carrying prefill, in the preemption cost model", registry=r)
        self.constrained_requests = Counter("nanoserve_structured_output_requests",
                                            "Requests with a structured-output constraint", registry=r)
        self.grammar_compile_errors = Counter("nanoserve_grammar_compile_errors",
                                              "Structured-output constraints the scheduler could not compile",
                                              registry=r)
        self.masked_steps = Counter("nanoserve_token_masked_steps",
                                    "Steps that sampled a constrained sequence", registry=r)
        self.token_mask_seconds = Counter(
            "nanoserve_token_mask_seconds", "Scheduler time filling token masks; per masked step: its rate over "
            "nanoserve_token_masked_steps_total's", registry=r)
        self.late_mask_wait_seconds = Counter(
            "nanoserve_late_mask_wait_seconds", "Rank 0's time waiting for token masks sent after their plan "
            "(async scheduling; on a GPU the forward runs meanwhile)", registry=r)
        # Prometheus counters fed from the scheduler's cumulative ones, by SchedulerStats field
        self._cumulative = {name: _FromCumulative(counter) for name, counter in (
            ("num_preemptions", self.preemptions), ("num_constrained_requests", self.constrained_requests),
            ("num_grammar_compile_errors", self.grammar_compile_errors), ("num_masked_steps", self.masked_steps),
            ("token_mask_seconds", self.token_mask_seconds), ("late_mask_wait_seconds", self.late_mask_wait_seconds))}
        self._cumulative.update({name: _FromCumulative(counter) for name, counter in {
            "num_swap_outs": decisions.labels("swap"),
            "num_recompute_preemptions": decisions.labels("recompute"),
            "num_priority_preemptions": Counter("nanoserve_priority_preemptions",
                                                "Preemptions that let a waiting request of higher priority in",
                                                registry=r),
            "num_recomputed_tokens": Counter("nanoserve_recomputed_tokens",
                                             "Tokens computed again after preemptions by recompute", registry=r),
            "num_swapped_bytes": Counter("nanoserve_swapped_bytes", "KV bytes swapped to the host pool and back",
                                         registry=r),
            "estimated_swap_seconds": cost.labels("swap", "estimated"),
            "measured_swap_seconds": cost.labels("swap", "measured"),
            "estimated_recompute_seconds": cost.labels("recompute", "estimated"),
            "measured_recompute_seconds": cost.labels("recompute", "measured"),
        }.items()})
        self._cumulative.update({name: _FromCumulative(Counter(f"nanoserve_speculative_{metric}", doc, registry=r))
                                 for name, metric, doc in (
            ("num_speculative_steps", "steps", "Sequence steps that verified proposed tokens (speculative decoding)"),
            ("num_proposed_tokens", "proposed_tokens", "Tokens proposed for verification"),
            ("num_accepted_tokens", "accepted_tokens", "Proposed tokens the model accepted"))})
        self.accepted_per_position = Counter("nanoserve_speculative_accepted_tokens_per_position",
                                             "Proposals accepted at each position of their step (0: the first)",
                                             ["position"], registry=r)
        self._accepted_per_position: list[_FromCumulative] = []
        self.mean_accepted_length = Gauge("nanoserve_speculative_mean_accepted_length",
                                          "Tokens a verifying sequence step yields on average (accepted + 1), since "
                                          "start", registry=r)
        self.step_durations = _StepDurations()
        r.register(self.step_durations)
        self.detokenize_seconds = Counter("nanoserve_frontend_detokenize_seconds",
                                          "Front-end time turning engine outputs into text deltas "
                                          "(incremental detokenizer and stop strings), added as each request ends",
                                          registry=r)

    def serve(self, host: str, port: int):
        """Serve /metrics over HTTP; returns the server (call .shutdown() to stop it)."""
        server, _thread = start_http_server(port, addr=host, registry=self.registry)
        return server

    def update_from_stats(self, s: engine_pb2.SchedulerStats) -> None:
        self.running.set(s.num_running)
        self.waiting.set(s.num_waiting)
        self.swapped.set(s.num_swapped)
        if s.total_kv_blocks:
            self.kv_usage.set(1.0 - s.free_kv_blocks / s.total_kv_blocks)
        if s.prefix_cache_query_tokens:
            self.prefix_hit_rate.set(s.prefix_cache_hit_tokens / s.prefix_cache_query_tokens)
        self.prefill_rate.set(s.prefill_tokens_per_s)
        self.prefill_premium.set(s.prefill_step_premium_seconds)
        for name, cumulative in self._cumulative.items():
            cumulative.update(getattr(s, name))
        for position, accepted in enumerate(s.accepted_per_position):
            if position == len(self._accepted_per_position):
                self._accepted_per_position.append(_FromCumulative(self.accepted_per_position.labels(str(position))))
            self._accepted_per_position[position].update(accepted)
        if s.num_speculative_steps:
            self.mean_accepted_length.set(1 + s.num_accepted_tokens / s.num_speculative_steps)
        self.step_durations.update(s)

    def start_request(self) -> "RequestTimer":
        return RequestTimer(self)


class _FromCumulative:
    """A Prometheus counter that follows one of the scheduler's cumulative counters."""

    def __init__(self, counter: Counter) -> None:
        self.counter = counter
        self.seen = 0

    def update(self, value) -> None:
        if value < self.seen:  # the scheduler restarted: its counters began again at 0
            self.seen = 0
        self.counter.inc(value - self.seen)
        self.seen = value


class _StepDurations:
    """nanoserve_step_duration_seconds: the scheduler's steps by wall time, a Prometheus histogram made from
    its bucket counts (SchedulerStats.step_seconds_counts), which restart at 0 with the scheduler."""

    NAME = "nanoserve_step_duration_seconds"

    def __init__(self) -> None:
        self.bounds: tuple[float, ...] = ()
        self.counts: list[int] = []  # per bucket, over every scheduler this front end has seen
        self.seconds = 0.0
        self._seen: tuple[list[int], float] = ([], 0.0)  # the current scheduler's counts and seconds

    def update(self, s: engine_pb2.SchedulerStats) -> None:
        counts, seconds = list(s.step_seconds_counts), s.prefill_step_seconds + s.decode_step_seconds
        if not counts or len(counts) != len(s.step_seconds_bounds) + 1:
            return  # a scheduler that does not count steps by time
        bounds = tuple(s.step_seconds_bounds)
        seen, seen_seconds = self._seen
        if bounds != self.bounds:  # the first scheduler, or one bucketing differently: start over
            self.bounds, self.counts, self.seconds, seen, seen_seconds = bounds, [0] * len(counts), 0.0, [], 0.0
        if len(seen) != len(counts) or any(now < before for now, before in zip(counts, seen)):
            seen, seen_seconds = [0] * len(counts), 0.0  # the scheduler restarted: its counts began again
        self.counts = [total + now - before for total, now, before in zip(self.counts, counts, seen)]
        self.seconds += max(0.0, seconds - seen_seconds)
        self._seen = (counts, seconds)

    def collect(self):
        family = HistogramMetricFamily(self.NAME, "Scheduler steps by wall time, from plan sent to result applied "
                                       "(steps overlap under async scheduling: each counts from the later of its "
                                       "launch and the result before it)")
        if self.counts:
            running, buckets = 0, []
            for bound, count in zip((*self.bounds, float("inf")), self.counts):
                running += count
                buckets.append(("+Inf" if bound == float("inf") else repr(bound), running))
            family.add_metric([], buckets, sum_value=self.seconds)
        yield family

    def describe(self):
        return [HistogramMetricFamily(self.NAME, "")]


class RequestTimer:
    """Latencies of one client request (all n completions together)."""

    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics
        self.start = time.perf_counter()
        self.first_token: float | None = None
        self.num_tokens = 0

    def on_tokens(self, count: int) -> None:
        if count and self.first_token is None:
            self.first_token = time.perf_counter()
            self.metrics.ttft.observe(self.first_token - self.start)
        self.num_tokens += count
        self.metrics.generation_tokens.inc(count)

    def finish(self, outcome: str, prompt_tokens: int) -> None:
        """outcome: finished, cancelled, or the gRPC status that ended it (e.g. unavailable)."""
        m = self.metrics
        m.requests.labels(outcome).inc()
        if outcome == "finished":
            end = time.perf_counter()
            m.e2e.observe(end - self.start)
            m.prompt_tokens.inc(prompt_tokens)
            if self.first_token is not None and self.num_tokens > 1:
                m.tpot.observe((end - self.first_token) / (self.num_tokens - 1))
