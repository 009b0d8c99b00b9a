#!/usr/bin/env bash
# The GPU half of the benchmarks in one call of a lent machine (see benchmarks/RESULTS.md, "GPU runs"), most
# important figure first, inside six minutes on a fresh machine:
#   1. Llama-3.1-8B-shaped decode at 32K, HeteroCache against full KV (recall steps apart, trigger rate)
#   2. the same steps one at a time and pipelined (bench_pipeline: what generate's overlap of host and device gives)
#   3. the recall path (bench_offload: gather, transfer, overlap with compute)
#   4. the decode kernels (numerics compiled on the GPU, the pool kernel's timing)
#   5. offloaded FreeKV against full KV at 32K (issue 36's FreeKV target; its table goes to the log)
#   6. the decode step kernel by kernel, host events beside (profile_step)
#   7. stage 2 again with XLA's command buffers (CUDA graphs) off: their per-step update was 2.7 ms of host time
#   8. 128K latency, then the per-group kernel's launch sweep, while time is left
#
#   make gpu-bundle          # once, here: the authors' Llama profile into .gpuref/ (git-ignored)
#   device run, carry [".gpuref"]:
#   OUT=/some/dir HETERO_JAX_COMMIT=<commit> BUDGET_S=330 bash benchmarks/gpu_session.sh
#   OUT=/tmp/gpu-dry PYTHON=.venv/bin/python bash benchmarks/gpu_session.sh --dry-run   # tiny shapes on a CPU (tests/test_gpu_session.py)
#
# Every stage is its own process under a deadline, writing its own JSON under $OUT as it goes, so a stage
# that fails or runs out of time loses only itself. Join latency lengths afterwards with
#   python benchmarks/bench_latency.py --preset llama8b-gpu --merge $OUT/lat-*.json --write-results
# The other stages' JSON carry their markdown ("markdown" key) for RESULTS.md. At most 8 files come back
# from a lent machine: this writes 8 at most (log, two latency lengths, two pipeline runs, offload, kernels, profile);
# the FreeKV stage's and the kernel sweep's JSON stay on the machine with the plots, their tables in the log.
set -u
DRY=0
[[ "${1:-}" == "--dry-run" ]] && DRY=1
OUT=${OUT:?set OUT to the output folder}
BUDGET_S=${BUDGET_S:-330}
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.92}
if [[ -z "${HETERO_JAX_REFERENCE_DIR:-}" && -d "$PWD/.gpuref" ]]; then
  export HETERO_JAX_REFERENCE_DIR=$PWD/.gpuref
fi
if (( ! DRY )) && [[ ! -f "${HETERO_JAX_REFERENCE_DIR:-/nonexistent}/official_profile_llama-3.1-8b-instruct.json" ]]; then
  echo "gpu_session.sh: the authors' Llama-3.1-8B profile is not here: run 'make gpu-bundle' and carry .gpuref" \
       "(or set HETERO_JAX_REFERENCE_DIR)" >&2
  exit 2
fi
mkdir -p "$OUT"
PLOTS=$(mktemp -d)  # the latency plots stay on the machine: at most 8 files come back
t_end=$(( $(date +%s) + BUDGET_S ))
left() { echo $(( t_end - $(date +%s) )); }
stage() {   # stage NAME MAX_SECONDS CMD...: run CMD under min(MAX, time left - 5) seconds (a dry run: time left)
  local name=$1 max=$2; shift 2
  (( DRY )) && max=$(left)  # MAX is sized for a GPU; tiny shapes on a loaded CPU may take longer, and their time means nothing
  local t=$(( $(left) - 5 )); (( t > max )) && t=$max
  if (( t < 30 )); then echo "=== $name: skipped ($(left) s left)"; return; fi
  echo "=== $name (limit ${t}s, $(left)s left) $(date +%T)"
  timeout --signal=INT --kill-after=10 "$t" "$@"
  echo "=== $name: rc=$? $(date +%T)"
}

