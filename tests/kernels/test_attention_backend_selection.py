"""Which attention backend a flag picks, what each backend declares it can do (the model runner and
the attention layer ask these, never a name), and the errors for the ones that cannot run here."""
import importlib.util
import subprocess
import sys

import pytest
import torch
from torch.overrides import TorchFunctionMode

from kernels.attention.base import AttentionMetadata
from kernels.attention.names import ATTENTION_BACKEND_CHOICES, AUTO, FLASH_ATTN, TORCH, TRITON
from kernels.attention.registry import auto_backend_name, backend_class, get_backend

needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")


def test_auto_on_the_cpu_is_the_torch_reference():
    assert get_backend(AUTO, torch.device("cpu")).name == TORCH


def test_an_unknown_backend_name_is_refused_with_the_choices():
    with pytest.raises(ValueError, match="choose from"):
        get_backend("cudnn", torch.device("cpu"))


def test_every_flag_choice_but_auto_names_a_backend_class_that_carries_that_name():
    names = [n for n in ATTENTION_BACKEND_CHOICES if n != AUTO]
    assert sorted(names) == sorted([TORCH, TRITON, FLASH_ATTN])
    if importlib.util.find_spec("triton") is None:
        names.remove(TRITON)
    for name in names:
        assert backend_class(name).name == name


