"""Supported architectures, by the name in config.json's "architectures"."""
from executor_svc.models.llama import LlamaForCausalLM
from executor_svc.models.mixtral import MixtralForCausalLM
from executor_svc.models.qwen2 import Qwen2ForCausalLM
from executor_svc.models.qwen3 import Qwen3ForCausalLM
from executor_svc.models.qwen3_moe import Qwen3MoeForCausalLM

MODEL_REGISTRY = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
}
