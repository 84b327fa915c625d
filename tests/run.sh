#!/usr/bin/env bash
# Installs what the build needs, builds everything, and runs the whole test suite, then
# the unit tests again under ASan+UBSan and TSan (tests/sanitize.sh; MEGATRAIN_SANITIZE=0
# skips them). GPU tests skip cleanly where there is no GPU. Usage: tests/run.sh [ctest args...]
set -euo pipefail
cd "$(dirname "$0")/.."
bash deploy/install-deps.sh
BUILD_DIR=${BUILD_DIR:-build}
cmake -S . -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo
cmake --build "$BUILD_DIR" -j"$(nproc)"
ctest --test-dir "$BUILD_DIR" --output-on-failure -j"$(nproc)" "$@"
if [[ ${MEGATRAIN_SANITIZE:-1} != 0 ]]; then
  bash tests/sanitize.sh all
fi
