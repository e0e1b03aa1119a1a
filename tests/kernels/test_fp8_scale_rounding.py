"""FP8 scales by IEEE division (kernels/attention/triton_kv_store.fp8_scale, kernels/fp8_quant.group_scales): where a
group's amax / 448 is exact, many x / scale are exact ties between FP8 values, and a scale an ulp off (Triton's `/`,
div.full.f32; CUDA torch's division by a Python scalar, a multiply by the reciprocal) rounds them all one way. The
kernels compile to div.rn (checked here for sm_90, on any host), and on a GPU they quantize as the CPU's reference."""
from __future__ import annotations

import pytest
import torch
from support.interpreter_child import needs_cuda

pytest.importorskip("triton")

from kernels.fp8_quant import quantize_rows_ref  # noqa: E402


def exact_quotient_groups(rows: int, groups: int, seed: int) -> torch.Tensor:
    """bf16 activations [rows, groups * 128] whose every group's largest magnitude has a mantissa that is a multiple
    of 7 (3.5, 2.625, 3.0625), so that amax / 448 is exact and many x / scale are exact ties between FP8 values."""
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, groups, 128, generator=gen) * 0.8).clamp(-2.5, 2.5)
    amax = torch.tensor([3.5, 2.625, 3.0625])[torch.randint(0, 3, (rows, groups), generator=gen)]
    x[:, :, 0] = amax * torch.where(torch.rand(rows, groups, generator=gen) < 0.5, -1.0, 1.0)
    return x.view(rows, groups * 128).bfloat16()


def test_exact_quotient_groups_quantize_differently_with_a_scale_an_ulp_off():
    """The premise of the test below: on these inputs an ulp in the scale changes the bytes (a scale computed by a
    reciprocal multiply would show)."""
    x = exact_quotient_groups(8, 4, seed=1).float()
    q, scale = quantize_rows_ref(x, 128)
    off = torch.nextafter(scale, torch.full_like(scale, 1.0)).repeat_interleave(128, 1)
    assert not torch.equal((x / off).clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8), q.view(torch.uint8))


@pytest.mark.parametrize("kernel", ["fp8_gemm._quantize_rows_kernel", "fp8_fused_quant._quantize_by_chunk_maxes_kernel"])
def test_the_activation_scales_compile_to_ieee_division_for_sm90(kernel):
    """The quantization kernels' scale is amax / 448 correctly rounded (div.rn), not Triton's `/` (div.full.f32), so
    that a GPU quantizes as the CPU's reference does where the quotient is exact: compiled for sm_90 on this host.
    These two divide nothing else (the norm's and SiLU's own divisions are not quantization steps)."""
    import importlib

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler.compiler import ASTSource

    module, name = kernel.split(".")
    fn = getattr(importlib.import_module(f"kernels.{module}"), name)
    pointers = {"x_ptr": "*bf16", "h_ptr": "*bf16", "q_ptr": "*fp8e4nv", "scale_ptr": "*fp32", "amax_ptr": "*fp32"}
    constexprs = {"BLOCK": 128} if "rows" in name else {"CHUNK": 1024, "CHUNKS": 16}
    sig = {arg: "constexpr" if arg in constexprs else pointers.get(arg, "fp32" if arg == "max_scale" else "i32")
           for arg in fn.arg_names}
    ptx = triton.compile(ASTSource(fn, sig, constexprs=constexprs), target=GPUTarget("cuda", 90, 32),
                         options={"num_warps": 1}).asm["ptx"]
    assert "div.full" not in ptx and "div.rn.f32" in ptx


@needs_cuda
@pytest.mark.gpu
def test_gpu_activation_quantization_equals_the_cpu_reference_where_amax_over_448_is_exact():
    from kernels import fp8_gemm

    x = exact_quotient_groups(64, 8, seed=2)
    q, scale = fp8_gemm.quantize_rows(x.cuda(), 128)
    q_ref, scale_ref = quantize_rows_ref(x, 128)  # on the CPU: IEEE division
    assert torch.equal(scale.cpu(), scale_ref)
    assert torch.equal(q.cpu().view(torch.uint8), q_ref.view(torch.uint8))
