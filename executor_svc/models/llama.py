"""Llama: pre-norm decoder blocks of (RMSNorm -> GQA attention with RoPE) and (RMSNorm -> SwiGLU MLP).

Qwen2 and Qwen3 are this same block with other switches (qkv bias; per-head q/k RMSNorm), so
they construct LlamaForCausalLM with their flags rather than repeating it.
"""
import torch
from torch import nn

from executor_svc.layers.activation import SiluAndMul
from executor_svc.layers.attention import Attention
from executor_svc.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from executor_svc.layers.layernorm import RMSNorm
from executor_svc.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from executor_svc.layers.rotary import RotaryEmbedding, rope_config
from kernels.attention.base import AttentionMetadata


def head_dim_of(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


class LlamaAttention(nn.Module):
    def __init__(self, config, rotary_emb: RotaryEmbedding, qkv_bias: bool, o_bias: bool, qk_norm: bool):
        super().__init__()
        head_dim = head_dim_of(config)
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size, head_dim, config.num_attention_heads, config.num_key_value_heads, bias=qkv_bias
        )
        num_heads, num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads  # this rank's
        self.q_size, self.kv_size = num_heads * head_dim, num_kv_heads * head_dim
        self.o_proj = RowParallelLinear(config.num_attention_heads * head_dim, config.hidden_size, bias=o_bias)
        self.q_norm = RMSNorm(head_dim, config.rms_norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(head_dim, config.rms_norm_eps) if qk_norm else None
        self.rotary_emb = rotary_emb
        self.attn = Attention(num_heads, head_dim, head_dim**-0.5, num_kv_heads)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        q, k, v, product_scales = self.attn.split_qkv(self.qkv_proj(hidden), self.q_size, self.kv_size)
        q = q.unflatten(-1, (self.attn.num_heads, self.attn.head_dim))
        k = k.unflatten(-1, (self.attn.num_kv_heads, self.attn.head_dim))
        # q/k norm (Qwen3) and RoPE run inside the attention layer, fused with the K/V store when it can
        return self.o_proj(self.attn(positions, q, k, v, meta, self.rotary_emb, self.q_norm, self.k_norm,
                                     product_scales))

    def fp8_activation_producers(self) -> list[tuple[nn.Module, nn.Module]]:
        """As LlamaMLP.fp8_activation_producers: the attention layer's output is read by o_proj alone (decode steps
        write it in FP8 where the backend can: Attention.fp8_group)."""
        return [(self.attn, self.o_proj)]

    def fp8_unscaled_readers(self) -> list[tuple[nn.Module, nn.Module]]:
        """As LlamaMLP.fp8_unscaled_readers: qkv_proj's output is read by the attention layer alone, whose fused
        prologue scales q, k and v as it reads them."""
        return [(self.qkv_proj, self.attn)]


class LlamaMLP(nn.Module):
    def __init__(self, config, intermediate_size: int | None = None):
        super().__init__()
        bias = getattr(config, "mlp_bias", False)
        inter = intermediate_size or config.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [inter, inter], bias=bias)
        self.act_fn = SiluAndMul()
        self.down_proj = RowParallelLinear(inter, config.hidden_size, bias=bias)
        if config.hidden_act != "silu":
            raise ValueError(f"hidden_act {config.hidden_act!r} is not supported; only 'silu'")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))

    def fp8_activation_producers(self) -> list[tuple[nn.Module, nn.Module]]:
        """(producer, Linear layer) pairs in which the layer alone reads the producer's output: with FP8
        weights the producer may write it quantized (executor_svc/layers/fp8.py)."""
        return [(self.act_fn, self.down_proj)]

    def fp8_unscaled_readers(self) -> list[tuple[nn.Module, nn.Module]]:
        """(Linear layer, reader) pairs in which the reader alone reads the layer's output and, when it writes FP8
        itself, can apply an FP8 product's scales as it reads it (executor_svc/layers/fp8.py)."""
        return [(self.gate_up_proj, self.act_fn)]


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config, rotary_emb: RotaryEmbedding, qkv_bias: bool, o_bias: bool, qk_norm: bool,
                 mlp: nn.Module):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = LlamaAttention(config, rotary_emb, qkv_bias, o_bias, qk_norm)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = mlp

    def forward(
        self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None, meta: AttentionMetadata
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            hidden, residual = self.input_layernorm(hidden), hidden
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden, meta)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual

    def fp8_activation_producers(self) -> list[tuple[nn.Module, nn.Module]]:
        """The norms' pairs (as LlamaMLP.fp8_activation_producers): qkv_proj's, and gate_up_proj's when the MLP is
        dense (a mixture of experts' router reads the post-attention norm too)."""
        pairs = [(self.input_layernorm, self.self_attn.qkv_proj)]
        if isinstance(self.mlp, LlamaMLP):
            pairs.append((self.post_attention_layernorm, self.mlp.gate_up_proj))
        return pairs

    def fp8_unscaled_readers(self) -> list[tuple[nn.Module, nn.Module]]:
        """As LlamaMLP.fp8_unscaled_readers: o_proj's output is read by the post-attention norm alone."""
        return [(self.self_attn.o_proj, self.post_attention_layernorm)]

    def fp8_router_producers(self) -> list[tuple[nn.Module, nn.Module]]:
        """(producer, mixture of experts) pairs: the post-attention norm's output is read by the block's router, as it
        is, and by its experts, which quantize it when they multiply FP8 activations: the norm may write both."""
        return [] if isinstance(self.mlp, LlamaMLP) else [(self.post_attention_layernorm, self.mlp)]


