#!/usr/bin/env bash
# Sanitizer builds of the unit tests (no CUDA; GCC's sanitizers):
#   asan: AddressSanitizer + UndefinedBehaviorSanitizer, every CPU engine, server and client
#         unit test;
#   tsan: ThreadSanitizer, the pipeline (threads as streams), the host optimizer, background
#         checkpoints, the CPU reduce-scatter of data parallelism, the NVMe tier), the trainer and the
#         server (job store, metrics registry, daemon metrics, the server's mutex). The
#         server locks
#         with server/mutex.h (std::mutex), which TSan sees; gRPC and SQLite, from
#         Debian, are not instrumented, so their own internals are not checked.
# Usage: tests/sanitize.sh [asan|tsan|all]   (BUILD_ROOT: where the build folders go)
# The compiler and libraries come from deploy/install-deps.sh (tests/run.sh runs it).
set -euo pipefail
cd "$(dirname "$0")/.."
WHICH=${1:-all}
ROOT=${BUILD_ROOT:-.}
jobs=$(nproc)

configure() {  # dir, sanitizer
  cmake -S . -B "$1" -G Ninja -DMEGATRAIN_CUDA=OFF -DMEGATRAIN_SANITIZE="$2" \
    -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O1 -g" \
    -DCMAKE_C_FLAGS_RELWITHDEBINFO="-O1 -g" > /dev/null
}

# Unit-test targets of a build folder matching a pattern (never the GPU tests), and the
# fuzz-corpus replayers. ctest then runs the tests of the binaries that were built.
targets() {  # dir, regex
  ninja -C "$1" -t targets all | sed -n 's/^\([a-z0-9_]*_test\|fuzz_[a-z_]*\): .*/\1/p' |
    grep -E "$2" | grep -v '^gpu_test$' | sort -u
}

if [[ $WHICH == asan || $WHICH == all ]]; then
  dir="$ROOT/build-asan"
  configure "$dir" address,undefined
  mapfile -t t < <(targets "$dir" '.')  # every unit test, and the fuzz corpora replayed
  cmake --build "$dir" -j"$jobs" --target "${t[@]}"
  # Leaks: gRPC and OpenBLAS keep process-lifetime allocations; report only ours.
  ASAN_OPTIONS=detect_leaks=1:abort_on_error=1:strict_string_checks=1 \
  LSAN_OPTIONS=suppressions=$PWD/tests/sanitizers/lsan.supp \
  UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
    ctest --test-dir "$dir" -L 'unit|fuzz' --output-on-failure -j"$jobs"
fi

if [[ $WHICH == tsan || $WHICH == all ]]; then
  dir="$ROOT/build-tsan"
  configure "$dir" thread
  mapfile -t t < <(targets "$dir" '^(pipeline|host_optimizer|trainer|collective|moment_disk|job_store|metrics|daemon_metrics|server_mutex|access)_test$')
  [[ ${#t[@]} -ge 8 ]] || { echo "sanitize.sh: TSan targets not found: ${t[*]}" >&2; exit 1; }
  cmake --build "$dir" -j"$jobs" --target "${t[@]}"
  # OpenMP teams of one: libgomp is not instrumented, so its barriers would read as races.
  # Our own threads (the CPU backend's streams, the host optimizer) are
  # what is checked.
  OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 \
  TSAN_OPTIONS="halt_on_error=1:second_deadlock_stack=1:suppressions=$PWD/tests/sanitizers/tsan.supp" \
    ctest --test-dir "$dir" -L unit --output-on-failure -j"$jobs" -E '^fuzz_replay'
fi
