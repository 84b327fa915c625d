#!/usr/bin/env bash
# Issue 24's measurements on an H200 from a bundle: host bytes per parameter, step time and
# losses of the host-state choices, and the NVMe tier. One JSON per run in OUT.
#
#   bench/run_host_bytes_h200.sh OUT PART...
#
# profile: machine_bench with the disk's rates (--nvme-dir), saved as the planner's profile
# qwen:    Qwen2.5-7B at 64K tokens: bf16 copy yes / no with fp32 moments, int8 moments
#          without the copy, and the plan `auto` picks
# llama:   the same for Llama-3.1-8B
# qwen_copy: the first two of qwen (with a timeline of the first)
# nvme:    Qwen2.5-7B without the copy, the host budget capped so that about a third of the
#          layers' moments live on disk (the plan picks the layers; compare its losses with
#          qwen's no-copy run)
# The scratch folder for the disk tier is SCRATCH (default ./nvme_scratch, never under OUT:
# OUT comes back to the caller).
set -uo pipefail
OUT=${1:?OUT folder}; shift
mkdir -p "$OUT"
export MEGATRAIN_PROFILE=${MEGATRAIN_PROFILE:-$OUT/machine-profile.json}
SCRATCH=${SCRATCH:-$PWD/nvme_scratch}
run() {  # name, timeout, command...
  local name=$1 limit=$2; shift 2
  echo "== $name: $*" >&2
  local t0=$SECONDS
  timeout "$limit" "$@" > "$OUT/$name.json" 2> "$OUT/$name.log"
  echo "   rc=$? in $((SECONDS - t0)) s" >&2
  python3 - "$OUT/$name.json" <<'EOF' >&2
import json, sys
try:
    r = json.load(open(sys.argv[1]))
except Exception as e:
    print("   no JSON:", e); sys.exit(0)
keys = ('step_seconds', 'host_bytes_per_param', 'host_gib', 'optimizer_state_dtype',
        'bf16_copy', 'step_over_largest_floor', 'prediction_error', 'measured_bound', 'nvme')
print("  ", {k: r[k] for k in keys if k in r})
if 'steps' in r:
    print("   losses", [s['loss'] for s in r['steps']])
if 'plan' in r and 'steps' not in r:
    print("   plan", r['plan'])
EOF
}
bench7b() {  # name, shape, extra args...
  local name=$1 shape=$2; shift 2
  run "$name" 400 train_bench --shape "$shape" --seq 4096 --tokens-per-step 65536 --steps 5 \
      --warmup 2 "$@"
}
for part in "$@"; do
  case "$part" in
    profile)
      mkdir -p "$SCRATCH"
      run machine_bench 400 machine_bench --backend cuda --nvme-dir "$SCRATCH" \
          --save "$MEGATRAIN_PROFILE" ;;
    qwen|llama)
      shape=qwen2.5-7b; [ "$part" = llama ] && shape=llama-3.1-8b
      bench7b "${part}_copy_yes" $shape --bf16-copy yes
      bench7b "${part}_copy_no" $shape --bf16-copy no
      bench7b "${part}_int8_copy_no" $shape --bf16-copy no --state-dtype int8
      bench7b "${part}_auto_plan" $shape --bf16-copy auto --plan-only ;;
    qwen_copy)  # bf16 copy yes / no only: a reference pair
      bench7b qwen_copy_yes qwen2.5-7b --bf16-copy yes --timeline "$OUT/qwen_copy_yes_timeline.json"
      bench7b qwen_copy_no qwen2.5-7b --bf16-copy no ;;
    nvme)
      mkdir -p "$SCRATCH"
      df -h "$SCRATCH" >&2
      # The largest cap whose plan puts at least a third of the 28 layers on disk.
      cap=
      for c in 84 82 80 78 76 74 72; do
        n=$(timeout 60 train_bench --shape qwen2.5-7b --seq 4096 --tokens-per-step 65536 \
              --bf16-copy no --nvme-dir "$SCRATCH" --host-memory-gib $c --plan-only 2>/dev/null |
            python3 -c "import json,sys; print(json.load(sys.stdin)['plan']['nvme_layers'])")
        echo "   cap $c GiB: ${n:-?} layers on disk" >&2
        if [ -n "$n" ] && [ "$n" -ge 9 ]; then cap=$c; break; fi
      done
      [ -n "$cap" ] && bench7b nvme_qwen_copy_no qwen2.5-7b --bf16-copy no --nvme-dir "$SCRATCH" \
          --host-memory-gib "$cap"
      rm -rf "$SCRATCH" ;;
    *) echo "unknown part $part" >&2 ;;
  esac
done
