#!/usr/bin/env bash
# H200 checks from a bundle, in parts that each fit one device call (10 minutes). Written for
# stop 31's unrun work (the hopper, attn, hsteps parts ran in stop 32); still to run: finish
# (stop 32's Finish() change), moe2, rates:
#   hopper   the Hopper attention tests alone first (its backward has never run: a hang or a
#            crash shows here, under a short timeout), then the whole gpu_test
#   gate     stops the run unless the Hopper tests passed
#   hsteps   the steps part on the Hopper kernels only
#   attn     machine_bench --attention-only: the attention kernels' rates alone (a minute)
#   rates    machine_bench, saved as the profile: attention_kernels (Hopper forward and now
#            backward against the mma kernels), grouped_gemm (the expert GEMMs' buckets)
#   moe      the MoE shapes with both of stop 31's fixes (row offsets once, cuBLASLt
#            algorithm per bucket): Qwen3-30B-A3B 4 layers at 64K and 256K, Mixtral-8x7B 4
#            layers at 64K (box 7 of stop 31 left it unexplained), with timelines
#   moe2     Qwen3-30B-A3B 12 layers at 64K (no bf16 copy: 12 B/param fits), GPT-OSS-120B 2
#            layers at 64K and 256K (vocab 32000: two layers fit beside the embeddings)
#   moe64    stop 33 (the optimizer's one team pass over a unit's tensors, the schedule
#            floor): Qwen3-30B-A3B and Mixtral-8x7B 4 layers at 64K, with timelines
#   moe256   the same two at 256K tokens a step
#   mixmb    Mixtral-8x7B 4 layers at 64K in 8 micro-batches of 2 sequences (the plan of
#            stop 32's boxes; stop 33's profile plans one of 16)
#   fused    stop 33's one-pass attention backward (MEGATRAIN_ATTENTION_BACKWARD=fused, never
#            run yet): the Hopper attention tests alone under a short timeout (a wait that
#            never ends shows as a timeout), then the rates of both backwards in one run
#   fsteps   whole steps with the fused backward: Qwen2.5-7B one 128K sequence (2,519 tokens/s
#            with the two passes, box 1 of stop 33), Llama-3.1-8B seq 8K 128K tokens
#   omp      stop 34: why AdamW runs at ~70% of machine_bench's rate inside steps: the box's
#            cores, NUMA and huge pages, then Qwen3-30B-A3B 4 layers at 64K (optimizer bound)
#            as is, with OMP_NUM_THREADS one and two below the cores, and with
#            OMP_WAIT_POLICY=passive
#   moe64only  Qwen3-30B-A3B 4 layers and GPT-OSS-120B 2 layers at 64K (stop 34's huge-page A/B)
#   issue21  stop 34: issue 21's MoE benchmarks with the planner's AdamW at its in-step
#            fraction, those whose prediction missed first
#   suite    stop 35: the whole gpu_test (not run since stop 34's fused dq and dk/dv order)
#   ncu      stop 35: Nsight Compute on the Hopper forward (head_dim 128 and 64) and the dk/dv
#            pass at 8K: the pipes' use (tensor, MUFU, FMA), issue and stall reasons, raw
#   issue21a, issue21b  the issue21 part in two halves, one device call each
#   next     stop 35's unrun work, first: the whole gpu_test (the mask's loops in the Hopper
#            attention) and the attention rates of both kernels; then the ncu part again
#            (against bench/results/h200-2026-12-03/box1_ncu_*.csv)
#   ncubwd   stop 36: Nsight Compute on the backward's dq and dk/dv passes at 8K, head_dim 128
#   layerops stop 36: every kernel's time (ncu_kernel_times.py) in 2-layer cuts of Llama-3.1-8B
#            at seq 8K and Qwen2.5-7B at 4K, one micro-batch a step: what beside attention
#            and the GEMMs the 8K steps spend
#   spans    the CPU optimizer's pieces (train_bench's optimizer_pieces and timeline stream
#            3): GPT-OSS-120B 2 layers at 256K (AdamW at 0.75 of its rate alone in its steps)
#            and Qwen3-30B-A3B 4 layers at 64K (0.90) on one box, with timelines
#   steps22  issue 22's whole steps on the Hopper kernels: Qwen2.5-7B seq 4K 64K tokens,
#            Llama-3.1-8B seq 8K 128K tokens, Qwen2.5-7B one 128K sequence
#   steps    whole steps with MEGATRAIN_ATTENTION=hopper against the mma kernels in the same
#            call: Qwen2.5-7B seq 4K, 64K tokens; Llama-3.1-8B seq 8K, 128K tokens
#   finish   the optimizer's squares on its own thread (stop 32): Mixtral-8x7B and
#            Qwen3-30B-A3B 4 layers at 64K with a timeline, then Mixtral without one (a
#            timeline's step also waits for the early uploads' spans); against box 5's
#            2.596 s and 1.747 s (bench/results/h200-2026-12-02-hopper/); the 7B 128K sequence
# Usage: bench/run_stop32_h200.sh OUT PART...   (PATH must hold the bundle's bin/)
set -uo pipefail
OUT=${1:?OUT}; shift
mkdir -p "$OUT"
export MEGATRAIN_PROFILE=${MEGATRAIN_PROFILE:-$OUT/machine-profile.json}
summary() {  # a train_bench JSON's headline
  python3 - "$1" <<'PY'
import json, sys
try:
    r = json.load(open(sys.argv[1]))
except Exception as e:
    print("   no JSON:", e); sys.exit(0)
keys = ('step_seconds', 'step_over_largest_floor', 'step_over_schedule_floor',
        'prediction_error', 'model_tflops', 'measured_bound')
print("  ", {k: r.get(k) for k in keys}, r.get('floors_seconds'))
PY
}
attention_rows() {  # a machine_bench JSON's attention_kernels, a line each
  python3 - "$1" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
for a in d.get("attention_kernels", []):
    print(a.get("kernels"), "D", a.get("head_dim"), "len", a.get("seq_len"),
          "fwd %.1f bwd %.1f" % (a["forward_tflops"], a["backward_tflops"]))
PY
}
train() {  # name, train_bench arguments...
  local name=$1; shift
  timeout 280 train_bench "$@" --timeline "$OUT/${name}_timeline.json" > "$OUT/$name.json" \
    2> "$OUT/$name.log"
  echo "$name rc=$?"
  summary "$OUT/$name.json"
  python3 bench/timeline_spans.py "$OUT/${name}_timeline.json" 2>/dev/null | head -3
}
moe() {  # shape, layers, tokens, extra arguments... (TAG: a suffix for the files)
  local shape=$1 layers=$2 tokens=$3; shift 3
  train "moe_${shape}_${layers}l_${tokens}${TAG:+_$TAG}" --shape "$shape" --layers "$layers" --seq 4096 \
    --tokens-per-step "$tokens" --steps 4 "$@"
}
steps_on() {  # kernels...: Qwen2.5-7B seq 4K, 64K tokens; Llama-3.1-8B seq 8K, 128K tokens
  for kernels in "$@"; do
    MEGATRAIN_ATTENTION=$kernels train "step_qwen7b_4k_64k_$kernels" --shape qwen2.5-7b \
      --seq 4096 --tokens-per-step 65536 --steps 4 --warmup 2
    MEGATRAIN_ATTENTION=$kernels train "step_llama8b_8k_128k_$kernels" --shape llama-3.1-8b \
      --seq 8192 --tokens-per-step 131072 --steps 3 --warmup 1
  done
}
for part in "$@"; do
  case "$part" in
    hopper)
      timeout 120 gpu_test --gtest_filter='*HopperAttention*' \
        > "$OUT/gpu_test_hopper.txt" 2>&1
      echo "hopper tests rc=$?"; grep -E "OK|FAILED|Failure|differs|against" \
        "$OUT/gpu_test_hopper.txt" | head -40
      timeout 240 gpu_test --gtest_brief=1 > "$OUT/gpu_test.txt" 2>&1
      echo "gpu_test rc=$?"; tail -n 3 "$OUT/gpu_test.txt" ;;
    gate)  # stop here unless the Hopper tests passed
      if ! grep -q "PASSED" "$OUT/gpu_test_hopper.txt" || grep -q "FAILED" "$OUT/gpu_test_hopper.txt"; then
        echo "the Hopper tests did not pass: stopping"; exit 1
      fi ;;
    hsteps) steps_on hopper ;;  # whole steps on the Hopper kernels only
    attn)
      timeout 200 machine_bench --backend cuda --attention-only > "$OUT/attention_rates.json" \
        2> "$OUT/attention_rates.log"
      echo "attention rates rc=$?"
      attention_rows "$OUT/attention_rates.json" ;;
    rates)
      timeout 300 machine_bench --backend cuda --save "$MEGATRAIN_PROFILE" \
        > "$OUT/machine_bench.json" 2> "$OUT/machine_bench.log"
      echo "machine_bench rc=$?"
      attention_rows "$OUT/machine_bench.json"
      python3 - "$OUT/machine_bench.json" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
