#!/bin/bash
# Device run 1: the Hopper attention forward, tested and measured.
tar xzf bundle.tgz
export PATH=$PWD/bundle/bin:$PATH LD_LIBRARY_PATH=/usr/local/cuda/lib64
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv,noheader
ls /usr/local/cuda/bin | tr '\n' ' '; echo
timeout 300 gpu_test --gtest_filter='*HopperAttention*:*AttentionKernels*:*SinkWindow*' 2>&1 | grep -E "^\[|Failure|Expected|Which|differs|against|error" | head -60
echo "=== machine_bench"
timeout 400 machine_bench --save $OUT/profile.json > $OUT/machine_bench.json 2> $OUT/mb.err
echo "rc $?"; tail -3 $OUT/mb.err
python3 - <<'PY'
import json, os
d = json.load(open(os.environ["OUT"] + "/machine_bench.json"))
for a in d.get("attention_kernels", []):
    print(f'{a["kernels"]:5} D{a["head_dim"]:4} H{a["heads"]:3} len {a["seq_len"]:7}: fwd {a["forward_tflops"]:6.1f} bwd {a["backward_tflops"]:6.1f} TFLOP/s ({a["forward_ms"]:.2f} / {a["backward_ms"]:.2f} ms)')
print("profile attention", d.get("attention"))
print("gemm peak", d.get("gemm_peak_tflops"))
PY
