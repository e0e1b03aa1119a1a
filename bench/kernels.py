"""Benchmarks of the Triton attention kernels; a benchmark, not a test.

  python bench/kernels.py                      # H200: decode bandwidth, prefill TFLOP/s, store GB/s
  python bench/kernels.py --sweep              # + decode tile / warps / stages / splits sweep
  python bench/kernels.py --prefill-sweep      # + prefill tiles / warps / stages on the workload's batch
  python bench/kernels.py --ragged             # + decode at the throughput run's ragged contexts, by splits
  python bench/kernels.py --device cpu --tiny  # interpreter smoke run, tiny shapes, seconds
  python bench/kernels.py --sweep --kv-cache-dtype fp8   # the sweeps over an fp8 pool
  python bench/kernels.py --moe-only --moe-sweep         # the fused MoE layer alone, + its tile sweep
  python bench/kernels.py --moe-only --moe-fp8           # + the layer with FP8 experts against bf16

Decode is memory bound, so it is scored as effective bandwidth: K+V bytes of every context read
once, divided by the kernel time, next to a plain device-to-device copy measured in the same run.
Heads are Qwen3-0.6B's (16 q heads, 8 KV heads, D=128), bf16, block size 16. The fp8 decode table
runs the same batches from an fp8 pool (--kv-cache-dtype fp8, per-head scales) against bf16 in the
same call: bandwidth over the fp8 bytes, and context tokens per second for both.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
# Run as a script, this file's folder comes first on sys.path and its name would shadow the
# kernels package.
sys.path = [str(REPO)] + [p for p in sys.path if Path(p or ".").resolve() != HERE]

from bench import moe_kernels  # noqa: E402

Q_HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 16, 8, 128, 16
DECODE_SHAPES = [(b, c) for b in (64, 256) for c in (512, 1024, 4096)]  # (seqs, context)
PREFILL_SHAPES = [(4, 1024, 0), (4, 1024, 3072), (1, 8192, 0)]  # (seqs, new tokens each, cached prefix)
STORE_TOKENS = 8192


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--tiny", action="store_true", help="tiny shapes (for the CPU interpreter)")
    p.add_argument("--sweep", action="store_true", help="also sweep decode configs")
    p.add_argument("--prefill-sweep", action="store_true",
                   help="also sweep prefill configs, on the throughput workload's ragged prefill batch too")
    p.add_argument("--ragged", action="store_true", help="also time decode over ragged contexts by split count")
    p.add_argument("--kv-cache-dtype", choices=["bf16", "fp8", "int8"], default="bf16",
                   help="the pool of the --sweep and --ragged runs (the fp8 vs bf16 decode table always runs)")
    p.add_argument("--ragged-configs", nargs="+", metavar="N,W,S", default=None,
                   help="decode tiles (BLOCK_N,warps,stages) for --ragged (default: the engine's choice)")
    p.add_argument("--moe-sweep", action="store_true", help="also sweep the fused MoE GEMM tiles (bench/moe_kernels.py)")
    p.add_argument("--moe-only", action="store_true", help="only the fused MoE layer (and its sweep), no attention")
    p.add_argument("--moe-fp8", action="store_true", help="also the MoE layer with FP8 experts against bf16")
    p.add_argument("--moe-sweep-inter", type=int, nargs="+", default=None, metavar="I",
                   help="sweep only these expert intermediate sizes (768: Qwen3-30B-A3B; 384: its -tp 2 slice)")
    p.add_argument("--moe-tiles-out", default=None, metavar="JSON",
                   help="write the sweep's MOE_TILES rows here (the engine takes them from NANOSERVE_MOE_TILES)")
    p.add_argument("--fp8-gemm", action="store_true",
                   help="only the FP8 GEMM table (bench/fp8_gemm_table.py: Qwen3-8B's GEMMs, fp8 vs bf16) and the "
                        "fused FP8 producers' table")
    p.add_argument("--fp8-gemm-sweep", action="store_true",
                   help="with --fp8-gemm: first sweep the Triton FP8 GEMM's tiles and use the fastest per shape and M")
    p.add_argument("--fp8-gemm-table-out", default=None, metavar="JSON",
                   help="with --fp8-gemm-sweep: write its choice for NANOSERVE_FP8_GEMM_TABLE")
    p.add_argument("--fp8-gemm-sweep-tokens", default=None, metavar="M,M,...",
                   help="with --fp8-gemm-sweep: sweep these token counts instead of SWEEP_TOKENS "
                        "(e.g. 160,192 to refine the rows between 128 and 256)")
    p.add_argument("--fp8-gemm-table-base", default=None, metavar="JSON",
                   help="with --fp8-gemm-table-out: an earlier sweep's JSON whose rows the new ones join "
                        "(a token count swept now replaces its old row)")
    p.add_argument("--out", default=str(HERE / "results" / "kernels.json"))
    return p.parse_args()


def main() -> None:
    args = parse_args()
    if args.device == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"  # before the kernels are decorated
    import torch

    bench = Bench(torch.device(args.device), tiny=args.tiny, sweep_pool=args.kv_cache_dtype)
    if args.fp8_gemm:
        from bench import fp8_gemm_table as fg

        results = {"device": bench.device_name}
        if args.fp8_gemm_sweep:
            tokens = [int(m) for m in args.fp8_gemm_sweep_tokens.split(",")] if args.fp8_gemm_sweep_tokens else None
            results["fp8_gemm_sweep"] = fg.fp8_gemm_sweep(bench.device, tokens)
            fg.print_fp8_gemm_sweep(results["fp8_gemm_sweep"])
            fg.apply_and_write_sweep(results["fp8_gemm_sweep"], args.fp8_gemm_table_out, args.fp8_gemm_table_base)
        results["fp8_gemm"] = fg.fp8_gemm_rows(bench.device)
        fg.print_fp8_gemm_table(results["fp8_gemm"])
        results["fp8_producers"] = fg.fused_producer_rows(lambda fn: bench.time_us(fn, graph=True), bench.device)
        fg.print_fused_producer_table(results["fp8_producers"])
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(results, indent=2))
        return
    results = {"device": bench.device_name, "copy": bench.copy_bandwidth()}
    print(f"device: {bench.device_name}; d2d copy {results['copy']['tb_per_s']:.2f} TB/s (read + write)")
    if args.moe_sweep:  # first: the layer table below then runs on the tiles it found (when pasted in)
        results["moe_sweep"] = moe_kernels.tile_sweep(bench, args.tiny, args.moe_sweep_inter)
        if args.moe_tiles_out:
            Path(args.moe_tiles_out).write_text(json.dumps(results["moe_sweep"]["tiles"]))
    results["moe_layer"] = moe_kernels.layer_table(bench, args.tiny)
    if args.moe_fp8 and not args.tiny:
        results["moe_fp8_layer"] = moe_kernels.fp8_layer_table(bench)
    if not args.moe_only:
        results["decode"] = bench.decode()
        results["decode_fp8"] = bench.decode_fp8()
        results["prefill"] = bench.prefill()
        results["store_kvcache"] = bench.store()
    if args.sweep:
        results["decode_sweep"] = bench.decode_sweep()
    if args.prefill_sweep:
        results["prefill_sweep"] = bench.prefill_sweep()
    if args.ragged:
        from kernels.attention.triton_tuning import DecodeConfig

        configs = [None] if not args.ragged_configs else [
            DecodeConfig(*map(int, c.split(","))) for c in args.ragged_configs]
        results["decode_ragged"] = [row for cfg in configs for row in bench.decode_ragged(cfg)]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    print(f"wrote {out}")


class Bench:
    def __init__(self, device, tiny: bool, sweep_pool: str = "bf16"):
        import torch
        import triton

        from kernels.attention import triton_backend as ta
        from kernels.triton_runtime import num_sms
        from kernels.attention.base import AttentionMetadata

        self.torch, self.triton, self.ta, self.Meta, self.num_sms = torch, triton, ta, AttentionMetadata, num_sms
        self.device = device
        self.sweep_pool = sweep_pool  # --sweep and --ragged over a bf16, fp8 or int8 pool
        self.dtype = torch.bfloat16
        self.heads = (Q_HEADS, KV_HEADS, HEAD_DIM)
        self.decode_shapes, self.prefill_shapes, self.store_tokens = DECODE_SHAPES, PREFILL_SHAPES, STORE_TOKENS
        if tiny:
            self.heads = (4, 2, 32)
            self.decode_shapes, self.prefill_shapes, self.store_tokens = [(2, 40)], [(2, 20, 8)], 16
        self.device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (interpreter)"
        self.gen = torch.Generator(device=device).manual_seed(0)

    # -- timing ------------------------------------------------------------------------------

    def time_us(self, fn, graph: bool = False) -> float:
        """Median microseconds; on the GPU with an L2 flush per call (do_bench), or graph-replayed."""
        if self.device.type != "cuda":
            fn()  # the interpreter has no compile step, but keep the shape of a warm run
            start = time.perf_counter()
            fn()
            return (time.perf_counter() - start) * 1e6
        testing = self.triton.testing
        # Both timers run fn on a stream of their own that does not wait for this one: the inputs just
        # made here (block tables, pools, decode order) must be written before fn reads them.
        self.torch.cuda.synchronize()
        if graph:  # no launch overhead, as decode runs in the server (CUDA graphs); no L2 flush
            return testing.do_bench_cudagraph(fn, rep=100, return_mode="median") * 1e3
        return testing.do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e3

    # -- inputs ------------------------------------------------------------------------------

    def randn(self, *shape):
        return self.torch.randn(*shape, generator=self.gen, device=self.device, dtype=self.dtype)

    def paged_batch(self, seqlens_q: list[int], seqlens_k: list[int]):
        """q and a pool whose blocks are shuffled across sequences, as in a long-running server."""
        torch = self.torch
        hq, hkv, d = self.heads
        blocks_each = [self.triton.cdiv(k, BLOCK_SIZE) for k in seqlens_k]
        num_blocks = sum(blocks_each)
        order = torch.randperm(num_blocks, generator=self.gen, device=self.device).to(torch.int32)
        block_tables = torch.zeros(len(seqlens_k), max(blocks_each), dtype=torch.int32, device=self.device)
        used = 0
        for i, n in enumerate(blocks_each):
            block_tables[i, :n] = order[used:used + n]
            used += n
        k_cache = self.randn(num_blocks, BLOCK_SIZE, hkv, d)
        v_cache = self.randn(num_blocks, BLOCK_SIZE, hkv, d)
        q = self.randn(sum(seqlens_q), hq, d)
        cu = torch.tensor([0] + torch.tensor(seqlens_q).cumsum(0).tolist(), dtype=torch.int32, device=self.device)
        meta = self.Meta(
            slot_mapping=torch.full((q.shape[0],), -1, dtype=torch.int64, device=self.device),
            cu_seqlens_q=cu,
            seqlens_k=torch.tensor(seqlens_k, dtype=torch.int32, device=self.device),
            block_tables=block_tables,
            max_seqlen_q=max(seqlens_q),
            max_seqlen_k=max(seqlens_k),
            block_size=BLOCK_SIZE,
        )
        return q, k_cache, v_cache, meta

    def quantized_pool(self, k_cache, v_cache, kind: str = "fp8"):
        """The pool quantized as the engine stores it (kernels/kv_quant.py), with scales from its amax: per KV
        head for fp8, per head and channel for int8."""
        from kernels.kv_quant import FP8_DTYPE, INT8_DTYPE, KVScales, quantize, scales_from_amax

        dtype, dims = (FP8_DTYPE, (0, 1, 3)) if kind == "fp8" else (INT8_DTYPE, (0, 1))
        scales = KVScales(*(scales_from_amax(c.abs().amax(dim=dims), dtype) for c in (k_cache, v_cache)))
        return quantize(k_cache, scales.k, dtype), quantize(v_cache, scales.v, dtype), scales

    def fp8_pool(self, k_cache, v_cache):
        return self.quantized_pool(k_cache, v_cache, "fp8")

    def pool_for_sweeps(self, k_cache, v_cache):
        """(k_cache, v_cache, kv_scales) of the --kv-cache-dtype the sweeps run on."""
        if self.sweep_pool == "bf16":
            return k_cache, v_cache, None
        return self.quantized_pool(k_cache, v_cache, self.sweep_pool)

    # -- benchmarks --------------------------------------------------------------------------

    def copy_bandwidth(self) -> dict:
        nbytes = (2 << 30) if self.device.type == "cuda" else (1 << 20)
        src = self.torch.empty(nbytes, dtype=self.torch.uint8, device=self.device)
        dst = self.torch.empty_like(src)
        us = self.time_us(lambda: dst.copy_(src))
        return {"bytes": 2 * nbytes, "us": us, "tb_per_s": 2 * nbytes / us / 1e6}

    def decode(self) -> list[dict]:
        torch, ta = self.torch, self.ta
        F = torch.nn.functional
        hq, hkv, d = self.heads
        rows = []
        print("\ndecode attention (bf16, block 16)")
        print(f"{'B':>5} {'C':>6} {'splits':>6} {'us':>8} {'TB/s':>6} {'graph us':>9} {'TB/s':>6}"
              f" {'sdpa us':>8} {'TB/s':>6} {'rel err':>8}")
        for num_seqs, context in self.decode_shapes:
            q, k_cache, v_cache, meta = self.paged_batch([1] * num_seqs, [context] * num_seqs)
            scale = d ** -0.5
            kv_bytes = 2 * num_seqs * context * hkv * d * k_cache.element_size()
            splits = ta.decode_num_splits(num_seqs, hkv, context, self.num_sms(self.device),
                                          ta.decode_config(ta._block_d(d)).block_n)
            run = lambda: ta.paged_decode_attention(q, k_cache, v_cache, meta, scale)  # noqa: E731
            us = self.time_us(run)
            graph_us = self.time_us(run, graph=True) if self.device.type == "cuda" else us

            # Dense SDPA over the same contexts: a reference point and a correctness check.
            blocks = meta.block_tables.long()
            k_dense = k_cache[blocks].flatten(1, 2)[:, :context].transpose(1, 2).contiguous()
            v_dense = v_cache[blocks].flatten(1, 2)[:, :context].transpose(1, 2).contiguous()
            q_dense = q.unsqueeze(2)
            sdpa = lambda: F.scaled_dot_product_attention(q_dense, k_dense, v_dense, scale=scale,  # noqa: E731
                                                          enable_gqa=True)
            ref = sdpa().squeeze(2).float()
            err = ((run().float() - ref).norm() / ref.norm()).item()
            sdpa_us = self.time_us(sdpa)
            del k_dense, v_dense
            row = {"num_seqs": num_seqs, "context": context, "splits": splits, "kv_bytes": kv_bytes,
                   "us": us, "tb_per_s": kv_bytes / us / 1e6, "graph_us": graph_us,
                   "graph_tb_per_s": kv_bytes / graph_us / 1e6, "sdpa_us": sdpa_us,
                   "sdpa_tb_per_s": kv_bytes / sdpa_us / 1e6, "rel_err_vs_sdpa": err}
            rows.append(row)
            print(f"{num_seqs:>5} {context:>6} {splits:>6} {us:>8.1f} {row['tb_per_s']:>6.2f} {graph_us:>9.1f}"
                  f" {row['graph_tb_per_s']:>6.2f} {sdpa_us:>8.1f} {row['sdpa_tb_per_s']:>6.2f} {err:>8.1e}")
            del q, k_cache, v_cache
            if self.device.type == "cuda":
                torch.cuda.empty_cache()  # the largest shape holds ~10 GB; free it before the next
        return rows

    def decode_fp8(self) -> list[dict]:
        """Decode over an fp8 and an int8 pool against the same batch over bf16, graph-replayed (eager on the CPU)."""
        ta = self.ta
        hq, hkv, d = self.heads
        graph = self.device.type == "cuda"
        rows = []
        print("\ndecode attention, fp8 and int8 pools vs bf16 (graph replay; TB/s over each pool's own bytes)")
        print(f"{'B':>5} {'C':>6} {'bf16 us':>8} {'TB/s':>6} {'fp8 us':>8} {'TB/s':>6} {'int8 us':>8} {'TB/s':>6}"
              f" {'Mtok/s bf16':>11} {'fp8':>7} {'int8':>7} {'fp8 x':>6} {'int8 x':>6} {'fp8 err':>8} {'int8 err':>8}")
        for num_seqs, context in self.decode_shapes:
            q, k_cache, v_cache, meta = self.paged_batch([1] * num_seqs, [context] * num_seqs)
            values = 2 * num_seqs * context * hkv * d  # K and V elements read
            tokens = num_seqs * context
            bf16 = lambda: ta.paged_decode_attention(q, k_cache, v_cache, meta, d ** -0.5)  # noqa: E731
            ref = bf16().float()
            bf16_us = self.time_us(bf16, graph=graph)
            row = {"num_seqs": num_seqs, "context": context, "bf16_us": bf16_us,
                   "bf16_tb_per_s": 2 * values / bf16_us / 1e6, "bf16_ctx_tok_per_s": tokens / bf16_us * 1e6}
            for kind in ("fp8", "int8"):
                k8, v8, scales = self.quantized_pool(k_cache, v_cache, kind)
                run = lambda: ta.paged_decode_attention(q, k8, v8, meta, d ** -0.5, kv_scales=scales)  # noqa: E731
                err = ((run().float() - ref).norm() / ref.norm()).item()
                us = self.time_us(run, graph=graph)
                row |= {f"{kind}_us": us, f"{kind}_tb_per_s": values / us / 1e6,
                        f"{kind}_ctx_tok_per_s": tokens / us * 1e6,
                        f"{kind}_speedup": bf16_us / us, f"{kind}_rel_err_vs_bf16": err}
                del k8, v8
            rows.append(row)
            print(f"{num_seqs:>5} {context:>6} {bf16_us:>8.1f} {row['bf16_tb_per_s']:>6.2f} {row['fp8_us']:>8.1f}"
                  f" {row['fp8_tb_per_s']:>6.2f} {row['int8_us']:>8.1f} {row['int8_tb_per_s']:>6.2f}"
                  f" {row['bf16_ctx_tok_per_s'] / 1e6:>11.0f} {row['fp8_ctx_tok_per_s'] / 1e6:>7.0f}"
                  f" {row['int8_ctx_tok_per_s'] / 1e6:>7.0f} {row['fp8_speedup']:>5.2f}x {row['int8_speedup']:>5.2f}x"
                  f" {row['fp8_rel_err_vs_bf16']:>8.1e} {row['int8_rel_err_vs_bf16']:>8.1e}")
            del q, k_cache, v_cache
            if self.device.type == "cuda":
                self.torch.cuda.empty_cache()
        return rows

    def prefill(self) -> list[dict]:
        ta = self.ta
        hq, hkv, d = self.heads
        rows = []
        print("\nprefill attention (bf16, causal, block 16)")
        print(f"{'seqs':>5} {'new':>6} {'prefix':>6} {'us':>9} {'TFLOP/s':>8}")
        for num_seqs, new, prefix in self.prefill_shapes:
            q, k_cache, v_cache, meta = self.paged_batch([new] * num_seqs, [prefix + new] * num_seqs)
            # Query i sees prefix + i + 1 keys; QK^T and PV are 2 flops per multiply-add each.
            flops = num_seqs * 4 * d * hq * sum(prefix + i + 1 for i in range(new))
            us = self.time_us(lambda: ta.paged_prefill_attention(q, k_cache, v_cache, meta, d ** -0.5))
            row = {"num_seqs": num_seqs, "new_tokens": new, "prefix": prefix, "flops": flops, "us": us,
                   "tflop_per_s": flops / us / 1e6}
            rows.append(row)
            print(f"{num_seqs:>5} {new:>6} {prefix:>6} {us:>9.1f} {row['tflop_per_s']:>8.1f}")
        return rows

    def prefill_sweep(self) -> list[dict]:
        """Every prefill config on a uniform batch and on the throughput workload's first prefill step
        (prompts U[100, 1024] filling 16384 tokens), where short ragged sequences leave tiles half masked."""
        import random

        ta = self.ta
        hq, hkv, d = self.heads
        rng = random.Random(0)
        ragged = []
        while sum(ragged) < 16384:
            ragged.append(min(rng.randint(100, 1024), 16384 - sum(ragged)))
        batches = {"4x1024": [1024] * 4, f"workload {len(ragged)} seqs": ragged}
        if self.device.type != "cuda":
            batches = {"tiny": [20, 7]}
        configs = [ta.PrefillConfig(m, n, w, s) for m in (64, 128) for n in (32, 64, 128) for w in (4, 8)
                   for s in (2, 3, 4)]
        if self.device.type != "cuda":
            configs = [ta.PrefillConfig(16, 16, 4, 1)]
        rows = []
        print(f"\nprefill sweep (default {ta.prefill_config(ta._block_d(d))}): best 5 per batch")
        for name, lens in batches.items():
            q, k_cache, v_cache, meta = self.paged_batch(lens, lens)
            flops = 4 * d * hq * sum(n * (n + 1) // 2 for n in lens)
            batch_rows = []
            for cfg in configs:
                try:
                    us = self.time_us(lambda: ta.paged_prefill_attention(  # noqa: B023
                        q, k_cache, v_cache, meta, d ** -0.5, config=cfg))
                except Exception as e:  # out of shared memory or registers: skip the config
                    print(f"  skip {cfg}: {type(e).__name__}")
                    continue
                batch_rows.append({"batch": name, "block_m": cfg.block_m, "block_n": cfg.block_n,
                                   "num_warps": cfg.num_warps, "num_stages": cfg.num_stages, "us": us,
                                   "tflop_per_s": flops / us / 1e6})
            batch_rows.sort(key=lambda r: r["us"])
            default = tuple(vars(ta.prefill_config(ta._block_d(d))).values())
            def is_default(r: dict) -> bool:
                return (r["block_m"], r["block_n"], r["num_warps"], r["num_stages"]) == default
            for r in batch_rows[:5] + [r for r in batch_rows[5:] if is_default(r)]:
                print(f"  {name:<22} m={r['block_m']:<4} n={r['block_n']:<4} warps={r['num_warps']} "
                      f"stages={r['num_stages']} {r['us']:9.1f} us {r['tflop_per_s']:6.1f} TFLOP/s"
                      f"{'  (default)' if is_default(r) else ''}")
            rows += batch_rows
        return rows

    def store(self) -> dict:
        torch, ta = self.torch, self.ta
        _, hkv, d = self.heads
        tokens = self.store_tokens
        k_cache = self.randn(2 * tokens // BLOCK_SIZE, BLOCK_SIZE, hkv, d)
        v_cache = self.randn(2 * tokens // BLOCK_SIZE, BLOCK_SIZE, hkv, d)
        key, value = self.randn(tokens, hkv, d), self.randn(tokens, hkv, d)
        slots = torch.randperm(2 * tokens, generator=self.gen, device=self.device)[:tokens]
        us = self.time_us(lambda: ta.store_kvcache(key, value, k_cache, v_cache, slots))
        nbytes = 2 * 2 * key.numel() * key.element_size()  # K and V, each read once and written once
        row = {"tokens": tokens, "bytes": nbytes, "us": us, "gb_per_s": nbytes / us / 1e3}
        print(f"\nstore_kvcache: {tokens} tokens, {us:.1f} us, {row['gb_per_s']:.0f} GB/s")
        return row

    def decode_sweep(self) -> list[dict]:
        """Every decode config on a few shapes; pick the defaults in kernels/attention/triton_tuning.py from it."""
        ta = self.ta
        hq, hkv, d = self.heads
        shapes = [(64, 512), (64, 4096), (256, 1024)] if self.device.type == "cuda" else self.decode_shapes
        configs = [ta.DecodeConfig(n, w, s) for n in (32, 64, 128) for w in (4, 8) for s in (2, 3, 4)]
        if self.device.type != "cuda":
            configs = configs[:2]
        rows = []
        print(f"\ndecode sweep ({self.sweep_pool} pool): best 5 per shape")
        for num_seqs, context in shapes:
            q, k_cache, v_cache, meta = self.paged_batch([1] * num_seqs, [context] * num_seqs)
            k_cache, v_cache, scales = self.pool_for_sweeps(k_cache, v_cache)
            kv_bytes = 2 * num_seqs * context * hkv * d * k_cache.element_size()
            auto = ta.decode_num_splits(num_seqs, hkv, context, self.num_sms(self.device), 64)
            shape_rows = []
            for cfg in configs:
                for splits in sorted({1, auto, 2 * auto}):
                    try:
                        us = self.time_us(lambda: ta.triton_decode_attention(  # noqa: B023
                            q, k_cache, v_cache, meta, d ** -0.5, num_splits=splits, config=cfg, kv_scales=scales),
                            graph=True)
                    except Exception as e:  # out of shared memory or registers: skip the config
                        print(f"  skip {cfg} splits={splits}: {type(e).__name__}")
                        continue
                    shape_rows.append({"num_seqs": num_seqs, "context": context, "block_n": cfg.block_n,
                                       "num_warps": cfg.num_warps, "num_stages": cfg.num_stages,
                                       "splits": splits, "us": us, "tb_per_s": kv_bytes / us / 1e6})
            shape_rows.sort(key=lambda r: r["us"])
            for r in shape_rows[:5]:
                print(f"  B={num_seqs:<4} C={context:<5} block_n={r['block_n']:<4} warps={r['num_warps']}"
                      f" stages={r['num_stages']} splits={r['splits']:<3} {r['us']:8.1f} us"
                      f" {r['tb_per_s']:5.2f} TB/s")
            rows += shape_rows
        return rows

    def decode_ragged(self, config=None) -> list[dict]:
        """The batches the throughput workload decodes at a few points of its run (contexts U[100, 1024]
        plus the tokens generated so far), timed in a graph at each split count: ragged contexts leave a
        tail of long programs that a per-sequence split evens out."""
        import random

        torch, ta = self.torch, self.ta
        hq, hkv, d = self.heads
        rng = random.Random(0)
        points = [(256, 80), (153, 400), (59, 800), (7, 1000)] if self.device.type == "cuda" else [(3, 8)]
        rows = []
        tile = f"({config.block_n}, {config.num_warps}, {config.num_stages})" if config else "the engine's"
        # a tile is the Triton kernel's; without one, the engine's choice (the Gluon kernel over an 8-bit pool)
        decode = functools.partial(ta.triton_decode_attention, config=config) if config else ta.paged_decode_attention
        print(f"\ndecode over ragged contexts (graph replay), tile {tile}: TB/s by split count")
        for num_seqs, generated in points:
            contexts = [rng.randint(100, 1024) + generated for _ in range(num_seqs)]
            q, k_cache, v_cache, meta = self.paged_batch([1] * num_seqs, contexts)
            k_cache, v_cache, scales = self.pool_for_sweeps(k_cache, v_cache)
            kv_bytes = 2 * sum(contexts) * hkv * d * k_cache.element_size()
            auto = ta.decode_num_splits(num_seqs, hkv, max(contexts), self.num_sms(self.device), 64)
            line = []
            order = torch.argsort(meta.seqlens_k, descending=True, stable=True).to(torch.int32)
            # longest contexts first (as the server runs decode), then batch order at every split count
            runs = [(True, 1), (True, 2)] + [(False, n) for n in (1, 2, 3, 4, 6, 8, 12, 16)]
            for longest_first, splits in runs:
                meta.decode_order = order if longest_first else None
                us = self.time_us(lambda: decode(  # noqa: B023
                    q, k_cache, v_cache, meta, d ** -0.5, num_splits=splits, kv_scales=scales),
                    graph=True)
                rows.append({"num_seqs": num_seqs, "generated": generated, "splits": splits, "auto": auto,
                             "config": [config.block_n, config.num_warps, config.num_stages] if config else None,
                             "longest_first": longest_first, "us": us, "tb_per_s": kv_bytes / us / 1e6})
                line.append(f"{'lpt' if longest_first else ''}{splits}:{kv_bytes / us / 1e6:.2f}")
            print(f"  B={num_seqs:<4} ctx~{sum(contexts) // num_seqs:<5} Triton kernel's own={auto:<3} " + " ".join(line))
            del q, k_cache, v_cache
        return rows


if __name__ == "__main__":
    main()
