"""Qwen3: the Llama block with RMSNorm on each q and k head before RoPE, and an explicit head_dim."""
from executor_svc.models.llama import LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    def __init__(self, config):
        super().__init__(config, qk_norm=True)
