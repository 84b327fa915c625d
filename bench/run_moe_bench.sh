#!/usr/bin/env bash
# MoE benchmarks on an H200 from a bundle: machine_bench (grouped expert GEMMs against the
# dense rate at MoE shapes; saved as the planner's profile), then train_bench on the MoE
# shapes given as "SHAPE LAYERS TOKENS [VOCAB]" arguments (VOCAB: train_bench --vocab).
# Environment: TRAIN_ARGS, more train_bench arguments, and TAG, a suffix for their runs'
# names; MEGATRAIN_PROFILE set: that profile, and no machine_bench.
# Usage: bench/run_moe_bench.sh OUT SPEC...
set -uo pipefail
OUT=${1:?OUT}; shift
mkdir -p "$OUT"
if [ -z "${MEGATRAIN_PROFILE:-}" ]; then
  export MEGATRAIN_PROFILE=$OUT/machine-profile.json
  timeout 240 machine_bench --backend cuda --save "$MEGATRAIN_PROFILE" > "$OUT/machine_bench.json" \
    2> "$OUT/machine_bench.log"
  python3 -c "
import json, sys
for g in json.load(open(sys.argv[1])).get('grouped_gemm', []):
    if g: print(g)" "$OUT/machine_bench.json"
fi
for spec in "$@"; do
  set -- $spec
  name=train_$1_$2l_$3${4:+_v$4}${TAG:+_$TAG}
  timeout 300 train_bench --shape "$1" --layers "$2" --seq 4096 --tokens-per-step "$3" --steps 4 \
    ${4:+--vocab $4} ${TRAIN_ARGS:-} > "$OUT/$name.json" 2> "$OUT/$name.log"
  echo "$spec rc=$?"
  python3 -c "
import json, sys
r = json.load(open(sys.argv[1]))
print({k: r[k] for k in ('step_seconds', 'step_over_largest_floor', 'prediction_error',
                         'model_tflops', 'measured_bound', 'device_peak_gib', 'host_gib')})
print(r['floors_seconds'], r['steps'][-1].get('compute_seconds_by_stage'))" "$OUT/$name.json"
done
