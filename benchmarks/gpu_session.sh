#!/usr/bin/env bash
# The GPU half of the benchmarks in one call of a lent machine (see benchmarks/RESULTS.md, "GPU runs"):
# kernel numerics and timings, host-offload overlap, the decode kernel's launch-parameter sweep,
# Llama-3.1-8B-shaped latency up to 128K.
#
#   OUT=/some/dir HETERO_JAX_COMMIT=<commit> HETERO_JAX_REFERENCE_DIR=<dir with the authors' profiles> \
#       BUDGET_S=480 bash benchmarks/gpu_session.sh
#
# Every stage is its own process under a deadline, writing its own JSON under $OUT, so a stage that
# fails or runs out of time loses only itself. Latency lengths run in the order 32K, 16K while time
# is left (128K did not fit a lease's six minutes); join them afterwards with
#   python benchmarks/bench_latency.py --preset llama8b-gpu --merge $OUT/lat-*.json --write-results
# The other stages' JSON (kernels.json, kernels-sweep.json, offload.json) carry their markdown ("markdown"
# key) for RESULTS.md. At most 8 files come back from a lent machine: this writes at most 8
# (log, kernels, offload, two latency lengths, profile, sweep).
set -u
OUT=${OUT:?set OUT to the output folder}
BUDGET_S=${BUDGET_S:-480}
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.92}
t_end=$(( $(date +%s) + BUDGET_S ))
left() { echo $(( t_end - $(date +%s) )); }
stage() {   # stage NAME MAX_SECONDS CMD...: run CMD under min(MAX, time left - 5) seconds
  local name=$1 max=$2; shift 2
  local t=$(( $(left) - 5 )); (( t > max )) && t=$max
  if (( t < 30 )); then echo "=== $name: skipped ($(left) s left)"; return; fi
  echo "=== $name (limit ${t}s, $(left)s left) $(date +%T)"
  timeout --signal=INT --kill-after=10 "$t" "$@"
  echo "=== $name: rc=$? $(date +%T)"
}

{
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv
  $PY -c "import jax, jaxlib, flax; print('jax', jax.__version__, 'jaxlib', jaxlib.__version__, 'flax', flax.__version__, jax.devices())"
  stage kernels 150 $PY benchmarks/bench_kernels.py --no-progress --out "$OUT/kernels.json"
  stage offload 60 $PY benchmarks/bench_offload.py --out "$OUT/offload.json"
  # A kernel that does not compile here would stop every latency run: they then time the plain-JAX
  # references (the JSON's machine.env and machine.kernels say which ran)
  if ! timeout 120 $PY -c "
import jax, jax.numpy as jnp, pallas_kernels as pk
q = jnp.ones((1, 8, 4, 128), jnp.bfloat16); k = jnp.ones((1, 8, 256, 128), jnp.bfloat16)
jax.block_until_ready(pk.sparse_decode_attention(q, k, k, jnp.full((1, 8), 200, jnp.int32)))
qs = jnp.ones((1, 2, 5, 4, 128), jnp.bfloat16); ks = jnp.ones((1, 2, 256, 128), jnp.bfloat16)
base = jnp.zeros((1, 2, 16), jnp.int32) + jnp.arange(16, dtype=jnp.int32)
jax.block_until_ready(pk.drift_check(qs, ks, base, 16, 0.5, jnp.full((1, 2), 256, jnp.int32), backend='pallas'))
qp = jnp.ones((1, 8, 1, 4, 128), jnp.bfloat16); kp = jnp.ones((1, 4096, 128), jnp.bfloat16)
offs = jnp.arange(8, dtype=jnp.int32)[None] * 512; lens = jnp.full((1, 8), 300, jnp.int32)
jax.block_until_ready(pk.pool_attention(qp, kp, kp, offs, lens, max_len=512, score_len=256, backend='pallas'))
print('compiled kernels run')"; then
    echo "=== compiled kernels failed: latency runs use HETERO_JAX_KERNELS=reference"
    export HETERO_JAX_KERNELS=reference
  fi
  for L in 32768 16384; do
    warm=1; (( L > 32768 )) && warm=0   # one untimed TTFT round where a prefill costs little
    stage "latency $L" 400 $PY benchmarks/bench_latency.py --preset llama8b-gpu --synthetic-lengths "$L" \
      --ttft-warmup "$warm" --no-progress --out "$OUT/lat-$L.json" --plot "/tmp/lat-$L.png"
  done
  # Kernel by kernel: where the step's device time goes, and how much of the wall time is host time
  stage profile 150 $PY benchmarks/profile_step.py --shape llama-3.1-8b --dtype bfloat16 --length 32768 \
    --warmup 6 --steps 10 --top 30 --policies full heterocache:tau_drift=-1 heterocache --out "$OUT/profile-32k.json"
  # The launch-parameter sweep of the older per-group kernel last: the row pool's kernel is what decodes now
  stage sweep 150 $PY benchmarks/bench_kernels.py --sweep --no-progress --out "$OUT/kernels.json"
  echo "=== done, $(left)s of ${BUDGET_S}s left"
} 2>&1 | tee "$OUT/log.txt"
