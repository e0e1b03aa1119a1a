"""Speculative decoding: tokens per second and time per output token with and without speculation (n-gram, or a
draft model with --speculative-method draft --draft-model DIR), at several concurrencies, on prompts that reward
n-gram (editing, summarising a given text, code with repetition) and on plain chat; with the acceptance figures.
Greedy, ignore_eos, fixed output length, so every engine generates the same tokens (the test suite checks they
are equal). --stop-at-eos ends each request at the model's end of sequence instead (--max-tokens stays a cap): what a
real editing request costs, where ignore_eos would time the text a model writes after its answer has ended.

    python bench/speculative.py [--model DIR] [--concurrency 1,4,16,64] [--max-tokens 128] [--rounds 3]
        [--requests-per-slot 4] [engine flags]
    python bench/speculative.py --self-draft-ks 1,2,4,8 [...]   # the mechanism's ceiling, see below

--self-draft-ks runs the model as its own draft (every proposal accepted, bar near-ties) at each K against no
speculation: the most a draft-model step can give at that K, where the draft costs what the target costs.

Each concurrency c is a closed loop of c clients (LLM.generate's max_concurrency): a request is sent as soon as
one ends, as a server's clients keep its slots full; --requests-per-slot x c requests a row (every prompt at least
once, taken in turn). Waves of c requests that wait for the slowest one (as this bench ran until 2026-12-04) count
a sequence's gain only when every sequence of the wave gains: plain chat there ran as many steps with speculation as
without (a step ratio of 1.00-1.02 at 4 and 16), so it paid the verifications' cost and got nothing. Each row runs
--rounds times; TPOT is its wall time times c over the tokens generated (time to first
token included). The speculating engine runs each row's rounds interleaved (A B B A ...) with rounds of the same
requests opted out of speculation (SamplingParams.disable_speculation): a row is a fraction of a second, and the
machine's drift between rows a few seconds apart (GPU clocks, host noise) moved per-step times by ~10% when each
engine ran its rows in turn. That ratio is the table's first; the second is against a plain engine (no
speculation configured), run after it, which also shows what configuring speculation costs a request that does
not use it. Two engines up at once on one GPU are no cure: both slowed by 10-30% (H200, 2026-12-04). Each engine
is warmed up first: a short chat batch, then at each concurrency an editing batch that speculates, so the
verification path's first-use costs (kernels compiled for its row counts, the rejection sampler's first calls)
fall before the measured rows. Rates, steps and acceptance are over all rounds; the tokens compared are the first
round's. Prints a table (with the ratio of step counts, which host noise barely moves) and writes JSON (--out).

Where a row's tokens differ from the plain engine's (bf16 on a GPU: a batch of other shape runs other GEMM tiles),
the plain engine generates that row's requests again, untimed, with the top-5 logprobs (requests with logprobs
never speculate), and the table says where the first difference is and whether it is a near-tie there: both
tokens in the plain engine's top 5, within NEAR_TIE_NATS (the project's standard for a flipped token). In bf16
the gap is also worth reading in bf16 units: a logit between 16 and 32 is a multiple of 0.125.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from scheduler_svc.common.config import add_engine_args, engine_config_from_args  # noqa: E402
from scheduler_svc.entrypoints.llm import LLM  # noqa: E402
from scheduler_svc.frontend.sampling_params import SamplingParams  # noqa: E402
from scheduler_svc.text.tokenizer import Tokenizer  # noqa: E402

TEXT = ("The city council met on Monday evening to discuss the new budget. After a long debate, the members "
        "agreed to increase funding for public libraries, to repair the old bridge over the river, and to "
        "reduce spending on office supplies. The mayor said that the decision would help families and students, "
        "and that the council would review the results at the end of the year.")
CODE = ("class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n\n"
        "    def add(self, other):\n        return Point(self.x + other.x, self.y + other.y)\n\n"
        "    def sub(self, other):\n        return Point(self.x - other.x, self.y - other.y)\n\n")
WORKLOADS = {
    "editing": [f"Repeat this text exactly, changing nothing: {TEXT}", f"Fix any spelling mistakes in: {TEXT}",
                f"Rewrite this text in the past tense: {TEXT}", f"Copy this paragraph: {TEXT}"],
    "summarising": [f"Summarise this text in three sentences: {TEXT}", f"What did the council decide? {TEXT}"],
    "code": [f"Add mul and div methods to this class, in the same style:\n{CODE}",
             f"Write the same class with a z coordinate:\n{CODE}"],
    "chat": ["What is the capital of France?", "Write a short poem about the sea.", "Give me three tips for sleep.",
             "Explain what a CPU does.", "Tell me a fun fact about cats.", "How do airplanes fly?"],
}


NEAR_TIE_NATS = 0.02
TOP_LOGPROBS = 5


def first_difference(plain: list[int], other: list[int], top: list) -> dict | None:
    """Where other first leaves plain, and whether plain's top-5 there (engine_pb2.TokenLogprobs per position, or
    none) call it a near-tie. None when they are equal."""
    at = next((i for i, (a, b) in enumerate(zip(plain, other)) if a != b), None)
    if at is None and len(plain) == len(other):
        return None
    if at is None:
        return {"position": min(len(plain), len(other)), "near_tie": False, "gap_nats": None}
    found = {"position": at, "plain_token": plain[at], "other_token": other[at], "near_tie": False, "gap_nats": None}
    if at < len(top):
        lp = dict(zip(top[at].top_token_ids, top[at].top_logprobs))
        if plain[at] in lp and other[at] in lp:
            found["gap_nats"] = lp[plain[at]] - lp[other[at]]
            found["near_tie"] = found["gap_nats"] <= NEAR_TIE_NATS
    return found


def explain_differences(llm: LLM, requests: list[list[int]], params: SamplingParams, plain: list[list[int]],
                        other: list[list[int]]) -> list[dict | None]:
    """For each request whose tokens differ: its first difference, judged by the plain engine's top-5 logprobs,
    generated again (untimed) by llm, a plain engine. A request whose logprob run itself left the timed plain
    tokens is reported as such (rerun_differs)."""
    differing = [i for i, (a, b) in enumerate(zip(plain, other)) if a != b]
    found: list[dict | None] = [None] * len(requests)
    if not differing:
        return found
    params = dataclasses.replace(params, logprobs=TOP_LOGPROBS)
    results = llm.generate([requests[i] for i in differing], params, use_tqdm=False)
    for i, r in zip(differing, results):
        out = r.outputs[0]
        found[i] = first_difference(plain[i], other[i], out.logprobs)
        found[i]["rerun_differs"] = list(out.token_ids) != plain[i]
    return found


def warm_up(llm: LLM, prompts: dict[str, list[list[int]]], warmup_prompt: list[int], concurrency: list[int]) -> int:
    """Runs every path the measured rows take once: plain decode and prefill, and (with speculation on)
    verification at each measured batch size. Returns the verifying steps it ran."""
    before = llm.stats().num_speculative_steps
    llm.generate(prompts[next(iter(prompts))][:2], SamplingParams(max_tokens=8), use_tqdm=False)
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=24)
    for c in concurrency:
        llm.generate([warmup_prompt] * c, params, use_tqdm=False)
    return llm.stats().num_speculative_steps - before


def workload_requests(batch: list[list[int]], concurrency: int, per_slot: int) -> list[list[int]]:
    """A row's requests at this concurrency: the workload's prompts in turn (wrapping round), per_slot for each of
    the c slots, and every prompt at least once."""
    return [batch[i % len(batch)] for i in range(max(len(batch), per_slot * concurrency))]


def measure(llm: LLM, requests: list[list[int]], params: SamplingParams, concurrency: int) -> tuple[float, list]:
    """One round of a row: the requests, `concurrency` at a time in a closed loop (LLM.generate's max_concurrency).
    Returns seconds and results."""
    t0 = time.perf_counter()
    results = llm.generate(requests, params, use_tqdm=False, max_concurrency=concurrency)
    return time.perf_counter() - t0, results


def run_engine(args, overrides: dict, variants: dict[str, bool], prompts: dict[str, list[list[int]]],
               warmup_prompt: list[int], compare: list[dict] | None = None) -> dict[str, list[dict]]:
    """One engine of the flags with these config fields changed, warmed up, then every workload and concurrency for
    each variant (label -> whether its requests opt out of speculation, SamplingParams.disable_speculation), their
    rounds interleaved (in turn, the order reversed every other round: A B B A ...), so that the machine's drift
    (GPU clocks, host noise: ~10% in per-step time between rows run seconds apart) weighs on each variant alike.
    Rows labelled by variant, in the same order for each. compare: when this is the plain engine, the speculating
    variant's rows, in the same order: it then explains, untimed, where their tokens differ from its own
    (explain_differences)."""
    config = dataclasses.replace(engine_config_from_args(args), **overrides)
    engine_args = {k: v for k, v in vars(config).items() if k != "model"}
    params = {label: SamplingParams(temperature=0.0, ignore_eos=not args.stop_at_eos, max_tokens=args.max_tokens,
                                    disable_speculation=opt_out) for label, opt_out in variants.items()}
    labels = list(variants)
    rows: dict[str, list[dict]] = {label: [] for label in labels}
    with LLM(config.model, **engine_args) as llm:
        print(f"  {'/'.join(labels)}: warm-up ran {warm_up(llm, prompts, warmup_prompt, args.concurrency)} "
              f"verifying steps", flush=True)
        for name, batch in prompts.items():
            for c in args.concurrency:
                requests = workload_requests(batch, c, args.requests_per_slot)
                elapsed, tokens = dict.fromkeys(labels, 0.0), dict.fromkeys(labels, 0)
                results: dict[str, list] = {}
                counts = {label: [] for label in labels}  # (stats before, after) of each of its rounds
                for label in labels * args.warm_rounds:  # untimed: whatever a row's first run pays once
                    measure(llm, requests, params[label], c)
                for r in range(args.rounds):
                    for label in (labels if r % 2 == 0 else labels[::-1]):
                        before = llm.stats()
                        seconds, round_results = measure(llm, requests, params[label], c)
                        counts[label].append((before, llm.stats()))
                        elapsed[label] += seconds
                        tokens[label] += sum(len(x.outputs[0].token_ids) for x in round_results)
                        results.setdefault(label, round_results)  # the first round's tokens are compared
                for label in labels:
                    rows[label].append(row(label, name, c, args.rounds, elapsed[label], tokens[label],
                                           results[label], counts[label]))
                    r = rows[label][-1]
                    print(f"  {label:<10}{name:<12}{c:>4}: {r['tok_per_s']:9.1f} tok/s, TPOT {r['tpot_ms']:.2f} ms, "
                          f"{r['steps']} steps, accepted {r['accepted']}/{r['proposed']}", flush=True)
                    if compare is not None:
                        r["differences"] = explain_differences(llm, requests, params[label], r["tokens"],
                                                               compare[len(rows[label]) - 1]["tokens"])
    return rows


def row(label: str, workload: str, c: int, rounds: int, elapsed: float, tokens: int, results: list,
        counts: list[tuple]) -> dict:
    """A table row: rates over all rounds; the engine's step and speculation counts over the variant's own rounds
    (stats before and after each)."""
    delta = lambda f: sum(getattr(after, f) - getattr(before, f) for before, after in counts)  # noqa: E731
    steps = delta("num_speculative_steps")
    positions = [sum(pos) for pos in zip(*([a - b for a, b in zip(after.accepted_per_position,
                                                                  before.accepted_per_position or
                                                                  [0] * len(after.accepted_per_position))]
                                           for before, after in counts))]
    return {"method": label, "workload": workload, "concurrency": c, "rounds": rounds, "output_tokens": tokens,
            "seconds": elapsed, "tok_per_s": tokens / elapsed, "tpot_ms": 1000 * elapsed * c / tokens,
            "steps": delta("num_steps"), "verifying_steps": steps, "proposed": delta("num_proposed_tokens"),
            "accepted": delta("num_accepted_tokens"),
            "acceptance": delta("num_accepted_tokens") / max(1, delta("num_proposed_tokens")),
            "mean_accepted_length": 1 + delta("num_accepted_tokens") / steps if steps else 0.0,
            "accepted_per_position": positions, "tokens": [r.outputs[0].token_ids for r in results],
            # where the steps' time went: decode-only steps in the decode graphs, steps with a prefill chunk apart
            "prefill_steps": delta("num_prefill_steps"), "prefill_step_seconds": delta("prefill_step_seconds"),
            "decode_step_seconds": delta("decode_step_seconds"),
            "executor_busy_seconds": delta("executor_busy_seconds"),
            "executor_idle_seconds": delta("executor_idle_seconds"),
            # steps by wall time (SchedulerStats.step_seconds_bounds): a one-off stall shows here
            "step_seconds_counts": step_count_deltas(counts),
            "step_seconds_bounds": list(counts[0][1].step_seconds_bounds)}


def step_count_deltas(counts: list[tuple]) -> list[int]:
    """Steps by wall time over a variant's rounds (SchedulerStats.step_seconds_counts, before and after each)."""
    n = len(counts[0][1].step_seconds_counts)
    return [sum(after.step_seconds_counts[i] - (before.step_seconds_counts[i] if len(before.step_seconds_counts) > i
                                                 else 0) for before, after in counts) for i in range(n)]


def describe(differences: list[dict | None] | None) -> str:
    """A row's differing requests in a few words: how many, how many are near-ties, each first difference."""
    found = [d for d in differences or [] if d is not None]
    if not found:
        return ""
    ties = sum(d["near_tie"] for d in found)
    first = ", ".join(f"@{d['position']}" + ("" if d["gap_nats"] is None else f" {d['gap_nats']:.3f}n")
                      + (" rerun differs" if d.get("rerun_differs") else "") for d in found[:4])
    return f" ({len(found)} differ, {ties} near-tie{'s' if ties != 1 else ''}: {first})"


def slow_steps(r: dict, seconds: float) -> int:
    """How many of a row's steps took longer than `seconds` (one of SchedulerStats.step_seconds_bounds)."""
    return sum(r["step_seconds_counts"][r["step_seconds_bounds"].index(seconds) + 1:])


def time_shares(opted_out: list[dict], on: list[dict], method: str) -> None:
    """Where each row's step time went, both variants: decode-only steps (the decode graphs on CUDA), steps with a
    prefill chunk (piecewise graphs there, attention eager), and rank 0's idle time between its reply and the next plan."""
    print("\nwhere the time went (ms a step): decode-only steps (in the graphs), steps with a prefill chunk (piecewise "
          "graphs on CUDA), and rank 0's idle time waiting for the next plan")
    print(f"{'workload':<12}{'conc':>5}  {'variant':<10}{'steps':>7}{'prefill':>9}{'decode ms':>11}{'prefill ms':>12}"
          f"{'idle ms':>9}  steps over 20 ms / 100 ms")
    for o, b in zip(opted_out, on):
        for label, r in (("opted out", o), (method, b)):
            decode_steps = max(1, r["steps"] - r["prefill_steps"])
            print(f"{r['workload']:<12}{r['concurrency']:>5}  {label:<10}{r['steps']:>7}{r['prefill_steps']:>9}"
                  f"{1e3 * r['decode_step_seconds'] / decode_steps:>11.3f}"
                  f"{1e3 * r['prefill_step_seconds'] / max(1, r['prefill_steps']):>12.3f}"
                  f"{1e3 * r['executor_idle_seconds'] / max(1, r['steps']):>9.3f}  {slow_steps(r, 0.02)} / "
                  f"{slow_steps(r, 0.1)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", default="1,4,16,64")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--rounds", type=int, default=3,
                        help="run each row this many times; rates and counts are over all of them")
    parser.add_argument("--warm-rounds", type=int, default=1,
                        help="run each row's variants this many times untimed first (one-off costs: JIT, caches)")
    parser.add_argument("--requests-per-slot", type=int, default=4,
                        help="each row sends this many requests per slot of its concurrency (all prompts at least once)")
    parser.add_argument("--stop-at-eos", action="store_true",
                        help="end each request at the model's end of sequence (--max-tokens a cap), not ignore_eos")
    parser.add_argument("--out", default="speculative.json")
    parser.add_argument("--self-draft-ks", default="",
                        help="the ceiling: the model as its own draft at each of these K (e.g. 1,2,4,8) against off")
    add_engine_args(parser)
    args = parser.parse_args()
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    config = engine_config_from_args(args)
    tokenizer = Tokenizer(config.model)
    prompts = {name: [tokenizer.encode_chat([{"role": "user", "content": p}]) for p in WORKLOADS[name]]
               for name in args.workloads.split(",")}
    # Not one of the measured prompts: a text to copy, which n-gram proposals predict from the first tokens.
    warmup_prompt = tokenizer.encode_chat([{"role": "user", "content": f"Copy this text exactly: {CODE}"}])
    if args.self_draft_ks:
        ceiling(args, config, prompts, warmup_prompt)
        return
    # one engine speculates, its rounds interleaved with rounds of the same requests opted out; then a plain engine,
    # which explains where the tokens differ
    method = config.speculative_method or "ngram"
    rows = run_engine(args, {"speculative_method": method}, {method: False, "opted out": True}, prompts,
                      warmup_prompt)
    on, opted_out = rows[method], rows["opted out"]
    off = run_engine(args, {"speculative_method": None, "draft_model": None}, {"off": False}, prompts, warmup_prompt,
                     compare=on)["off"]
    proposer = f"draft {os.path.basename(config.draft_model)}" if method == "draft" else \
        f"ngram {config.ngram_min}..{config.ngram_max}"
    print(f"\nspeculative decoding, {proposer}, K={config.num_speculative_tokens}, max batch "
          f"{config.speculative_max_batch_size}, "
          + (f"to the end of sequence (at most {args.max_tokens} tokens)" if args.stop_at_eos
             else f"{args.max_tokens} tokens each") + f", {args.rounds} rounds")
    print("ratio: against the same requests opted out, in the same engine, rounds interleaved; vs off: against the "
          "plain engine, run after it; steps: the step count's ratio")
    print(f"{'workload':<12}{'conc':>5}{'off tok/s':>11}{'opted out':>11}{method + ' tok/s':>13}{'ratio':>7}"
          f"{'vs off':>8}{'TPOT':>8}{'steps':>7}{'accept':>8}{'mean len':>9}  same tokens")
    for a, o, b in zip(off, opted_out, on):
        same = a.pop("tokens") == b.pop("tokens")
        o.pop("tokens")
        b["same_tokens_as_off"] = same
        print(f"{a['workload']:<12}{a['concurrency']:>5}{a['tok_per_s']:>11.1f}{o['tok_per_s']:>11.1f}"
              f"{b['tok_per_s']:>13.1f}{b['tok_per_s'] / o['tok_per_s']:>7.2f}{b['tok_per_s'] / a['tok_per_s']:>8.2f}"
              f"{b['tpot_ms']:>7.2f}m{b['steps'] / o['steps']:>7.2f}{b['acceptance']:>8.2f}"
              f"{b['mean_accepted_length']:>9.2f}  {same}{describe(a.get('differences'))}")
    time_shares(opted_out, on, method)
    with open(args.out, "w") as f:
        json.dump({"config": {k: v for k, v in vars(config).items()}, "off": off, "opted_out": opted_out, method: on},
                  f, indent=1)


