#!/usr/bin/env bash
# Stop 37 on the H200: is a whole training step bound by the card's power rather than by its
# kernels? Samples nvidia-smi (SM clock, power, the clock-event reasons) every 100 ms across
# the steps, and runs bench/gemm_probe.py's sustained GEMM beside them.
#   power   Qwen2.5-7B seq 4K 64K tokens and Llama-3.1-8B seq 8K 128K tokens (train_bench,
#           the planner's plans, timelines), then 12 s of back-to-back gate|up GEMMs
#   held    machine_bench with its rates held at the power limit (--save: the profile), then
#           the same two steps planned from it: the planner's prediction error against the
#           burst-measured profiles' -7% and -10%
#   upload  the fp32 master's upload with its roundings on their own stream: gpu_test, then
#           Qwen2.5-7B seq 4K 64K tokens on the held profile's plan (call 3: one micro-batch,
#           2 weight slots, each layer's upload 58 ms beside its 45 ms forward), its timeline
#   final   issue 22's 8K-and-under steps on a fresh box's held profile, the planner's
#           plans: Qwen2.5-7B seq 4K 64K tokens, Llama-3.1-8B seq 8K 128K tokens (fewer steps
#           than steps22: the session's device time); final128k: Qwen2.5-7B, one 128K
#           sequence
#   recheck (stop 38) the steps the upload fix had not run: gpu_test, a fresh held profile,
#           Qwen2.5-7B seq 4K 64K tokens on its plan and on call 3's (16 rows x 1, 2 weight
#           slots: 6.15 s before the fix), Llama-3.1-8B seq 8K 128K tokens
# Everything under OUT ends up in OUT/results.tgz (the device tool returns few files).
# Usage: bench/run_stop37_h200.sh OUT PART...   (PATH must hold the bundle's bin/)
set -uo pipefail
OUT=${1:?OUT}; shift
mkdir -p "$OUT"
export MEGATRAIN_PROFILE=${MEGATRAIN_PROFILE:-$OUT/machine-profile.json}
FIELDS=timestamp,utilization.gpu,clocks.sm,power.draw,temperature.gpu
REASONS=clocks_event_reasons.sw_power_cap,clocks_event_reasons.hw_slowdown,clocks_event_reasons.sw_thermal_slowdown,clocks_event_reasons.hw_power_brake_slowdown
nvidia-smi --query-gpu=$FIELDS,$REASONS --format=csv,noheader -c 1 > /dev/null 2>&1 && FIELDS=$FIELDS,$REASONS
mark() { echo "$(date -u +%Y/%m/%d\ %H:%M:%S.%3N) $*" >> "$OUT/marks.txt"; }
train() {  # name, train_bench arguments...
  local name=$1; shift
  mark "start $name"
  timeout 280 train_bench "$@" --timeline "$OUT/${name}_timeline.json" > "$OUT/$name.json" \
    2> "$OUT/$name.log"
  echo "$name rc=$?"
  mark "end $name"
  tar czf /tmp/results.tgz -C "$OUT" --exclude results.tgz . && mv /tmp/results.tgz "$OUT/results.tgz"
  python3 - "$OUT/$name.json" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
print("  ", {k: r.get(k) for k in ('step_seconds', 'model_tflops', 'tokens_per_second', 'prediction_error', 'step_over_largest_floor')})
print("   plan", {k: r["plan"].get(k) for k in ("micro_batch_rows", "kept_layers", "weight_slots", "bf16_copy")})
PY
}
for part in "$@"; do
  case $part in
    power)  # (call 2 of stop 37)
      nvidia-smi --query-gpu=$FIELDS --format=csv -lms 100 > "$OUT/smi.csv" 2>&1 &
      smi=$!
      train step_qwen7b_4k_64k --shape qwen2.5-7b --seq 4096 --tokens-per-step 65536 --steps 4 \
        --warmup 2
      train step_llama8b_8k_128k --shape llama-3.1-8b --seq 8192 --tokens-per-step 131072 \
        --steps 3 --warmup 1
      mark "start sustained"
      python3 bench/gemm_probe.py --sustained 12 --json "$OUT/gemm_sustained.json" \
        > "$OUT/gemm_sustained.log" 2>&1
      echo "sustained rc=$?"; mark "end sustained"
      kill $smi
      python3 bench/smi_spans.py "$OUT/smi.csv" "$OUT/marks.txt" --json "$OUT/smi_spans.json" ;;
    held)
      nvidia-smi --query-gpu=$FIELDS --format=csv -lms 100 > "$OUT/smi_held.csv" 2>&1 &
      smi=$!
      mark "start machine_bench"
      timeout 400 machine_bench --backend cuda --save "$OUT/machine-profile.json" \
        > "$OUT/machine_bench.json" 2> "$OUT/machine_bench.log"
      echo "machine_bench rc=$?"; mark "end machine_bench"
      MEGATRAIN_PROFILE=$OUT/machine-profile.json train step_qwen7b_4k_64k_held \
        --shape qwen2.5-7b --seq 4096 --tokens-per-step 65536 --steps 4 --warmup 2
      MEGATRAIN_PROFILE=$OUT/machine-profile.json train step_llama8b_8k_128k_held \
        --shape llama-3.1-8b --seq 8192 --tokens-per-step 131072 --steps 3 --warmup 1
      kill $smi
      python3 bench/smi_spans.py "$OUT/smi_held.csv" "$OUT/marks.txt" \
        --json "$OUT/smi_spans_held.json"
      python3 - "$OUT/machine_bench.json" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
