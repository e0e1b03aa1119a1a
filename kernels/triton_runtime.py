"""What every Triton kernel module here shares: whether kernels run in the CPU interpreter, the
interpreter fix they need, and the device's SM count for sizing grids.

TRITON_INTERPRET=1 must be set before this module (and the kernels) are imported.
"""
from __future__ import annotations

import functools

import torch
import triton

# Read once: kernels are decorated as interpreted or compiled at import time.
INTERPRET = bool(triton.knobs.runtime.interpret)


def _patch_interpreter_for_numpy_2_4() -> None:
    """Let loop bounds loaded from memory work in Triton 3.6's interpreter under NumPy >= 2.4.

    The interpreter holds scalars as shape-(1,) arrays and calls int() on them for range(), which
    NumPy 2.4 rejects (triton-lang/triton#9171, fixed upstream after 3.6). Same fix, applied here.
    """
    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor
    if getattr(original, "nanoserve_fixed", False):
        return

    def patch_lang_tensor(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patch_lang_tensor.nanoserve_fixed = True
    interpreter._patch_lang_tensor = patch_lang_tensor


if INTERPRET:
    _patch_interpreter_for_numpy_2_4()


@functools.lru_cache(maxsize=None)
def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device; in the interpreter a small number, so that grids
    sized by it still take their split and multi-chunk paths."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 8