if (( DRY )); then  # the same stages at tiny shapes (SmolLM2, its shipped profile): the plumbing, not numbers
  LAT32=(--real-lengths 256 --synthetic-lengths --policies full heterocache --budgets 0.5 --decode-steps 4
         --warmup-steps 2 --ttft-warmup 0 --ttft-repeats 1)
  FREEKV32=(--real-lengths 256 --synthetic-lengths --policies full freekv --budgets 0.5 --decode-steps 4
            --warmup-steps 2 --ttft-warmup 0 --ttft-repeats 1)
  OFFLOAD=(--small --iters 3 --warmup 1 --overlap)
  PROFILE=(--length 256 --warmup 1 --steps 2 --policies full heterocache)
  PIPELINE=(--length 256 --warmup 1 --block 2 --rounds 1 --policies full heterocache)
else
  LAT32=(--preset llama8b-gpu --synthetic-lengths 32768 --policies full heterocache --ttft-warmup 1)
  FREEKV32=(--preset llama8b-gpu --synthetic-lengths 32768 --policies full freekv --ttft-warmup 0)
  OFFLOAD=(--overlap)
  PROFILE=(--shape llama-3.1-8b --dtype bfloat16 --length 32768 --warmup 6 --steps 10 --top 30
           --policies full heterocache:tau_drift=-1 heterocache)
  PIPELINE=(--shape llama-3.1-8b --dtype bfloat16 --length 32768 --warmup 4 --block 10 --rounds 4
            --policies full heterocache:tau_drift=-1 heterocache)
fi

{
  (( DRY )) || nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv
  $PY -c "import jax, jaxlib, flax; print('jax', jax.__version__, 'jaxlib', jaxlib.__version__, 'flax', flax.__version__, jax.devices())"
  stage "latency 32768" 170 $PY benchmarks/bench_latency.py "${LAT32[@]}" --no-progress \
    --out "$OUT/lat-32768.json" --plot "$PLOTS/lat-32768.png"
  stage pipeline 90 $PY benchmarks/bench_pipeline.py "${PIPELINE[@]}" --out "$OUT/pipeline.json"
  stage offload 50 $PY benchmarks/bench_offload.py "${OFFLOAD[@]}" --out "$OUT/offload.json"
  if (( DRY )); then
    echo "=== kernels: not in a dry run (compiled kernels need a GPU; tests/test_kernels.py checks them here)"
  else
    stage kernels 100 $PY benchmarks/bench_kernels.py --no-progress --out "$OUT/kernels.json"
  fi
  stage "latency 32768, FreeKV" 150 $PY benchmarks/bench_latency.py "${FREEKV32[@]}" --no-progress \
    --out "$PLOTS/lat-32768-freekv.json" --plot "$PLOTS/lat-32768-freekv.png"
  stage profile 100 $PY benchmarks/profile_step.py "${PROFILE[@]}" --out "$OUT/profile-32k.json"
  if (( ! DRY )); then
    XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_enable_command_buffer=" stage "pipeline, no command buffers" 90 \
      $PY benchmarks/bench_pipeline.py "${PIPELINE[@]}" --out "$OUT/pipeline-nocmdbuf.json"
  fi
  if (( ! DRY )); then
    stage "latency 131072" 300 $PY benchmarks/bench_latency.py --preset llama8b-gpu --synthetic-lengths 131072 \
      --policies full heterocache --ttft-warmup 0 --decode-steps 32 --no-progress \
      --out "$OUT/lat-131072.json" --plot "$PLOTS/lat-131072.png"
    # the sweep writes kernels-sweep.json beside --out: a ninth file, so it stays with the plots (its table is in the log)
    stage sweep 150 $PY benchmarks/bench_kernels.py --sweep --no-progress --out "$PLOTS/kernels.json"
  fi
  echo "=== done, $(left)s of ${BUDGET_S}s left"
} 2>&1 | tee "$OUT/log.txt"
