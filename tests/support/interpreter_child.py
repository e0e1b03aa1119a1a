"""Run a Triton test module again in a child process with TRITON_INTERPRET=1.

The variable must be set before the kernels are decorated, so the parent pytest process (which may
already have imported triton for another module) never runs them itself."""
import os
import subprocess
import sys

import pytest
import torch

INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"  # this process is the child
HAS_CUDA = torch.cuda.is_available()
# kernels are imported only where they run: compiled-mode kernels would stick in sys.modules otherwise
KERNELS_RUN_HERE = INTERPRETING or HAS_CUDA
interpreter = pytest.mark.skipif(not INTERPRETING, reason="runs in the TRITON_INTERPRET=1 child process")
needs_cuda = pytest.mark.skipif(not HAS_CUDA or INTERPRETING, reason="needs CUDA and compiled kernels")

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def assert_module_passes_under_interpreter(module_file: str, own_test: str, timeout: int = 900) -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    child = subprocess.run(
        [sys.executable, "-m", "pytest", module_file, "-q", "-m", "not gpu", "-p", "no:cacheprovider",
         "-k", f"not {own_test}"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout,
    )
    assert child.returncode == 0, child.stdout[-8000:] + child.stderr[-4000:]
    summary = child.stdout.strip().splitlines()[-1]
    assert " passed" in summary and "skipped" not in summary, child.stdout[-2000:]
