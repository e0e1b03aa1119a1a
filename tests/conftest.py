"""Fixtures shared by the test modules."""
import os

import pytest

from scheduler_svc.common.model_paths import default_model_dir


@pytest.fixture(scope="session")
def embedded_model() -> str:
    """The embedded SmolLM2 checkpoint that `make model` fetches (make test depends on it)."""
    path = default_model_dir()
    if not os.path.exists(os.path.join(path, "config.json")):
        pytest.fail(f"embedded model missing at {path}: run `make model`")
    return path


@pytest.fixture(scope="session")
def gpu_qwen3_dir(tmp_path_factory) -> str:
    """The random Qwen3 checkpoint of the CUDA engine tests (support/gpu_engine.py), made once per pytest session."""
    from support.gpu_engine import make_gpu_qwen3

    return make_gpu_qwen3(str(tmp_path_factory.mktemp("qwen3_gpu")))


@pytest.fixture(scope="session")
def gpu_prompts() -> list[list[int]]:
    from support.gpu_engine import gpu_prompts

    return gpu_prompts()
