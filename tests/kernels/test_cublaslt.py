"""kernels/cublaslt.py, cuBLASLt's FP8 matmul through its C API: every candidate algorithm (the heuristic's and the
split-K variants built from them) in each scaling mode matches float64 on the same quantized operands, fresh random
inputs with outlier channels; a configuration rebuilt from its description gives the same bytes; a call captured in
a CUDA graph and replayed on new inputs matches the eager one. On the CPU: the errors a caller meets first, and what
the binding hands cuBLASLt's C API, read back from a stand-in library."""
from __future__ import annotations

import pytest
import torch

from kernels import cublaslt
from kernels.fp8_quant import dequantize_rows, quantize_blocks_on_rows, quantize_rows_ref

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
IN_PLACE = cublaslt.REDUCTION_SCHEMES[0]  # split-K partials added into the output by atomics


def test_a_plan_names_what_it_cannot_do():
    with pytest.raises(ValueError, match="tensor, outer, block"):
        cublaslt.Fp8Matmul(128, 128, 16, torch.bfloat16, "rowwise")
    with pytest.raises(ValueError, match="bf16, fp16 or fp32"):
        cublaslt.Fp8Matmul(128, 128, 16, torch.int8)


def test_a_missing_library_is_named(monkeypatch):
    monkeypatch.setattr(cublaslt, "_lib", None)
    monkeypatch.setattr(cublaslt, "_library_paths", lambda: ["/nonexistent/libcublasLt.so.99"])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RuntimeError, match="libcublasLt.so"):
        cublaslt.library()


@pytest.fixture
def stub(tmp_path, monkeypatch):
    """kernels/cublaslt bound to tests/support/cublaslt_stub.c (compiled here) in place of libcublasLt: what the
    binding hands the C API (descriptor attributes and their widths, layouts, pointers, the stream) is read back."""
    import ctypes
    import shutil
    import subprocess
    from pathlib import Path

    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler for the stand-in library")
    lib = tmp_path / "libcublaslt_stub.so"
    source = Path(__file__).resolve().parent.parent / "support" / "cublaslt_stub.c"
    subprocess.run([cc, "-shared", "-fPIC", "-O1", "-o", str(lib), str(source)], check=True)
    monkeypatch.setattr(cublaslt, "_lib", None)
    monkeypatch.setattr(cublaslt, "_library_paths", lambda: [str(lib)])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # no cuBLAS to bring up first
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: type("S", (), {"cuda_stream": 0xABC})())
    monkeypatch.setattr(cublaslt, "_per_device", {("handle", 0): ctypes.c_void_p(0x1234),
                                                  ("workspace", 0): torch.empty(64, dtype=torch.uint8)})
    c = cublaslt.library()
    return c, (ctypes.c_int64 * 32).in_dll(c, "seen"), (ctypes.c_int64 * 64).in_dll(c, "desc_attr")


def test_the_binding_hands_cublaslt_what_its_c_api_expects(stub):
    _, seen, desc = stub
    m, n, k = 36, 384, 1024
    plan = cublaslt.Fp8Matmul(n, k, m, torch.bfloat16, "outer", fast_accum=True, device=torch.device("cuda", 0),
                              x_stride=2048)
    assert (seen[0], seen[1]) == (68, 0)  # fp32 compute and scales
    assert (desc[3], desc[4], desc[25], desc[31], desc[32]) == (1, 0, 1, 3, 3)  # TN, fast, outer-vector scales
    algos = plan.heuristic(8)
    # A = w as K x N (ld K), B = x as K x M (ld: its row stride), C = y as N x M; e4m3, bf16; the workspace limit
    assert list(seen[2:14]) == [28, k, n, k, 28, k, m, 2048, 14, n, m, n] and seen[14] == cublaslt.WORKSPACE_BYTES
    assert [a.config["id"] for a in algos] == [66, 67, 68] and [a.waves for a in algos] == [0.5, 1.0, 1.5]
    assert algos[0].config == {"id": 66, "tile": 20, "split_k": 1, "reduction": 0, "swizzle": 0, "custom": 0,
                               "stages": 0, "inner_shape": 3}  # the cluster shape this cuBLASLt does not keep
    # split-K variants: each supported reduction scheme (compute and output type here), 3 splits refused
    variants = plan.candidates(8, splits=(2, 3), split_top=1)
    assert [(a.config["id"], a.config["split_k"], a.config["reduction"]) for a in variants] == [
        (66, 1, 0), (66, 2, 2), (66, 2, 4), (67, 1, 0), (68, 1, 0)]
    assert variants[1].workspace == 4096
    # a table's entry: the same bytes where the version matches, else rebuilt from the configuration
    assert plan.built(variants[1].entry()).raw == variants[1].raw
    assert plan.built({**variants[1].entry(), "version": 1}).config == variants[1].config
    assert plan.built({"id": 5000}) is None  # an id cuBLASLt does not have
    x = torch.zeros(m, 2048, dtype=torch.uint8).view(torch.float8_e4m3fn)[:, :k]
    w = torch.zeros(n, k, dtype=torch.uint8).view(torch.float8_e4m3fn)
    x_scale, w_scale, out = torch.ones(m), torch.ones(n), torch.empty(m, n, dtype=torch.bfloat16)
    plan(x, w, variants[1], x_scale=x_scale, w_scale=w_scale, out=out)
    assert list(seen[16:20]) == [w.data_ptr(), x.data_ptr(), out.data_ptr(), out.data_ptr()]  # A = w, B = x, C = D
    assert list(seen[20:26]) == [cublaslt._per_device[("workspace", 0)].data_ptr(), 4096, 0xABC, 66, 10, 0]
    assert (desc[17], desc[18]) == (w_scale.data_ptr(), x_scale.data_ptr())  # A's scale the weight's
    with pytest.raises(ValueError, match="row"):
        plan(x.contiguous(), w, variants[1], out=out)  # rows k apart, not the plan's 2048


