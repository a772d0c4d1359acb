#!/usr/bin/env bash
# Installs everything lutb needs to build and test on Debian 12 (bookworm).
# Run as root (or through sudo). CUDA is optional: when nvcc is on PATH (or in
# /usr/local/cuda/bin) the CUDA sources are built too.
set -euo pipefail
SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends \
  build-essential cmake ninja-build ccache git pkg-config \
  clang libclang-rt-dev \
  libgtest-dev libgmock-dev libbenchmark-dev \
  nlohmann-json3-dev libcli11-dev libfmt-dev \
  libopenblas-dev libhwy-dev libomp-dev \
  python3 python3-dev python3-venv >/dev/null
echo "lutb: dependencies installed"
