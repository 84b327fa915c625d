#!/usr/bin/env bash
# A/B of two train_bench builds on one GPU box, in one call: a restructuring's "no
# behaviour change" check. Both plan with one machine profile (measured first), so both
# run the same plan; each shape runs under A, then B. JSON per run in OUT, and a summary
# (OUT/ab_summary.json): the losses, equal to the last bit or not, and the step times.
#
#   bench/ab_train.sh OUT SET TRAIN_BENCH_A TRAIN_BENCH_B     SET: small | large
#
# small: Qwen2.5-1.5B shape, 4K tokens per step, 10 steps (bit-reproducible losses)
# large: Qwen2.5-7B shape, 64K tokens per step, 6 steps (step time)
set -uo pipefail
OUT=${1:?OUT folder}
SET=${2:?SET}
A=${3:?train_bench A}
B=${4:?train_bench B}
mkdir -p "$OUT"
export MEGATRAIN_PROFILE=${MEGATRAIN_PROFILE:-$OUT/machine-profile.json}
[ -f "$MEGATRAIN_PROFILE" ] || machine_bench --backend cuda --save "$MEGATRAIN_PROFILE" \
  > "$OUT/machine_bench.json" 2> "$OUT/machine_bench.log"
case "$SET" in
  small) args=(--shape qwen2.5-1.5b --seq 4096 --tokens-per-step 4096 --steps 10) ;;
  large) args=(--shape qwen2.5-7b --seq 4096 --tokens-per-step 65536 --steps 6) ;;
  *) echo "unknown SET $SET" >&2; exit 2 ;;
esac
for side in A B; do
  bin=$A
  [ "$side" = B ] && bin=$B
  echo "== $SET $side: $bin ${args[*]}" >&2
  "$bin" "${args[@]}" > "$OUT/${SET}_$side.json" 2> "$OUT/${SET}_$side.log"
  echo "   rc=$?" >&2
done
python3 - "$OUT" "$SET" <<'PY'
import json, os, sys
out, name = sys.argv[1], sys.argv[2]
runs = {s: json.load(open(os.path.join(out, f"{name}_{s}.json"))) for s in "AB"}
def losses(r): return [s["loss"] for s in r["steps"]]
def seconds(r): return r["step_seconds"]
summary = {"set": name,
           "losses_equal": losses(runs["A"]) == losses(runs["B"]),
           "losses_A": losses(runs["A"]), "losses_B": losses(runs["B"]),
           "step_seconds_A": seconds(runs["A"]), "step_seconds_B": seconds(runs["B"])}
if summary["step_seconds_A"] and summary["step_seconds_B"]:
    summary["time_ratio_B_over_A"] = summary["step_seconds_B"] / summary["step_seconds_A"]
path = os.path.join(out, f"ab_{name}.json")
json.dump(summary, open(path, "w"), indent=1)
print(json.dumps(summary, indent=1))
PY
