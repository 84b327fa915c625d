#!/usr/bin/env bash
# Runs the benchmarks on a GPU box from a bundle (deploy/bundle.sh) and writes one JSON
# file per run into OUT. Not a test: each run's figures are for the issue notes.
#
#   bench/run_h200.sh OUT SET     SET: profile | small | large | reference
#
# profile:   machine_bench (saved as the planner's profile for the runs after it)
# small:     Qwen2.5-1.5B shape: 4K and 64K tokens per step, as planned
# depth:     1.5B width at 28 and 84 layers, one fixed plan (host checkpoints, nothing kept)
# large:     Qwen2.5-7B shape at 64K tokens, all of the device and capped at 24 GiB
# llama:     Llama-3.1-8B shape at 64K tokens
# checkpoint: 1.5B shape at 64K and 4K tokens per step: a checkpoint written while training
#            runs, against one taken with training stopped (SCRATCH: a folder on a disk with
#            ~45 GB free; default $OUT/scratch)
# reference: PyTorch eager + transformers on the 1.5B shape; torch's CPU AdamW
set -uo pipefail
OUT=${1:?OUT folder}
SET=${2:?SET}
mkdir -p "$OUT"
export MEGATRAIN_PROFILE=${MEGATRAIN_PROFILE:-$OUT/machine-profile.json}
run() {  # name, command...
  local name=$1; shift
  echo "== $name: $*" >&2
  local t0=$SECONDS
  "$@" > "$OUT/$name.json" 2> "$OUT/$name.log"
  local rc=$?
  echo "   rc=$rc in $((SECONDS - t0)) s" >&2
  tail -n 3 "$OUT/$name.log" >&2
}
case "$SET" in
  profile)
    run machine_bench machine_bench --backend cuda --save "$MEGATRAIN_PROFILE" ;;
  small)
    run train_1p5b_4k train_bench --shape qwen2.5-1.5b --seq 4096 --tokens-per-step 4096 --steps 8
    run train_1p5b_64k train_bench --shape qwen2.5-1.5b --seq 4096 --tokens-per-step 65536 --steps 7 ;;
  depth)
    for layers in 28 84; do
      run train_1p5b_${layers}l_fixed train_bench --shape qwen2.5-1.5b --layers $layers --seq 4096 \
          --tokens-per-step 65536 --checkpoints host --k 1 --kept-layers 0 --weight-slots 0 \
          --steps 6
    done ;;
  large)
    run train_7b_64k train_bench --shape qwen2.5-7b --seq 4096 --tokens-per-step 65536 --steps 6
    run train_7b_64k_24g train_bench --shape qwen2.5-7b --seq 4096 --tokens-per-step 65536 \
        --device-memory-gib 24 --steps 5 ;;
  llama)
    run train_llama8b_64k train_bench --shape llama-3.1-8b --seq 4096 --tokens-per-step 65536 \
        --steps 4 ;;
  checkpoint)
    SCRATCH=${SCRATCH:-$OUT/scratch}
    df -h "$(dirname "$SCRATCH")" >&2
    run checkpoint_1p5b_64k checkpoint_bench --dir "$SCRATCH" --shape qwen2.5-1.5b --seq 4096 \
        --tokens-per-step 65536 --before 4 --after 2
    run checkpoint_1p5b_4k checkpoint_bench --dir "$SCRATCH" --shape qwen2.5-1.5b --seq 4096 \
        --tokens-per-step 4096 --before 6 --after 3 --verify 0
    rm -rf "$SCRATCH" ;;
  reference)
    run hf_1p5b_64k python3 bench/hf_train_reference.py --shape qwen2.5-1.5b --seq 4096 \
        --tokens-per-step 65536
    run torch_cpu_adamw python3 bench/torch_cpu_adamw.py ;;
  *) echo "unknown set $SET" >&2; exit 2 ;;
esac
