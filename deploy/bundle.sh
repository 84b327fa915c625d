#!/usr/bin/env bash
# Packs the built binaries with every shared library they load (except the C library,
# the dynamic loader and the NVIDIA driver, which the target box provides) into one
# folder that runs on a GPU box lacking our -dev packages:
#
#   deploy/bundle.sh [BUILD_DIR] [OUT_DIR]      (defaults: build, bundle)
#   OUT_DIR/bin/megatraind ...                   wrappers that set LD_LIBRARY_PATH
#
# Copy OUT_DIR anywhere (scp, rsync) and run OUT_DIR/bin/<tool>.
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR=${1:-build}
OUT=${2:-bundle}
BINARIES=(
  server/megatraind client/megatrain engine/tools/megatrain-train engine/tools/megatrain-generate
  engine/tools/megatrain-merge
  tests/gpu/gpu_test tests/engine/backend/pci_numa_test tests/hf/export_reference
  tests/hf/gpu_reference tests/hf/dpo_reference bench/daemon_load
  bench/train_bench bench/generate_bench bench/machine_bench bench/checkpoint_bench
)
rm -rf "$OUT"
mkdir -p "$OUT/bin" "$OUT/libexec" "$OUT/lib"
# Provided by the target system: glibc, the loader, and the GPU driver's libraries.
# BUNDLE_CUDA_LIBS=0 also leaves out the CUDA runtime and cuBLAS (large), for boxes with
# the CUDA toolkit installed (add its lib64 to LD_LIBRARY_PATH there).
skip='^(linux-vdso|ld-linux|libc\.so|libm\.so|libdl\.so|libpthread\.so|librt\.so|libcuda\.so|libnvidia)'
if [ "${BUNDLE_CUDA_LIBS:-1}" = 0 ]; then
  skip='^(linux-vdso|ld-linux|libc\.so|libm\.so|libdl\.so|libpthread\.so|librt\.so|libcuda\.so|libnvidia|libcudart|libcublas)'
fi
for rel in "${BINARIES[@]}"; do
  bin="$BUILD_DIR/$rel"
  [ -x "$bin" ] || continue
  name=$(basename "$bin")
  cp "$bin" "$OUT/libexec/$name"
  strip --strip-debug "$OUT/libexec/$name"
  ldd "$bin" | awk '/=>/ {print $1, $3}' | while read -r lib path; do
    if [[ "$lib" =~ $skip ]]; then continue; fi
    if [ -f "$path" ] && [ ! -e "$OUT/lib/$lib" ]; then cp -L "$path" "$OUT/lib/$lib"; fi
  done
  cat > "$OUT/bin/$name" <<WRAP
#!/usr/bin/env bash
here=\$(cd "\$(dirname "\$0")/.." && pwd)
export LD_LIBRARY_PATH="\$here/lib\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}:/usr/local/cuda/lib64"
exec "\$here/libexec/$name" "\$@"
WRAP
  chmod +x "$OUT/bin/$name"
done
cp README.md "$OUT/"
echo "bundle: $(ls "$OUT/bin" | wc -l) programs, $(ls "$OUT/lib" | wc -l) libraries, $(du -sh "$OUT" | cut -f1) in $OUT"
