#!/bin/bash
# Stop 29's GPU checks in one short call: the new GPU tests (Hopper attention forward, the
# fp32 master's upload, the attention tests it now shares helpers with).
tar xzf bundle.tgz
export PATH=$PWD/bundle/bin:$PATH LD_LIBRARY_PATH=/usr/local/cuda/lib64
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 100 gpu_test --gtest_filter='*HopperAttention*:*UploadWeightsFromF32*:*SinkWindow*:*AttentionKernels*' 2>&1 | grep -E "^\[ +(OK|FAILED|SKIPPED|PASSED) |Failure|against|differs|Expected|Which" | head -60
echo "gpu_test rc ${PIPESTATUS[0]}"
