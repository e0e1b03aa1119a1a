"""The Gluon decode kernel over 8-bit pools (kernels/attention/gluon_decode.py, the engine's decode wherever it
fits) matches float64 attention over the dequantized pool as closely as the Triton decode kernel does.

On the CPU Gluon cannot run, so its calls are mapped onto triton.language with the layouts dropped
(bench/studies/fp8_decode_gluon.load_kernel_module) and the kernel runs in Triton's interpreter, in a child process: a
check of its index logic (the channel renumbering, the head slice, the masks, the scales, the split partials).
On a GPU the compiled kernel, layouts and all, meets the same bound.
"""
from __future__ import annotations

import pytest
from support.interpreter_child import (INTERPRETING, assert_module_passes_under_interpreter, interpreter,
                                       needs_cuda)

pytest.importorskip("triton")

from bench.studies.fp8_decode_gluon import CHECK_CASES, check_case, close_to_triton, load_kernel_module  # noqa: E402


def test_the_gluon_kernel_is_checked_under_the_interpreter():
    if INTERPRETING:
        pytest.skip("this is the child")
    assert_module_passes_under_interpreter(__file__, "test_the_gluon_kernel_is_checked_under_the_interpreter")


@interpreter
@pytest.mark.parametrize("case", [CHECK_CASES[0], CHECK_CASES[1], CHECK_CASES[5]],
                         ids=["fp8-group2-3-splits", "fp8-group3-longest-first", "int8-empty-context"])
def test_gluon_decode_logic_matches_float64_as_the_engine_kernel_does(case):
    gk = load_kernel_module(interpreted=True)
    for row in check_case(gk, *case, seed=7):
        assert close_to_triton(row), row


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("case", CHECK_CASES, ids=[f"{c[4]}-{c[0][0]}-{c[0][1]}-{len(c[1])}seqs" for c in CHECK_CASES])
def test_the_compiled_gluon_decode_kernel_matches_float64_on_a_gpu(case):
    gk = load_kernel_module(interpreted=False)
    for row in check_case(gk, *case, seed=11, device="cuda"):
        assert close_to_triton(row), row
