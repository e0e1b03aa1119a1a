"""Benchmark of the skinny GEMM against cuBLAS (F.linear) on Qwen3-0.6B's decode linear layers.

  python bench/gemm.py                                    # H200: us per call and weight TB/s by shape and M
  python bench/gemm.py --sweep                            # + the best config per (M, N, K) from a pruned grid
  python bench/gemm.py --sweep --shapes o_proj down_proj --m 1 16 64   # a slice of the sweep
  python bench/gemm.py --device cpu --tiny [--sweep]      # interpreter smoke run; --sweep runs each grid config once

Decode runs each layer's GEMM once per step over 28 layers, so the weight always comes from HBM:
each timing is a CUDA graph of back-to-back calls (at least 20) that cycle through enough distinct
copies of the weight to overflow L2 three times, replayed several times; the median per call is
reported with the effective weight bandwidth, next to a device-to-device copy measured in the same
run. Inputs are bf16; down_proj also times the fused silu(gate) * up operand against the unfused
chain fused_ops.silu_and_mul + F.linear. The sweep compiles its configs in parallel worker
processes first (Triton's disk cache), then times them: tiles and splits at 4 warps and automatic
stages, then warps x stages for the best three.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
# Run as a script, this file's folder comes first on sys.path and its name would shadow kernels.
sys.path = [str(REPO)] + [p for p in sys.path if Path(p or ".").resolve() != HERE]

SHAPES = {"qkv_proj": (4096, 1024), "o_proj": (1024, 2048), "gate_up_proj": (6144, 1024), "down_proj": (1024, 3072)}
TINY_SHAPES = {"qkv_proj": (128, 256), "o_proj": (64, 512), "gate_up_proj": (192, 256), "down_proj": (64, 384)}
M_VALUES = [1, 8, 16, 32, 48, 64, 96, 128, 192, 256]
TINY_M = [1, 5]
MIN_CALLS = 20
L2_OVERFLOW = 3  # the weight copies in one graph cover this many L2 sizes
INF = float("inf")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--tiny", action="store_true", help="tiny shapes (for the CPU interpreter)")
    p.add_argument("--sweep", action="store_true", help="also sweep configs per (M, N, K)")
    p.add_argument("--shapes", nargs="+", choices=list(SHAPES), default=list(SHAPES))
    p.add_argument("--m", nargs="+", type=int, default=None, help=f"batch sizes (default {M_VALUES})")
    p.add_argument("--replays", type=int, default=10, help="graph replays per timing (median taken)")
    p.add_argument("--workers", type=int, default=min(16, os.cpu_count() or 1), help="sweep compile processes")
    p.add_argument("--out", default=str(HERE / "results" / "gemm.json"))
    return p.parse_args(argv)


# ---------------------------------------------------------------------------------------------
# The sweep grid (pure functions of the shape: no GPU needed)
# ---------------------------------------------------------------------------------------------

TILES_NK = [(bn, bk) for bn in (16, 32, 64, 128) for bk in (64, 128, 256) if 2048 <= bn * bk <= 16384]


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def auto_stages(block_m: int, block_n: int, block_k: int, k_tiles_per_split: int, silu: bool) -> int:
    """As the default table: enough stages for a split's K tiles, within ~96 KB of buffers."""
    stage_bytes = ((2 if silu else 1) * block_m + block_n) * block_k * 2
    return max(2, min(4, k_tiles_per_split + 1, 96 * 1024 // stage_bytes))


def sweep_candidates(M: int, N: int, K: int, sms: int, silu: bool, SkinnyConfig) -> list:
    """Stage one: tile shapes, splits and operand order at 4 warps and automatic stages.

    Pruned to: block_m from 16 up to M's power of two (at most 64); W tiles of 4-32 KB; splits
    that keep a whole K tile each and give between half an SM and 8 programs per SM.
    """
    top_m = min(64, max(16, 1 << (M - 1).bit_length()))
    configs = []
    for block_m in (16, 32, 64):
        if block_m > top_m:
            continue
        m_tiles = cdiv(M, block_m)
        for block_n, block_k in TILES_NK:
            if block_n > max(16, N) or block_k > max(16, K):
                continue
            tiles, k_tiles = m_tiles * cdiv(N, block_n), cdiv(K, block_k)
            for split in (1, 2, 4, 8):
                programs = tiles * split
                if split > k_tiles or (split > 1 and programs > 8 * sms) or programs < sms // 2:
                    continue
                stages = auto_stages(block_m, block_n, block_k, cdiv(k_tiles, split), silu)
                for swap_ab in (True, False):
                    configs.append(SkinnyConfig(block_m, block_n, block_k, split, 4, stages, swap_ab))
    return configs


def refinements(cfg, SkinnyConfig) -> list:
    """Stage two: warps x stages around one config."""
    return [SkinnyConfig(cfg.block_m, cfg.block_n, cfg.block_k, cfg.split_k, w, s, cfg.swap_ab)
            for w in (2, 4, 8) for s in (2, 3, 4, 5) if (w, s) != (cfg.num_warps, cfg.num_stages)]


def _compile_one(task) -> tuple[bool, str]:
    """Worker: compile one config by running it once on small inputs of the real (N, K)."""
    M, N, K, silu, fields = task
    import torch

    from kernels import skinny_gemm as sg

    try:
        x = torch.randn(M, 2 * K if silu else K, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16)
        sg.skinny_linear(x, w, silu_and_mul_input=silu, config=sg.SkinnyConfig(*fields))
        torch.cuda.synchronize()
        return True, ""
    except Exception as e:  # out of shared memory or registers
        return False, f"{type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"


# ---------------------------------------------------------------------------------------------
# Timing
# ---------------------------------------------------------------------------------------------


class GemmBench:
    def __init__(self, args: argparse.Namespace):
        import torch
        import torch.nn.functional as F

        from kernels import fused_ops
        from kernels import skinny_gemm as sg
        from kernels.triton_runtime import num_sms

        self.torch, self.F, self.fo, self.sg = torch, F, fused_ops, sg
        self.args = args
        self.device = torch.device(args.device)
        self.cuda = self.device.type == "cuda"
        self.sms = num_sms(self.device)
        self.dtype = torch.bfloat16
        self.shapes = {name: (TINY_SHAPES if args.tiny else SHAPES)[name] for name in args.shapes}
        self.m_values = args.m or (TINY_M if args.tiny else M_VALUES)
        self.l2_bytes = torch.cuda.get_device_properties(self.device).L2_cache_size if self.cuda else 0
        self.gen = torch.Generator(device=self.device).manual_seed(0)

    def randn(self, *shape):
        return self.torch.randn(*shape, generator=self.gen, device=self.device, dtype=self.dtype)

    def weight_pool(self, N: int, K: int) -> list:
        """Distinct weight copies, enough to overflow L2 (one on the CPU)."""
        copies = cdiv(L2_OVERFLOW * self.l2_bytes, N * K * 2) if self.cuda else 1
        return [self.randn(N, K) for _ in range(max(1, copies))]

    def time_us(self, call, weights, replays: int | None = None) -> float:
        """Median us per call of call(w) over the weights, back to back in one CUDA graph."""
        torch = self.torch
        if not self.cuda:
            call(weights[0])  # the interpreter compiles nothing; keep the shape of a warm run
            start = time.perf_counter()
            call(weights[0])
            return (time.perf_counter() - start) * 1e6
        calls = [weights[i % len(weights)] for i in range(max(MIN_CALLS, len(weights)))]
        for w in weights[:2]:
            call(w)  # compile, allocate workspaces and cuBLAS handles outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for w in calls:
                call(w)
        graph.replay()
        times = []
        for _ in range(replays or self.args.replays):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e3 / len(calls))
        del graph
        return statistics.median(times)

    def copy_bandwidth(self) -> dict:
        from bench.kernels import Bench

        return Bench(self.device, tiny=self.args.tiny).copy_bandwidth()

    # -- cuBLAS against the default config ----------------------------------------------------

    def compare(self) -> list[dict]:
        F, sg = self.F, self.sg
        rows = []
        print(f"\n{'shape':<13} {'M':>4} {'cuBLAS us':>9} {'TB/s':>5} {'skinny us':>9} {'TB/s':>5} {'speedup':>7}"
              f" {'rel err':>8}  default config")
        for name, (N, K) in self.shapes.items():
            weights = self.weight_pool(N, K)
            wbytes = N * K * 2
            for M in self.m_values:
                x = self.randn(M, K)
                cfg = sg.config_for(M, N, K, sms=self.sms)
                cublas_us = self.time_us(lambda w: F.linear(x, w), weights)  # noqa: B023
                skinny_us = self.time_us(lambda w: sg.skinny_linear(x, w, config=cfg), weights)  # noqa: B023
                ref = F.linear(x, weights[0]).double()
                err = ((sg.skinny_linear(x, weights[0], config=cfg).double() - ref).norm() / ref.norm()).item()
                row = {"shape": name, "M": M, "N": N, "K": K, "weight_bytes": wbytes, "config": cfg.__dict__,
                       "cublas_us": cublas_us, "skinny_us": skinny_us, "cublas_tb_per_s": wbytes / cublas_us / 1e6,
                       "skinny_tb_per_s": wbytes / skinny_us / 1e6, "rel_err_vs_cublas": err}
                if name == "down_proj":
                    gate_up = self.randn(M, 2 * K)
                    fused_cfg = sg.config_for(M, N, K, sms=self.sms, silu_and_mul_input=True)
                    row["chain_us"] = self.time_us(
                        lambda w: F.linear(self.fo.silu_and_mul(gate_up), w), weights)  # noqa: B023
                    row["fused_us"] = self.time_us(lambda w: sg.skinny_linear(  # noqa: B023
                        gate_up, w, silu_and_mul_input=True, config=fused_cfg), weights)
                    row["fused_config"] = fused_cfg.__dict__
                rows.append(row)
                c = cfg
                print(f"{name:<13} {M:>4} {cublas_us:>9.2f} {row['cublas_tb_per_s']:>5.2f} {skinny_us:>9.2f}"
                      f" {row['skinny_tb_per_s']:>5.2f} {cublas_us / skinny_us:>6.2f}x {err:>8.1e}  m{c.block_m}"
                      f" n{c.block_n} k{c.block_k} split{c.split_k} w{c.num_warps} s{c.num_stages}"
                      f"{' swap' if c.swap_ab else ''}"
                      + (f"  | silu+linear {row['chain_us']:.2f} us, fused {row['fused_us']:.2f} us"
                         if "fused_us" in row else ""))
            del weights
        return rows

    # -- sweep ---------------------------------------------------------------------------------

    def precompile(self, tasks: list) -> set:
        """Compile every config once, in worker processes; returns the tasks that failed."""
        if not self.cuda or self.args.workers <= 1 or not tasks:
            return set()
        import multiprocessing as mp

        start = time.perf_counter()
        with mp.get_context("spawn").Pool(self.args.workers) as pool:
            results = pool.map(_compile_one, tasks, chunksize=1)
        failed = {task for task, (ok, _) in zip(tasks, results) if not ok}
        for reason in sorted({why for ok, why in results if not ok})[:5]:
            print(f"  compile failure: {reason}")
        print(f"compiled {len(tasks)} configs in {time.perf_counter() - start:.0f} s ({len(failed)} failed)")
        return failed

    def sweep(self) -> tuple[list[dict], list[dict]]:
        """Stage one for every (shape, M), then stage two around each one's best three; each stage's
        configs compile in parallel before any is timed."""
        sg = self.sg
        SkinnyConfig = sg.SkinnyConfig
        plans = []  # (name, M, N, K, silu): {config: us; None: not timed yet; inf: did not compile}
        for name, (N, K) in self.shapes.items():
            silu = name == "down_proj"
            for M in self.m_values:
                plans.append(((name, M, N, K, silu),
                              dict.fromkeys(sweep_candidates(M, N, K, self.sms, silu, SkinnyConfig))))
        self.time_plans(plans)
        for _, timed in plans:
            top = sorted((c for c in timed if timed[c] < INF), key=timed.get)[:3]
            for cfg in top:
                timed.update({v: None for v in refinements(cfg, SkinnyConfig) if v not in timed})
        self.time_plans(plans)

        rows, best_rows = [], []
        print("\nsweep: best per (shape, M), against the default config")
        for (name, M, N, K, silu), timed in plans:
            wbytes = N * K * 2
            ok = [c for c in timed if timed[c] < INF]
            rows += [{"shape": name, "M": M, "N": N, "K": K, "silu_and_mul_input": silu, "config": c.__dict__,
                      "us": timed[c], "tb_per_s": wbytes / timed[c] / 1e6} for c in ok]
            if not ok:
                print(f"  {name:<13} M={M:<4} no config ran")
                continue
            default = sg.config_for(M, N, K, sms=self.sms, silu_and_mul_input=silu)
            if default not in timed:
                timed[default] = self.time_configs(name, M, N, K, silu, [default])[default]
            default_us = timed[default]
            best = min(ok, key=timed.get)
            best_rows.append({"shape": name, "M": M, "N": N, "K": K, "silu_and_mul_input": silu,
                              "config": best.__dict__, "us": timed[best], "tb_per_s": wbytes / timed[best] / 1e6,
                              "default_us": default_us, "configs_timed": len(ok)})
            print(f"  {name:<13} M={M:<4} best {timed[best]:7.2f} us {wbytes / timed[best] / 1e6:5.2f} TB/s"
                  f" (default {default_us:7.2f} us, {len(ok)} timed)"
                  f"  CONFIGS[({M}, {N}, {K})] = {best}")
        return rows, best_rows

    def time_plans(self, plans: list) -> None:
        """Time every config still marked None in each plan (compiling them all first)."""
        pending = [(key, [c for c, us in timed.items() if us is None]) for key, timed in plans]
        tasks = sorted({(1, N, K, silu, tuple(c.__dict__.values()))
                        for (_, _, N, K, silu), cfgs in pending for c in cfgs})
        failed = {(N, K, silu, fields) for _, N, K, silu, fields in self.precompile(tasks)}
        for (key, cfgs), (_, timed) in zip(pending, plans):
            _, _, N, K, silu = key
            broken = {c for c in cfgs if (N, K, silu, tuple(c.__dict__.values())) in failed}
            timed.update(dict.fromkeys(broken, INF))
            timed.update(self.time_configs(*key, [c for c in cfgs if c not in broken]))

    def time_configs(self, name: str, M: int, N: int, K: int, silu: bool, cfgs: list) -> dict:
        """{config: median us per call, inf where it did not compile}."""
        sg = self.sg
        weights = self.weight_pool(N, K)
        x = self.randn(M, 2 * K if silu else K)
        timed = {}
        for cfg in cfgs:
            try:
                timed[cfg] = self.time_us(lambda w: sg.skinny_linear(  # noqa: B023
                    x, w, silu_and_mul_input=silu, config=cfg), weights, replays=5)  # noqa: B023
            except Exception as e:  # out of shared memory or registers
                print(f"  skip {name} M={M} {cfg}: {type(e).__name__}")
                timed[cfg] = INF
        return timed


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.device == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"  # before the kernels are decorated
    bench = GemmBench(args)
    torch = bench.torch
    name = torch.cuda.get_device_name(bench.device) if bench.cuda else "cpu (interpreter)"
    results = {"device": name, "copy": bench.copy_bandwidth()}
    print(f"device: {name}; d2d copy {results['copy']['tb_per_s']:.2f} TB/s (read + write)")
    results["rows"] = bench.compare()
    if args.sweep:
        results["sweep"], results["best"] = bench.sweep()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
