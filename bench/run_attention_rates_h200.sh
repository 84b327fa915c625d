#!/bin/bash
# machine_bench on the H200, the attention kernels' rates printed (Hopper forward vs mma).
tar xzf bundle.tgz
export PATH=$PWD/bundle/bin:$PATH LD_LIBRARY_PATH=/usr/local/cuda/lib64
timeout 170 machine_bench > mb.json 2> mb.err; echo "rc $?"; cp mb.json $OUT/ 2>/dev/null
python3 - <<'PY'
import json
d = json.load(open("mb.json"))
for a in d.get("attention_kernels", []):
    print(f'{a["kernels"]:6} D{a["head_dim"]:3} H{a["heads"]:2} len {a["seq_len"]:6}: fwd {a["forward_tflops"]:6.1f} bwd {a["backward_tflops"]:6.1f} TFLOP/s')
print("gemm peak", d.get("gemm_peak_tflops"), "adamw", d.get("adamw_params_per_second"), d.get("adamw_bf16_params_per_second"), d.get("adamw_int8_params_per_second"))
PY
