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
