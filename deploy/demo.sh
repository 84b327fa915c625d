#!/usr/bin/env bash
# The main job: installs what the build needs, builds, and runs the embedded demo job
# (a small Llama-style model trained on a short text) on the GPU if there is one, else on
# the CPU. Checkpoints land in ./megatrain-demo/checkpoints.
set -euo pipefail
cd "$(dirname "$0")/.."
bash deploy/install-deps.sh
BUILD_DIR=${BUILD_DIR:-build}
cmake -S . -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo
cmake --build "$BUILD_DIR" -j"$(nproc)" --target megatrain-train
exec "$BUILD_DIR/engine/tools/megatrain-train" --demo --demo-dir megatrain-demo "$@"
