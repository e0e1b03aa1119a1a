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

    def validate(self, *, max_n: int = 16, max_logprobs: int = 20, max_stop: int = 16,
                 max_stop_len: int = 256) -> None:
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
        ]
        for ok, message in problems:
            if not ok:
                raise ValueError(message)

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