def dense_mlp(config, layer_idx: int) -> nn.Module:
    return LlamaMLP(config)


class LlamaModel(nn.Module):
    def __init__(self, config, qkv_bias: bool, o_bias: bool, qk_norm: bool, mlp_for_layer=dense_mlp):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        theta, scaling = rope_config(config)
        rotary_emb = RotaryEmbedding(head_dim_of(config), config.max_position_embeddings, theta, scaling)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, rotary_emb, qkv_bias, o_bias, qk_norm, mlp_for_layer(config, i))
            for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def fp8_unscaled_readers(self) -> list[tuple[nn.Module, nn.Module]]:
        """As LlamaMLP.fp8_unscaled_readers: a dense MLP's down_proj output is read by the next layer's input norm
        alone (the last one's by the final norm, which feeds the LM head and writes no FP8)."""
        return [(layer.mlp.down_proj, after.input_layernorm) for layer, after in zip(self.layers, self.layers[1:])
                if isinstance(layer.mlp, LlamaMLP)]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        hidden, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual, meta)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class LlamaForCausalLM(nn.Module):
    # checkpoint name -> (our fused parameter's name, shard id passed to its weight_loader)
    packed_modules_mapping = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, config, qkv_bias: bool | None = None, o_bias: bool | None = None, qk_norm: bool = False,
                 mlp_for_layer=dense_mlp):
        """Biases default to config.attention_bias (Llama's switch for all four projections);
        mlp_for_layer(config, layer_idx) builds each block's MLP (a mixture of experts in the MoE models)."""
        super().__init__()
        attention_bias = getattr(config, "attention_bias", False)
        qkv_bias = attention_bias if qkv_bias is None else qkv_bias
        o_bias = attention_bias if o_bias is None else o_bias
        self.model = LlamaModel(config, qkv_bias, o_bias, qk_norm, mlp_for_layer)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        if self.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Hidden states [T, hidden] of the step's packed tokens."""
        return self.model(input_ids, positions, meta)

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor | None:
        """Logits [B, vocab] on rank 0, None on other ranks; written into `out` when given (one rank)."""
        return self.lm_head(hidden, out)

    def checkpoint_param(self, ckpt_name: str) -> tuple[str, object] | None:
        """(parameter name, shard id) of a checkpoint tensor this family names its own way; None: the
        loader's default (packed_modules_mapping)."""
        return None

    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn.attn for layer in self.model.layers]
