"""A verifying step's verdict from one draw per logits row, in one kernel (speculative decoding, DESIGN.md 14).

Chunk c's logits rows start at first[c]; its k[c] proposals are the inputs of its rows 1..k, so the draw x_j of its
row j is compared with the proposal after it, target[first[c] + j]. Proposals are accepted while the draws equal them,
and the chunk yields the draw after the accepted ones. In torch that is a gather, a compare, a cumulative product, a
sum, another gather and a stack: six launches, and their host work, on every verifying step, whose draws a decode
graph made in one replay. Here it is one launch over `spec`, which packs first [C], k [C] and target [R] (int64, -1
after each chunk's last proposal) so that the host uploads it in one copy. Nothing syncs with the host.
"""
from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU image has no Triton: its executors take the torch reference
    triton = None

# Lanes a program compares: every K up to this shares one compiled kernel (a new K would compile mid-serving)
MIN_LANES = 16


def lanes(max_k: int) -> int:
    """The power of two of lanes that holds max_k proposals (at least MIN_LANES)."""
    return max(MIN_LANES, 1 << max(0, max_k - 1).bit_length())


def verdict_reference(draws: torch.Tensor, spec: torch.Tensor, num_chunks: int, max_k: int) -> torch.Tensor:
    """int64 [2, C]: each chunk's token and accepted count, in torch (the CPU's path, and the kernel's reference)."""
    c = num_chunks
    first, k, target = spec[:c], spec[c:2 * c], spec[2 * c:]
    j = torch.arange(max(1, max_k), device=draws.device)
    rows = (first[:, None] + j[None, :]).clamp(max=draws.numel() - 1)
    accepted = (j[None, :] < k[:, None]) & (draws[rows] == target[rows])
    n = accepted.to(torch.int64).cumprod(dim=1).sum(dim=1)
    return torch.stack([draws[first + n], n])


if triton is not None:
    from kernels.triton_runtime import INTERPRET

    @triton.jit(do_not_specialize=["num_chunks"])  # one variant for every batch
    def _verdict_kernel(draws_ptr, spec_ptr, out_ptr, num_chunks, LANES: tl.constexpr):
        c = tl.program_id(0)
        first = tl.load(spec_ptr + c)
        k = tl.load(spec_ptr + num_chunks + c)
        j = tl.arange(0, LANES)
        valid = j < k
        drawn = tl.load(draws_ptr + first + j, mask=valid, other=0)
        proposed = tl.load(spec_ptr + 2 * num_chunks + first + j, mask=valid, other=-1)
        # the first lane that is not an accepted proposal: the count accepted (lanes past k never are)
        stop = tl.where(valid & (drawn == proposed), LANES, j)
        n = tl.minimum(tl.min(stop, axis=0).to(tl.int64), k)
        tl.store(out_ptr + c, tl.load(draws_ptr + first + n))
        tl.store(out_ptr + num_chunks + c, n)
else:
    INTERPRET = False


def verdict(draws: torch.Tensor, spec: torch.Tensor, num_chunks: int, max_k: int) -> torch.Tensor:
    """int64 [2, C]: each chunk's token (the draw after its accepted proposals) and its accepted count. draws: int64
    [R], one per logits row; spec: first [C] | k [C] | target [R], int64 on the draws' device; max_k: max(k)."""
    if not (draws.is_cuda or INTERPRET):
        return verdict_reference(draws, spec, num_chunks, max_k)
    out = torch.empty(2, num_chunks, dtype=torch.int64, device=draws.device)
    _verdict_kernel[(num_chunks,)](draws, spec, out, num_chunks, LANES=lanes(max_k))
    return out
