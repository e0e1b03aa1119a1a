"""The FP8 GEMM table of bench/kernels.py --fp8-gemm: each Linear GEMM of the Qwen3-8B shape at M = 1, 16,
64, 256 and 4,096 tokens, bf16 (F.linear) against the FP8 GEMMs of kernels/fp8_gemm.py: torch._scaled_mm
and Triton with channel scales, Triton with 128 x 128 block scales (1 x 128 activation groups), each
timed on pre-quantized activations (the GEMM alone), and the engine's whole FP8 product (activation
quantization + the GEMM kernels/fp8_gemm_dispatch.py picks). TFLOP/s count 2MNK; TB/s count the operands
read and the output written once (x, W, y, and the scales).

It ends with the dispatch table the measurement implies (the faster channel GEMM per shape and M), in the
form of kernels/fp8_gemm_dispatch.TABLE.
"""
from __future__ import annotations

# (name, N, K) of Qwen3-8B: hidden 4096, 32 q and 8 KV heads of 128, intermediate 12288
QWEN3_8B_GEMMS = [("qkv_proj", 6144, 4096), ("o_proj", 4096, 4096), ("gate_up_proj", 24576, 4096),
                  ("down_proj", 4096, 12288)]
TOKENS = [1, 16, 64, 256, 4096]


def fp8_gemm_rows(time_us, device) -> list[dict]:
    import torch
    import torch.nn.functional as F

    from kernels import fp8_gemm
    from kernels.fp8_gemm_dispatch import choose_backend
    from kernels.fp8_quant import quantize_rows_ref

    gen = torch.Generator(device=device).manual_seed(0)
    rows = []
    for name, n, k in QWEN3_8B_GEMMS:
        w = torch.randn(n, k, generator=gen, device=device, dtype=torch.bfloat16) / k**0.5
        w_ch, s_ch = quantize_rows_ref(w, k)
        w_bl, s_bl = quantize_rows_ref(w, 128)  # a scale per row and 128 columns: the loader's block layout
        for m in TOKENS:
            x = torch.randn(m, k, generator=gen, device=device, dtype=torch.bfloat16)
            a_ch, as_ch = fp8_gemm.quantize_rows(x, k)
            a_bl, as_bl = fp8_gemm.quantize_rows(x, 128)
            us = {
                "bf16": time_us(lambda: F.linear(x, w)),
                "scaled_mm": time_us(lambda: fp8_gemm.scaled_mm_fp8_gemm(a_ch, as_ch, w_ch, s_ch, torch.bfloat16)),
                "triton_channel": time_us(lambda: fp8_gemm.triton_fp8_gemm(a_ch, as_ch, w_ch, s_ch, k, torch.bfloat16)),
                "triton_block": time_us(lambda: fp8_gemm.triton_fp8_gemm(a_bl, as_bl, w_bl, s_bl, 128, torch.bfloat16)),
                "act_quant": time_us(lambda: fp8_gemm.quantize_rows(x, k)),
                "engine_channel": time_us(lambda: fp8_gemm.fp8_linear(x, w_ch, s_ch, k)),
                "engine_block": time_us(lambda: fp8_gemm.fp8_linear(x, w_bl, s_bl, 128)),
            }
            flops = 2 * m * n * k
            bf16_bytes = 2 * (m * k + n * k + m * n)
            fp8_bytes = m * k + n * k + 2 * m * n + 4 * (m + n)
            row = {"gemm": name, "m": m, "n": n, "k": k, "us": us,
                   "tflops": {key: flops / t / 1e6 for key, t in us.items() if key != "act_quant"},
                   "tb_per_s": {key: (bf16_bytes if key == "bf16" else fp8_bytes) / t / 1e6
                                for key, t in us.items() if key != "act_quant"},
                   "channel_backend": choose_backend("channel", m, n, k)}
            rows.append(row)
    return rows


def print_fp8_gemm_table(rows: list[dict]) -> None:
    print("\nFP8 GEMMs of the Qwen3-8B shape: us (TFLOP/s | TB/s); speedup = bf16 / engine FP8 product")
    keys = ["bf16", "scaled_mm", "triton_channel", "triton_block", "engine_channel", "engine_block"]
    print(f"{'gemm':>12} {'M':>5} " + " ".join(f"{k:>24}" for k in keys) + f" {'quant us':>8} {'x ch':>5} {'x bl':>5}")
    for r in rows:
        cells = " ".join(f"{r['us'][k]:>7.1f} ({r['tflops'][k]:>5.0f}|{r['tb_per_s'][k]:>4.2f})".rjust(24) for k in keys)
        print(f"{r['gemm']:>12} {r['m']:>5} {cells} {r['us']['act_quant']:>8.1f} "
              f"{r['us']['bf16'] / r['us']['engine_channel']:>5.2f} {r['us']['bf16'] / r['us']['engine_block']:>5.2f}")
    print("\nthe faster channel GEMM per shape (kernels/fp8_gemm_dispatch.TABLE):")
    table: dict = {}
    for r in rows:
        best = "scaled_mm" if r["us"]["scaled_mm"] <= r["us"]["triton_channel"] else "triton"
        table.setdefault((r["n"], r["k"]), []).append((r["m"], best))
    for shape, entries in table.items():
        print(f"    {shape}: {entries},")
