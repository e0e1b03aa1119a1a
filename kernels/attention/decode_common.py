"""What both decode kernels (the Triton one in triton_backend.py, the Gluon one in gluon_decode.py) share:
base-2 softmax, the int8 -> fp16 conversion, and flash-decoding's split partials (their workspace, and the kernel
that merges them into the output).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634  # softmax runs in base 2: exp(x) = exp2(x * log2(e))


# int8 x as fp16, exactly, four values per 32-bit register: x ^ 0x80 is x + 128 as a byte, which PRMT places
# under 0x64, fp16 1024 + (x + 128), and a packed fp16 subtract of 1152 leaves x. One LOP3, two PRMT and two
# HSUB2 per four values, where Triton's own conversion extracts and converts each byte. (Inputs: one register
# of four int8; outputs: two of fp16 pairs; inline_asm_elementwise(..., "=r,=r,r", pack=4).)
INT8_TO_FP16_PTX = tl.constexpr("""{
    .reg .b32 t, c;
    xor.b32 t, $2, 0x80808080;
    prmt.b32 $0, t, 0x64646464, 0x4140;
    prmt.b32 $1, t, 0x64646464, 0x4342;
    mov.b32 c, 0x64806480;
    sub.f16x2 $0, $0, c;
    sub.f16x2 $1, $1, c;
    }""")


@triton.jit(do_not_specialize=["num_splits"])
def _merge_splits_kernel(
    part_acc_ptr, part_m_ptr, part_l_ptr, o_ptr, stride_ot, stride_oh, num_splits,
    NUM_Q_HEADS: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr,
):
    """Merge the splits' partial softmaxes: rescale each to the global max, then normalise."""
    head = tl.program_id(0)
    seq = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_mask = offs_s < num_splits
    part = (seq * NUM_Q_HEADS + head) * num_splits + offs_s
    m = tl.load(part_m_ptr + part, mask=s_mask, other=float("-inf"))
    l = tl.load(part_l_ptr + part, mask=s_mask, other=0.0)
    acc = tl.load(part_acc_ptr + part[:, None] * D + offs_d[None, :],
                  mask=s_mask[:, None] & (offs_d < D)[None, :], other=0.0)
    m_max = tl.max(m, 0)
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)  # every split empty: keep exp2 finite
    w = tl.math.exp2(m - m_max)
    l_sum = tl.sum(w * l, 0)
    out = tl.sum(w[:, None] * acc, 0) / tl.where(l_sum > 0, l_sum, 1.0)
    tl.store(o_ptr + seq.to(tl.int64) * stride_ot + head * stride_oh + offs_d, out.to(o_ptr.dtype.element_ty),
             mask=offs_d < D)


def split_partials(out: torch.Tensor, num_splits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The splits' unnormalised partials for out [B, H_q, D] in one allocation: acc [B, H_q, splits, D], then
    max and sum [B, H_q, splits]. One split writes out directly: then the three are out, pointers the decode
    kernels never touch when SPLIT is False."""
    if num_splits == 1:
        return out, out, out
    num_seqs, num_q_heads, head_dim = out.shape
    n = num_seqs * num_q_heads * num_splits
    workspace = torch.empty(n * (head_dim + 2), dtype=torch.float32, device=out.device)
    part_acc, part_m, part_l = workspace.split([n * head_dim, n, n])
    return part_acc, part_m, part_l


def merge_splits(partials: tuple[torch.Tensor, torch.Tensor, torch.Tensor], out: torch.Tensor, num_splits: int,
                 block_d: int) -> None:
    """out [B, H_q, D] from the partials that split_partials allocated and a decode kernel wrote."""
    num_seqs, num_q_heads, head_dim = out.shape
    part_acc, part_m, part_l = partials
    _merge_splits_kernel[(num_q_heads, num_seqs)](
        part_acc, part_m, part_l, out, out.stride(0), out.stride(1), num_splits,
        NUM_Q_HEADS=num_q_heads, D=head_dim, BLOCK_D=block_d, BLOCK_S=triton.next_power_of_2(num_splits),
        num_warps=4,
    )
