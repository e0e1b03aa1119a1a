"""cuBLASLt's FP8 matmul through its C API (ctypes), running the algorithm its caller names.

torch._scaled_mm asks cuBLASLt's heuristic for one algorithm and runs it. At decode's token counts that first choice
is often not the fastest (DESIGN 12: gate_up_proj's product took 74 us on 144 rows, 48 on 256), and torch offers no way
to take another. An `Fp8Matmul` (one operand shape, scaling mode and output dtype) lists the heuristic's candidates,
split-K variants of them included, and runs the one its caller picked; bench/studies/fp8_cublaslt_algos.py times
them against torch's choice.

The layout is torch's: y [M, N] row-major = x [M, K] @ w [N, K]^T. In cuBLASLt's column-major terms that is
D [N, M] = op(A) B with A = w seen as K x N and transposed, B = x seen as K x M: the "TN" form its FP8 kernels
require. So cuBLASLt's A scale is the weight's and its B scale the activations'.

Scaling modes: "tensor" (a float per operand, or none: the bare product), "outer" (a float per output channel and per
token: cuBLASLt's outer-vector scaling), "block" (the weight a float per 128 x 128 block, [N / 128, K / 128]; the
activations one per token and 128 columns, M-major, as torch's block recipe passes them). Nothing here waits on the
device, so a call captures in a CUDA graph (the workspace is allocated once per device, before any capture).
"""
from __future__ import annotations

import ctypes
import glob
import os
from dataclasses import dataclass, field

import torch

_SUCCESS = 0
_STATUS = {1: "NOT_INITIALIZED", 3: "ALLOC_FAILED", 7: "INVALID_VALUE", 8: "ARCH_MISMATCH", 13: "EXECUTION_FAILED",
           14: "INTERNAL_ERROR", 15: "NOT_SUPPORTED"}
_DTYPES = {torch.float32: 0, torch.float16: 2, torch.bfloat16: 14, torch.float8_e4m3fn: 28}  # cudaDataType_t
_COMPUTE_32F = 68
# cublasLtMatmulDescAttributes_t
_TRANSA, _TRANSB, _A_SCALE_POINTER, _B_SCALE_POINTER = 3, 4, 17, 18
_FAST_ACCUM, _A_SCALE_MODE, _B_SCALE_MODE = 25, 31, 32
_OP_N, _OP_T = 0, 1
# cublasLtMatmulMatrixScale_t per scaling mode: (A's, B's)
_SCALE_MODES = {"tensor": (0, 0), "outer": (3, 3), "block": (5, 4)}  # SCALAR_32F, OUTER_VEC_32F, BLK128x128 / VEC128
_PREF_MAX_WORKSPACE_BYTES = 1
_CAP_SPLITK_SUPPORT, _CAP_REDUCTION_SCHEME_MASK = 0, 1
# cublasLtMatmulAlgoConfigAttributes_t: what describes an algorithm (and, set on a fresh one, rebuilds it)
CONFIG = {"id": 0, "tile": 1, "split_k": 2, "reduction": 3, "swizzle": 4, "custom": 5, "stages": 6, "inner_shape": 7,
          "cluster_shape": 8}
REDUCTION_SCHEMES = (1, 2, 4)  # in place, in the compute type, in the output type
WORKSPACE_BYTES = 32 * 2**20


class _Algo(ctypes.Structure):
    _fields_ = [("data", ctypes.c_uint64 * 8)]


class _Heuristic(ctypes.Structure):
    _fields_ = [("algo", _Algo), ("workspace_size", ctypes.c_size_t), ("state", ctypes.c_int),
                ("waves", ctypes.c_float), ("reserved", ctypes.c_int * 4)]


def _library_paths() -> list[str]:
    """Where libcublasLt is: the copy this process already mapped (torch's, once cuBLAS is up), then the nvidia wheels'
    lib folders, then the loader's search path."""
    paths = []
    try:
        with open("/proc/self/maps") as maps:
            paths += sorted({line.split()[-1] for line in maps if "libcublasLt.so" in line})
    except OSError:
        pass
    try:
        import nvidia  # the CUDA wheels torch depends on

        for root in nvidia.__path__:
            paths += sorted(glob.glob(os.path.join(root, "*", "lib", "libcublasLt.so*")))
    except ImportError:
        pass
    return paths + ["libcublasLt.so.13", "libcublasLt.so.12", "libcublasLt.so"]


