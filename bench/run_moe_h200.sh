#!/usr/bin/env bash
# The MoE checks on an H200 from a bundle (deploy/bundle.sh), one call:
#   gpu     gpu_test (every kernel and step test; MoE kernels included)
#   hf      the transformers comparison (tests/hf/compare_gpu_with_transformers.py) on the
#           text data for MEGATRAIN_CMP_MODELS (default: all seven families)
#   bench   train_bench on the MoE shapes (depth cut to fit the box)
# Usage: bench/run_moe_h200.sh OUT gpu,hf,bench
set -uo pipefail
OUT=${1:?OUT}; WHAT=${2:-gpu,hf}
mkdir -p "$OUT"
has() { [[ ",$WHAT," == *",$1,"* ]]; }
if has gpu; then
  timeout 200 gpu_test --gtest_brief=1 > "$OUT/gpu_test.txt" 2>&1; echo "gpu_test rc=$?"
  tail -n 5 "$OUT/gpu_test.txt"
fi
if has hf; then
  MEGATRAIN_CMP_DATA=text timeout 370 python3 tests/hf/compare_gpu_with_transformers.py \
    "$(command -v gpu_reference)" /tmp/cmp > "$OUT/hf_compare.jsonl" 2> "$OUT/hf_compare.log"
  echo "hf rc=$?"
  python3 - "$OUT/hf_compare.jsonl" <<'PY'
import json, sys
for line in open(sys.argv[1]):
    if not line.startswith("{"):
        continue  # gpu_reference's own lines
    r = json.loads(line)
    print(f"{r['model']:14s} loss {r['step_loss_rel_err']:.1e} aux {r.get('aux_loss_rel_err')} "
          f"grad max {r['grad_rel_err_max']:.3f} d_ours {r['curve_mean_d_ours']:.4f} "
          f"bound {r['curve_criterion_bound']:.4f} last10 {r['last10_mean_rel_err']:.4f} "
          f"logits {r['logits_rel_err']:.4f} problems {r['problems']}")
PY
fi
if has bench; then
  export MEGATRAIN_PROFILE=$OUT/machine-profile.json
  timeout 200 machine_bench --backend cuda --save "$MEGATRAIN_PROFILE" > "$OUT/machine_bench.json" 2> "$OUT/machine_bench.log"
  for spec in "qwen3-30b-a3b 4 65536" "mixtral-8x7b 4 65536"; do
    set -- $spec
    timeout 300 train_bench --shape $1 --layers $2 --seq 4096 --tokens-per-step $3 --steps 4 \
      > "$OUT/train_$1_$2l_$3.json" 2> "$OUT/train_$1_$2l_$3.log"
    echo "$1 $2 layers $3 tokens rc=$?"; tail -n 3 "$OUT/train_$1_$2l_$3.log"
    python3 -c "import json,sys; r=json.load(open(sys.argv[1])); print({k: r[k] for k in ('step_seconds','step_over_largest_floor','prediction_error','model_tflops','measured_bound')}, r['floors_seconds'])" "$OUT/train_$1_$2l_$3.json" || true
  done
fi
