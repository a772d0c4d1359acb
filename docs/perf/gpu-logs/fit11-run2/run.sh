#!/usr/bin/env bash
# fit11's second device run (one call): builds the GPU fitter as scripts/gpu_run.sh's "fit" mode
# does (sm_90a, src/cuda/fit_*.cu with -fmad=false, src/fit with -ffp-contract=off), runs the
# fitter and online-method GPU tests (the even DP levels as the default), compute-sanitizer
# (memcheck, racecheck, synccheck) on the edge tiles of both fitters, and the benchmark (Gaussian and
# Student-t, [8, 4096, 7168]; DP levels with a group of lanes per node vs evenly spread, alternated
# twice).
# Usage, from the staged folder (scripts/gpu_stage.sh DEST; cp this file to DEST/run_fit11b.sh):
#   OUT=... bash run_fit11b.sh
set -uo pipefail
ROOT=$(pwd)
B=$ROOT/build/gpu
mkdir -p "$B/obj"
OUT=${OUT:-$B/out}
mkdir -p "$OUT"
GTEST_DIR=$ROOT/deps/googletest
JSON_INC=$ROOT/deps/include
DEPS_INC=$ROOT/deps/include
DEPS_LIB=$ROOT/deps/lib
export LUTB_SHARED_DIR=$ROOT/shared
FA="-gencode=arch=compute_90a,code=sm_90a"
FCU="-std=c++20 -O3 --expt-relaxed-constexpr -lineinfo $FA -Iinclude -Isrc"
CXXFLAGS="-std=c++20 -O2 -fopenmp -DFMT_HEADER_ONLY -Iinclude -Isrc -Itests -I$JSON_INC -I$DEPS_INC -isystem $GTEST_DIR/include -I$(dirname "$(command -v nvcc)")/../include"
t0=$(date +%s)
{
  pids=()
  for f in src/cuda/fit_*.cu; do nvcc $FCU -fmad=false -c "$f" -o "$B/obj/f_$(basename "$f" .cu).o" & pids+=($!); done
  nvcc $FCU -c src/cuda/lane_major.cu -o "$B/obj/fl_lane_major.o" & pids+=($!)
  nvcc $FCU -c bench/gpu/bench_fit_gpu.cu -o "$B/obj/fb_bench_fit_gpu.o" & pids+=($!)
  g++ -std=c++17 -O2 -isystem "$GTEST_DIR/include" -I"$GTEST_DIR" -c "$GTEST_DIR/src/gtest-all.cc" -o "$B/obj/gtest-all.o" & pids+=($!)
  g++ -std=c++17 -O2 -isystem "$GTEST_DIR/include" -I"$GTEST_DIR" -c "$GTEST_DIR/src/gtest_main.cc" -o "$B/obj/gtest_main.o" & pids+=($!)
  for f in src/core/*.cpp src/fit/*.cpp src/io/safetensors*.cpp; do
    g++ $CXXFLAGS -O3 -ffp-contract=off -c "$f" -o "$B/obj/fc_$(basename "$(dirname "$f")")_$(basename "$f" .cpp).o" & pids+=($!)
  done
  for f in tests/cuda/fit_gpu_test.cpp tests/cuda/online_gpu_test.cpp tests/support/test_support.cpp; do
    g++ $CXXFLAGS -DLUTB_SOURCE_DIR="\"$ROOT\"" -c "$f" -o "$B/obj/ft_$(basename "$f" .cpp).o" & pids+=($!)
  done
  for p in "${pids[@]}"; do wait "$p"; done
  nvcc $FA -o "$B/lutb_fit_gpu_tests" "$B"/obj/ft_*.o "$B"/obj/f_fit_*.o "$B/obj/fl_lane_major.o" "$B"/obj/fc_*.o "$B/obj/gtest-all.o" "$B/obj/gtest_main.o" \
    -Xcompiler -fopenmp -L"$DEPS_LIB" -lhwy -lpthread -Xlinker -rpath="$DEPS_LIB"
  nvcc $FA -o "$B/bench_fit_gpu" "$B/obj/fb_bench_fit_gpu.o" "$B"/obj/f_fit_*.o "$B/obj/fl_lane_major.o" "$B"/obj/fc_*.o \
    -Xcompiler -fopenmp -L"$DEPS_LIB" -lhwy -lpthread -Xlinker -rpath="$DEPS_LIB"
} > "$OUT/build_fit.log" 2>&1
echo "build: $(( $(date +%s) - t0 )) s" | tee -a "$OUT/build_fit.log"
[ -x "$B/bench_fit_gpu" ] || { tail -40 "$OUT/build_fit.log"; exit 1; }
export LD_LIBRARY_PATH="$DEPS_LIB:${LD_LIBRARY_PATH:-}"
{ date -u; nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,memory.total --format=csv; nproc; } > "$OUT/gpu.txt" 2>&1
"$B/lutb_fit_gpu_tests" > "$OUT/fit_tests.log" 2>&1
tail -3 "$OUT/fit_tests.log"; grep -E "FAILED|Failure" "$OUT/fit_tests.log" | head -20
echo "tests done: $(( $(date +%s) - t0 )) s"
S='FitGpu.EdgeTiles:FitGpuOptimal.EdgeTiles'
{
  compute-sanitizer --tool memcheck --error-exitcode 9 "$B/lutb_fit_gpu_tests" --gtest_filter="$S:FitGpu.ScanVariantsSameBytes" 2>&1 | tail -6
  echo "memcheck rc=${PIPESTATUS[0]}"
  compute-sanitizer --tool racecheck --error-exitcode 9 "$B/lutb_fit_gpu_tests" --gtest_filter="$S" 2>&1 | tail -5
  echo "racecheck rc=${PIPESTATUS[0]}"
  compute-sanitizer --tool synccheck --error-exitcode 9 "$B/lutb_fit_gpu_tests" --gtest_filter="$S" 2>&1 | tail -3
  echo "synccheck rc=${PIPESTATUS[0]}"
} > "$OUT/fit_sanitizer.log" 2>&1
grep -E "rc=|ERROR SUMMARY|RACECHECK SUMMARY" "$OUT/fit_sanitizer.log"
echo "sanitizers done: $(( $(date +%s) - t0 )) s"
{ "$B/bench_fit_gpu" 8 4096 7168; echo; "$B/bench_fit_gpu" 8 4096 7168 student; } > "$OUT/bench_fit_gpu.md" 2>&1
grep -E "fit11|== " "$OUT/bench_fit_gpu.md"
echo "all done: $(( $(date +%s) - t0 )) s"
