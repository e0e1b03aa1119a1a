"""The scheduler's limits, fixed once the executors have shaken hands."""
from __future__ import annotations

from dataclasses import dataclass, field

from protos import engine_pb2
from scheduler_svc.common.config import PREEMPTION_MODES, PREEMPTION_POLICIES, EngineConfig
from scheduler_svc.core.preemption_cost import PreemptionCosts


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
    preemption_mode: str = "swap"  # recompute, swap (when the host pool has room) or auto (preemption_cost.py)
    preemption_policy: str = "newest"  # who is preempted (preemption_policy.py)
    preemption_costs: PreemptionCosts = field(default_factory=PreemptionCosts)  # the executors' calibration
    world_size: int = 1  # tensor-parallel ranks, each holding a shard of every block
    mask_fill_threads: int = 0  # threads filling structured-output masks; 0: mask_fill.default_fill_threads()
    speculative_method: str | None = None  # None: no speculative decoding (core/speculative/)
    num_speculative_tokens: int = 4  # proposals per sequence and step, at most
    ngram_min: int = 1  # n-gram proposals: the suffix lengths looked up
    ngram_max: int = 4
    speculative_max_batch_size: int = 8  # speculation pauses while more sequences than this run (EngineConfig's)
    chain_verifications: bool = False  # async scheduling: plan a verifying sequence's next step before its verdict

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len", "block_size", "num_blocks"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.preemption_mode not in PREEMPTION_MODES or self.preemption_policy not in PREEMPTION_POLICIES:
            raise ValueError(f"preemption mode must be one of {PREEMPTION_MODES} and policy one of "
                             f"{PREEMPTION_POLICIES}, got "
                             f"{self.preemption_mode!r} and {self.preemption_policy!r}")


def scheduler_config(config: EngineConfig, ready: engine_pb2.EngineReady) -> SchedulerConfig:
    """The engine flags and what the executors reported (the smallest pools, the slowest costs over ranks)."""
    facts = ready.model
    return SchedulerConfig(
        max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=config.max_num_batched_tokens,
        max_model_len=ready.max_model_len,
        block_size=config.block_size,
        num_blocks=facts.num_blocks,
        enable_prefix_caching=config.enable_prefix_caching,
        eos_token_ids=tuple(facts.eos_token_ids),
        num_host_blocks=facts.num_host_blocks,
        preemption_mode=config.resolved_preemption_mode(facts.device.split(":")[0]),
        preemption_policy=config.preemption_policy,
        preemption_costs=PreemptionCosts(facts.kv_block_bytes, facts.host_link_bytes_per_s, facts.copy_fixed_seconds,
                                         facts.prefill_tokens_per_s),
        world_size=facts.world_size,
        vocab_size=facts.vocab_size,
        tokenizer_dir=config.model,
        mask_fill_threads=config.mask_fill_threads,
        speculative_method=config.speculative_method,
        num_speculative_tokens=config.num_speculative_tokens,
        ngram_min=config.ngram_min,
        ngram_max=config.ngram_max,
        speculative_max_batch_size=config.speculative_max_batch_size,
        # a draft's proposals are drawn by the executors from the sequence's true tokens: its verifications wait for
        # their verdicts (DESIGN.md, "Speculative decoding")
        chain_verifications=config.async_scheduling and config.max_steps_in_flight > 1
        and config.speculative_method != "draft",
    )
