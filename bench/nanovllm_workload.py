"""nano-vLLM's bench workload and model, shared by bench/throughput.py (offline) and bench/serving.py
(gRPC), so that both measure the same draws on the same model with the same engine flags."""
from __future__ import annotations

import json
import os
import random
import tempfile

QWEN3_0_6B = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 1024,
    "intermediate_size": 3072, "num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 8,
    "head_dim": 128, "vocab_size": 151936, "max_position_embeddings": 40960, "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0, "tie_word_embeddings": True, "attention_bias": False, "hidden_act": "silu",
    "torch_dtype": "bfloat16", "bos_token_id": 151643, "eos_token_id": 151645,
}
# The same architecture shrunk for a CPU smoke run; the vocabulary still covers the prompts' ids (< 10001).
TINY_QWEN3 = {**QWEN3_0_6B, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 16384,
              "bos_token_id": 16382, "eos_token_id": 16383}
# The Qwen3-8B shape (the brief's second workload model; its decode is near the bandwidth roofline).
QWEN3_8B = {**QWEN3_0_6B, "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36,
            "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "tie_word_embeddings": False}
# The Qwen3-30B-A3B shape: every layer a mixture of 128 experts, top-8 renormalised, 768 wide; ~3B active.
QWEN3_30B_A3B = {**QWEN3_0_6B, "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
                 "hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 48, "num_attention_heads": 32,
                 "num_key_value_heads": 4, "head_dim": 128, "tie_word_embeddings": False, "num_experts": 128,
                 "num_experts_per_tok": 8, "moe_intermediate_size": 768, "norm_topk_prob": True,
                 "decoder_sparse_step": 1, "mlp_only_layers": []}
MODEL_SHAPES = {"qwen3-0.6b": QWEN3_0_6B, "qwen3-8b": QWEN3_8B, "qwen3-30b-a3b": QWEN3_30B_A3B, "tiny": TINY_QWEN3}

# bench/throughput.py's engine flags over the engine's defaults
ENGINE_DEFAULTS = {"max_num_batched_tokens": 16384, "max_num_seqs": 512}


def workload(num_seqs: int, max_input: int, max_output: int, seed: int, min_input: int = 100, min_output: int = 100):
    """nano-vLLM's bench.py draws, in this order, so the token totals match (133,966 output at 256).
    The lower bounds are nano-vLLM's 100 unless a smaller run (a CPU smoke test) asks otherwise."""
    rng = random.Random(seed)
    prompts = [[rng.randint(0, 10000) for _ in range(rng.randint(min_input, max_input))] for _ in range(num_seqs)]
    max_tokens = [rng.randint(min_output, max_output) for _ in range(num_seqs)]
    return prompts, max_tokens


def dummy_model_dir(shape: dict = QWEN3_0_6B) -> tempfile.TemporaryDirectory:
    """A model directory holding only config.json: load it with --load-format dummy (random weights)."""
    tmp = tempfile.TemporaryDirectory(prefix=f"{shape['model_type']}-random-")
    with open(os.path.join(tmp.name, "config.json"), "w") as f:
        json.dump(shape, f)
    return tmp
