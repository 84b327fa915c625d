#!/usr/bin/env bash
# Where MoE steps lose time, on an H200 from a bundle, in one call (README "Where MoE steps
# lose time"): machine_bench (saved as the planner's profile), then each shape's step with
# the CPU optimizer and with --no-optimizer, each writing its timeline, and a one-line
# summary per run: step, step over the largest and the schedule floor, prediction error,
# compute seconds by stage.
# Usage: bench/run_floors_h200.sh OUT [SPEC...]   SPEC: "SHAPE LAYERS TOKENS [VOCAB]"
#   default specs: qwen3-30b-a3b 4 at 64K and 256K, mixtral-8x7b 4 at 64K,
#   gpt-oss-120b 2 at 256K with vocab 32000. Each spec runs twice (with and without the
#   optimizer): about two specs fit a 10-minute device call (GPT-OSS alone takes ~9 min).
set -uo pipefail
OUT=${1:?OUT}; shift
mkdir -p "$OUT"
[ $# -gt 0 ] || set -- "qwen3-30b-a3b 4 65536" "qwen3-30b-a3b 4 262144" "mixtral-8x7b 4 65536" \
  "gpt-oss-120b 2 262144 32000"
export MEGATRAIN_PROFILE=$OUT/machine-profile.json
timeout 150 machine_bench --backend cuda --save "$MEGATRAIN_PROFILE" > "$OUT/machine_bench.json" \
  2> "$OUT/machine_bench.log"
echo "machine_bench rc=$?"
for spec in "$@"; do
  set -- $spec
  for mode in adamw none; do
    name=train_$1_$2l_$3${4:+_v$4}
    flag=
    if [ "$mode" = none ]; then name=${name}_no_optimizer; flag=--no-optimizer; fi
    timeout 420 train_bench --shape "$1" --layers "$2" --seq 4096 --tokens-per-step "$3" \
      --steps 4 ${4:+--vocab $4} $flag \
      --timeline "$OUT/$name.timeline.json" > "$OUT/$name.json" 2> "$OUT/$name.log"
    echo "$spec $mode rc=$?"
    python3 - "$OUT/$name.json" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
print(f"  step {r['step_seconds']:.3f} s, x{r['step_over_largest_floor']:.2f} largest floor, "
      f"x{r['step_over_schedule_floor']:.2f} schedule floor, planner "
      f"{r['prediction_error']:+.0%}, floors {r['floors_seconds']}, "
      f"stages {r['steps'][-1].get('compute_seconds_by_stage')}")
PY
  done
done
