"""Tiny random HF checkpoints (safetensors, fp32) for tests that compare against transformers.

Every weight, norm scales and biases included, is re-drawn at a scale that makes logits spread
out, so a wrongly loaded or skipped tensor changes the output visibly.
"""
import os

import torch

_COMMON = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=256,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
)


def _randomize_and_save(model, path: str, seed: int, router_scale: float = 1.0) -> str:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=gen)
            if name.endswith("mlp.gate.weight"):  # an MoE router: decisive logits, so tokens spread over experts
                param.copy_(router_scale * noise / param.shape[-1] ** 0.5)
            elif name.endswith("norm.weight"):
                param.copy_(1.0 + 0.2 * noise)
            elif param.dim() == 1:  # biases
                param.copy_(0.2 * noise)
            else:
                param.copy_(noise / param.shape[-1] ** 0.5)
    model.save_pretrained(path)
    model.generation_config.save_pretrained(path)
    return path


def make_tiny_llama(path: str, seed: int = 0, **overrides) -> str:
    """Llama with untied embeddings (by default) and rope theta 10000."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**{**_COMMON, "tie_word_embeddings": False, "eos_token_id": 2, **overrides})
    torch.manual_seed(seed)
    return _randomize_and_save(LlamaForCausalLM(config), path, seed)


def make_tiny_qwen2(path: str, seed: int = 1, **overrides) -> str:
    """Qwen2: q/k/v biases, tied embeddings."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(**{**_COMMON, "tie_word_embeddings": True, "eos_token_id": 3, **overrides})
    torch.manual_seed(seed)
    return _randomize_and_save(Qwen2ForCausalLM(config), path, seed)


def make_tiny_qwen3(path: str, seed: int = 2, **overrides) -> str:
    """Qwen3: q/k norms and head_dim 32, deliberately not hidden_size / num_heads (16)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        **{**_COMMON, "head_dim": 32, "tie_word_embeddings": False, "eos_token_id": [4, 5], **overrides}
    )
    torch.manual_seed(seed)
    return _randomize_and_save(Qwen3ForCausalLM(config), path, seed)


def make_tiny_llama3_biased(path: str) -> str:
    """Llama with llama3 rope scaling (theta 1e5), every bias on, tied embeddings, vocab 251 (odd)."""
    rope = {
        "rope_type": "llama3",
        "rope_theta": 100000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,  # short, so test prompts reach the scaled band
    }
    return make_tiny_llama(
        path, seed=3, vocab_size=251, attention_bias=True, mlp_bias=True, tie_word_embeddings=True, rope_parameters=rope
    )


def make_tiny_qwen3_moe(path: str, seed: int = 4, **overrides) -> str:
    """Qwen3-MoE: 3 layers, the middle one dense (mlp_only_layers), 8 experts top-3 renormalised."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(**{
        **_COMMON, "num_hidden_layers": 3, "head_dim": 32, "tie_word_embeddings": False, "eos_token_id": 6,
        "num_experts": 8, "num_experts_per_tok": 3, "moe_intermediate_size": 32, "norm_topk_prob": True,
        "decoder_sparse_step": 1, "mlp_only_layers": [1], **overrides})
    torch.manual_seed(seed)
    return _randomize_and_save(Qwen3MoeForCausalLM(config), path, seed, router_scale=4.0)


def make_tiny_mixtral(path: str, seed: int = 5, **overrides) -> str:
    """Mixtral: 6 experts top-2 (always renormalised), rope theta 1e6, untied embeddings."""
    from transformers import MixtralConfig, MixtralForCausalLM

    config = MixtralConfig(**{
        **_COMMON, "tie_word_embeddings": False, "eos_token_id": 7, "num_local_experts": 6,
        "num_experts_per_tok": 2, "intermediate_size": 48,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}, **overrides})
    torch.manual_seed(seed)
    return _randomize_and_save(MixtralForCausalLM(config), path, seed, router_scale=4.0)


def make_tiny_draft(path: str, tokenizer_dir: str, seed: int = 6, **overrides) -> str:
    """A random Llama of the embedded SmolLM2's vocabulary and tokenizer (its files copied): a draft model whose
    proposals the target rarely accepts."""
    import shutil

    from transformers import AutoConfig

    target = AutoConfig.from_pretrained(tokenizer_dir)
    make_tiny_llama(path, seed, vocab_size=target.vocab_size, max_position_embeddings=target.max_position_embeddings,
                    eos_token_id=target.eos_token_id, bos_token_id=target.bos_token_id, **overrides)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"):
        if os.path.exists(os.path.join(tokenizer_dir, name)):
            shutil.copy(os.path.join(tokenizer_dir, name), path)
    return path


MAKERS = {
    "llama": make_tiny_llama,
    "qwen2": make_tiny_qwen2,
    "qwen3": make_tiny_qwen3,
    "llama3_biased": make_tiny_llama3_biased,
    "qwen3_moe": make_tiny_qwen3_moe,
    "mixtral": make_tiny_mixtral,
}


def tiny_checkpoint(kind: str, tmp_path_factory) -> str:
    """A pytest-session-cached checkpoint directory of `kind` (one of MAKERS), built on first use."""
    root = tmp_path_factory.getbasetemp() / "tiny_checkpoints"
    path = root / kind
    if not (path / "config.json").exists():
        os.makedirs(root, exist_ok=True)
        MAKERS[kind](str(path))
    return str(path)


def drop_checkpoint_tensor(path: str, name: str) -> None:
    """Remove one tensor from a tiny checkpoint's model.safetensors (a checkpoint missing a weight)."""
    from safetensors.torch import load_file, save_file
    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    del tensors[name]
    save_file(tensors, file, metadata={"format": "pt"})
