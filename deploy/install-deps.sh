#!/usr/bin/env bash
# Installs every Debian package megatrain needs to build and test, on Debian 12 / Ubuntu.
# Idempotent: packages already present are skipped by apt. CUDA is not installed here:
# the CUDA backend is built only when nvcc is found (e.g. /usr/local/cuda).
set -euo pipefail
SUDO=""
[ "$(id -u)" -eq 0 ] || SUDO="sudo"
PKGS=(
  build-essential cmake ninja-build pkg-config git
  libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler
  libabsl-dev libyaml-cpp-dev nlohmann-json3-dev libsqlite3-dev
  libopenblas-dev libhwloc-dev libnuma-dev
  libgtest-dev libgmock-dev libcli11-dev
  libpcre2-dev libutf8proc-dev liburing-dev
  libssl-dev openssl
  prometheus-cpp-dev
  prometheus
)
missing=()
for p in "${PKGS[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ "${#missing[@]}" -gt 0 ]; then
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get update -qq
  $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi
