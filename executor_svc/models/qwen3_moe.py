"""Qwen3-MoE: the Qwen3 block (q/k RMSNorm, no biases) whose MLP is a mixture of experts, except in the
layers listed in mlp_only_layers or off the decoder_sparse_step, which keep a dense SwiGLU MLP."""
from executor_svc.layers.fused_moe import OTHER_VARIANTS, FusedMoE, expert_checkpoint_name, refuse_unsupported
from executor_svc.models.llama import LlamaForCausalLM, LlamaMLP


def is_sparse_layer(config, layer_idx: int) -> bool:
    """HF's rule: experts unless listed in mlp_only_layers, and only every decoder_sparse_step-th layer."""
    step = config.decoder_sparse_step
    return (layer_idx not in (config.mlp_only_layers or [])
            and config.num_experts > 0 and step > 0 and (layer_idx + 1) % step == 0)


def qwen3_moe_mlp(config, layer_idx: int):
    if not is_sparse_layer(config, layer_idx):
        return LlamaMLP(config)  # intermediate_size: the dense layers' width
    return FusedMoE(config.num_experts, config.num_experts_per_tok, config.hidden_size,
                    config.moe_intermediate_size, renormalize=bool(config.norm_topk_prob))


class Qwen3MoeForCausalLM(LlamaForCausalLM):
    def __init__(self, config):
        refuse_unsupported(config, {**OTHER_VARIANTS, "use_sliding_window": bool,
                                    "decoder_sparse_step": lambda v: v is None or v < 1})
        super().__init__(config, qk_norm=True, mlp_for_layer=qwen3_moe_mlp)

    def checkpoint_param(self, ckpt_name: str):
        return expert_checkpoint_name(ckpt_name)
