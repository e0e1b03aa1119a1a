"""Which attention backend a flag picks, and the errors for the ones that cannot run here."""
import importlib.util

import pytest
import torch

from kernels.attention.base import get_backend
from kernels.attention.flash_backend import supports_block_size


def test_auto_on_the_cpu_is_the_torch_reference():
    assert get_backend("auto", torch.device("cpu")).name == "torch"


def test_an_unknown_backend_name_is_refused_with_the_choices():
    with pytest.raises(ValueError, match="choose from"):
        get_backend("cudnn", torch.device("cpu"))


def test_flash_attn_paged_cache_needs_blocks_of_256_tokens():
    assert supports_block_size(256) and supports_block_size(512)
    assert not supports_block_size(16)


@pytest.mark.skipif(importlib.util.find_spec("flash_attn") is not None, reason="flash_attn is installed")
def test_asking_for_flash_attn_without_it_installed_fails_at_startup():
    with pytest.raises(ImportError):
        get_backend("flash_attn", torch.device("cpu"))
