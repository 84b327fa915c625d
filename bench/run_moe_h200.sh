#!/usr/bin/env bash
# The MoE checks on an H200 from a bundle (deploy/bundle.sh), one call:
#   gpu     gpu_test (every kernel and step test; MoE kernels included)
#   hf      the transformers comparison (tests/hf/compare_gpu_with_transformers.py) on the
#           text data for MEGATRAIN_CMP_MODELS (default: all seven families)
#   mxfp4   transformers' MXFP4 dequantization of every scale, written to OUT (the fixture
#           tests/engine/model/data/mxfp4_transformers.safetensors)
# (The MoE benchmarks: bench/run_moe_bench.sh.)
# Usage: bench/run_moe_h200.sh OUT gpu,hf,mxfp4
set -uo pipefail
OUT=${1:?OUT}; WHAT=${2:-gpu,hf}
mkdir -p "$OUT"
has() { [[ ",$WHAT," == *",$1,"* ]]; }
if has mxfp4; then
  python3 tests/hf/make_mxfp4_reference.py "$OUT"; echo "mxfp4 rc=$?"
fi
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
          f"logits {r['logits_rel_err']:.4f} (hf bf16 "
          f"{r.get('transformers_bf16_autocast_logits_rel_err', float('nan')):.4f}, our cpu "
          f"{r.get('cpu_backend_logits_rel_err', float('nan')):.1e}) "
          f"problems {r['problems']}")
PY
fi
