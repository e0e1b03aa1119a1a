"""--quantization fp8 on the embedded SmolLM2 on the CPU, against the same engine with fp32 weights: a short
version of bench/fp8_weights_accuracy.py (8 chat prompts x 16 tokens, teacher-forced). It cannot be exact;
the floors sit under what the bench measures at this size (FLOOR_SOURCE), so a regression in the FP8
loading (a wrong scale, a wrong shard, a layer left out or quantized twice) fails it.

On the CPU the weights are dequantized at load and activations stay fp32: this is the weight error alone.
SmolLM2-135M misses issue 30's targets (top-1 >= 97%, mean KL <= 0.02) with e4m3 weights; bench/RESULTS.md
shows why (the FP8 weights section)."""
from __future__ import annotations

import pytest

from bench.fp8_weights_accuracy import measure

pytestmark = pytest.mark.slow

# bench/fp8_weights_accuracy.py --device cpu --num-prompts 8 --new-tokens 16 --batch 8 --variants "fp8 weights"
# measured 2026-12-03 on 2 CPU cores: top-1 117 / 128 (91.41%), mean KL 0.0194 (p99 0.151)
FLOOR_SOURCE = {"top1": 117 / 128, "mean_kl": 0.0194}
TOP1_FLOOR, MEAN_KL_CEILING = 114 / 128, 0.025  # three more misses, 30% more KL (another CPU's BLAS rounds otherwise)


def test_fp8_weights_keep_top1_and_kl_against_fp32_weights_within_the_measured_floor(embedded_model):
    result = measure(embedded_model, "cpu", num_prompts=8, new_tokens=16, batch=8, variants=["fp8 weights"],
                     exact_match_len=False)
    (row,) = result["rows"]
    assert row["weight_format"] == "fp8_e4m3fn, per-channel scales, quantized at load"
    assert row["num_tokens"] == 8 * 16
    assert row["top1"] >= TOP1_FLOOR and row["mean_kl"] <= MEAN_KL_CEILING, row
    assert row["mean_kl"] > 0  # the weights did change
