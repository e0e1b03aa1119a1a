"""Launch configurations of the Triton attention kernels (kernels/attention/triton_backend.py): tile
sizes per dtype and head size, and the flash-decoding split count. The figures come from
bench/kernels.py sweeps on the H200.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton

from kernels.attention.triton_kv_store import KV_FP8, KV_INT8, KV_PLAIN
from kernels.triton_runtime import INTERPRET

MAX_SPLITS = 32


@dataclass(frozen=True)
class PrefillConfig:
    block_m: int  # query rows per program
    block_n: int  # context tokens per loop step
    num_warps: int
    num_stages: int


@dataclass(frozen=True)
class DecodeConfig:
    block_n: int  # context tokens per loop step; several KV blocks when block_size is small
    num_warps: int
    num_stages: int


def prefill_config(block_d: int, dtype: torch.dtype = torch.bfloat16) -> PrefillConfig:
    if INTERPRET:
        return PrefillConfig(16, 16, 4, 1)  # smallest tiles tl.dot allows on a GPU
    if dtype == torch.float32:
        return PrefillConfig(64, 32, 8, 2)  # exact fp32 dots run on CUDA cores: keep tiles small
    if block_d <= 128:
        # bench/kernels.py --prefill-sweep (H200, D=128): 204 TFLOP/s on the workload's ragged
        # 16k-token batch against 163 for (128, 64, 8, 3); 187 against 164 on 4 x 1024
        return PrefillConfig(64, 32, 4, 3)
    return PrefillConfig(64, 32, 8, 2)  # padded D=256: smaller tiles fit shared memory and registers


def decode_config(block_d: int, dtype: torch.dtype = torch.bfloat16, kv_format: int = KV_PLAIN) -> DecodeConfig:
    if INTERPRET:
        return DecodeConfig(16, 4, 1)
    if dtype == torch.float32:
        return DecodeConfig(32, 8, 3)
    if kv_format == KV_FP8 and block_d <= 128:
        # 128 fp8 tokens (the bytes of 64 bf16 ones) per step, 2 stages, V converted in registers
        # (H200, D=128, fp16 dots): 149 registers and 72 KB shared, 3 programs an SM. bench/kernels.py
        # --ragged: as fast as (64, 4, 2) at the throughput run's B=256 and faster at B=153 and 59
        # (2.67 vs 2.45, 2.39 vs 2.17 TB/s); only equal contexts at B=64, one wave at 4 an SM, favour 64.
        return DecodeConfig(128, 4, 2)
    if kv_format == KV_INT8 and block_d <= 128:
        # int8's conversion (four values per PTX sequence) keeps more registers live than fp8's: 64 tokens,
        # 126 registers, 4 programs an SM. bench/kernels.py --ragged --kv-cache-dtype int8 (H200): 2.66 /
        # 2.47 / 2.20 TB/s at B=256 / 153 / 59 against 2.17 / 2.27 / 2.21 at (128, 4, 2)
        return DecodeConfig(64, 4, 2)
    if block_d <= 128:
        # 64 tokens x D=128 x (K+V) bf16 = 32 KB per step, ~4 CTAs per SM (128 registers, 39 KB
        # shared). 3 stages let the pipeliner fetch the next step's block ids ahead of its K/V.
        return DecodeConfig(64, 4, 3)
    return DecodeConfig(32, 4, 3)


def decode_num_splits(num_seqs: int, num_kv_heads: int, max_seqlen_k: int, sm_count: int, block_n: int) -> int:
    """Flash-decoding split count: split the context only when (seq, kv head) programs are too few.

    With the programs visiting sequences longest first (decode_order), two per SM already keep the
    device busy to the end: on the H200's ragged throughput batches (bench/kernels.py --ragged) one
    split beat two at B = 59, 153 and 256. Below that, splits aim at ~4 programs per SM; each keeps
    at least 2 tiles so the partial results stay small next to the K/V it read.
    """
    programs = num_seqs * num_kv_heads
    if programs >= 2 * sm_count:
        return 1
    tiles = triton.cdiv(max(max_seqlen_k, 1), block_n)
    return max(1, min(triton.cdiv(4 * sm_count, programs), tiles // 2, MAX_SPLITS))
