"""One sequence's sampling options as the sampler reads them, torch-free: the sequence mirrors
(executor_svc/seq_mirror.py) read them once from the plan's protobuf, and the sampler and the
decode graphs take them from there every step.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from protos import engine_pb2

GREEDY_EPS = 1e-5  # a temperature below this is greedy


@dataclass(frozen=True, slots=True)
class SamplingRow:
    """One sequence's sampling options, read from the protobuf once rather than at every step."""

    temperature: float
    greedy: bool
    top_k: int          # 0 where off
    top_p: float        # 1.0 where off
    min_p: float        # 0.0 where off
    repetition_penalty: float  # 1.0 where off
    presence_penalty: float
    frequency_penalty: float
    seed: int | None
    logprobs: int
    plain: bool = False  # temperature (or greedy) alone: no filter, penalty, seed or logprobs

    def __post_init__(self) -> None:
        plain = (self.top_k == 0 and self.top_p == 1.0 and self.min_p == 0.0 and self.repetition_penalty == 1
                 and not self.presence_penalty and not self.frequency_penalty and self.seed is None
                 and not self.logprobs)
        object.__setattr__(self, "plain", plain)  # derived once: build() asks it of every row, every step

    @staticmethod
    def of(o: "engine_pb2.SamplingOptions | SamplingRow") -> "SamplingRow":
        if isinstance(o, SamplingRow):
            return o
        greedy = o.temperature < GREEDY_EPS
        return SamplingRow(
            temperature=o.temperature, greedy=greedy, top_k=max(0, o.top_k),
            top_p=o.top_p if 0 < o.top_p < 1 else 1.0, min_p=o.min_p if 0 < o.min_p <= 1 else 0.0,
            repetition_penalty=o.repetition_penalty if o.repetition_penalty > 0 else 1.0,
            presence_penalty=o.presence_penalty, frequency_penalty=o.frequency_penalty,
            seed=o.seed if o.HasField("seed") and not greedy else None, logprobs=o.logprobs)

    @property
    def needs_prompt(self) -> bool:
        return self.repetition_penalty != 1

    @property
    def needs_output(self) -> bool:
        return self.needs_prompt or bool(self.presence_penalty or self.frequency_penalty) or self.seed is not None


def plain_sampling_columns(rows: list[SamplingRow], rng: np.random.Generator) -> dict[str, np.ndarray]:
    """All that plain rows need: temperature (0 on greedy rows) and a fresh noise seed per row."""
    temperature = np.fromiter((0.0 if r.greedy else r.temperature for r in rows), dtype=np.float32, count=len(rows))
    return {"temperature": temperature, "noise_seeds": rng.integers(-2**63, 2**63 - 1, size=len(rows), dtype=np.int64)}


GREEDY_ROW = SamplingRow.of(engine_pb2.SamplingOptions())  # the defaults: greedy, nothing else