print("held", d.get("held_seconds"), "peak", d.get("gemm_peak_tflops"))
for g in d.get("gemm", []):
    if g["rows"] == 8192:
        print("  gemm", g["in_features"], g["out_features"], "fwd %.0f bwd %.0f" % (g["forward_tflops"], g["backward_tflops"]))
for a in d.get("attention_kernels", []):
    print("  attn", a.get("kernels"), "D", a["head_dim"], "len", a["seq_len"],
          "fwd %.0f held %.0f bwd %.0f held %.0f" % (a["forward_tflops"], a["held_forward_tflops"],
                                                 a["backward_tflops"], a["held_backward_tflops"]))
PY
      ;;
    upload)
      timeout 300 gpu_test --gtest_brief=1 > "$OUT/gpu_test.txt" 2>&1
      echo "gpu_test rc=$?"; tail -3 "$OUT/gpu_test.txt"
      train step_qwen7b_4k_64k_upload --shape qwen2.5-7b --seq 4096 --tokens-per-step 65536 \
        --steps 4 --warmup 2
      python3 - "$OUT/step_qwen7b_4k_64k_upload_timeline.json" <<'PY'
import json, sys
spans = json.load(open(sys.argv[1]))
up = [e["end_ms"] - e["start_ms"] for e in spans if e["label"].startswith("h2d w ")]
fwd = [e["end_ms"] - e["start_ms"] for e in spans if e["label"].startswith("fwd ")]
med = lambda xs: sorted(xs)[len(xs) // 2] if xs else None
print("   layer uploads: %d, median %.1f ms; forwards median %.1f ms" % (len(up), med(up), med(fwd)))
PY
      ;;
    final)
      train step_qwen7b_4k_64k --shape qwen2.5-7b --seq 4096 --tokens-per-step 65536 \
        --steps 3 --warmup 1
      train step_llama8b_8k_128k --shape llama-3.1-8b --seq 8192 --tokens-per-step 131072 \
        --steps 2 --warmup 1 ;;
    final128k)
      train step_qwen7b_128k_seq --shape qwen2.5-7b --seq 131072 --tokens-per-step 131072 \
        --steps 1 --warmup 1 ;;
    recheck)
      timeout 200 gpu_test --gtest_brief=1 > "$OUT/gpu_test.txt" 2>&1
      echo "gpu_test rc=$?"; tail -3 "$OUT/gpu_test.txt"
      mark "start machine_bench"
      timeout 300 machine_bench --backend cuda --save "$OUT/machine-profile.json" \
        > "$OUT/machine_bench.json" 2> "$OUT/machine_bench.log"
      echo "machine_bench rc=$?"; mark "end machine_bench"
      train step_qwen7b_4k_64k --shape qwen2.5-7b --seq 4096 --tokens-per-step 65536 --steps 3 \
        --warmup 1
      train step_qwen7b_4k_64k_16x1 --shape qwen2.5-7b --seq 4096 --tokens-per-step 65536 \
        --steps 3 --warmup 1 --micro-batch-rows 16 --weight-slots 2
      train step_llama8b_8k_128k --shape llama-3.1-8b --seq 8192 --tokens-per-step 131072 \
        --steps 2 --warmup 1 ;;
    *) echo "unknown part $part"; exit 2 ;;
  esac
done
tar czf /tmp/results.tgz -C "$OUT" --exclude results.tgz . && mv /tmp/results.tgz "$OUT/results.tgz"
