"""Engine flags, shared by the offline API, the CLI and every process role."""
from __future__ import annotations

import argparse
import dataclasses
import os
import shlex
from dataclasses import dataclass

from kernels.attention.names import ATTENTION_BACKEND_CHOICES  # torch-free (invariant 3)
from scheduler_svc.common.checkpoint_kv_scales import checkpoint_kv_scale_names
from scheduler_svc.common.draft_model import check_draft_model
from scheduler_svc.common.model_paths import default_model_dir
from scheduler_svc.common.weight_quantization import QUANTIZATION_CHOICES, weight_quantization

DEVICES = ("auto", "cpu", "cuda")
DTYPES = ("auto", "float32", "bfloat16", "float16")
LOAD_FORMATS = ("auto", "dummy")
# auto: the KV pool holds the model's dtype; fp8: float8_e4m3fn, int8: int8, both with float32 scales
# (kernels/kv_quant.py, executor_svc/kv_calibration.py)
KV_CACHE_DTYPES = ("auto", "fp8", "int8")
# how a quantized pool's scales are chosen: 1.0 everywhere (fp8), or calibrated at start-up per layer, per KV
# head or per KV head and channel; auto: per KV head for fp8, per channel for int8
KV_CACHE_SCALES = ("auto", "calibrated", "calibrated-per-channel", "calibrated-per-head", "checkpoint", "static")
# how an fp8 pool's K is transformed before it is quantized (kernels/kv_rotation.py): a Hadamard rotation
# of K and q over head_dim, which attention does not see, or none
KV_CACHE_ROTATIONS = ("hadamard", "none")
# proposers of speculative decoding: n-gram lookup (scheduler_svc/core/speculative/), or a smaller draft model run
# by the executors beside the target (executor_svc/draft_model.py)
SPECULATIVE_METHODS = ("ngram", "draft")
PREEMPTION_MODES = ("recompute", "swap", "auto")  # scheduler_svc/core/preemption_cost.py
PREEMPTION_POLICIES = ("newest", "least-progress", "priority")  # scheduler_svc/core/preemption_policy.py
DEFAULT_SWAP_SPACE_GB = 4.0  # host pool per executor where the preemption mode can swap and no size is given


