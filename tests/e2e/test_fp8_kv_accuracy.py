"""Greedy SmolLM2 with a quantized KV cache against the same engine with an fp32 one, on the CPU: short
versions of bench/kv_fp8_accuracy.py (fp8: 8 chat prompts x 16 tokens; int8: 16 x 32; the default
scales), held to issue 13's targets: mean per-token KL <= 0.01 nats and top-1 agreement >= 98%.

int8 (a scale per KV head and channel) meets both: 98.4% top-1 on its 512 tokens, 98.57% and mean KL
0.0013 at the issue's 64 x 128 (bench/RESULTS.md, 2026-12-02, 95ef68d).

Top-1 falls short: 95-97% on every run so far (bench/RESULTS.md; 96.7% at 64 prompts x 128 tokens), the
misses at positions where the reference's two best tokens are a median 0.09 nats apart (close, but not
near-ties by the project's 0.02-nat rule). The error is e4m3's 3-bit mantissa on K (fp8 V
alone keeps KL under 0.001), which no choice of scale changes; a Hadamard rotation of K and q
(--kv-cache-rotation hadamard) cuts KL by ~30% but reaches only ~96%. The test says so until fixed.
"""
from __future__ import annotations

import pytest

from bench.kv_fp8_accuracy import MEAN_KL_TARGET, TOP1_TARGET, measure
from scheduler_svc.common.config import EngineConfig

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def default_scales_row(embedded_model) -> dict:
    return default_row(embedded_model, "fp8", num_prompts=8, new_tokens=16)


@pytest.fixture(scope="module")
def int8_row(embedded_model) -> dict:
    return default_row(embedded_model, "int8", num_prompts=16, new_tokens=32)


def default_row(model: str, kv_cache_dtype: str, num_prompts: int, new_tokens: int) -> dict:
    method = EngineConfig.__dataclass_fields__["kv_cache_scales"].default
    result = measure(model, "cpu", num_prompts=num_prompts, new_tokens=new_tokens, methods=[method], batch=8,
                     exact_match_len=False, kv_dtypes=(kv_cache_dtype,))
    (row,) = result["rows"]
    assert row["num_tokens"] == num_prompts * new_tokens and result["reference_kv_dtype"] == "float32"
    assert row["kv_cache_dtype"] == kv_cache_dtype
    return row


def test_fp8_kv_cache_keeps_the_mean_kl_to_the_fp32_cache_within_the_target(default_scales_row):
    assert default_scales_row["mean_kl"] <= MEAN_KL_TARGET, default_scales_row


@pytest.mark.xfail(strict=True, raises=AssertionError,
                   reason="e4m3 K on SmolLM2-135M: 95-97% top-1 measured, near-ties (issue 13 target 98%)")
def test_fp8_kv_cache_keeps_top1_agreement_with_the_fp32_cache_within_the_target(default_scales_row):
    assert default_scales_row["top1"] >= TOP1_TARGET, default_scales_row


def test_int8_kv_cache_meets_both_targets(int8_row):
    assert int8_row["mean_kl"] <= MEAN_KL_TARGET and int8_row["top1"] >= TOP1_TARGET, int8_row


def test_a_flip_counts_as_a_near_tie_only_within_002_nats_and_each_others_top5_under_both():
    import torch

    from bench.kv_fp8_accuracy import near_ties

    def logprobs(*rows):  # each row: the scores of a 6-token vocabulary
        return torch.log_softmax(torch.tensor(rows, dtype=torch.float64), -1)[None]

    ref = logprobs([5.0, 4.99, 0, 0, 0, 0], [5.0, 4.99, 0, 0, 0, 0], [5.0, 4.9, 0, 0, 0, 0], [5.0, 4.99, 0, 0, 0, 0])
    test = logprobs([4.99, 5.0, 0, 0, 0, 0], [5.0, 4.99, 0, 0, 0, 0], [4.99, 5.0, 0, 0, 0, 0], [4.0, 5.0, 0, 0, 0, 0])
    # a tie flipped both ways; no flip; 0.1 nats apart under ref; 1 nat apart under test
    assert near_ties(ref, test).tolist() == [True, False, False, False]
