#!/usr/bin/env bash
# One device-tool call on the GPU machine: install the carried wheels (.whl, made by
# ../shared/gpu/wheels.sh), build the stubs, then run the steps named as arguments:
#   tests        pytest -m gpu (TESTS names files)
#   kernels      bench/kernels.py
#   throughput   bench/throughput.py (256 seqs; THROUGHPUT_ARGS adds flags; repeat it for several runs)
#   profile      bench/step_profile.py (PROFILE_ARGS adds flags)
#   serving      bench/serving.py on throughput's workload and engine flags over gRPC: the offline figure,
#                then 5 waves on one launched server from 2 client processes, and the ratios
#                (SERVING_ARGS adds flags, e.g. --scale-check for a wave at 4 client processes)
#   fused        bench/fused_ops.py (fused small ops and the sampler against their torch chains)
#   preemption   bench/preemption.py (every preemption mode x policy; PREEMPTION_ARGS adds flags, e.g.
#                --workloads c-nanovllm: all three take longer than one call)
#   timeline     bench/throughput.py with torch.profiler windows in the executor (PROFILE_STEPS,
#                default 80:10,400:10,800:10,1000:10): GPU busy and idle per step, top kernels
# Logs go to $OUT; the tables are printed last.
set -uo pipefail
OUT=${OUT:-/tmp/nanoserve-out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
python3 -m grpc_tools.protoc -I. --python_out=. --pyi_out=. --grpc_python_out=. protos/*.proto || exit 1
nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm --format=csv,noheader
summary=()
for step in "$@"; do
  case "$step" in
    tests)
      python3 -m pytest -q -m gpu -p no:cacheprovider -x ${TESTS:-} 2>&1 | tee "$OUT/gpu_tests.log" | tail -n 30
      summary+=("tests: $(tail -n 1 "$OUT/gpu_tests.log")") ;;
    kernels)
      python3 bench/kernels.py --out "$OUT/kernels.json" ${KERNELS_ARGS:-} 2>&1 | tee "$OUT/kernels.log" | tail -n 40 ;;
    throughput)
      python3 bench/throughput.py --no-progress --out "$OUT/throughput.json" ${THROUGHPUT_ARGS:-} \
        > "$OUT/throughput.log" 2>&1
      grep -v " INFO " "$OUT/throughput.log" | tail -n 25
      # a repeated step overwrites the files: the summary keeps every run's row
      summary+=("throughput ${THROUGHPUT_ARGS:-}: $(grep -E '^ +nanoserve ' "$OUT/throughput.log" | tail -n 1)") ;;
    timeline)
      NANOSERVE_PROFILE_DIR="$OUT/prof" NANOSERVE_PROFILE_STEPS="${PROFILE_STEPS:-80:10,400:10,800:10,1000:10}" \
        python3 bench/throughput.py --no-progress --out "$OUT/throughput_profiled.json" ${THROUGHPUT_ARGS:-} \
        > "$OUT/timeline.log" 2>&1
      grep -v " INFO " "$OUT/timeline.log" | tail -n 4
      python3 -m executor_svc.step_profiler "$OUT/prof" ;;
    serving)
      python3 bench/serving.py --dataset nanovllm --launch --offline-too --repeat 5 --client-procs 2 \
        --server-log "$OUT/serving_server.log" --out "$OUT/serving.json" ${SERVING_ARGS:-} > "$OUT/serving.log" 2>&1
      grep -v " INFO " "$OUT/serving.log" | tail -n 16
      summary+=("serving ${SERVING_ARGS:-}: $(grep -E '^gRPC / offline' "$OUT/serving.log" | tail -n 1)") ;;
    preemption)
      python3 bench/preemption.py --out "$OUT/preemption.json" ${PREEMPTION_ARGS:-} > "$OUT/preemption.log" 2>&1
      grep -v -E " (INFO|WARNING) " "$OUT/preemption.log" | tail -n 14 ;;
    fused)
      python3 bench/fused_ops.py --out "$OUT/fused_ops.json" 2>&1 | tee "$OUT/fused_ops.log" | tail -n 40 ;;
    profile)
      python3 bench/step_profile.py ${PROFILE_ARGS:-} 2>&1 | grep -v " INFO " | tee "$OUT/profile.log" | tail -n 45 ;;
    *) echo "unknown step $step"; exit 2 ;;
  esac
done
printf '%s\n' "${summary[@]}"
