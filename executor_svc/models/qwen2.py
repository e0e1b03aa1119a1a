"""Qwen2: the Llama block with a bias on the q/k/v projections (none on o_proj)."""
from executor_svc.models.llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    def __init__(self, config):
        if getattr(config, "use_sliding_window", False):
            raise ValueError("Qwen2 with use_sliding_window=True is not supported")
        super().__init__(config, qkv_bias=True, o_bias=False)
