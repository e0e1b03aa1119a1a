"""The scheduler's limits, fixed once the executors have shaken hands."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    block_size: int
    num_blocks: int  # the smallest KV pool over the executor ranks
    enable_prefix_caching: bool = True
    eos_token_ids: tuple[int, ...] = ()
    num_host_blocks: int = 0  # the executors' host (swap) pool; 0 preempts by recompute only
    vocab_size: int = 0  # the logits' width: a structured-output token mask covers it
    tokenizer_dir: str = ""  # the model's tokenizer.json lives here: structured output compiles grammars with it

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len", "block_size", "num_blocks"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
