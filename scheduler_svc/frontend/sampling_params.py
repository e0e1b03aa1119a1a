"""User-facing sampling parameters, their validation, and their wire form."""
from __future__ import annotations

from dataclasses import dataclass, field

from protos import engine_pb2


@dataclass
class SamplingParams:
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 means off
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int = 256
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    n: int = 1
    logprobs: int = 0  # top-N candidates per generated token
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    beam_width: int = 0  # 0 samples; k >= 1 runs beam search and returns the n best of k beams
    length_penalty: float = 1.0  # beam search: score = sum(logprob) / generated_len ** length_penalty

    def validate(self, *, max_n: int = 16, max_logprobs: int = 20, max_stop: int = 16,
                 max_stop_len: int = 256, max_beam_width: int = 16) -> None:
        """Raise ValueError naming the field and the limit."""
        problems = [
            (self.temperature >= 0, f"temperature must be >= 0, got {self.temperature}"),
            (0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}"),
            (self.top_k >= 0, f"top_k must be >= 0 (0 disables it), got {self.top_k}"),
            (0 <= self.min_p <= 1, f"min_p must be in [0, 1], got {self.min_p}"),
            (self.max_tokens >= 1, f"max_tokens must be >= 1, got {self.max_tokens}"),
            (self.min_tokens >= 0, f"min_tokens must be >= 0, got {self.min_tokens}"),
            (self.min_tokens <= self.max_tokens,
             f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})"),
            (1 <= self.n <= max_n, f"n must be in [1, {max_n}], got {self.n}"),
            (0 <= self.logprobs <= max_logprobs, f"logprobs must be in [0, {max_logprobs}], got {self.logprobs}"),
            (len(self.stop) <= max_stop, f"stop has {len(self.stop)} strings, the limit is {max_stop}"),
            (all(0 < len(s) <= max_stop_len for s in self.stop),
             f"each stop string must have 1 to {max_stop_len} characters"),
            (all(t >= 0 for t in self.stop_token_ids), "stop_token_ids must be >= 0"),
            (-2 <= self.presence_penalty <= 2, f"presence_penalty must be in [-2, 2], got {self.presence_penalty}"),
            (-2 <= self.frequency_penalty <= 2,
             f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}"),
            (0 < self.repetition_penalty <= 10,
             f"repetition_penalty must be in (0, 10], got {self.repetition_penalty}"),
            (self.seed is None or 0 <= self.seed < 2**63, f"seed must be in [0, 2^63), got {self.seed}"),
            (0 <= self.beam_width <= max_beam_width,
             f"beam_width must be in [0, {max_beam_width}] (0 samples), got {self.beam_width}"),
            (-10 <= self.length_penalty <= 10,  # also false for NaN
             f"length_penalty must be a finite number in [-10, 10], got {self.length_penalty}"),
        ]
        if self.beam_width > 0:
            problems += self._beam_search_problems()
        for ok, message in problems:
            if not ok:
                raise ValueError(message)

    def _beam_search_problems(self) -> list[tuple[bool, str]]:
        """Beam search scores with the raw log-softmax: the sampling knobs would be silently ignored."""
        off = "does not apply to beam search (beam_width > 0)"
        return [
            (self.n <= self.beam_width,
             f"n ({self.n}) must be <= beam_width ({self.beam_width}): beam search returns the n best of its beams"),
            (self.top_p == 1, f"top_p {off}; leave it at 1, got {self.top_p}"),
            (self.top_k == 0, f"top_k {off}; leave it at 0, got {self.top_k}"),
            (self.min_p == 0, f"min_p {off}; leave it at 0, got {self.min_p}"),
            (self.seed is None, f"seed {off}: beam search is deterministic; leave it unset"),
            (self.presence_penalty == 0, f"presence_penalty {off}; leave it at 0, got {self.presence_penalty}"),
            (self.frequency_penalty == 0, f"frequency_penalty {off}; leave it at 0, got {self.frequency_penalty}"),
            (self.repetition_penalty == 1,
             f"repetition_penalty {off}; leave it at 1, got {self.repetition_penalty}"),
        ]

    def sampling_options(self, seed_offset: int = 0) -> engine_pb2.SamplingOptions:
        """Wire form for the executor; seed_offset separates the n parallel samples of one request."""
        opts = engine_pb2.SamplingOptions(
            temperature=self.temperature, top_k=self.top_k, top_p=self.top_p, min_p=self.min_p,
            logprobs=self.logprobs, presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty, repetition_penalty=self.repetition_penalty,
        )
        if self.seed is not None:
            opts.seed = (self.seed + seed_offset) % 2**64
        return opts

    def stopping_options(self) -> engine_pb2.StoppingOptions:
        return engine_pb2.StoppingOptions(
            max_tokens=self.max_tokens, min_tokens=self.min_tokens,
            stop_token_ids=self.stop_token_ids, ignore_eos=self.ignore_eos,
        )

    def beam_search_options(self) -> engine_pb2.BeamSearchOptions | None:
        """Wire form of a beam search whose n best hypotheses go to n engine requests; None when sampling."""
        if self.beam_width <= 0:
            return None
        return engine_pb2.BeamSearchOptions(beam_width=self.beam_width, length_penalty=self.length_penalty,
                                            num_requests=self.n)

    def add_requests(self, request_ids: list[str], prompt_token_ids: list[int],
                     priority: int = 0) -> list[engine_pb2.AddRequest]:
        """The engine requests of the n completions, one per id, to be sent in this order.

        They share a group id (the first id): parallel samples so that the later ones reuse the
        first one's cached prompt, a beam search so that the scheduler runs one search for all of
        them and hands the i-th best hypothesis to the i-th request.
        """
        beam = self.beam_search_options()
        group_id = request_ids[0] if beam is not None or len(request_ids) > 1 else ""
        return [engine_pb2.AddRequest(
            request_id=rid, prompt_token_ids=prompt_token_ids, sampling=self.sampling_options(seed_offset=i),
            stopping=self.stopping_options(), priority=priority, group_id=group_id,
            beam_search=beam) for i, rid in enumerate(request_ids)]