_lib: ctypes.CDLL | None = None


def library() -> ctypes.CDLL:
    global _lib
    if _lib is None:
        if torch.cuda.is_available():
            torch.cuda.current_blas_handle()  # cuBLAS up, so torch's own libcublasLt is the one mapped
        for path in _library_paths():
            try:
                lib = ctypes.CDLL(path)
                break
            except OSError:
                continue
        else:
            raise RuntimeError("cuBLASLt (libcublasLt.so) was not found; it comes with a CUDA build of torch")
        p, i, u64, i64, sz = ctypes.c_void_p, ctypes.c_int, ctypes.c_uint64, ctypes.c_int64, ctypes.c_size_t
        signatures = {
            "cublasLtCreate": [p], "cublasLtMatmulDescCreate": [p, i, i], "cublasLtMatmulDescDestroy": [p],
            "cublasLtMatmulDescSetAttribute": [p, i, p, sz], "cublasLtMatrixLayoutCreate": [p, i, u64, u64, i64],
            "cublasLtMatrixLayoutDestroy": [p], "cublasLtMatmulPreferenceCreate": [p],
            "cublasLtMatmulPreferenceDestroy": [p], "cublasLtMatmulPreferenceSetAttribute": [p, i, p, sz],
            "cublasLtMatmulAlgoGetHeuristic": [p, p, p, p, p, p, p, i, p, p],
            "cublasLtMatmulAlgoCapGetAttribute": [p, i, p, sz, p],
            "cublasLtMatmulAlgoConfigGetAttribute": [p, i, p, sz, p],
            "cublasLtMatmulAlgoConfigSetAttribute": [p, i, p, sz],
            "cublasLtMatmulAlgoInit": [p, i, i, i, i, i, i, i, p],
            "cublasLtMatmulAlgoCheck": [p, p, p, p, p, p, p, p],
            "cublasLtMatmul": [p, p, p, p, p, p, p, p, p, p, p, p, p, p, sz, p],
        }
        for name, argtypes in signatures.items():
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = argtypes, ctypes.c_int
        lib.cublasLtGetVersion.argtypes, lib.cublasLtGetVersion.restype = [], ctypes.c_size_t
        _lib = lib
    return _lib


def version() -> int:
    """cuBLASLt's version (e.g. 130100 for 13.1.0)."""
    return int(library().cublasLtGetVersion())


def _check(status: int, what: str) -> None:
    if status != _SUCCESS:
        raise RuntimeError(f"cuBLASLt {what}: CUBLAS_STATUS_{_STATUS.get(status, status)}")


_per_device: dict[tuple[str, int], object] = {}


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def _handle(device: torch.device) -> ctypes.c_void_p:
    key = ("handle", _index(device))
    if key not in _per_device:
        handle = ctypes.c_void_p()
        with torch.cuda.device(device):
            _check(library().cublasLtCreate(ctypes.byref(handle)), "create")
        _per_device[key] = handle
    return _per_device[key]


def prepare(device: torch.device) -> None:
    """Everything a call on `device` needs made before a CUDA graph captures one: the library, the handle and the
    workspace."""
    _handle(device)
    workspace(device)


def workspace(device: torch.device) -> torch.Tensor:
    """The device's cuBLASLt workspace (split-K partials), made once, before graphs capture it."""
    key = ("workspace", _index(device))
    if key not in _per_device:
        _per_device[key] = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
    return _per_device[key]


def _set(setter, obj, attr: int, value: ctypes._SimpleCData, what: str) -> None:
    _check(setter(obj, attr, ctypes.byref(value), ctypes.sizeof(value)), what)


def _attribute_size(getter, algo: _Algo, attr: int) -> int:
    written = ctypes.c_size_t()
    _check(getter(ctypes.byref(algo), attr, None, 0, ctypes.byref(written)), f"algorithm attribute {attr}'s size")
    return written.value


