"""Structured output: token-mask fill time and grammar compile time on the scheduler, and throughput with
half the requests constrained by a JSON schema.

--mode mask (CPU): a nested JSON schema over a Qwen3-size vocabulary (151,936 tokens). No Qwen3 tokenizer
is on these machines, so by default the vocabulary is a synthetic byte-level one of that size
(synthetic_tokenizer.py: the 256 bytes, JSON punctuation, and words, numbers and spaced pieces like
Qwen3's); --tokenizer DIR takes a real tokenizer.json instead. The matcher walks a valid document token
by token and each mask is timed (median, p99; the first mask after a compile, which builds the lexer's
states lazily, is reported apart), then one step's masks for B rows through the scheduler's own path
(StructuredOutputs.plan_masks: mask_fill.py, llguidance's pool from 8 rows on where there are cores).
Compile time per schema: a fresh matcher each.

--mode throughput: bench/throughput.py's workload through the real engine, all requests free, then half
of them constrained by the nested schema (the same prompts and max_tokens; ignore_eos), with the synthetic
tokenizer beside the random-weight model. On the H200: the defaults (Qwen3-0.6B, 256 sequences). On the
CPU: --shape tiny --num-seqs 8 --max-input-len 64 --max-output-len 48 --min-len 16 --device cpu. With async
scheduling constrained rows decode every step, their masks sent after the plan: "late masks" counts those,
"mask wait" is rank 0's time waiting for them before sampling (inside "exec busy"; on a GPU the forward runs
meanwhile).

    python bench/structured.py [--mode mask] [--rows 1 16 128] [--tokenizer DIR]
    python bench/structured.py --mode throughput [--shape qwen3-0.6b] [engine flags]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.nanovllm_workload import ENGINE_DEFAULTS, MODEL_SHAPES, dummy_model_dir, workload  # noqa: E402
from bench.synthetic_tokenizer import write_synthetic_tokenizer  # noqa: E402

QWEN3_VOCAB = 151_936
QWEN3_EOS = 151_645


def _obj(required, **properties) -> dict:
    return {"type": "object", "properties": properties, "required": required, "additionalProperties": False}


ADDRESS = _obj(["street", "city", "zip"], street={"type": "string", "maxLength": 40},
               city={"type": "string", "maxLength": 30}, zip={"type": "string", "pattern": "^[0-9]{5}$"})
NESTED = _obj(  # an order: nested objects, arrays of objects, enums, bounded numbers, optional fields
    ["id", "customer", "items", "status"],
    id={"type": "integer", "minimum": 1, "maximum": 10**9},
    customer=_obj(["name", "email", "address"], name={"type": "string", "maxLength": 40},
                  email={"type": "string", "pattern": "^[a-z0-9.]+@[a-z0-9]+\\.[a-z]{2,4}$"}, address=ADDRESS,
                  vip={"type": "boolean"}),
    items={"type": "array", "minItems": 1, "maxItems": 20, "items": _obj(
        ["sku", "quantity", "price"], sku={"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
        quantity={"type": "integer", "minimum": 1, "maximum": 100},
        price={"type": "number", "minimum": 0, "maximum": 10000}, note={"type": "string", "maxLength": 200})},
    status={"enum": ["new", "paid", "shipped", "delivered", "cancelled"]},
    notes={"type": "string", "maxLength": 4000})
DOCUMENT = {"id": 48213, "customer": {"name": "Ada Lovelace", "email": "ada@example.org", "address": {
    "street": "12 Analytical Road", "city": "London", "zip": "10001"}, "vip": True}, "items": [
    {"sku": "ENG-0001", "quantity": 2, "price": 1999.5, "note": "fragile"},
    {"sku": "CAR-0420", "quantity": 10, "price": 3.25}], "status": "paid",
    "notes": "Deliver in the morning, ring twice."}
SCHEMAS = {
    "nested order": NESTED,
    "flat person": _obj(["name", "age"], name={"type": "string"}, age={"type": "integer", "minimum": 0}),
    "array of ints": {"type": "array", "items": {"type": "integer"}},
    "refs": {"$defs": {"node": _obj(["value"], value={"type": "integer"},
                                    children={"type": "array", "items": {"$ref": "#/$defs/node"}})},
             "$ref": "#/$defs/node"},
    "big enum": {"enum": [f"option-{i}" for i in range(500)]},
    "any JSON object": {"type": "object"},
}


def walk(tokenizer, matcher, text: str, mask) -> list[int]:
    """Tokens that spell text as a model would sample them: at each step the longest allowed token that
    the rest of the text starts with (json.dumps writes ": " and ", ", as the grammar does)."""
    from llguidance.numpy import fill_next_token_bitmask

    by_bytes = {}
    for token in range(tokenizer.vocab_size):
        by_bytes.setdefault(tokenizer.decode_bytes([token]), token)
    rest, tokens = text.encode(), []
    while rest:
        fill_next_token_bitmask(matcher, mask)
        for length in range(min(len(rest), 32), 0, -1):
            token = by_bytes.get(rest[:length])
            if token is not None and mask[0, token // 32] >> (token % 32) & 1:
                break
        else:
            raise AssertionError(f"no allowed token spells {rest[:20]!r}")
        assert matcher.consume_token(token)
        tokens.append(token)
        rest = rest[length:]
    return tokens


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


# ---------------------------------------------------------------- --mode mask


def bench_masks(tokenizer_dir: str, vocab: int, eos: int, repeats: int, rows_list: list[int]) -> dict:
    import llguidance
    import numpy as np
    from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask

    from protos import engine_pb2
    from scheduler_svc.core.scheduler_output import ScheduledSeq
    from scheduler_svc.core.sequence import Sequence
    from scheduler_svc.core.structured.compiler import GrammarCompiler, tokenizer_loader
    from scheduler_svc.core.structured.grammars import grammar_of
    from scheduler_svc.core.structured.structured_outputs import StructuredOutputs

    t0 = time.perf_counter()
    tokenizer = tokenizer_loader(tokenizer_dir, vocab, (eos,))()
    tokenizer_seconds = time.perf_counter() - t0
    constraint = engine_pb2.Constraint(json_schema=json.dumps(NESTED))
    grammar = grammar_of(constraint)
    compile_ms = {}
    for name, schema in SCHEMAS.items():
        g = grammar_of(engine_pb2.Constraint(json_schema=json.dumps(schema)))
        t0 = time.perf_counter()
        matcher = llguidance.LLMatcher(tokenizer, g)
        compile_ms[name] = (time.perf_counter() - t0) * 1e3
        assert not matcher.is_error(), matcher.get_error()

    template = llguidance.LLMatcher(tokenizer, grammar)
    mask = allocate_token_bitmask(1, vocab)
    tokens = walk(tokenizer, template.deep_copy(), json.dumps(DOCUMENT), mask)
    first_ms, fills_us = [], []
    for _ in range(repeats):
        matcher = llguidance.LLMatcher(tokenizer, grammar)  # a fresh compile: its first mask builds lexer states
        t0 = time.perf_counter()
        fill_next_token_bitmask(matcher, mask)
        first_ms.append((time.perf_counter() - t0) * 1e3)
        matcher = template.deep_copy()
        for token in tokens:
            t0 = time.perf_counter()
            fill_next_token_bitmask(matcher, mask)
            fills_us.append((time.perf_counter() - t0) * 1e6)
            assert mask[0, token // 32] >> (token % 32) & 1, "the document's own token was masked out"
            assert matcher.consume_token(token)
    assert matcher.is_accepting()

    # one step's masks for B rows as the scheduler fills them, each row at a different point of the document
    step_ms = {}
    for rows in rows_list:
        structured = StructuredOutputs(GrammarCompiler(lambda: tokenizer), vocab)
        seqs = []
        for i in range(rows):
            seq = Sequence(seq_id=i + 1, request_id=str(i), token_ids=[1], num_prompt_tokens=1,
                           sampling=engine_pb2.SamplingOptions(), stopping=engine_pb2.StoppingOptions(),
                           constraint=constraint)
            structured.add(seq)
            seqs.append(seq)
        while structured.compiling:
            structured.poll()
            time.sleep(0.001)
        for i, seq in enumerate(seqs):
            structured.matchers[seq.seq_id].consume_tokens(tokens[: (i * 7) % (len(tokens) - 1)])
        scheduled = [ScheduledSeq(seq, 1, False, 1, True) for seq in seqs]
        times = []
        for _ in range(max(5, repeats)):
            t0 = time.perf_counter()
            masks, _ = structured.plan_masks(scheduled)
            times.append((time.perf_counter() - t0) * 1e3)
        step_ms[rows] = {"median": statistics.median(times), "p99": percentile(times, 0.99)}
        assert np.count_nonzero(np.frombuffer(masks.words, dtype="<i4")) > 0
    return {"vocab_size": vocab, "tokenizer_dir": tokenizer_dir, "tokenizer_load_seconds": tokenizer_seconds,
            "document_tokens": len(tokens), "fill_us": {"median": statistics.median(fills_us),
                                                        "p99": percentile(fills_us, 0.99), "n": len(fills_us)},
            "first_fill_ms": statistics.median(first_ms), "compile_ms": compile_ms, "step_fill_ms": step_ms}


def print_masks(r: dict) -> None:
    print(f"\ntoken masks: nested JSON schema, vocabulary {r['vocab_size']} ({r['tokenizer_dir']}), "
          f"a {r['document_tokens']}-token document")
    f = r["fill_us"]
    print(f"  one mask: median {f['median']:.1f} us, p99 {f['p99']:.1f} us over {f['n']} fills (target <= 50 us "
          f"median); first mask after a compile {r['first_fill_ms']:.2f} ms")
    print(f"  {'rows':>5} {'step fill median ms':>20} {'p99 ms':>8}")
    for rows, t in r["step_fill_ms"].items():
        print(f"  {rows:>5} {t['median']:>20.3f} {t['p99']:>8.3f}")
    print(f"  compile (tokenizer load {r['tokenizer_load_seconds']:.2f} s, once):")
    for name, ms in r["compile_ms"].items():
        print(f"  {name:>20} {ms:>8.2f} ms")


# ---------------------------------------------------------------- --mode throughput


def run_throughput(args, model_dir: str, constrain_half: bool) -> dict:
    from scheduler_svc.common.config import engine_config_from_args
    from scheduler_svc.entrypoints.llm import LLM
    from scheduler_svc.frontend.sampling_params import SamplingParams

    prompts, max_tokens = workload(args.num_seqs, args.max_input_len, args.max_output_len, args.workload_seed,
                                   args.min_len, args.min_len)
    config = engine_config_from_args(args)
    engine_args = {k: v for k, v in vars(config).items() if k != "model"}
    with LLM(model_dir, **engine_args) as llm:
        warm = SamplingParams(max_tokens=8, json_schema=NESTED)  # compiles the schema: both runs start warm
        llm.generate([list(range(1, 12))], warm, use_tqdm=False)
        before = llm.stats()
        params = [SamplingParams(temperature=args.temperature, ignore_eos=True, max_tokens=m,
                                 json_schema=NESTED if constrain_half and i % 2 else None)
                  for i, m in enumerate(max_tokens)]
        t0 = time.perf_counter()
        results = llm.generate(prompts, params, use_tqdm=not args.no_progress)
        elapsed = time.perf_counter() - t0
        after = llm.stats()
    delta = lambda name: getattr(after, name) - getattr(before, name)  # noqa: E731
    constrained = [r.outputs[0] for i, r in enumerate(results) if constrain_half and i % 2]
    out_tokens = sum(len(r.outputs[0].token_ids) for r in results)
    return {"run": "half constrained" if constrain_half else "all free", "output_tokens": out_tokens,
            "seconds": elapsed, "output_tok_per_s": out_tokens / elapsed, "steps": delta("num_steps"),
            "masked_steps": delta("num_masked_steps"), "token_masks": delta("num_token_masks"),
            "late_token_masks": delta("num_late_token_masks"),
            "late_mask_wait_seconds": delta("late_mask_wait_seconds"),
            "mask_ms_per_masked_step": 1e3 * delta("token_mask_seconds") / max(1, delta("num_masked_steps")),
            "executor_busy_seconds": delta("executor_busy_seconds"),
            "executor_idle_seconds": delta("executor_idle_seconds"),
            "constrained_tokens": sum(len(o.token_ids) for o in constrained),
            "constrained_finished_by_grammar": sum(o.finish_reason == "stop" for o in constrained)}


def print_throughput(rows: list[dict], args) -> None:
    print(f"\nthroughput: {args.num_seqs} seqs, input U[{args.min_len},{args.max_input_len}], output "
          f"U[{args.min_len},{args.max_output_len}], async scheduling {'on' if args.async_scheduling else 'off'}")
    print(f"{'run':>17} {'out tokens':>10} {'seconds':>8} {'tok/s':>9} {'steps':>6} {'masked':>7} "
          f"{'mask ms/step':>12} {'late masks':>10} {'mask wait':>9} {'exec busy':>9} {'exec idle':>9} "
          f"{'constr. tokens':>14} {'grammar ends':>12}")
    for r in rows:
        print(f"{r['run']:>17} {r['output_tokens']:>10} {r['seconds']:>8.2f} {r['output_tok_per_s']:>9.0f} "
              f"{r['steps']:>6} {r['masked_steps']:>7} {r['mask_ms_per_masked_step']:>12.3f} "
              f"{r['late_token_masks']:>10} {r['late_mask_wait_seconds']:>9.2f} "
              f"{r['executor_busy_seconds']:>9.2f} {r['executor_idle_seconds']:>9.2f} "
              f"{r['constrained_tokens']:>14} {r['constrained_finished_by_grammar']:>12}")
    print(f"ratio half constrained / all free: {rows[1]['output_tok_per_s'] / rows[0]['output_tok_per_s']:.3f}x "
          f"(target >= 0.8x)")


def main() -> None:
    from scheduler_svc.common.config import add_engine_args

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mode", choices=["mask", "throughput"], default="mask")
    parser.add_argument("--tokenizer", default=None, help="a directory with tokenizer.json (default: synthetic)")
    parser.add_argument("--repeats", type=int, default=20, help="walks of the document (mask mode)")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16, 128], help="rows per step (mask mode)")
    parser.add_argument("--shape", choices=sorted(MODEL_SHAPES), default="qwen3-0.6b", help="throughput mode")
    parser.add_argument("--num-seqs", type=int, default=256)
    parser.add_argument("--max-input-len", type=int, default=1024)
    parser.add_argument("--max-output-len", type=int, default=1024)
    parser.add_argument("--min-len", type=int, default=100, help="lower bound of input and output lengths")
    parser.add_argument("--workload-seed", type=int, default=0)
    parser.add_argument("--temperature", type=float, default=0.6)
    parser.add_argument("--no-progress", action="store_true")
    parser.add_argument("--out", default=None, help="JSON results (default: bench/results/structured_MODE.json)")
    add_engine_args(parser)
    parser.set_defaults(**ENGINE_DEFAULTS)
    args = parser.parse_args()
    out = args.out or f"bench/results/structured_{args.mode}.json"
    with tempfile.TemporaryDirectory(prefix="structured-") as tmp:
        if args.mode == "mask":
            tokenizer_dir = args.tokenizer or write_synthetic_tokenizer(tmp, QWEN3_VOCAB, QWEN3_EOS)
            result = bench_masks(tokenizer_dir, QWEN3_VOCAB, QWEN3_EOS, args.repeats, args.rows)
            print_masks(result)
        else:
            shape = MODEL_SHAPES[args.shape]
            model = dummy_model_dir(shape)  # config.json alone: random weights
            write_synthetic_tokenizer(model.name, shape["vocab_size"], shape["eos_token_id"])
            args.load_format = "dummy"
            rows = [run_throughput(args, model.name, constrain_half) for constrain_half in (False, True)]
            model.cleanup()
            print_throughput(rows, args)
            result = {"num_seqs": args.num_seqs, "shape": args.shape, "async_scheduling": args.async_scheduling,
                      "max_steps_in_flight": args.max_steps_in_flight, "rows": rows,
                      "ratio": rows[1]["output_tok_per_s"] / rows[0]["output_tok_per_s"]}
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    with open(out, "w") as f:
        json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
