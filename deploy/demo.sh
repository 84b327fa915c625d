#!/usr/bin/env bash
# The main job: installs what the build needs, builds, starts megatraind with its
# embedded defaults (unless one is already serving), submits the demo job with the
# megatrain CLI and watches it to the end. The demo trains a small Llama-style model on a
# short text, on the GPU if there is one, else on the CPU; its checkpoints land in
# ./megatrain-demo/checkpoints. Exit code: the job's outcome (megatrain --help).
set -euo pipefail
cd "$(dirname "$0")/.."
bash deploy/install-deps.sh
BUILD_DIR=${BUILD_DIR:-build}
cmake -S . -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo
cmake --build "$BUILD_DIR" -j"$(nproc)" --target megatraind megatrain megatrain-train

CLI="$BUILD_DIR/client/megatrain"
daemon_pid=""
if ! "$CLI" node >/dev/null 2>&1; then
  "$BUILD_DIR/server/megatraind" &
  daemon_pid=$!
  trap 'kill -TERM "$daemon_pid" 2>/dev/null; wait "$daemon_pid" 2>/dev/null || true' EXIT
  for _ in $(seq 100); do "$CLI" node >/dev/null 2>&1 && break; sleep 0.2; done
fi
rm -rf megatrain-demo/checkpoints
spec=$("$BUILD_DIR/engine/tools/megatrain-train" --demo --write-only --demo-dir megatrain-demo "$@")
"$CLI" submit "$spec" --watch