def _algo_attribute(getter, algo: _Algo, attr: int) -> int:
    """One of an algorithm's capability or configuration values, whatever its width (1-8 bytes)."""
    size, written = _attribute_size(getter, algo, attr), ctypes.c_size_t()
    buf = (ctypes.c_uint8 * max(size, 1))()
    _check(getter(ctypes.byref(algo), attr, buf, size, ctypes.byref(written)), f"algorithm attribute {attr}")
    return int.from_bytes(bytes(buf)[:written.value], "little")


def _set_config(algo: _Algo, name: str, value: int) -> bool:
    """Sets one of CONFIG's values on algo, at the width cuBLASLt keeps it; False where it refuses."""
    lib = library()
    try:
        size = _attribute_size(lib.cublasLtMatmulAlgoConfigGetAttribute, algo, CONFIG[name])
    except RuntimeError:
        return False
    buf = (ctypes.c_uint8 * size).from_buffer_copy(value.to_bytes(size, "little", signed=value < 0))
    return lib.cublasLtMatmulAlgoConfigSetAttribute(ctypes.byref(algo), CONFIG[name], buf, size) == _SUCCESS


@dataclass(frozen=True)
class Algorithm:
    """One cuBLASLt algorithm for one Fp8Matmul: its opaque 64 bytes, the workspace it needs, the heuristic's estimate
    of its waves over the SMs (0 where it was built, not suggested) and its configuration (CONFIG's names)."""
    raw: bytes
    workspace: int
    waves: float
    config: dict = field(hash=False, compare=False)

    def entry(self) -> dict:
        """What a table keeps of it: its configuration, and its bytes with the cuBLASLt version they belong to (used
        where the version matches: a configuration may not name all that picks a kernel)."""
        return {**self.config, "raw": self.raw.hex(), "version": version()}

    def __str__(self) -> str:
        return " ".join(f"{name} {value}" for name, value in self.config.items())


