#!/usr/bin/env bash
# Stages what scripts/gpu_run.sh needs into DEST (default: .gpu in this checkout, git-ignored) for a GPU machine that
# receives only that checkout: the sources, googletest and nlohmann-json sources from this machine's
# Debian packages, the golden vectors and the tiny-qwen3-moe model (more with STAGE_MODELS, below).
set -euo pipefail
SRC=$(cd "$(dirname "$0")/.." && pwd)
DEST=${1:-$SRC/.gpu}
SHARED=${SHARED:-$SRC/../shared}
rm -rf "$DEST/include" "$DEST/src" "$DEST/tests" "$DEST/bench" "$DEST/scripts"
mkdir -p "$DEST/deps/include" "$DEST/shared/models"
cp -r "$SRC/include" "$SRC/src" "$SRC/tests" "$SRC/bench" "$SRC/scripts" "$DEST/"
[ -d "$DEST/deps/googletest" ] || cp -r /usr/src/googletest/googletest "$DEST/deps/googletest"
[ -d "$DEST/deps/include/nlohmann" ] || cp -r /usr/include/nlohmann "$DEST/deps/include/"
[ -d "$DEST/deps/include/fmt" ] || cp -r /usr/include/fmt "$DEST/deps/include/"
[ -d "$DEST/deps/include/hwy" ] || cp -r /usr/include/hwy "$DEST/deps/include/"
mkdir -p "$DEST/deps/lib"
cp -L /usr/lib/x86_64-linux-gnu/libhwy.so.1 "$DEST/deps/lib/libhwy.so.1"
ln -sf libhwy.so.1 "$DEST/deps/lib/libhwy.so"
# The lutb tool (gpu_run.sh cli): CLI11's headers, cblas.h, and OpenBLAS with its Fortran runtime,
# xz-compressed (36 MB -> 4 MB: the carried tree must stay under 64 MiB).
[ -d "$DEST/deps/include/CLI" ] || cp -r /usr/include/CLI "$DEST/deps/include/"
cp /usr/include/x86_64-linux-gnu/openblas-pthread/cblas.h /usr/include/x86_64-linux-gnu/openblas-pthread/openblas_config.h \
  "$DEST/deps/include/"
mkdir -p "$DEST/deps/blas"
for l in /usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 /lib/x86_64-linux-gnu/libgfortran.so.5 \
         /lib/x86_64-linux-gnu/libquadmath.so.0; do
  [ -f "$DEST/deps/blas/$(basename "$l").xz" ] || xz -T2 -6 -c "$l" > "$DEST/deps/blas/$(basename "$l").xz"
done
cp -r "$SHARED/golden" "$DEST/shared/"
# STAGE_MODELS: the shared models to stage (default tiny-qwen3-moe, 29 MB; the cli mode also runs
# tiny-deepseek-v3, 16 MB: STAGE_MODELS="tiny-qwen3-moe tiny-deepseek-v3"; tiny-mixtral, 13 MB more,
# would pass the 64 MiB carry limit with both).
for m in ${STAGE_MODELS:-tiny-qwen3-moe}; do
  mkdir -p "$DEST/shared/models/$m"
  for f in config.json model.safetensors moe_activations.safetensors val_tokens.safetensors; do
    cp "$SHARED/models/$m/$f" "$DEST/shared/models/$m/"
  done
done
chmod -R u+w "$DEST"
du -sh "$DEST"