for g in d.get("grouped_gemm", []):
    if g:
        print("E", g["experts"], "rows", g["rows_per_expert"], g["in_features"], "->",
              g["out_features"], "fwd %.2f bwd %.2f of dense" % (
                  g["grouped_over_dense_forward"], g["grouped_over_dense_backward"]))
print("AdamW G/s", d.get("adamw_params_per_second", 0) / 1e9)
PY
      ;;
    moe)
      moe qwen3-30b-a3b 4 65536
      moe qwen3-30b-a3b 4 262144
      moe mixtral-8x7b 4 65536 ;;
    moe2)
      moe qwen3-30b-a3b 12 65536 --bf16-copy no
      moe gpt-oss-120b 2 65536 --vocab 32000
      moe gpt-oss-120b 2 262144 --vocab 32000 ;;
    moe64)
      moe qwen3-30b-a3b 4 65536
      moe mixtral-8x7b 4 65536 ;;
    issue21)  # stop 34's planner (AdamW at its in-step fraction): the benchmarks it missed first
      moe gpt-oss-120b 2 262144 --vocab 32000
      moe gpt-oss-120b 2 65536 --vocab 32000
      moe mixtral-8x7b 4 262144
      moe mixtral-8x7b 4 65536
      moe qwen3-30b-a3b 4 262144
      moe qwen3-30b-a3b 12 65536 --bf16-copy no
      moe qwen3-30b-a3b 4 65536 ;;
    issue21a)
      moe gpt-oss-120b 2 262144 --vocab 32000
      moe gpt-oss-120b 2 65536 --vocab 32000
      moe mixtral-8x7b 4 262144
      moe mixtral-8x7b 4 65536 ;;
    issue21b)
      moe qwen3-30b-a3b 4 262144
      moe qwen3-30b-a3b 12 65536 --bf16-copy no
      moe qwen3-30b-a3b 4 65536 --bf16-copy no
      moe qwen3-30b-a3b 4 65536 ;;
    suite)
      timeout 300 gpu_test --gtest_brief=1 > "$OUT/gpu_test.txt" 2>&1
      echo "gpu_test rc=$?"; grep -E "FAILED|SKIPPED|PASSED" "$OUT/gpu_test.txt" | head -20 ;;
    layerops)  # stop 36: every kernel's time in two steps of one micro-batch of 2-layer cuts
      # (the 8K and 4K steps' shapes), by Nsight Compute: what the ~11 ms of each Llama-3.1-8B
      # layer's 110 ms forward (and ~33 ms of its 254 ms backward) beside attention and the
      # GEMMs at machine_bench's rates are, and the GEMMs' own rates in the step
      for cut in "llama-3.1-8b 8192" "qwen2.5-7b 4096"; do
        read -r shape seq <<< "$cut"
        # The box's profile first, outside ncu: without one train_bench measures it under ncu,
        # and its kernels join the list (stop 37's call 1).
        timeout 120 train_bench --shape "$shape" --layers 2 --seq "$seq" --tokens-per-step "$seq" \
          --plan-only > /dev/null 2> "$OUT/profile_$shape.log"
        timeout 200 ncu --clock-control none --metrics gpu__time_duration.sum --csv --page raw \
          train_bench --shape "$shape" --layers 2 --seq "$seq" --tokens-per-step "$seq" \
          --steps 2 --warmup 1 > "$OUT/ncu_kernels_$shape.csv" 2> "$OUT/ncu_kernels_$shape.log"
        echo "ncu kernels $shape rc=$?"
        python3 bench/ncu_kernel_times.py "$OUT/ncu_kernels_$shape.csv" \
          --json "$OUT/kernels_$shape.json" --top 25
      done ;;
    ncubwd)  # stop 36: the backward's dq and dk/dv passes at 8K, head_dim 128, by Nsight Compute
      for k in Dq DkDv; do
        timeout 150 ncu --clock-control none -k regex:Hopper$k --launch-skip 1 --launch-count 1 \
          --set full --page raw --csv machine_bench --backend cuda --attention-only \
          --attention-kernels hopper --attention-lengths 8192 --attention-head-dims 128 \
          > "$OUT/ncu_${k,,}_d128.csv" 2> "$OUT/ncu_${k,,}_d128.log"
        echo "ncu $k D128 rc=$?"
        python3 bench/ncu_pipes.py "$OUT/ncu_${k,,}_d128.csv" | grep -E 'duration|pipe_(alu|fma|xu|tensor_cycles).*avg|issue_active.avg|stall' | head -12
      done ;;
    ncu)
      for d in 128 64; do
        timeout 150 ncu --clock-control none -k regex:HopperForward --launch-skip 2 \
          --launch-count 1 --set full --page raw --csv machine_bench --backend cuda \
          --attention-only --attention-kernels hopper --attention-lengths 8192 \
          --attention-head-dims $d > "$OUT/ncu_forward_d$d.csv" 2> "$OUT/ncu_forward_d$d.log"
        echo "ncu forward D$d rc=$?"
      done
      timeout 150 ncu --clock-control none -k regex:HopperDkDv --launch-skip 1 --launch-count 1 \
        --set full --page raw --csv machine_bench --backend cuda --attention-only \
        --attention-kernels hopper --attention-lengths 8192 --attention-head-dims 128 \
        > "$OUT/ncu_dkdv_d128.csv" 2> "$OUT/ncu_dkdv_d128.log"
      echo "ncu dk/dv D128 rc=$?"
      for f in "$OUT"/ncu_*.csv; do python3 bench/ncu_pipes.py "$f"; done 2>&1 | head -150 ;;
    next)
      timeout 300 gpu_test --gtest_brief=1 > "$OUT/gpu_test.txt" 2>&1
      echo "gpu_test rc=$?"; grep -E "FAILED|SKIPPED|PASSED" "$OUT/gpu_test.txt" | head -20
      timeout 200 machine_bench --backend cuda --attention-only > "$OUT/attention_rates.json" \
        2> "$OUT/attention_rates.log"
      echo "attention rates rc=$?"
      attention_rows "$OUT/attention_rates.json" ;;
    spans)
      moe gpt-oss-120b 2 262144 --vocab 32000
      python3 bench/timeline_spans.py "$OUT/moe_gpt-oss-120b_2l_262144${TAG:+_$TAG}_timeline.json" | tail -12
      moe qwen3-30b-a3b 4 65536
      python3 bench/timeline_spans.py "$OUT/moe_qwen3-30b-a3b_4l_65536${TAG:+_$TAG}_timeline.json" | tail -10 ;;
    steps22)
      train step_qwen7b_4k_64k --shape qwen2.5-7b --seq 4096 --tokens-per-step 65536 --steps 4 \
        --warmup 2
      train step_llama8b_8k_128k --shape llama-3.1-8b --seq 8192 --tokens-per-step 131072 \
        --steps 3 --warmup 1
      train step_qwen7b_128k_seq --shape qwen2.5-7b --seq 131072 --tokens-per-step 131072 \
        --steps 2 --warmup 1 ;;
    moe64only)  # the optimizer-bound pair: Qwen3-30B-A3B 4 layers, GPT-OSS-120B 2 layers, 64K
      moe qwen3-30b-a3b 4 65536
      moe gpt-oss-120b 2 65536 --vocab 32000 ;;
    mixmb) moe mixtral-8x7b 4 65536 --micro-batch-rows 2 ;;
    fused)
      timeout 180 gpu_test --gtest_filter='*HopperAttention*' > "$OUT/gpu_test_fused.txt" 2>&1
      echo "hopper tests (with the fused backward) rc=$?"
      grep -E "OK|FAILED|Failure|differs|against" "$OUT/gpu_test_fused.txt" | head -40
      timeout 200 machine_bench --backend cuda --attention-only \
        --attention-kernels hopper hopper-fused > "$OUT/attention_rates_fused.json" \
        2> "$OUT/attention_rates_fused.log"
      echo "attention rates rc=$?"
      attention_rows "$OUT/attention_rates_fused.json" ;;
    fsteps)
      MEGATRAIN_ATTENTION_BACKWARD=fused train step_qwen7b_128k_seq_fused --shape qwen2.5-7b \
        --seq 131072 --tokens-per-step 131072 --steps 2 --warmup 1
      MEGATRAIN_ATTENTION_BACKWARD=fused train step_llama8b_8k_128k_fused \
        --shape llama-3.1-8b --seq 8192 --tokens-per-step 131072 --steps 3 --warmup 1 ;;
    moe256)
      moe qwen3-30b-a3b 4 262144
      moe mixtral-8x7b 4 262144 ;;
    steps) steps_on mma hopper ;;
    omp)
      { nproc; cat /sys/kernel/mm/transparent_hugepage/enabled; ls -d /sys/devices/system/node/node*
        grep -m1 "model name" /proc/cpuinfo; } 2>&1 | tee "$OUT/box.txt"
      cores=$(nproc)
      moe qwen3-30b-a3b 4 65536
      TAG=omp$((cores - 1)) OMP_NUM_THREADS=$((cores - 1)) moe qwen3-30b-a3b 4 65536
      TAG=omp$((cores - 2)) OMP_NUM_THREADS=$((cores - 2)) moe qwen3-30b-a3b 4 65536
      TAG=passive OMP_WAIT_POLICY=passive moe qwen3-30b-a3b 4 65536 ;;
    finish)
      moe mixtral-8x7b 4 65536
      moe qwen3-30b-a3b 4 65536
      timeout 280 train_bench --shape mixtral-8x7b --layers 4 --seq 4096 --tokens-per-step 65536 \
        --steps 4 > "$OUT/moe_mixtral_4l_65536_plain.json" 2> "$OUT/moe_mixtral_4l_65536_plain.log"
      echo "mixtral without a timeline rc=$?"; summary "$OUT/moe_mixtral_4l_65536_plain.json"
      train step_qwen7b_128k_seq --shape qwen2.5-7b --seq 131072 --tokens-per-step 131072 \
        --steps 2 --warmup 1 ;;
    *) echo "unknown part $part" >&2 ;;
  esac
done