@dataclass
class EngineConfig:
    model: str = ""  # checkpoint directory; empty means the embedded default model
    device: str = "auto"
    dtype: str = "auto"
    block_size: int = 16
    num_gpu_blocks: int | None = None  # KV pool size in blocks on any device; overrides sizing
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 4096
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    enable_prefix_caching: bool = True
    seed: int = 0
    tensor_parallel_size: int = 1
    attention_backend: str = "auto"
    gpu_memory_utilization: float = 0.9
    cpu_kv_cache_gb: float = 2.0  # KV pool budget on the CPU
    swap_space_gb: float | None = None  # host pool per executor for preemption by swap; None: host_pool_gb()
    num_host_blocks: int | None = None  # host pool size in blocks; overrides swap_space_gb (tests)
    preemption_mode: str | None = None  # None: resolved_preemption_mode()
    preemption_policy: str = "newest"  # which running sequence gives way
    enforce_eager: bool = False
    # steps with a prefill chunk of at most this many tokens run as piecewise CUDA graphs (attention eager between
    # them, executor_svc/piecewise_graphs.py); 0: such steps run eagerly
    cuda_graph_max_tokens: int = 2048
    executor_timeout_s: float = 10.0  # no heartbeat for this long means the executor is lost
    frontend_timeout_s: float = 10.0  # a front end silent this long is gone: its requests are aborted
    beam_group_timeout_s: float = 30.0  # a beam search whose members have not all arrived by then fails
    load_format: str = "auto"  # auto: safetensors from --model; dummy: random weights (benchmarks)
    async_scheduling: bool = True  # plan step N+1 while step N runs
    max_steps_in_flight: int = 2  # with async scheduling: planned steps not yet answered
    cpu_threads: int = 0  # torch threads of a CPU executor; 0: one per core, less one for the other roles
    mask_fill_threads: int = 0  # the scheduler's threads filling structured-output masks; 0: cores - 1, at most 8
    kv_cache_dtype: str = "auto"  # one of KV_CACHE_DTYPES
    kv_cache_scales: str = "auto"  # one of KV_CACHE_SCALES; used with kv_cache_dtype fp8 or int8
    kv_cache_rotation: str = "none"  # one of KV_CACHE_ROTATIONS; used with kv_cache_dtype fp8 or int8
    quantization: str | None = None  # "fp8": quantize a plain checkpoint's Linear weights at load
    speculative_method: str | None = None  # one of SPECULATIVE_METHODS; None: no speculative decoding
    num_speculative_tokens: int = 8  # at most, per sequence and step (policy.py picks), verified in one forward
    ngram_min: int = 3  # n-gram proposals: the shortest suffix matched earlier (shorter ones mostly miss)
    ngram_max: int = 4  # and the longest (tried first)
    # speculation pauses while more sequences than this run: on the H200 n-gram chat gained 1.28x at 4 running and lost
    # (0.83x) at 16 (bench/RESULTS.md, 2026-12-04)
    speculative_max_batch_size: int = 8
    draft_model: str | None = None  # speculative method draft: the proposer's checkpoint (same tokenizer and vocab)

    def __post_init__(self) -> None:
        if not self.model:
            self.model = default_model_dir()
        self.validate()

    def validate(self) -> None:
        def need(ok: bool, msg: str) -> None:
            if not ok:
                raise ValueError(msg)

        need(self.device in DEVICES, f"--device must be one of {DEVICES}, got {self.device!r}")
        need(self.dtype in DTYPES, f"--dtype must be one of {DTYPES}, got {self.dtype!r}")
        need(self.attention_backend in ATTENTION_BACKEND_CHOICES,
             f"--attention-backend must be one of {ATTENTION_BACKEND_CHOICES}, got {self.attention_backend!r}")
        need(self.block_size > 0 and self.block_size & (self.block_size - 1) == 0,
             f"--block-size must be a power of two, got {self.block_size}")
        need(self.num_gpu_blocks is None or self.num_gpu_blocks > 0,
             f"--num-gpu-blocks must be positive, got {self.num_gpu_blocks}")
        need(self.max_num_seqs > 0, f"--max-num-seqs must be positive, got {self.max_num_seqs}")
        need(self.max_num_batched_tokens > 0,
             f"--max-num-batched-tokens must be positive, got {self.max_num_batched_tokens}")
        need(self.cuda_graph_max_tokens >= 0,
             f"--cuda-graph-max-tokens must be >= 0, got {self.cuda_graph_max_tokens}")
        need(self.max_model_len is None or self.max_model_len > 0,
             f"--max-model-len must be positive, got {self.max_model_len}")
        need(self.tensor_parallel_size > 0,
             f"--tensor-parallel-size must be positive, got {self.tensor_parallel_size}")
        need(0.0 < self.gpu_memory_utilization <= 1.0,
             f"--gpu-memory-utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        need(self.load_format in LOAD_FORMATS, f"--load-format must be one of {LOAD_FORMATS}")
        need(self.kv_cache_dtype in KV_CACHE_DTYPES,
             f"--kv-cache-dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}")
        need(self.kv_cache_scales in KV_CACHE_SCALES,
             f"--kv-cache-scales must be one of {KV_CACHE_SCALES}, got {self.kv_cache_scales!r}")
        need(not (self.kv_cache_dtype == "int8" and self.kv_cache_scales == "static"),
             "--kv-cache-scales static is for fp8: a scale of 1.0 would round int8's K and V to integers")
        need(self.kv_cache_rotation in KV_CACHE_ROTATIONS,
             f"--kv-cache-rotation must be one of {KV_CACHE_ROTATIONS}, got {self.kv_cache_rotation!r}")
        if self.kv_cache_scales == "checkpoint":  # the checkpoint's calibrated scales (common/checkpoint_kv_scales.py)
            need(self.kv_cache_dtype == "fp8", "--kv-cache-scales checkpoint is for --kv-cache-dtype fp8: a "
                 "checkpoint's KV scales are e4m3's, one per tensor or per KV head")
            need(self.kv_cache_rotation == "none", "--kv-cache-scales checkpoint with --kv-cache-rotation hadamard: "
                 "the checkpoint's scales are of K unrotated")
            need(self.load_format != "dummy", "--kv-cache-scales checkpoint needs the checkpoint (--load-format auto)")
            checkpoint_kv_scale_names(self.model)  # a checkpoint without them fails here, naming what it lacks
        weight_quantization(self.model, self.quantization)  # an unsupported checkpoint format fails here
        need(self.max_steps_in_flight >= 1, f"--max-steps-in-flight must be >= 1, got {self.max_steps_in_flight}")
        need(self.frontend_timeout_s > 0 and self.beam_group_timeout_s > 0 and self.executor_timeout_s > 0,
             "--executor-timeout-s, --frontend-timeout-s and --beam-group-timeout-s must be positive")
        need(self.cpu_threads >= 0, f"--cpu-threads must be >= 0, got {self.cpu_threads}")
        need(self.mask_fill_threads >= 0, f"--mask-fill-threads must be >= 0, got {self.mask_fill_threads}")
        need(self.cpu_kv_cache_gb > 0, f"--cpu-kv-cache-gb must be positive, got {self.cpu_kv_cache_gb}")
        need(self.swap_space_gb is None or self.swap_space_gb >= 0,
             f"--swap-space-gb must be >= 0, got {self.swap_space_gb}")
        need(self.preemption_mode is None or self.preemption_mode in PREEMPTION_MODES,
             f"--preemption-mode must be one of {PREEMPTION_MODES}, got {self.preemption_mode!r}")
        need(self.preemption_policy in PREEMPTION_POLICIES,
             f"--preemption-policy must be one of {PREEMPTION_POLICIES}, got {self.preemption_policy!r}")
        need(self.speculative_method is None or self.speculative_method in SPECULATIVE_METHODS,
             f"--speculative-method must be one of {SPECULATIVE_METHODS}, got {self.speculative_method!r}")
        need(1 <= self.num_speculative_tokens <= 16,
             f"--num-speculative-tokens must be in [1, 16], got {self.num_speculative_tokens}")
        need(1 <= self.ngram_min <= self.ngram_max,
             f"--ngram-min and --ngram-max need 1 <= min <= max, got {self.ngram_min} and {self.ngram_max}")
        need(self.speculative_max_batch_size >= 1,
             f"--speculative-max-batch-size must be >= 1, got {self.speculative_max_batch_size}")
        need((self.speculative_method == "draft") == bool(self.draft_model),
             "--speculative-method draft needs --draft-model DIR, and --draft-model is only used with it, got "
             f"{self.speculative_method!r} and {self.draft_model!r}")
        if self.draft_model:
            check_draft_model(self.model, self.draft_model, self.tensor_parallel_size, self.max_model_len)
        need(self.num_host_blocks is None or self.num_host_blocks >= 0,
             f"--num-host-blocks must be >= 0, got {self.num_host_blocks}")

    def resolved_preemption_mode(self, device_type: str) -> str:
        """--preemption-mode, else auto on CUDA, and on the CPU recompute unless a host pool is asked for."""
        if self.preemption_mode is not None:
            return self.preemption_mode
        if device_type == "cuda":
            return "auto"
        return "swap" if (self.swap_space_gb or 0) > 0 or (self.num_host_blocks or 0) > 0 else "recompute"

    def kv_scales_method(self) -> str:
        """--kv-cache-scales with auto resolved: per KV head for fp8, per KV head and channel for int8."""
        if self.kv_cache_scales != "auto":
            return self.kv_cache_scales
        return "calibrated-per-channel" if self.kv_cache_dtype == "int8" else "calibrated-per-head"

    def host_pool_gb(self, device_type: str) -> float:
        """--swap-space-gb, else DEFAULT_SWAP_SPACE_GB (at most a quarter of the machine's memory per rank)
        where the mode can swap, and none in recompute mode."""
        if self.swap_space_gb is not None:
            return self.swap_space_gb
        if self.resolved_preemption_mode(device_type) == "recompute":
            return 0.0
        try:
            machine_gb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
        except (ValueError, OSError):
            machine_gb = 4 * DEFAULT_SWAP_SPACE_GB
        return min(DEFAULT_SWAP_SPACE_GB, machine_gb / 4 / self.tensor_parallel_size)

    def to_argv(self) -> list[str]:
        """The same config as command-line flags, to start another process role."""
        argv: list[str] = []
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            flag = "--" + f.name.replace("_", "-")
            if isinstance(value, bool):
                argv.append(flag if value else "--no-" + f.name.replace("_", "-"))
            elif value is not None:
                argv += [flag, str(value)]
        return argv


ENGINE_ARGS_ENV = "NANOSERVE_ENGINE_ARGS"


def engine_args_from_env() -> list[str]:
    """Engine flags in $NANOSERVE_ENGINE_ARGS (shell syntax): a deployment sets the flags that the scheduler
    and every executor must agree on once, in the environment that all of them share."""
    return shlex.split(os.environ.get(ENGINE_ARGS_ENV, ""))


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    d = EngineConfig.__dataclass_fields__
    g = parser.add_argument_group("engine")
    g.add_argument("--model", default="", help="HF checkpoint directory (default: the embedded SmolLM2-135M-Instruct)")
    g.add_argument("--device", choices=DEVICES, default=d["device"].default)
    g.add_argument("--dtype", choices=DTYPES, default=d["dtype"].default,
                   help="auto: bfloat16 on CUDA, float32 on the CPU")
    g.add_argument("--block-size", type=int, default=d["block_size"].default, help="tokens per KV block")
    g.add_argument("--num-gpu-blocks", type=int, default=None,
                   help="KV pool size in blocks on any device; overrides memory-based sizing")
    g.add_argument("--max-num-seqs", type=int, default=d["max_num_seqs"].default)
    g.add_argument("--max-num-batched-tokens", type=int, default=d["max_num_batched_tokens"].default,
                   help="token budget of one step (prefill chunks + decodes)")
    g.add_argument("--max-model-len", type=int, default=None, help="prompt + output limit (default: the model's)")
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                   default=d["enable_prefix_caching"].default)
    g.add_argument("--seed", type=int, default=d["seed"].default)
    g.add_argument("--tensor-parallel-size", "-tp", type=int, default=d["tensor_parallel_size"].default)
    g.add_argument("--attention-backend", choices=ATTENTION_BACKEND_CHOICES, default=d["attention_backend"].default)
    g.add_argument("--gpu-memory-utilization", type=float, default=d["gpu_memory_utilization"].default)
    g.add_argument("--cpu-kv-cache-gb", type=float, default=d["cpu_kv_cache_gb"].default)
    g.add_argument("--swap-space-gb", type=float, default=None,
                   help=f"host memory per executor for swapping preempted sequences out (default: "
                        f"{DEFAULT_SWAP_SPACE_GB:g}, at most a quarter of RAM per rank, where the mode can swap)")
    g.add_argument("--num-host-blocks", type=int, default=None, help="host swap pool in blocks (overrides)")
    g.add_argument("--preemption-mode", choices=PREEMPTION_MODES, default=None,
                   help="how a preempted sequence keeps its work: recompute it later, swap its KV to the host "
                        "pool, or auto: the cheaper by the measured costs (default: auto on CUDA, recompute on "
                        "the CPU unless a host pool is given)")
    g.add_argument("--preemption-policy", choices=PREEMPTION_POLICIES, default=d["preemption_policy"].default,
                   help="who gives way: the newest admitted, the least computed, or the lowest priority (which "
                        "also lets a waiting request of higher priority preempt)")
    g.add_argument("--enforce-eager", action=argparse.BooleanOptionalAction, default=d["enforce_eager"].default,
                   help="disable CUDA graphs")
    g.add_argument("--cuda-graph-max-tokens", type=int, default=d["cuda_graph_max_tokens"].default,
                   help="steps with a prefill chunk of at most this many tokens run as CUDA graphs of the layers "
                        "between attention calls, attention eager (0: eagerly); decode steps are graphed whole")
    g.add_argument("--executor-timeout-s", type=float, default=d["executor_timeout_s"].default)
    g.add_argument("--frontend-timeout-s", type=float, default=d["frontend_timeout_s"].default,
                   help="abort the requests of a front end not heard from for this long")
    g.add_argument("--beam-group-timeout-s", type=float, default=d["beam_group_timeout_s"].default,
                   help="fail a beam search whose member requests have not all arrived by then")
    g.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction,
                   default=d["async_scheduling"].default, help="plan the next step while the current one runs")
    g.add_argument("--max-steps-in-flight", type=int, default=d["max_steps_in_flight"].default,
                   help="with async scheduling, how many planned steps may be unanswered")
    g.add_argument("--cpu-threads", type=int, default=d["cpu_threads"].default,
                   help="torch threads of a CPU executor (0: cores - 1, at least 1)")
    g.add_argument("--mask-fill-threads", type=int, default=d["mask_fill_threads"].default,
                   help="scheduler threads filling structured-output token masks (0: cores - 1, 1 to 8; "
                        "1 fills them in the step loop's own thread)")
    g.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default=d["kv_cache_dtype"].default,
                   help="fp8: K and V as float8_e4m3fn, int8: as int8 (the more accurate), both with float32 "
                        "scales and about twice the blocks per byte of bf16")
    g.add_argument("--kv-cache-scales", choices=KV_CACHE_SCALES, default=d["kv_cache_scales"].default,
                   help="quantized KV scales: from a calibration forward at start-up, per layer, per KV head or "
                        "per KV head and channel, 1.0 (fp8), or the checkpoint's calibrated k_scale and v_scale "
                        "(fp8); auto: per head for fp8, per channel for int8")
    g.add_argument("--kv-cache-rotation", choices=KV_CACHE_ROTATIONS, default=d["kv_cache_rotation"].default,
                   help="fp8 or int8: rotate K and q by a Hadamard matrix over head_dim before K is quantized "
                        "(attention is unchanged; the quantization error averages over q.k)")
    g.add_argument("--quantization", choices=QUANTIZATION_CHOICES, default=None,
                   help="fp8: quantize the Linear weights to float8_e4m3fn at load (a scale per output channel, "
                        "activations per token); FP8 checkpoints are detected without it")
    g.add_argument("--load-format", choices=LOAD_FORMATS, default=d["load_format"].default,
                   help="dummy: random weights from config.json alone (benchmarks)")
    g.add_argument("--speculative-method", choices=SPECULATIVE_METHODS, default=None,
                   help="speculative decoding: ngram proposes the tokens that followed the sequence's last n-gram "
                        "where it occurred before (prompt lookup); the model verifies them in one forward")
    g.add_argument("--num-speculative-tokens", type=int, default=d["num_speculative_tokens"].default,
                   help="tokens proposed per sequence and step")
    g.add_argument("--ngram-min", type=int, default=d["ngram_min"].default,
                   help="ngram: the shortest suffix looked up (the longest matching one is used)")
    g.add_argument("--ngram-max", type=int, default=d["ngram_max"].default, help="ngram: the longest suffix looked up")
    g.add_argument("--speculative-max-batch-size", type=int, default=d["speculative_max_batch_size"].default,
                   help="speculation pauses while more sequences than this run (where a step is no longer "
                        "launch-bound, verifying costs more than it saves)")
    g.add_argument("--draft-model", default=None,
                   help="speculative method draft: a smaller model with the target's tokenizer and vocabulary "
                        "(HF checkpoint directory), run by the same executors with its own KV pool")


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    names = [f.name for f in dataclasses.fields(EngineConfig)]
    return EngineConfig(**{n: getattr(args, n) for n in names})