def _operands(m, n, k, recipe, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen)
    x[:, torch.randperm(k, generator=gen)[:3]] *= 30
    w = torch.randn(n, k, generator=gen) * 2.0 ** torch.randint(-4, 4, (n, 1), generator=gen)
    if recipe == "block":
        a, a_s = quantize_rows_ref(x, 128)
        wq, w_rows = quantize_blocks_on_rows(w)
        ref = dequantize_rows(a, a_s, 128, torch.float64) @ dequantize_rows(wq, w_rows, 128, torch.float64).T
        blocks = w_rows[::128].contiguous()  # [N / 128, K / 128]
        return a, wq, a_s.t().contiguous(), blocks, ref  # activations' scales M-major, [K / 128, M]
    a, a_s = quantize_rows_ref(x, k)
    wq, w_s = quantize_rows_ref(w, k)
    ref = dequantize_rows(a, a_s, k, torch.float64) @ dequantize_rows(wq, w_s, k, torch.float64).T
    if recipe == "outer":
        return a, wq, a_s.view(-1), w_s.view(-1), ref
    return a, wq, a_s, w_s, ref  # tensor: the bare product, scaled here afterwards


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("recipe", ["tensor", "outer", "block"])
@pytest.mark.parametrize("m", [8, 36, 144])  # the block recipe's rows in 4s (cuBLASLt's scale leading dimension)
def test_every_candidate_matches_float64(recipe, m):
    n, k = 384, 1024
    a, wq, a_s, w_s, ref = _operands(m, n, k, recipe, seed=m)
    a, wq, a_s, w_s = a.cuda(), wq.cuda(), a_s.cuda(), w_s.cuda()
    plan = cublaslt.Fp8Matmul(n, k, m, torch.bfloat16, recipe, device="cuda")
    candidates = plan.candidates(count=8, splits=(2, 4))
    assert candidates, "cuBLASLt offered no algorithm"
    one = torch.ones((), device="cuda")
    scales = (one, one) if recipe == "tensor" else (a_s, w_s)
    scale = ref.abs().max().item()
    for algo in candidates:
        out = plan(a, wq, algo, x_scale=scales[0], w_scale=scales[1]).double().cpu()
        if recipe == "tensor":
            out = out * a_s.cpu().double() * w_s.cpu().double().view(1, -1)
        # bf16's rounding of the output (2^-9 of max |y|) and Hopper's promoted accumulation; a wrong scale, layout or
        # split is off by O(1)
        assert (out - ref).abs().max().item() <= 1e-2 * scale, str(algo)
    # a table's entry (bytes and version) runs the same kernel: the same bytes out (from one that adds its split-K
    # partials in a fixed order: an in-place reduction adds them by atomics)
    last = next((c for c in reversed(candidates) if c.config.get("reduction") != IN_PLACE), candidates[0])
    same = plan.built(last.entry())
    assert same is not None and same.config == last.config
    assert torch.equal(plan(a, wq, same, x_scale=scales[0], w_scale=scales[1]),
                       plan(a, wq, last, x_scale=scales[0], w_scale=scales[1]))
    # its configuration alone (another cuBLASLt version) rebuilds a valid algorithm
    rebuilt = plan.built(last.config)
    assert rebuilt is not None and rebuilt.config["id"] == last.config["id"]
    out = plan(a, wq, rebuilt, x_scale=scales[0], w_scale=scales[1]).double().cpu()
    if recipe == "tensor":
        out = out * a_s.cpu().double() * w_s.cpu().double().view(1, -1)
    assert (out - ref).abs().max().item() <= 1e-2 * scale, str(rebuilt)


@needs_cuda
@pytest.mark.gpu
def test_a_call_replays_in_a_cuda_graph():
    m, n, k = 64, 512, 2048
    a, wq, a_s, w_s, _ = _operands(m, n, k, "outer", seed=1)
    static_a, wq, static_s, w_s = a.cuda(), wq.cuda(), a_s.cuda(), w_s.cuda()
    plan = cublaslt.Fp8Matmul(n, k, m, torch.bfloat16, "outer", device="cuda")
    # a split one if offered, whose partials add in a fixed order (replays are compared bit for bit)
    algo = max((c for c in plan.candidates(count=8, splits=(4,)) if c.config.get("reduction") != IN_PLACE),
               key=lambda c: c.config.get("split_k", 1))
    plan(static_a, wq, algo, x_scale=static_s, w_scale=w_s)  # warm-up outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = plan(static_a, wq, algo, x_scale=static_s, w_scale=w_s)
    for seed in (2, 3):
        a, _, a_s, _, _ = _operands(m, n, k, "outer", seed=seed)
        static_a.copy_(a.cuda())
        static_s.copy_(a_s.cuda())
        graph.replay()
        assert torch.equal(static_out, plan(static_a, wq, algo, x_scale=static_s, w_scale=w_s))