def test_the_engine_flags_offer_exactly_the_backend_choices_without_importing_torch():
    probe = ("import sys; from scheduler_svc.common.config import ATTENTION_BACKEND_CHOICES as c; "
             "assert 'torch' not in sys.modules, 'torch imported'; print(','.join(c))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert tuple(out.stdout.strip().split(",")) == ATTENTION_BACKEND_CHOICES


class HostReads(TorchFunctionMode):
    """Records the tensor calls that bring a device value to the host: a sync no CUDA graph captures."""

    SYNCING = {"__bool__", "__int__", "__float__", "item", "tolist", "cpu", "numpy"}

    def __init__(self):
        super().__init__()
        self.seen: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in self.SYNCING:
            self.seen.append(func.__name__)
        return func(*args, **(kwargs or {}))


def one_decode_step(device: str = "cpu", block_size: int = 4):
    """Two one-token sequences over a pool of 4 blocks: q, key, value, k_cache, v_cache, meta."""
    heads, dim = 2, 16
    k_cache, v_cache = (torch.zeros(4, block_size, heads, dim, device=device) for _ in range(2))
    q, key, value = (torch.randn(2, heads, dim, device=device) for _ in range(3))
    meta = AttentionMetadata(
        slot_mapping=torch.tensor([1, -1], device=device), cu_seqlens_q=torch.tensor([0, 1, 2], dtype=torch.int32,
                                                                                        device=device),
        seqlens_k=torch.tensor([2, 1], dtype=torch.int32, device=device),
        block_tables=torch.tensor([[0], [1]], dtype=torch.int32, device=device), max_seqlen_q=1, max_seqlen_k=2,
        block_size=block_size)
    return q, key, value, k_cache, v_cache, meta


def test_the_torch_reference_reads_slots_on_the_host_so_it_declares_itself_unsafe_for_cuda_graphs():
    backend = get_backend(TORCH, torch.device("cpu"))
    q, key, value, k_cache, v_cache, meta = one_decode_step()
    with HostReads() as reads:
        backend.store_kvcache(key, value, k_cache, v_cache, meta.slot_mapping)
    assert reads.seen, "the torch store skips -1 slots by asking the host"
    caps = backend.capabilities
    assert not caps.cuda_graph_safe and not caps.fused_norm_rope_store
    assert caps.supports_block_size(1) and caps.supports_block_size(16)


@needs_triton
def test_triton_fuses_norm_rope_and_the_kv_store_and_is_graph_safe_for_any_block_size():
    cls = backend_class(TRITON)
    caps = cls.capabilities
    assert caps.fused_norm_rope_store and caps.cuda_graph_safe
    assert caps.supports_block_size(1) and caps.supports_block_size(16)
    assert callable(getattr(cls, "norm_rope_store_kvcache", None)), "a fused backend brings the fused store"


def test_flash_attn_is_graph_safe_unfused_and_needs_blocks_of_256_tokens():
    caps = backend_class(FLASH_ATTN).capabilities
    assert caps.cuda_graph_safe and not caps.fused_norm_rope_store
    assert caps.supports_block_size(256) and caps.supports_block_size(512)
    assert not caps.supports_block_size(16)


def test_a_backend_that_claims_the_fused_store_has_it():
    for name in (TORCH, FLASH_ATTN) + ((TRITON,) if importlib.util.find_spec("triton") else ()):
        cls = backend_class(name)
        assert cls.capabilities.fused_norm_rope_store == hasattr(cls, "norm_rope_store_kvcache"), name


def test_a_backend_that_claims_an_fp8_decode_output_has_it():
    """Attention.forward asks decode_fp8 of a backend whose capabilities say fp8_decode_output (Triton's), for an FP8
    o_proj's input."""
    names = (TORCH, FLASH_ATTN) + ((TRITON,) if importlib.util.find_spec("triton") else ())
    for name in names:
        cls = backend_class(name)
        assert cls.capabilities.fp8_decode_output == hasattr(cls, "decode_fp8"), name
    assert [backend_class(n).capabilities.fp8_decode_output for n in names] == [False, False, True][:len(names)]


def test_a_quantized_kv_cache_goes_only_to_backends_that_declare_they_read_it(monkeypatch):
    fp8, int8 = torch.float8_e4m3fn, torch.int8
    assert backend_class(TORCH).capabilities.quantized_kv_dtypes == (fp8, int8)
    assert backend_class(FLASH_ATTN).capabilities.quantized_kv_dtypes == ()
    if importlib.util.find_spec("triton") is not None:
        assert backend_class(TRITON).capabilities.quantized_kv_dtypes == (fp8, int8)
    for dtype, name in ((fp8, "float8_e4m3fn"), (int8, "int8")):
        with pytest.raises(ValueError, match=f"cannot read a {name} KV cache"):
            get_backend(FLASH_ATTN, torch.device("cuda"), 256, kv_cache_dtype=dtype)
    monkeypatch.setitem(sys.modules, "flash_attn", type(sys)("flash_attn"))  # as if it were installed
    assert auto_backend_name(torch.device("cuda"), 256) == FLASH_ATTN
    assert auto_backend_name(torch.device("cuda"), 256, torch.bfloat16) == FLASH_ATTN  # the model's dtype
    assert auto_backend_name(torch.device("cuda"), 256, fp8) == TRITON
    assert auto_backend_name(torch.device("cuda"), 256, int8) == TRITON
    assert get_backend(AUTO, torch.device("cpu"), kv_cache_dtype=int8).name == TORCH


@pytest.mark.skipif(importlib.util.find_spec("flash_attn") is not None, reason="flash_attn is installed")
def test_asking_for_flash_attn_without_it_installed_fails_at_startup():
    with pytest.raises(ImportError):
        get_backend(FLASH_ATTN, torch.device("cpu"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@needs_triton
def test_a_graph_safe_backend_captures_its_store_and_decode_in_a_cuda_graph():
    backend = get_backend(TRITON, torch.device("cuda"))
    assert backend.capabilities.cuda_graph_safe
    q, key, value, k_cache, v_cache, meta = one_decode_step("cuda", block_size=16)
    backend.store_kvcache(key, value, k_cache, v_cache, meta.slot_mapping)  # compile outside the capture
    eager = backend.forward(q, k_cache, v_cache, meta, 0.25)
    k_cache.zero_()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        backend.store_kvcache(key, value, k_cache, v_cache, meta.slot_mapping)
        out = backend.forward(q, k_cache, v_cache, meta, 0.25)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(k_cache.flatten(0, 1)[1], key[0]) and out.shape == eager.shape
