"""Packed uploads: a step's arrays of mixed dtypes and shapes arrive on the device unchanged."""
import numpy as np
import pytest
import torch

from executor_svc.pinned_staging import PinnedStaging

CUDA = pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")])


def step_arrays(rng: np.random.Generator, n: int) -> dict[str, np.ndarray]:
    return {
        "ids": rng.integers(-2**40, 2**40, size=n),
        "greedy": rng.random(n) < 0.5,
        "temperature": rng.random(n).astype(np.float32),
        "block_tables": rng.integers(0, 1000, size=(n, 3)).astype(np.int32),
        "empty": np.zeros(0, dtype=np.int64),
        "odd": rng.integers(0, 7, size=n + 3).astype(np.int32),  # an unaligned size before the next
    }


@pytest.mark.parametrize("device", ["cpu", CUDA])
def test_packed_arrays_round_trip_with_their_dtypes_and_shapes(device):
    rng = np.random.default_rng()
    staging = PinnedStaging(torch.device(device))
    for n in (5, 300, 2):  # grows its buffer, then reuses it
        staging.next_step()
        arrays = step_arrays(rng, n)
        out = staging.upload(arrays)
        for name, a in arrays.items():
            t = out[name]
            assert t.device.type == device and t.shape == a.shape
            assert np.array_equal(t.cpu().numpy(), a), name


@pytest.mark.parametrize("device", [CUDA])
def test_the_previous_steps_upload_is_not_overwritten_by_the_next(device):
    staging = PinnedStaging(torch.device(device))
    first = staging.upload({"x": np.arange(64)})
    staging.next_step()
    staging.upload({"x": np.arange(64) * 0})
    assert torch.equal(first["x"].cpu(), torch.arange(64))