def ceiling(args, config, prompts: dict[str, list[list[int]]], warmup_prompt: list[int]) -> None:
    """The model as its own draft at each K of --self-draft-ks, each engine's rounds interleaved with the same
    requests opted out: a table of ratios."""
    ks = [int(k) for k in args.self_draft_ks.split(",")]
    runs, opted_out = {}, {}
    for k in ks:
        rows = run_engine(args, {"speculative_method": "draft", "draft_model": config.model,
                                 "num_speculative_tokens": k}, {f"self K={k}": False, "opted out": True},
                          prompts, warmup_prompt)
        runs[k], opted_out[k] = rows[f"self K={k}"], rows["opted out"]
    print(f"\nthe model as its own draft (the ceiling of a draft step), max batch {config.speculative_max_batch_size},"
          f" {args.max_tokens} tokens each, {args.rounds} rounds: tok/s against the same requests opted out (the same"
          f" engine, interleaved), acceptance, mean accepted length")
    print(f"{'workload':<12}{'conc':>5}{'opted out':>11}" + "".join(f"{f'K={k} ratio':>12}{'acc':>6}{'len':>6}"
                                                              for k in ks) + "  same tokens")
    for n, a in enumerate(opted_out[ks[0]]):
        tokens = a["tokens"]
        same = all(runs[k][n].pop("tokens") == tokens for k in ks)
        print(f"{a['workload']:<12}{a['concurrency']:>5}{a['tok_per_s']:>11.1f}" + "".join(
            f"{runs[k][n]['tok_per_s'] / opted_out[k][n]['tok_per_s']:>12.2f}{runs[k][n]['acceptance']:>6.2f}"
            f"{runs[k][n]['mean_accepted_length']:>6.2f}" for k in ks) + f"  {same}")
        for k in ks:
            runs[k][n]["same_tokens_as_opted_out"] = same
    for rows in opted_out.values():
        for r in rows:
            r.pop("tokens", None)
    with open(args.out, "w") as f:
        json.dump({"config": {k: v for k, v in vars(config).items()},
                   "opted_out": {str(k): rows for k, rows in opted_out.items()},
                   "self_draft": {str(k): rows for k, rows in runs.items()}}, f, indent=1)


if __name__ == "__main__":
    main()