class Fp8Matmul:
    """cuBLASLt's descriptors for y [m, n] = x [m, k] @ w [n, k]^T in FP8 (e4m3 operands, fp32 accumulation) into
    out_dtype, with `scaling`'s scales (module docstring) and, with fast_accum, the tensor cores' own accumulation."""

    def __init__(self, n: int, k: int, m: int, out_dtype: torch.dtype, scaling: str = "tensor",
                 fast_accum: bool = False, device: torch.device | str = "cuda", x_stride: int = 0):
        if scaling not in _SCALE_MODES:
            raise ValueError(f"scaling {scaling!r}: one of {', '.join(_SCALE_MODES)}")
        if out_dtype not in (torch.bfloat16, torch.float16, torch.float32):
            raise ValueError(f"an FP8 matmul writes bf16, fp16 or fp32, not {out_dtype}")
        self.n, self.k, self.m, self.out_dtype, self.scaling = n, k, m, out_dtype, scaling
        self.x_stride = x_stride or k
        self.device = torch.device(device)
        if self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        lib = library()
        self.handle = _handle(self.device)
        self.desc = ctypes.c_void_p()
        _check(lib.cublasLtMatmulDescCreate(ctypes.byref(self.desc), _COMPUTE_32F, _DTYPES[torch.float32]), "desc")
        set_desc = lib.cublasLtMatmulDescSetAttribute
        _set(set_desc, self.desc, _TRANSA, ctypes.c_int32(_OP_T), "transa")
        _set(set_desc, self.desc, _TRANSB, ctypes.c_int32(_OP_N), "transb")
        _set(set_desc, self.desc, _FAST_ACCUM, ctypes.c_int8(int(fast_accum)), "fast accumulation")
        if scaling != "tensor":
            a_mode, b_mode = _SCALE_MODES[scaling]
            _set(set_desc, self.desc, _A_SCALE_MODE, ctypes.c_int32(a_mode), f"{scaling} scales (weights)")
            _set(set_desc, self.desc, _B_SCALE_MODE, ctypes.c_int32(b_mode), f"{scaling} scales (activations)")
            # cuBLASLt's heuristic refuses vector and block scales (INVALID_VALUE) while their pointers are unset:
            # the workspace stands in until a call sets the real ones.
            placeholder = ctypes.c_void_p(workspace(self.device).data_ptr())
            for attr in (_A_SCALE_POINTER, _B_SCALE_POINTER):
                _set(set_desc, self.desc, attr, placeholder, f"{scaling} scales' placeholder")
        fp8, out = _DTYPES[torch.float8_e4m3fn], _DTYPES[out_dtype]
        self.layouts = []
        for dtype, rows, cols, ld in ((fp8, k, n, k), (fp8, k, m, self.x_stride), (out, n, m, n), (out, n, m, n)):
            layout = ctypes.c_void_p()
            _check(lib.cublasLtMatrixLayoutCreate(ctypes.byref(layout), dtype, rows, cols, ld), "layout")
            self.layouts.append(layout)
        self.alpha, self.beta = ctypes.c_float(1.0), ctypes.c_float(0.0)

    def __del__(self):
        lib = _lib
        if lib is None:
            return
        for layout in getattr(self, "layouts", []):
            lib.cublasLtMatrixLayoutDestroy(layout)
        if getattr(self, "desc", None):
            lib.cublasLtMatmulDescDestroy(self.desc)

    def _described(self, algo: _Algo, workspace_size: int, waves: float) -> Algorithm:
        get, config = library().cublasLtMatmulAlgoConfigGetAttribute, {}
        for name, attr in CONFIG.items():
            try:
                config[name] = _algo_attribute(get, algo, attr)
            except RuntimeError:  # an attribute this cuBLASLt does not keep
                continue
        return Algorithm(bytes(algo), workspace_size, waves, config)

    def heuristic(self, count: int = 32) -> list[Algorithm]:
        """The heuristic's candidates, best first as it ranks them (torch runs the first)."""
        lib = library()
        pref = ctypes.c_void_p()
        _check(lib.cublasLtMatmulPreferenceCreate(ctypes.byref(pref)), "preference")
        try:
            _set(lib.cublasLtMatmulPreferenceSetAttribute, pref, _PREF_MAX_WORKSPACE_BYTES,
                 ctypes.c_uint64(WORKSPACE_BYTES), "workspace limit")
            results, returned = (_Heuristic * count)(), ctypes.c_int()
            _check(lib.cublasLtMatmulAlgoGetHeuristic(self.handle, self.desc, *self.layouts, pref, count, results,
                                                      ctypes.byref(returned)), "heuristic")
        finally:
            lib.cublasLtMatmulPreferenceDestroy(pref)
        return [self._described(r.algo, r.workspace_size, r.waves) for r in results[:returned.value]
                if r.state == _SUCCESS]

    def checked(self, algo: _Algo) -> Algorithm | None:
        """algo as cuBLASLt accepts it for this product (with the workspace it needs), or None where it refuses."""
        result = _Heuristic()
        status = library().cublasLtMatmulAlgoCheck(self.handle, self.desc, *self.layouts, ctypes.byref(algo),
                                                   ctypes.byref(result))
        if status != _SUCCESS or result.workspace_size > WORKSPACE_BYTES:
            return None
        return self._described(algo, result.workspace_size, 0.0)

    def split_k(self, base: Algorithm, splits: int) -> list[Algorithm]:
        """base with K cut into `splits` parts, one per reduction scheme that base supports and cuBLASLt accepts."""
        lib = library()
        algo = _Algo.from_buffer_copy(base.raw)
        if not _algo_attribute(lib.cublasLtMatmulAlgoCapGetAttribute, algo, _CAP_SPLITK_SUPPORT):
            return []
        schemes = _algo_attribute(lib.cublasLtMatmulAlgoCapGetAttribute, algo, _CAP_REDUCTION_SCHEME_MASK)
        variants = []
        for scheme in REDUCTION_SCHEMES:
            if not schemes & scheme:
                continue
            variant = _Algo.from_buffer_copy(base.raw)
            if _set_config(variant, "split_k", splits) and _set_config(variant, "reduction", scheme):
                checked = self.checked(variant)
                if checked is not None:
                    variants.append(checked)
        return variants

    def built(self, config: dict) -> Algorithm | None:
        """The algorithm a table's entry (Algorithm.entry, or its configuration alone) names, for this product, or None
        where cuBLASLt refuses it: its bytes where this is the cuBLASLt version they came from, else rebuilt from its
        configuration (cuBLASLt's bytes are its own; a configuration carries over)."""
        if "raw" in config and int(config.get("version", -1)) == version():
            same = self.checked(_Algo.from_buffer_copy(bytes.fromhex(config["raw"])))
            if same is not None:
                return same
        algo = _Algo()
        fp8, out = _DTYPES[torch.float8_e4m3fn], _DTYPES[self.out_dtype]
        if library().cublasLtMatmulAlgoInit(self.handle, _COMPUTE_32F, _DTYPES[torch.float32], fp8, fp8, out, out,
                                            int(config["id"]), ctypes.byref(algo)) != _SUCCESS:
            return None
        if not all(_set_config(algo, name, int(config[name])) for name in CONFIG if name != "id" and name in config):
            return None
        return self.checked(algo)

    def candidates(self, count: int = 32, splits: tuple[int, ...] = (2, 3, 4, 6, 8), split_top: int = 0
                   ) -> list[Algorithm]:
        """The heuristic's candidates and the split-K variants of its first split_top (0: all), each configuration
        once."""
        seen, out = set(), []
        for rank, base in enumerate(self.heuristic(count)):
            variants = [v for s in splits for v in self.split_k(base, s)] if not split_top or rank < split_top else []
            for algo in [base] + variants:
                key = tuple(sorted(algo.config.items()))
                if key not in seen:
                    seen.add(key)
                    out.append(algo)
        return out

    def __call__(self, x: torch.Tensor, w: torch.Tensor, algo: Algorithm, x_scale: torch.Tensor | None = None,
                 w_scale: torch.Tensor | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
        """y [m, n] on the current stream. x [m, k] (its row stride the x_stride given), w [n, k] row-major, both e4m3;
        the scales per `scaling` (tensor: 0-dim floats or None; outer: w's [n], x's [m]; block: w's [n / 128, k / 128]
        and x's [k / 128, m], M-major), all float32 on the device."""
        if (x.shape != (self.m, self.k) or x.stride() != (self.x_stride, 1) or w.shape != (self.n, self.k)
                or not w.is_contiguous() or {x.dtype, w.dtype} != {torch.float8_e4m3fn}):
            raise ValueError(f"operands {tuple(x.shape)} (strides {x.stride()}, {x.dtype}) and {tuple(w.shape)} "
                             f"({w.dtype}) for a plan of m={self.m}, n={self.n}, k={self.k}, x's rows "
                             f"{self.x_stride} apart, both e4m3, w contiguous")
        lib = library()
        set_desc = lib.cublasLtMatmulDescSetAttribute
        for attr, scale in ((_A_SCALE_POINTER, w_scale), (_B_SCALE_POINTER, x_scale)):
            _set(set_desc, self.desc, attr, ctypes.c_void_p(scale.data_ptr() if scale is not None else None), "scale")
        if out is None:
            out = torch.empty(self.m, self.n, dtype=self.out_dtype, device=self.device)
        ws = workspace(self.device)
        raw = _Algo.from_buffer_copy(algo.raw)
        stream = ctypes.c_void_p(torch.cuda.current_stream(self.device).cuda_stream)
        a_layout, b_layout, c_layout, d_layout = self.layouts
        _check(lib.cublasLtMatmul(self.handle, self.desc, ctypes.byref(self.alpha), ctypes.c_void_p(w.data_ptr()),
                                  a_layout, ctypes.c_void_p(x.data_ptr()), b_layout, ctypes.byref(self.beta),
                                  ctypes.c_void_p(out.data_ptr()), c_layout, ctypes.c_void_p(out.data_ptr()),
                                  d_layout, ctypes.byref(raw), ctypes.c_void_p(ws.data_ptr()), algo.workspace,
                                  stream), "matmul")
        return out
