"""The verdict kernel (kernels/speculative_verdict.py) against the rule it implements, written out as a loop:
proposals accepted while each row's draw equals the proposal after it, the chunk yielding the draw after them.

The torch reference (the CPU's path) is checked in this process; the Triton kernel runs in the interpreter in a
child process (TRITON_INTERPRET=1 must be set before kernels are decorated), and compiled on a GPU. Inputs are fresh
random steps: ragged proposal counts, chunks without proposals, void chunks (k = 0 with proposals), draws that
match their proposals for a random stretch and then differ (or all match)."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from support.interpreter_child import (INTERPRETING, KERNELS_RUN_HERE, assert_module_passes_under_interpreter,
                                       interpreter, needs_cuda)

from kernels.speculative_verdict import lanes, verdict_reference

if KERNELS_RUN_HERE:
    from kernels.speculative_verdict import verdict


@st.composite
def steps(draw, max_chunks: int = 12, max_k: int = 20):
    """(draws [R], spec, C, max k, expected [2, C]) of a random verifying step."""
    num_chunks = draw(st.integers(1, max_chunks))
    draws, firsts, ks, targets, expected = [], [], [], [], [[], []]
    for _ in range(num_chunks):
        proposal = draw(st.lists(st.integers(0, 50), max_size=draw(st.sampled_from([0, 3, 8, max_k]))))
        void = bool(proposal) and draw(st.booleans()) and draw(st.booleans())  # ~a quarter: verified as k = 0
        k = 0 if void else len(proposal)
        # the rows' draws: equal to the proposals for a stretch, then anything (a new token, or by chance the same)
        agree = draw(st.integers(0, len(proposal)))
        rows = proposal[:agree] + [draw(st.integers(0, 50)) for _ in range(len(proposal) + 1 - agree)]
        firsts.append(len(draws))
        ks.append(k)
        targets += proposal + [-1]
        n = 0
        while n < k and rows[n] == proposal[n]:  # the rule, as a loop
            n += 1
        expected[0].append(rows[n])
        expected[1].append(n)
        draws += rows
    spec = torch.tensor(firsts + ks + targets, dtype=torch.int64)
    return torch.tensor(draws, dtype=torch.int64), spec, num_chunks, max(ks), torch.tensor(expected)


@settings(max_examples=300, deadline=None)
@given(steps())
def test_the_torch_reference_accepts_while_the_draws_equal_the_proposals(step):
    draws, spec, num_chunks, max_k, expected = step
    assert torch.equal(verdict_reference(draws, spec, num_chunks, max_k), expected)


def test_every_k_up_to_sixteen_shares_one_kernel_variant():
    assert {lanes(k) for k in range(0, 17)} == {16}
    assert lanes(17) == lanes(32) == 32 and lanes(33) == 64


# CPU: the interpreter

@pytest.mark.skipif(INTERPRETING, reason="this is the child process")
def test_verdict_kernel_passes_under_the_interpreter():
    assert_module_passes_under_interpreter(__file__, "test_verdict_kernel_passes_under_the_interpreter", timeout=600)


@interpreter
@settings(max_examples=60, deadline=None)
@given(steps())
def test_the_kernel_equals_the_rule_under_the_interpreter(step):
    draws, spec, num_chunks, max_k, expected = step
    assert torch.equal(verdict(draws, spec, num_chunks, max_k), expected)


# GPU: compiled

@needs_cuda
@pytest.mark.gpu
@settings(max_examples=200, deadline=None)
@given(steps(max_chunks=128, max_k=40))
def test_the_compiled_kernel_equals_the_rule(step):
    draws, spec, num_chunks, max_k, expected = step
    out = verdict(draws.cuda(), spec.cuda(), num_chunks, max_k)
    assert torch.equal(out.cpu(), expected)
