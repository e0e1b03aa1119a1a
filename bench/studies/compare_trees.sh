#!/usr/bin/env bash
# Serving throughput of an older tree against this one, in one device-tool call: why did the gRPC waves of a22f1ae (2026-11-30)
# vary by up to 1.6x (issue #12)? Extracts the tarball of the old tree (`git archive a22f1ae -o .old/a22f1ae.tar`,
# carried; the first argument, that by default) to /tmp, builds its stubs, then launches 4 fresh servers, old,
# new, old, new, each serving 3 waves of the nanovllm draws from 2 client processes (bench/serving.py
# --server-tree for the old one), with the probe's CPU per token by role and executor idle share per wave.
# Run it from the repo root with the wheels installed and this tree's stubs built, as bench/run_on_gpu.sh does
# before its steps. COMPARE_ARGS adds flags to every run (engine flags, or a CPU smoke run: --model-shape tiny
# --device cpu --num-prompts 8 --max-input-len 64 --max-output-len 16 --client-procs 1 --repeat 2).
# Every JSON and log goes into one tarball, $OUT/compare_trees.tgz; the table is printed last.
set -uo pipefail
TAR=${1:-.old/a22f1ae.tar}
OUT=${OUT:-/tmp/nanoserve-out}
NAME=$(basename "$TAR" .tar)
OLD=/tmp/oldtree-$NAME
RUNS=/tmp/compare-trees  # kept off $OUT, which brings back a limited number of files
export PYTHONUNBUFFERED=1
rm -rf "$OLD" "$RUNS"
mkdir -p "$OLD" "$RUNS" "$OUT"
tar xf "$TAR" -C "$OLD" || exit 1
(cd "$OLD" && python3 -m grpc_tools.protoc -I. --python_out=. --pyi_out=. --grpc_python_out=. protos/*.proto) || exit 1
for n in 1 2; do
  for tree in old new; do
    tree_args=()
    [[ $tree == old ]] && tree_args=(--server-tree "$OLD")
    run="${tree}_$n"
    echo "== $run (${SECONDS}s in)"
    python3 bench/serving.py --dataset nanovllm --launch --repeat 3 --client-procs 2 --startup-timeout 150 \
      "${tree_args[@]}" --out "$RUNS/$run.json" --server-log "$RUNS/${run}_server.log" ${COMPARE_ARGS:-} \
      > "$RUNS/$run.log" 2>&1 \
      || { echo "$run failed ($run.log in the tarball):"; tail -n 5 "$RUNS/$run.log"; }
    grep -E "^(server tree|the |launching)" "$RUNS/$run.log"
  done
done
tar czf "$OUT/compare_trees.tgz" -C "$RUNS" .
python3 - "$RUNS" "$NAME" <<'PY'
import json, os, sys
runs, name = sys.argv[1], sys.argv[2]
print(f"\nold = {name}, new = this tree; CPU in us per output token, and in cores (CPU s / wave s)")
print(f"{'tree':<5}{'launch':>7}{'wave':>5}{'tok/s':>8}{'FE us':>7}{'sch us':>7}{'ex us':>7}{'FE cor':>7}"
      f"{'sch cor':>8}{'ex idle':>8}{'no step':>8}{'tok/msg':>8}")
for n in (1, 2):
    for tree in ("old", "new"):
        path = os.path.join(runs, f"{tree}_{n}.json")
        if not os.path.exists(path):
            print(f"{tree:<5}{n:>7}  (no results)")
            continue
        for r in json.load(open(path))["runs"]:
            s = r["server"]
            us, cpu = s.get("cpu_us_per_token", {}), s.get("cpu_s", {})
            ex_us = sum(v for k, v in us.items() if k.startswith("executor"))
            idle = f"{s['executor_idle_share']:.1%}" if "executor_idle_share" in s else "-"
            nostep = f"{s['no_step_share']:.1%}" if "no_step_share" in s else "-"
            cores = {role: f"{cpu[role] / r['duration_s']:.2f}" if role in cpu else "-"
                     for role in ("frontend", "scheduler")}
            print(f"{tree:<5}{n:>7}{r['wave']:>5}{r['output_throughput']:>8.0f}{us.get('frontend', 0):>7.1f}"
                  f"{us.get('scheduler', 0):>7.1f}{ex_us:>7.1f}{cores['frontend']:>7}{cores['scheduler']:>8}"
                  f"{idle:>8}{nostep:>8}{s['tokens_per_client_message']:>8.2f}")
PY
