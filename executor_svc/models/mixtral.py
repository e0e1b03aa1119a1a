"""Mixtral: the Llama block whose MLP is a mixture of experts (block_sparse_moe, experts w1/w3/w2), the
top-k router weights always renormalised to sum to 1."""
from executor_svc.layers.fused_moe import OTHER_VARIANTS, FusedMoE, expert_checkpoint_name, refuse_unsupported
from executor_svc.models.llama import LlamaForCausalLM


def mixtral_moe(config, layer_idx: int):
    return FusedMoE(config.num_local_experts, config.num_experts_per_tok, config.hidden_size,
                    config.intermediate_size, renormalize=True)


class MixtralForCausalLM(LlamaForCausalLM):
    def __init__(self, config):
        # (router_jitter_noise is training-only noise: HF applies it in training mode alone)
        refuse_unsupported(config, {**OTHER_VARIANTS, "sliding_window": lambda v: v is not None})
        super().__init__(config, mlp_for_layer=mixtral_moe)

    def checkpoint_param(self, ckpt_name: str):
        # the checkpoint's block_sparse_moe (the router and the experts) is this model's mlp
        name = ckpt_name.replace(".block_sparse_moe.", ".mlp.")
        return expert_checkpoint_name(name) or ((name, None) if name != ckpt_name else None)
