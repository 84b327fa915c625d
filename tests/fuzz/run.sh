#!/usr/bin/env bash
# Builds the fuzz targets with clang, libFuzzer, ASan and UBSan (in build-fuzz/) and runs
# each for SECONDS (default 600), JOBS at a time (default 2), from a copy of its seed
# corpus. Findings (crash-*, leak-*, timeout-*) are left in build-fuzz/findings/<target>/;
# add each, once fixed, to tests/fuzz/corpus/<target>/ so the replay tests keep it.
# Prints one JSON line per target. Usage: tests/fuzz/run.sh [SECONDS] [JOBS] [TARGET...]
set -euo pipefail
cd "$(dirname "$0")/../.."
SECONDS_EACH=${1:-600}
JOBS=${2:-2}
shift $(( $# > 2 ? 2 : $# ))
TARGETS=(${@:-safetensors model_config job_spec tokenizer_json dataset_line})
BUILD=build-fuzz
command -v clang++ >/dev/null || { echo "run.sh needs clang (apt-get install clang libclang-rt-dev)" >&2; exit 2; }
cmake -S . -B "$BUILD" -G Ninja -DCMAKE_C_COMPILER=clang -DCMAKE_CXX_COMPILER=clang++ \
  -DCMAKE_BUILD_TYPE=RelWithDebInfo -DMEGATRAIN_FUZZ=ON -DMEGATRAIN_CUDA=OFF \
  -DMEGATRAIN_WERROR=OFF >/dev/null
cmake --build "$BUILD" -j"$(nproc)" --target "${TARGETS[@]/#/fuzz_}"
run_one() {
  local t=$1 corpus="$BUILD/corpus/$1" findings="$BUILD/findings/$1"
  mkdir -p "$corpus" "$findings"
  cp -n tests/fuzz/corpus/"$t"/* "$corpus"/ 2>/dev/null || true
  local log="$BUILD/fuzz_$t.log" start=$SECONDS rc=0
  (cd "$findings" && ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1 \
     "../../tests/fuzz/fuzz_$t" -max_total_time="$SECONDS_EACH" -max_len=65536 -timeout=20 \
     -rss_limit_mb=4096 -print_final_stats=1 "../../corpus/$t" >"../../fuzz_$t.log" 2>&1) || rc=$?
  local execs cov found
  execs=$(grep -o 'stat::number_of_executed_units: *[0-9]*' "$log" | grep -o '[0-9]*$' || echo 0)
  cov=$(grep -o 'cov: [0-9]*' "$log" | tail -1 | grep -o '[0-9]*' || echo 0)
  found=$(ls "$findings" | wc -l)
  printf '{"target": "%s", "seconds": %d, "executions": %s, "coverage_edges": %s, "corpus_files": %d, "findings": %d, "exit": %d}\n' \
    "$t" $((SECONDS - start)) "${execs:-0}" "${cov:-0}" "$(ls "$corpus" | wc -l)" "$found" "$rc"
}
export -f run_one
export BUILD SECONDS_EACH
printf '%s\n' "${TARGETS[@]}" | xargs -P "$JOBS" -I{} bash -c 'run_one {}'
