#!/usr/bin/env bash
# Fills the two git-ignored folders that travel with this checkout to a GPU machine that has CMake,
# ninja and CUDA but none of our Debian packages and no network:
#   .deps/    every third-party dependency of the `gpu` preset (-DLUTB_DEPS_DIR; the layout is
#             described in cmake/dependencies.cmake), taken from this machine's Debian packages
#             (scripts/setup.sh installs them)
#   .deps/wheels  accelerate and psutil (device_map in the Python CUDA tests; the machine's image
#             has torch and transformers but not these), from PyPI
#   .shared/  the golden vectors, the tiny models and the calibration tokens the GPU tests read
#             (LUTB_SHARED_DIR), and the peer MoE benchmark (bench/peer-moe: gpu_run.sh peers)
#
#   scripts/gpu_stage.sh
#     LUTB_SHARED_DIR  where the golden vectors and models are (default: ../shared)
#     STAGE_MODELS     the models to stage (default: tiny-qwen3-moe tiny-deepseek-v3, the two that
#                      tests/cuda reads; with tiny-mixtral the carried tree would pass 64 MiB)
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
DEPS=$ROOT/.deps
DATA=$ROOT/.shared
SHARED=$(cd "${LUTB_SHARED_DIR:-$ROOT/../shared}" && pwd)
[ "$SHARED" != "$DATA" ] || { echo "gpu_stage.sh: LUTB_SHARED_DIR is the staged copy itself; point it at ../shared" >&2; exit 2; }
LIB=/usr/lib/x86_64-linux-gnu

rm -rf "$DEPS" "$DATA"
# headers NAME PATH...: PATHs into .deps/NAME/include.
headers() {
  local name=$1; shift
  mkdir -p "$DEPS/$name/include"
  cp -r "$@" "$DEPS/$name/include/"
}
headers nlohmann_json /usr/include/nlohmann
headers cli11 /usr/include/CLI
headers fmt /usr/include/fmt
headers hwy /usr/include/hwy
rm -rf "$DEPS/hwy/include/hwy/tests" "$DEPS/hwy/include/hwy/contrib"
mkdir -p "$DEPS/hwy/lib"
cp -L "$LIB/libhwy.so.1" "$DEPS/hwy/lib/"
headers openblas /usr/include/x86_64-linux-gnu/openblas-pthread/{cblas.h,openblas_config.h}
# OpenBLAS and its Fortran runtime, named by their sonames.
blas=$(mktemp -d)
trap 'rm -rf "$blas"' EXIT
cp -L "$LIB/openblas-pthread/libopenblas.so.0" "$LIB/libgfortran.so.5" "$LIB/libquadmath.so.0" "$blas/"
tar -C "$blas" -cf - libopenblas.so.0 libgfortran.so.5 libquadmath.so.0 | xz -T2 -6 > "$DEPS/openblas/lib.tar.xz"
# GoogleTest's sources without googlemock, its tests, samples and docs.
mkdir -p "$DEPS/googletest/googletest"
cp /usr/src/googletest/CMakeLists.txt "$DEPS/googletest/"
cp -r /usr/src/googletest/googletest/{CMakeLists.txt,cmake,include,src} "$DEPS/googletest/googletest/"

# The pure-Python accelerate and psutil's abi3 wheel (any CPython >= 3.6).
python3 -m pip download -q --no-deps --only-binary=:all: -d "$DEPS/wheels" accelerate==1.16.0 psutil==7.2.2

mkdir -p "$DATA/models"
cp -r "$SHARED/golden" "$DATA/"
mkdir -p "$DATA/calib" "$DATA/bench"
cp "$SHARED/calib/train_tokens.safetensors" "$DATA/calib/"
cp -r "$SHARED/bench/peer-moe" "$DATA/bench/"
for m in ${STAGE_MODELS:-tiny-qwen3-moe tiny-deepseek-v3}; do
  mkdir -p "$DATA/models/$m"
  for f in config.json model.safetensors moe_activations.safetensors val_tokens.safetensors reference_eval.json; do
    cp "$SHARED/models/$m/$f" "$DATA/models/$m/"
  done
done
chmod -R u+w "$DEPS" "$DATA"
# What travels: the checkout (tracked and untracked-not-ignored files) and the two folders.
checkout=$(cd "$ROOT" && git ls-files -z --cached --others --exclude-standard | du -cb --files0-from=- 2>/dev/null | tail -1 | cut -f1)
staged=$(du -sb "$DEPS" "$DATA" | awk '{s += $1} END {print s}')
awk -v c="$checkout" -v s="$staged" 'BEGIN {
  printf "gpu_stage.sh: checkout %.1f MiB + .deps and .shared %.1f MiB = %.1f MiB to carry (limit 64 MiB)\n",
         c / 1048576, s / 1048576, (c + s) / 1048576 }'
