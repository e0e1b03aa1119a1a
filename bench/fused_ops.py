"""Benchmark of the fused small ops against their eager torch chains; a benchmark, not a test.

  python bench/fused_ops.py                      # H200: graph-replayed us and GB/s per op and batch
  python bench/fused_ops.py --model-shape qwen3-8b --kv-cache-dtype fp8 --ops prologue prologue-fp8  # the prologue
  python bench/fused_ops.py --device cpu --tiny  # interpreter smoke run, seconds

Both sides are timed replayed from a CUDA graph, as decode runs in the server, so the eager chain
is charged for its kernels and intermediate tensors, not for launches. GB/s counts the bytes the op
must move (inputs read once, outputs written once). Shapes are Qwen3-0.6B's (or --model-shape's), bf16 activations.
The prologue (q/k norm, RoPE and the K/V store in one kernel) is timed against the four kernels it replaces (two
rms_norm, rotary_embedding, store_kvcache: the eager reference indexes by a mask, which a graph cannot hold); its pool
is bf16 or, with --kv-cache-dtype fp8, float8_e4m3fn with per-head scales. "prologue, fp8 product" reads an FP8
qkv_proj's unscaled product, scaling it as it reads (`product_scales`), against scale_product's pass and then the
prologue.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
# Run as a script, this file's folder comes first on sys.path and its name would shadow kernels.
sys.path = [str(REPO)] + [p for p in sys.path if Path(p or ".").resolve() != HERE]

from bench.nanovllm_workload import MODEL_SHAPES  # noqa: E402

EPS, VOCAB, BLOCK_SIZE = 1e-6, 151936, 16
OPS = ("rms_norm", "rms_norm + residual", "q_norm + k_norm", "silu_and_mul", "rotary (q, k)", "prologue",
       "prologue, fp8 product", "sample (T=0.6)")


def sample_eager(logits, temperature):
    """The torch chain the fused sampler replaces: fp32 copy, temperature, softmax, exponential race."""
    import torch

    probs = (logits.float() / temperature[:, None]).softmax(dim=-1)
    q = torch.empty_like(probs).exponential_().clamp_min_(torch.finfo(torch.float32).tiny)
    return (probs / q).argmax(dim=-1)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--tiny", action="store_true", help="tiny shapes (for the CPU interpreter)")
    p.add_argument("--model-shape", choices=sorted(MODEL_SHAPES), default="qwen3-0.6b")
    p.add_argument("--kv-cache-dtype", choices=["bf16", "fp8"], default="bf16", help="the prologue's pool")
    p.add_argument("--ops", nargs="+", default=list(OPS),
                   help="a subset of the ops; 'prologue' and 'prologue-fp8' for the prologue's two")
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 64, 256, 1024, 4096])
    p.add_argument("--out", default=str(HERE / "results" / "fused_ops.json"))
    args = p.parse_args()
    shape = MODEL_SHAPES[args.model_shape]
    hidden, inter = shape["hidden_size"], shape["intermediate_size"]
    q_heads, kv_heads, head_dim = shape["num_attention_heads"], shape["num_key_value_heads"], shape["head_dim"]
    if args.device == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"  # before the kernels are decorated
    import torch
    from triton import testing

    from executor_svc.layers.rotary import RotaryEmbedding
    from kernels import fp8_gemm
    from kernels import fused_ops as fo
    from kernels.attention.triton_kv_store import store_kvcache
    from kernels.kv_quant import KVScales
    from kernels.sampling import sample_tokens

    device, dt = torch.device(args.device), torch.bfloat16

    def time_us(fn) -> float:
        if device.type == "cuda":
            return testing.do_bench_cudagraph(fn, rep=100, return_mode="median") * 1e3
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e6

    def randn(*shape):
        return torch.randn(*shape, device=device).to(dt)

    rope = RotaryEmbedding(head_dim, 40960, 1000000.0).to(device)
    w, head_w = randn(hidden), randn(head_dim)
    kv_dtype = torch.float8_e4m3fn if args.kv_cache_dtype == "fp8" else dt
    kv_scales = KVScales(*(torch.rand(kv_heads, device=device) * 0.02 + 0.01 for _ in range(2)))
    rows = []
    print(f"{args.model_shape} ({q_heads}/{kv_heads} heads of {head_dim}), {args.kv_cache_dtype} pool")
    print(f"{'op':<22} {'T':>5} {'fused us':>9} {'GB/s':>7} {'eager us':>9} {'GB/s':>7} {'speedup':>8}")
    for num_tokens in ([3] if args.tiny else args.tokens):
        x, res, gate_up = randn(num_tokens, hidden), randn(num_tokens, hidden), randn(num_tokens, 2 * inter)
        qkv = randn(num_tokens, (q_heads + 2 * kv_heads) * head_dim)
        q, k, v = (t.unflatten(-1, (-1, head_dim)) for t in qkv.split(
            [q_heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1))
        pos = torch.randint(0, 40960, (num_tokens,), device=device)
        # the pool: a slot for each token, in blocks of a pool twice the batch
        num_blocks = 2 * num_tokens // BLOCK_SIZE + 2
        k_cache, v_cache = (randn(num_blocks, BLOCK_SIZE, kv_heads, head_dim).to(kv_dtype) for _ in range(2))
        slots = torch.randperm(num_blocks * BLOCK_SIZE, device=device)[:num_tokens]
        scales = kv_scales if args.kv_cache_dtype == "fp8" else None
        prologue = (pos, q, k, v, rope.cos, rope.sin, k_cache, v_cache, slots, head_w, head_w, EPS, scales)

        # an FP8 qkv_proj's unscaled product: a scale per token and per column
        row_scale = torch.rand(num_tokens, 1, device=device) * 4e-5 + 1e-5
        col_scale = torch.rand(qkv.shape[1], 1, device=device) * 4e-3 + 1e-3
        product_scales = (row_scale, *col_scale.split([q_heads * head_dim, kv_heads * head_dim, kv_heads * head_dim]))

        def scale_pass_then_prologue():
            fp8_gemm.scale_product(qkv, row_scale, col_scale, dt)  # in place
            fo.qk_norm_rope_store(*prologue)

        def prologue_chain():
            normed_q, normed_k = fo.rms_norm(q, head_w, EPS), fo.rms_norm(k, head_w, EPS)
            fo.rotary_embedding(pos, normed_q, normed_k, rope.cos, rope.sin)
            store_kvcache(normed_k, v, k_cache, v_cache, slots, scales)
        logits = randn(num_tokens, 1000 if args.tiny else VOCAB)
        temperature = torch.full((num_tokens,), 0.6, device=device)
        seeds = torch.randint(-2**62, 2**62, (num_tokens,), device=device)
        e = x.element_size()
        qk = (q_heads + kv_heads) * head_dim * num_tokens * e
        # q, k, v read; q, k written; k, v written to the pool
        prologue_bytes = qk * 2 + kv_heads * head_dim * num_tokens * (e + 2 * k_cache.element_size())
        cases = {  # name: (fused, eager, bytes moved)
            "rms_norm": (lambda: fo.rms_norm(x, w, EPS), lambda: fo.rms_norm_ref(x, w, EPS), 2 * x.numel() * e),
            "rms_norm + residual": (lambda: fo.rms_norm(x, w, EPS, res), lambda: fo.rms_norm_ref(x, w, EPS, res),
                                    4 * x.numel() * e),
            "q_norm + k_norm": (lambda: (fo.rms_norm(q, head_w, EPS), fo.rms_norm(k, head_w, EPS)),
                                lambda: (fo.rms_norm_ref(q, head_w, EPS), fo.rms_norm_ref(k, head_w, EPS)), 2 * qk),
            "silu_and_mul": (lambda: fo.silu_and_mul(gate_up), lambda: fo.silu_and_mul_ref(gate_up),
                             gate_up.numel() * e * 3 // 2),
            "rotary (q, k)": (lambda: fo.rotary_embedding(pos, q, k, rope.cos, rope.sin),
                              lambda: fo.rotary_embedding_ref(pos, q, k, rope.cos, rope.sin), 2 * qk),
            "prologue": (lambda: fo.qk_norm_rope_store(*prologue), prologue_chain, prologue_bytes),
            "prologue, fp8 product": (lambda: fo.qk_norm_rope_store(*prologue, product_scales),
                                      scale_pass_then_prologue, prologue_bytes),
            "sample (T=0.6)": (lambda: sample_tokens(logits, temperature, seeds),
                               lambda: sample_eager(logits, temperature), logits.numel() * e),
        }
        for name, (fused, eager, nbytes) in cases.items():
            if name not in args.ops and name.replace(", fp8 product", "-fp8") not in args.ops:
                continue
            fused_us, eager_us = time_us(fused), time_us(eager)
            row = {"op": name, "tokens": num_tokens, "bytes": nbytes, "fused_us": fused_us, "eager_us": eager_us,
                   "fused_gb_per_s": nbytes / fused_us / 1e3, "eager_gb_per_s": nbytes / eager_us / 1e3}
            rows.append(row)
            print(f"{name:<22} {num_tokens:>5} {fused_us:>9.2f} {row['fused_gb_per_s']:>7.0f} {eager_us:>9.2f}"
                  f" {row['eager_gb_per_s']:>7.0f} {eager_us / fused_us:>7.1f}x")
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu (interpreter)"
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"device": name, "model_shape": args.model_shape, "kv_cache_dtype": args.kv_cache_dtype,
                               "ops": rows}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
