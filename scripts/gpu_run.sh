#!/usr/bin/env bash
# Builds the CUDA library, the GPU tests and the GPU benchmark with nvcc and g++ alone (the GPU
# machine lacks the Debian packages the CMake build uses: googletest and nlohmann-json are compiled
# from source, fmt is used header-only, Highway's headers and libhwy.so come from deps/), plus the
# CPU emulation the tests compare against (src/core, src/moe), then runs: the GPU tests,
# compute-sanitizer (memcheck, racecheck) on the small cases, and the benchmark.
#
#   scripts/gpu_run.sh [tests|sanitize|bench|all] [bench args...]
#   scripts/gpu_run.sh fit [bench_fit_gpu args...]   (LUTB_FIT_BENCH_FIRST=1: the benchmark before the sanitizers)
#     builds only the GPU fitter and the online method (src/cuda/fit_*.cu, -fmad=false), their test
#     binary (tests/cuda/fit_gpu_test.cpp and online_gpu_test.cpp against src/fit compiled with
#     -ffp-contract=off, as CMake does) and bench/gpu/bench_fit_gpu.cu, then runs the tests,
#     memcheck, racecheck and synccheck on small cases (both fitters) and the bench (binned-dp on
#     the old and new kernel, optimal on the warp kernel, Gaussian and Student-t data).
#   scripts/gpu_run.sh online
#     builds as fit, then the tests, the online method's old-vs-new benchmark, memcheck on the online
#     tests and an nsys trace when nsys exists (see the mode below; onl14).
#   scripts/gpu_run.sh moebench 'CMD' ['CMD'...]
#     builds only bench_moe_gpu (MoE sources, sm_90a) and runs each CMD with $BENCH = that binary.
#   scripts/gpu_run.sh decws 'CMD' ['CMD'...]
#     builds (sm_90a) the MoE CUDA sources, the MoE GPU tests (moe_cuda_test, moe_vs_cpu_test) and
#     bench_moe_gpu, runs the tests, memcheck / racecheck / synccheck on small cases, and each CMD
#     with $BENCH = the benchmark (DECWS_BENCH_FIRST=1: the CMDs first; DECWS_TESTS: a gtest filter).
#   scripts/gpu_run.sh moetests 'CMD' ['CMD'...]
#     builds only the MoE GPU tests and bench_moe_gpu (sm_90a), runs the tests, memcheck + racecheck
#     on the decode-path cases, then each CMD with $BENCH = the benchmark (see the mode below).
#   scripts/gpu_run.sh cli
#     builds the lutb tool with the CUDA backend (sm_90a) and tests/cuda/cli_gpu_test.cpp, runs them and
#     the --device cuda commands on tiny-qwen3-moe and, when staged (STAGE_MODELS of gpu_stage.sh),
#     tiny-deepseek-v3 (see the mode below; cli15, cli16).
#   scripts/gpu_run.sh prefill [bench_moe_prefill args...]
#     builds only the MoE CUDA sources (src/cuda/moe_*.cu, routing.cu, lane_major.cu), the prefill path's tests
#     (tests/cuda/moe_prefill_test.cpp) and bench/gpu/bench_moe_prefill.cu, then runs those tests,
#     the benchmark, and compute-sanitizer memcheck + racecheck on small cases (WS64 in separate
#     processes; PREFILL_WS_BENCH / PREFILL_NCU add its benchmark and an Nsight Compute view, see below).
# Environment:
#   GTEST_DIR   googletest source tree (default: deps/googletest, else /usr/src/googletest/googletest)
#   JSON_INC    folder holding nlohmann/json.hpp (default: deps/include, else /usr/include)
#   LUTB_SHARED_DIR  the shared golden/models folder (default: ../shared or ./shared)
#   OUT         where logs go (default: build/gpu/out)
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
WHAT=${1:-all}
shift || true
B=$ROOT/build/gpu
mkdir -p "$B/obj"
OUT=${OUT:-$B/out}
mkdir -p "$OUT"
GTEST_DIR=${GTEST_DIR:-$([ -d deps/googletest ] && echo "$ROOT/deps/googletest" || echo /usr/src/googletest/googletest)}
JSON_INC=${JSON_INC:-$([ -d deps/include/nlohmann ] && echo "$ROOT/deps/include" || echo /usr/include)}
if [ -z "${LUTB_SHARED_DIR:-}" ]; then
  for d in "$ROOT/shared" "$ROOT/../shared"; do [ -d "$d/golden" ] && export LUTB_SHARED_DIR=$d && break; done
fi
NVCC=${NVCC:-nvcc}
ARCH="-gencode=arch=compute_80,code=sm_80 -gencode=arch=compute_90a,code=sm_90a"
CUFLAGS="-std=c++20 -O3 --expt-relaxed-constexpr -lineinfo $ARCH -Iinclude -Isrc"
DEPS_INC=${DEPS_INC:-$([ -d deps/include/fmt ] && echo "$ROOT/deps/include" || echo /usr/include)}
DEPS_LIB=${DEPS_LIB:-$([ -d deps/lib ] && echo "$ROOT/deps/lib" || echo /usr/lib/x86_64-linux-gnu)}
CXXFLAGS="-std=c++20 -O2 -fopenmp -DFMT_HEADER_ONLY -Iinclude -Isrc -Itests -I$JSON_INC -I$DEPS_INC -isystem $GTEST_DIR/include -I$(dirname "$(command -v $NVCC)")/../include"

build() {
  local pids=()
  for f in src/cuda/*.cu; do
    local fl=""; case "$f" in src/cuda/fit_*) fl=-fmad=false;; esac
    $NVCC $CUFLAGS $fl -c "$f" -o "$B/obj/$(basename "$f" .cu).o" & pids+=($!)
  done
  if [ ! -f "$B/obj/gtest-all.o" ]; then
    g++ -std=c++17 -O2 -isystem "$GTEST_DIR/include" -I"$GTEST_DIR" -c "$GTEST_DIR/src/gtest-all.cc" -o "$B/obj/gtest-all.o" & pids+=($!)
    g++ -std=c++17 -O2 -isystem "$GTEST_DIR/include" -I"$GTEST_DIR" -c "$GTEST_DIR/src/gtest_main.cc" -o "$B/obj/gtest_main.o" & pids+=($!)
  fi
  for f in src/core/*.cpp src/fit/*.cpp src/moe/*.cpp src/io/safetensors*.cpp src/io/config_json.cpp; do
    local fc=""; case "$f" in src/fit/*) fc=-ffp-contract=off;; esac  # as CMakeLists.txt
    g++ $CXXFLAGS -O3 $fc -c "$f" -o "$B/obj/c_$(basename "$(dirname "$f")")_$(basename "$f" .cpp).o" & pids+=($!)
  done
  for f in tests/cuda/*.cpp tests/support/test_support.cpp; do
    g++ $CXXFLAGS -DLUTB_SOURCE_DIR="\"$ROOT\"" -c "$f" -o "$B/obj/t_$(basename "$f" .cpp).o" & pids+=($!)
  done
  $NVCC $CUFLAGS -c bench/gpu/bench_moe_gpu.cu -o "$B/obj/b_bench_moe_gpu.o" & pids+=($!)
  for p in "${pids[@]}"; do wait "$p"; done
  local lib=("$B"/obj/moe_*.o "$B"/obj/routing.o "$B"/obj/lane_major.o "$B"/obj/fit_*.o)
  $NVCC $ARCH -o "$B/lutb_cuda_tests" "$B"/obj/t_*.o "${lib[@]}" "$B"/obj/c_*.o "$B/obj/gtest-all.o" "$B/obj/gtest_main.o" \
    -Xcompiler -fopenmp -L"$DEPS_LIB" -lhwy -lpthread -Xlinker -rpath="$DEPS_LIB"
  # The GPU fitter objects in lib need the core (dtype names, tiles) and src/fit (fitter names) too.
  $NVCC $ARCH -o "$B/bench_moe_gpu" "$B/obj/b_bench_moe_gpu.o" "${lib[@]}" "$B"/obj/c_core_*.o "$B"/obj/c_fit_*.o -lcublas \
    -Xcompiler -fopenmp -L"$DEPS_LIB" -lhwy -lpthread -Xlinker -rpath="$DEPS_LIB"
}

build_fit() {
  # sm_90a only (the H200; the CMake build compiles sm_80 too): halves the longest compile.
  local FA="-gencode=arch=compute_90a,code=sm_90a"
  local FCU="${CUFLAGS/$ARCH/$FA}"
  local pids=()
  for f in src/cuda/fit_*.cu; do
    $NVCC $FCU -fmad=false -c "$f" -o "$B/obj/f_$(basename "$f" .cu).o" & pids+=($!)
  done
  $NVCC $FCU -c src/cuda/lane_major.cu -o "$B/obj/fl_lane_major.o" & pids+=($!)  # the online method's permutation
  $NVCC $FCU -c bench/gpu/bench_fit_gpu.cu -o "$B/obj/fb_bench_fit_gpu.o" & pids+=($!)
  if [ ! -f "$B/obj/gtest-all.o" ]; then
    g++ -std=c++17 -O2 -isystem "$GTEST_DIR/include" -I"$GTEST_DIR" -c "$GTEST_DIR/src/gtest-all.cc" -o "$B/obj/gtest-all.o" & pids+=($!)
    g++ -std=c++17 -O2 -isystem "$GTEST_DIR/include" -I"$GTEST_DIR" -c "$GTEST_DIR/src/gtest_main.cc" -o "$B/obj/gtest_main.o" & pids+=($!)
  fi
  for f in src/core/*.cpp src/fit/*.cpp src/io/safetensors*.cpp src/io/config_json.cpp; do
    g++ $CXXFLAGS -O3 -ffp-contract=off -c "$f" -o "$B/obj/fc_$(basename "$(dirname "$f")")_$(basename "$f" .cpp).o" & pids+=($!)
  done
  for f in tests/cuda/fit_gpu_test.cpp tests/cuda/online_gpu_test.cpp tests/support/test_support.cpp; do
    g++ $CXXFLAGS -DLUTB_SOURCE_DIR="\"$ROOT\"" -c "$f" -o "$B/obj/ft_$(basename "$f" .cpp).o" & pids+=($!)
  done
  for p in "${pids[@]}"; do wait "$p"; done
  $NVCC $FA -o "$B/lutb_fit_gpu_tests" "$B"/obj/ft_*.o "$B"/obj/f_fit_*.o "$B/obj/fl_lane_major.o" "$B"/obj/fc_*.o "$B/obj/gtest-all.o" "$B/obj/gtest_main.o" \
    -Xcompiler -fopenmp -L"$DEPS_LIB" -lhwy -lpthread -Xlinker -rpath="$DEPS_LIB"
  $NVCC $FA -o "$B/bench_fit_gpu" "$B/obj/fb_bench_fit_gpu.o" "$B"/obj/f_fit_*.o "$B/obj/fl_lane_major.o" "$B"/obj/fc_*.o \
    -Xcompiler -fopenmp -L"$DEPS_LIB" -lhwy -lpthread -Xlinker -rpath="$DEPS_LIB"
}

build_prefill() {
  local pids=()
  # PREFILL_ARCH90=1: sm_90a code only (the H200 runs nothing else): about halves the build of a short call.
  local CUFLAGS=$CUFLAGS ARCH=$ARCH
  if [ -n "${PREFILL_ARCH90:-}" ]; then
    CUFLAGS="${CUFLAGS/$ARCH/-gencode=arch=compute_90a,code=sm_90a}"
    ARCH="-gencode=arch=compute_90a,code=sm_90a"
  fi
  for f in src/cuda/moe_*.cu src/cuda/routing.cu src/cuda/lane_major.cu; do
    $NVCC $CUFLAGS -c "$f" -o "$B/obj/p_$(basename "$f" .cu).o" & pids+=($!)
  done
  $NVCC $CUFLAGS -c bench/gpu/bench_moe_prefill.cu -o "$B/obj/pb_bench_moe_prefill.o" & pids+=($!)
  if [ ! -f "$B/obj/gtest-all.o" ]; then
    g++ -std=c++17 -O2 -isystem "$GTEST_DIR/include" -I"$GTEST_DIR" -c "$GTEST_DIR/src/gtest-all.cc" -o "$B/obj/gtest-all.o" & pids+=($!)
    g++ -std=c++17 -O2 -isystem "$GTEST_DIR/include" -I"$GTEST_DIR" -c "$GTEST_DIR/src/gtest_main.cc" -o "$B/obj/gtest_main.o" & pids+=($!)
  fi
  for f in src/core/*.cpp; do
    g++ $CXXFLAGS -O3 -c "$f" -o "$B/obj/pc_$(basename "$f" .cpp).o" & pids+=($!)
  done
  for f in tests/cuda/moe_prefill_test.cpp tests/support/test_support.cpp; do
    g++ $CXXFLAGS -DLUTB_SOURCE_DIR="\"$ROOT\"" -c "$f" -o "$B/obj/pt_$(basename "$f" .cpp).o" & pids+=($!)
  done
  for p in "${pids[@]}"; do wait "$p"; done
  $NVCC $ARCH -o "$B/lutb_prefill_tests" "$B"/obj/pt_*.o "$B"/obj/p_*.o "$B"/obj/pc_*.o "$B/obj/gtest-all.o" "$B/obj/gtest_main.o" \
    -Xcompiler -fopenmp -L"$DEPS_LIB" -lhwy -lpthread -Xlinker -rpath="$DEPS_LIB"
  $NVCC $ARCH -o "$B/bench_moe_prefill" "$B/obj/pb_bench_moe_prefill.o" "$B"/obj/p_*.o "$B"/obj/pc_*.o -lcublas \
    -Xcompiler -fopenmp -L"$DEPS_LIB" -lhwy -lpthread -Xlinker -rpath="$DEPS_LIB"
}

if [ "$WHAT" = prefill ]; then
  build_prefill 2>&1 | tee "$OUT/build_prefill.log"
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,memory.total --format=csv | tee -a "$OUT/build_prefill.log" || true
  export LD_LIBRARY_PATH="$DEPS_LIB:${LD_LIBRARY_PATH:-}"
  # The warp-specialised tile WS64 runs in separate processes (tests and bench), so that a fault in
  # it cannot take down the other tiles' verification and figures.
  LUTB_PREFILL_TEST_WS=0 "$B/lutb_prefill_tests" 2>&1 | tee "$OUT/prefill_tests.log" || true
  "$B/bench_moe_prefill" "$@" 2>&1 | tee "$OUT/bench_moe_prefill.md" || true
  # PREFILL_SKIP_WS=1: no second test process for WS64 (saves ~15 s of a short device call).
  if [ -z "${PREFILL_SKIP_WS:-}" ]; then
    LUTB_PREFILL_TEST_WS=only "$B/lutb_prefill_tests" 2>&1 | tee "$OUT/prefill_tests_ws.log" || true
  fi
  # PREFILL_WS_BENCH: arguments of a second benchmark process, e.g. "--lean --tiles WS64 --T 1024,4096"
  if [ -n "${PREFILL_WS_BENCH:-}" ]; then
    "$B/bench_moe_prefill" $PREFILL_WS_BENCH 2>&1 | tee "$OUT/bench_ws.md" || true
  fi
  compute-sanitizer --tool memcheck --error-exitcode 9 "$B/lutb_prefill_tests" \
    --gtest_filter='Shapes/PrefillRandom.MatchesHostReference/padded_odd:Shapes/PrefillRandom.MatchesHostReference/m128_ragged:PrefillCuda.InvalidExpertIdWritesNanRowOnly' 2>&1 |
    tail -12 | tee "$OUT/prefill_sanitizer.log" || true
  compute-sanitizer --tool racecheck --error-exitcode 9 "$B/lutb_prefill_tests" \
    --gtest_filter='Shapes/PrefillRandom.MatchesHostReference/padded_odd' 2>&1 | tail -8 | tee -a "$OUT/prefill_sanitizer.log" || true
  # PREFILL_NCU=N: Nsight Compute on the first N GEMM launches of one uncaptured forward per tile
  # (bench --quick on Qwen3-30B, T = 4096, tiles M64 then $PREFILL_NCU_TILES), at most 45 s, and only
  # when this script has run less than PREFILL_NCU_BEFORE seconds (default 170).
  if [ -n "${PREFILL_NCU:-}" ] && command -v ncu > /dev/null && [ "$SECONDS" -lt "${PREFILL_NCU_BEFORE:-170}" ]; then
    timeout 45 ncu --clock-control none -k regex:gemm --launch-count "$PREFILL_NCU" --section SpeedOfLight \
      --section WarpStateStats --section SchedulerStats --section Occupancy \
      "$B/bench_moe_prefill" --shape qwen3-30b --T 4096 --quick --tiles "${PREFILL_NCU_TILES:-WB64}" \
      > "$OUT/prefill_ncu.txt" 2>&1 || true
  fi
  echo "gpu_run.sh prefill: ${SECONDS} s"
  exit 0
fi

# moebench: only the MoE CUDA sources and bench_moe_gpu, sm_90a only (~40 s on 16 cores instead of
# the full build's ~100 s), then runs "$@" as a shell command with $BENCH pointing at the binary, e.g.
#   scripts/gpu_run.sh moebench 'LUTB_SWAPAB_NB=1 $BENCH --shape qwen3-30b --tokens 64,128 --variants 1'
# For short A/B measurements of heuristics and knobs; correctness stays with the full build's tests.
# MOEBENCH_PHASES=1 (small17): also $BENCH_PHASES, the same benchmark with moe_lutb.cu and the bench
# compiled with -DLUTB_SWAPAB_PHASES=1 (variant 65 prints the swap-AB GEMMs' phase tables; moe.hpp).
if [ "$WHAT" = moebench ]; then
  FA="-gencode=arch=compute_90a,code=sm_90a"
  MCU="${CUFLAGS/$ARCH/$FA}"
  mkdir -p "$B/mb" "$B/mbp"
  pids=()
  for f in src/cuda/moe_*.cu src/cuda/routing.cu src/cuda/lane_major.cu bench/gpu/bench_moe_gpu.cu; do
    $NVCC $MCU -c "$f" -o "$B/mb/$(basename "$f" .cu).o" & pids+=($!)
  done
  if [ "${MOEBENCH_PHASES:-0}" = 1 ]; then
    for f in src/cuda/moe_lutb.cu bench/gpu/bench_moe_gpu.cu; do
      $NVCC $MCU -DLUTB_SWAPAB_PHASES=1 -c "$f" -o "$B/mbp/$(basename "$f" .cu).o" & pids+=($!)
    done
  fi
  for p in "${pids[@]}"; do wait "$p"; done
  $NVCC $FA -o "$B/bench_moe_gpu_sm90" "$B"/mb/*.o -lcublas
  if [ "${MOEBENCH_PHASES:-0}" = 1 ]; then
    $NVCC $FA -o "$B/bench_moe_gpu_phases" "$B"/mbp/*.o $(ls "$B"/mb/*.o | grep -v -e '/moe_lutb\.o$' -e '/bench_moe_gpu\.o$') -lcublas
    export BENCH_PHASES="$B/bench_moe_gpu_phases"
  fi
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,memory.total --format=csv | tee "$OUT/gpu.txt" || true
  export BENCH="$B/bench_moe_gpu_sm90"
  for cmd in "$@"; do echo "## $cmd"; bash -c "$cmd"; done 2>&1 | tee "$OUT/moebench.md"
  exit 0
fi

# moetests: the MoE GPU tests (tests/cuda/moe_cuda_test.cpp, moe_vs_cpu_test.cpp,
# moe_decode_paths_test.cpp against src/core + src/moe) and bench_moe_gpu, sm_90a only, without the
# fitter and prefill tests (~40 s on 16 cores instead of `all`'s ~250 s); then the tests, memcheck +
# racecheck on small decode cases, and each "CMD" with $BENCH = the benchmark, e.g.
#   scripts/gpu_run.sh moetests '$BENCH --tokens 1,4,16,64 --variants 0,20'
# MOETESTS_JOBS: parallel compiles (default 64; 2 on a small machine). MOEBENCH_PHASES=1: also
# $BENCH_PHASES, the phase-timing benchmark (see moebench below).
if [ "$WHAT" = moetests ]; then
  FA="-gencode=arch=compute_90a,code=sm_90a"
  MCU="${CUFLAGS/$ARCH/$FA}"
  mkdir -p "$B/mt"
  pids=()
  throttle() { while [ "$(jobs -rp | wc -l)" -ge "${MOETESTS_JOBS:-64}" ]; do sleep 1; done; }
  {
  for f in src/cuda/moe_*.cu src/cuda/routing.cu src/cuda/lane_major.cu; do
    throttle; $NVCC $MCU -c "$f" -o "$B/mt/l_$(basename "$f" .cu).o" & pids+=($!)
  done
  throttle; $NVCC $MCU -c bench/gpu/bench_moe_gpu.cu -o "$B/mt/bench_moe_gpu.o" & pids+=($!)
  if [ "${MOEBENCH_PHASES:-0}" = 1 ]; then  # $BENCH_PHASES as in moebench (small17)
    mkdir -p "$B/mtp"
    throttle; $NVCC $MCU -DLUTB_SWAPAB_PHASES=1 -c src/cuda/moe_lutb.cu -o "$B/mtp/l_moe_lutb.o" & pids+=($!)
    throttle; $NVCC $MCU -DLUTB_SWAPAB_PHASES=1 -c bench/gpu/bench_moe_gpu.cu -o "$B/mtp/bench_moe_gpu.o" & pids+=($!)
  fi
  if [ ! -f "$B/obj/gtest-all.o" ]; then
    throttle; g++ -std=c++17 -O2 -isystem "$GTEST_DIR/include" -I"$GTEST_DIR" -c "$GTEST_DIR/src/gtest-all.cc" -o "$B/obj/gtest-all.o" & pids+=($!)
    throttle; g++ -std=c++17 -O2 -isystem "$GTEST_DIR/include" -I"$GTEST_DIR" -c "$GTEST_DIR/src/gtest_main.cc" -o "$B/obj/gtest_main.o" & pids+=($!)
  fi
  for f in src/core/*.cpp src/moe/*.cpp src/fit/*.cpp; do
    local_fc=""; case "$f" in src/fit/*) local_fc=-ffp-contract=off;; esac  # as CMakeLists.txt
    throttle; g++ $CXXFLAGS -O3 $local_fc -c "$f" -o "$B/mt/c_$(basename "$(dirname "$f")")_$(basename "$f" .cpp).o" & pids+=($!)
  done
  for f in tests/cuda/moe_cuda_test.cpp tests/cuda/moe_vs_cpu_test.cpp tests/cuda/moe_decode_paths_test.cpp tests/cuda/moe_e4m3_encode_test.cpp tests/support/test_support.cpp; do
    throttle; g++ $CXXFLAGS -DLUTB_SOURCE_DIR="\"$ROOT\"" -c "$f" -o "$B/mt/t_$(basename "$f" .cpp).o" & pids+=($!)
  done
  for p in "${pids[@]}"; do wait "$p"; done
  $NVCC $FA -o "$B/lutb_moe_tests" "$B"/mt/t_*.o "$B"/mt/l_*.o "$B"/mt/c_*.o "$B/obj/gtest-all.o" "$B/obj/gtest_main.o" \
    -lcublas -Xcompiler -fopenmp -L"$DEPS_LIB" -lhwy -lpthread -Xlinker -rpath="$DEPS_LIB"
  $NVCC $FA -o "$B/bench_moe_gpu_mt" "$B/mt/bench_moe_gpu.o" "$B"/mt/l_*.o "$B"/mt/c_core_*.o -lcublas \
    -Xcompiler -fopenmp -L"$DEPS_LIB" -lhwy -lpthread -Xlinker -rpath="$DEPS_LIB"
  if [ "${MOEBENCH_PHASES:-0}" = 1 ]; then
    $NVCC $FA -o "$B/bench_moe_gpu_phases" "$B"/mtp/*.o $(ls "$B"/mt/l_*.o | grep -v '/l_moe_lutb\.o$') "$B"/mt/c_core_*.o \
      -lcublas -Xcompiler -fopenmp -L"$DEPS_LIB" -lhwy -lpthread -Xlinker -rpath="$DEPS_LIB"
  fi
  } 2>&1 | tee "$OUT/build_moetests.log"
  [ "${MOETESTS_BUILD_ONLY:-0}" = 1 ] && exit 0
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,memory.total --format=csv | tee "$OUT/gpu.txt" || true
  export LD_LIBRARY_PATH="$DEPS_LIB:${LD_LIBRARY_PATH:-}"
  export BENCH="$B/bench_moe_gpu_mt"
  [ "${MOEBENCH_PHASES:-0}" = 1 ] && export BENCH_PHASES="$B/bench_moe_gpu_phases"
  # MOETESTS_BENCH_FIRST=1: the benchmark commands before the tests (a short lease keeps the figures).
  run_tests() {
    "$B/lutb_moe_tests" ${MOETESTS_FILTER:+--gtest_filter="$MOETESTS_FILTER"} 2>&1 | tail -60 | tee "$OUT/moe_tests.log" || true
    if [ "${MOETESTS_SANITIZE:-1}" = 1 ]; then
      compute-sanitizer --tool memcheck --error-exitcode 9 "$B/lutb_moe_tests" \
        --gtest_filter='MoeDecodePaths*:MoeCuda.SingleTokenInvalidAndRepeatedExperts:MoeCuda.InvalidExpertIdWritesNanRow' 2>&1 |
        tail -12 | tee "$OUT/moe_sanitizer.log" || true
      compute-sanitizer --tool racecheck --error-exitcode 9 "$B/lutb_moe_tests" \
        --gtest_filter='Shapes/MoeDecodePathsRandom.*/E16_H200*' 2>&1 | tail -6 | tee -a "$OUT/moe_sanitizer.log" || true
    fi
  }
  [ "${MOETESTS_BENCH_FIRST:-0}" = 1 ] || run_tests
  for cmd in "$@"; do echo "## $cmd"; bash -c "$cmd"; done 2>&1 | tee "$OUT/moebench.md"
  [ "${MOETESTS_BENCH_FIRST:-0}" = 1 ] && run_tests
  echo "gpu_run.sh moetests: ${SECONDS} s"
  exit 0
fi

# online (onl14): build_fit, then the fitter + online-method tests, the online-method benchmark
# (LUTB_BENCH_ONLINE=1: old serial vs new pipelined method in the same process, Gaussian and
# Student-t, twice each, alternating), memcheck on the online tests, and (when nsys exists and the
# script has run less than ONLINE_NSYS_BEFORE seconds, default 200) an nsys trace of one old and one
# new call (LUTB_BENCH_ONLINE=2), printed as the CUDA GPU trace.
if [ "$WHAT" = online ]; then
  build_fit 2>&1 | tail -30 > "$OUT/build_fit.log"
  { nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,memory.total --format=csv; nvcc --version | tail -2;
    echo "nsys: $(command -v nsys || echo absent)  ncu: $(command -v ncu || echo absent)"; echo "build: ${SECONDS} s"; } > "$OUT/gpu.txt" 2>&1 || true
  export LD_LIBRARY_PATH="$DEPS_LIB:${LD_LIBRARY_PATH:-}"
  "$B/lutb_fit_gpu_tests" > "$OUT/fit_tests.log" 2>&1 || true
  for r in 1 2; do for d in "" student; do
    LUTB_BENCH_ONLINE=1 "$B/bench_fit_gpu" 8 4096 7168 $d; echo; done; done > "$OUT/bench_online.md" 2>&1 || true
  compute-sanitizer --tool memcheck --error-exitcode 9 "$B/lutb_fit_gpu_tests" \
    --gtest_filter='OnlineGpu.RandomLayer*:OnlineGpu.Errors*:OnlineGpu.Pipeline*:OnlineGpu.Released*:OnlineGpu.Lowest*:OnlineGpu.TooLarge*:OnlineGpu.Optimal*' 2>&1 |
    tail -12 > "$OUT/online_sanitizer.log" || true
  if command -v nsys > /dev/null && [ "$SECONDS" -lt "${ONLINE_NSYS_BEFORE:-200}" ]; then
    ( cd /tmp && LUTB_BENCH_ONLINE=2 timeout 60 nsys profile -t cuda -o /tmp/onl_trace --force-overwrite true "$B/bench_fit_gpu" 8 4096 7168 &&
      timeout 40 nsys stats -q --report cuda_gpu_trace --format csv /tmp/onl_trace.nsys-rep ) > "$OUT/nsys_trace.csv" 2>&1 || true
  fi
  echo "gpu_run.sh online: ${SECONDS} s" | tee -a "$OUT/gpu.txt"
  exit 0
fi

# cli: the lutb tool itself with the CUDA backend (session 15, cli15), sm_90a only: every
# src/cuda/*.cu, the library (src/core, fit, moe, io, model) and src/cli with g++ (CLI11 headers, cblas.h
# and OpenBLAS + its Fortran runtime staged by gpu_stage.sh, the libraries xz-compressed and unpacked
# here with python3's lzma), and tests/cuda/cli_gpu_test.cpp against that binary; then runs those
# tests and the commands below, logs in $OUT.
#   scripts/gpu_run.sh cli
if [ "$WHAT" = cli ]; then
  FA="-gencode=arch=compute_90a,code=sm_90a"
  CCU="${CUFLAGS/$ARCH/$FA}"
  C=$B/cli
  mkdir -p "$C/o" "$C/lib"
  for z in deps/blas/*.xz; do
    python3 -c "import lzma,sys; open(sys.argv[2],'wb').write(lzma.open(sys.argv[1]).read())" "$z" "$C/lib/$(basename "$z" .xz)"
  done
  ln -sf libopenblas.so.0 "$C/lib/libopenblas.so"
  CLIFLAGS="$CXXFLAGS -O3 -DLUTB_WITH_CUDA=1"
  {
  pids=()
  for f in src/cuda/*.cu; do
    fl=""; case "$f" in src/cuda/fit_*) fl=-fmad=false;; esac
    $NVCC $CCU $fl -c "$f" -o "$C/o/cu_$(basename "$f" .cu).o" & pids+=($!)
  done
  if [ ! -f "$B/obj/gtest-all.o" ]; then
    g++ -std=c++17 -O2 -isystem "$GTEST_DIR/include" -I"$GTEST_DIR" -c "$GTEST_DIR/src/gtest-all.cc" -o "$B/obj/gtest-all.o" & pids+=($!)
    g++ -std=c++17 -O2 -isystem "$GTEST_DIR/include" -I"$GTEST_DIR" -c "$GTEST_DIR/src/gtest_main.cc" -o "$B/obj/gtest_main.o" & pids+=($!)
  fi
  for f in src/core/*.cpp src/fit/*.cpp src/moe/*.cpp src/io/*.cpp src/model/*.cpp; do
    fc=""; case "$f" in src/fit/*) fc=-ffp-contract=off;; esac  # as CMakeLists.txt
    g++ $CLIFLAGS $fc -c "$f" -o "$C/o/l_$(basename "$(dirname "$f")")_$(basename "$f" .cpp).o" & pids+=($!)
  done
  for f in src/cli/*.cpp; do g++ $CLIFLAGS -c "$f" -o "$C/o/m_$(basename "$f" .cpp).o" & pids+=($!); done
  for f in tests/cuda/cli_gpu_test.cpp tests/support/test_support.cpp; do
    g++ $CLIFLAGS -DLUTB_SOURCE_DIR="\"$ROOT\"" -DLUTB_CLI_PATH="\"$C/lutb\"" -c "$f" -o "$C/o/t_$(basename "$f" .cpp).o" & pids+=($!)
  done
  for p in "${pids[@]}"; do wait "$p"; done
  $NVCC $FA -o "$C/lutb" "$C"/o/m_*.o "$C"/o/l_*.o "$C"/o/cu_*.o -lcublas -Xcompiler -fopenmp \
    -L"$DEPS_LIB" -L"$C/lib" -lhwy -lopenblas -lpthread -Xlinker -rpath="$DEPS_LIB:$C/lib"
  $NVCC $FA -o "$C/cli_gpu_tests" "$C"/o/t_*.o "$B/obj/gtest-all.o" "$B/obj/gtest_main.o" -Xcompiler -fopenmp -lpthread
  echo "build: ${SECONDS} s"
  } > "$OUT/build_cli.log" 2>&1 || true
  tail -5 "$OUT/build_cli.log"
  export LD_LIBRARY_PATH="$DEPS_LIB:$C/lib:${LD_LIBRARY_PATH:-}"
  M=shared/models/tiny-qwen3-moe
  { nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,memory.total --format=csv; nvcc --version | tail -2;
    lscpu | grep -E "Model name|^CPU\(s\)"; date -u; } > "$OUT/gpu.txt" 2>&1 || true
  "$C/cli_gpu_tests" > "$OUT/cli_gpu_tests.log" 2>&1 || true
  set +e  # the commands below include refusals (exit status 1) that the log records
  {
    for d in cpu cuda; do
      echo "\$ lutb quantize $M -o /tmp/q-$d --device $d --no-progress"
      "$C/lutb" quantize $M -o /tmp/q-$d --device $d --no-progress 2>&1; echo "exit $?"
    done
    echo "\$ cmp -r (every file of /tmp/q-cpu against /tmp/q-cuda)"
    (cd /tmp/q-cpu && for f in $(find . -type f | sort); do cmp "$f" "/tmp/q-cuda/$f" && echo "identical $f"; done) 2>&1
    echo "\$ lutb quantize $M -o /tmp/q-x --device cuda --fitter ct-lloyd"
    "$C/lutb" quantize $M -o /tmp/q-x --device cuda --fitter ct-lloyd 2>&1; echo "exit $?; exists: $(ls -d /tmp/q-x 2>&1)"
    for L in 0 3; do for qn in lutb none; do
      echo "\$ lutb moe $M --layer $L --quant $qn --device cuda --compare-cpu"
      "$C/lutb" moe $M --layer $L --quant $qn --device cuda --compare-cpu 2>&1; echo "exit $?"
      echo "\$ lutb moe $M --layer $L --quant $qn --device cpu"
      "$C/lutb" moe $M --layer $L --quant $qn --device cpu 2>&1; echo "exit $?"
    done; done
    echo "\$ lutb moe /tmp/q-cuda --layer 1 --device cuda --compare-cpu   (the stored LUT-B checkpoint)"
    "$C/lutb" moe /tmp/q-cuda --layer 1 --device cuda --compare-cpu --activations $M/moe_activations.safetensors 2>&1; echo "exit $?"
    for d in cpu cuda; do
      echo "\$ lutb eval $M --quant lutb --device $d --max-windows 16"
      "$C/lutb" eval $M --quant lutb --device $d --max-windows 16 2>&1; echo "exit $?"
    done
    # cli16: DeepSeek-V3 grouped routing and a shared expert (staged with STAGE_MODELS), and the load
    # time of eval --quant lutb with the fit on the CPU (--device cpu) and on the GPU (--device cuda).
    D=shared/models/tiny-deepseek-v3
    if [ -d $D ]; then
      for L in 1 3; do for qn in lutb none; do
        echo "\$ lutb moe $D --layer $L --quant $qn --device cuda --compare-cpu"
        "$C/lutb" moe $D --layer $L --quant $qn --device cuda --compare-cpu 2>&1; echo "exit $?"
      done; done
      for qn in lutb none; do for d in cpu cuda; do
        echo "\$ lutb eval $D --quant $qn --device $d --max-windows 16"
        "$C/lutb" eval $D --quant $qn --device $d --max-windows 16 2>&1; echo "exit $?"
      done; done
    fi
    for m in $M $D; do [ -d $m ] || continue; for r in 1 2; do for d in cpu cuda; do
      echo "\$ lutb eval $m --quant lutb --device $d --max-windows 1   (load time, repeat $r)"
      "$C/lutb" eval $m --quant lutb --device $d --max-windows 1 2>&1 | grep -E "^(time|fit|val loss)"; echo "exit ${PIPESTATUS[0]}"
    done; done; done
  } > "$OUT/cli_commands.log" 2>&1
  { echo "\$ lutb --experts 16 --tokens 256"; "$C/lutb" --experts 16 --tokens 256 2>&1; echo "exit $?"; } > "$OUT/default_job.log" 2>&1
  echo "gpu_run.sh cli: ${SECONDS} s" | tee -a "$OUT/gpu.txt"
  exit 0
fi

# decws: sm_90a only, the MoE CUDA sources, the MoE GPU tests (moe_cuda_test.cpp, moe_vs_cpu_test.cpp
# against src/core + src/fit + src/moe) and bench_moe_gpu; runs the tests, compute-sanitizer
# (memcheck on the small cases, racecheck and synccheck on one case of the decoders), then each
# "$@" as a shell command with $BENCH = the benchmark (session 14: the warp-specialised decode).
#   scripts/gpu_run.sh decws '$BENCH --variants 1,11 --tokens 1,4,16,64'
if [ "$WHAT" = decws ]; then
  FA="-gencode=arch=compute_90a,code=sm_90a"
  MCU="${CUFLAGS/$ARCH/$FA}"
  mkdir -p "$B/dw/c" "$B/dw/t"
  pids=()
  for f in src/cuda/moe_*.cu src/cuda/routing.cu src/cuda/lane_major.cu bench/gpu/bench_moe_gpu.cu; do
    $NVCC $MCU -c "$f" -o "$B/dw/$(basename "$f" .cu).o" & pids+=($!)
  done
  if [ ! -f "$B/obj/gtest-all.o" ]; then
    g++ -std=c++17 -O2 -isystem "$GTEST_DIR/include" -I"$GTEST_DIR" -c "$GTEST_DIR/src/gtest-all.cc" -o "$B/obj/gtest-all.o" & pids+=($!)
    g++ -std=c++17 -O2 -isystem "$GTEST_DIR/include" -I"$GTEST_DIR" -c "$GTEST_DIR/src/gtest_main.cc" -o "$B/obj/gtest_main.o" & pids+=($!)
  fi
  for f in src/core/*.cpp src/fit/*.cpp src/moe/*.cpp; do
    fc=""; case "$f" in src/fit/*) fc=-ffp-contract=off;; esac
    g++ $CXXFLAGS -O3 $fc -c "$f" -o "$B/dw/c/$(basename "$(dirname "$f")")_$(basename "$f" .cpp).o" & pids+=($!)
  done
  for f in tests/cuda/moe_cuda_test.cpp tests/cuda/moe_vs_cpu_test.cpp tests/support/test_support.cpp; do
    g++ $CXXFLAGS -DLUTB_SOURCE_DIR="\"$ROOT\"" -c "$f" -o "$B/dw/t/$(basename "$f" .cpp).o" & pids+=($!)
  done
  for p in "${pids[@]}"; do wait "$p" || echo "build step failed" | tee -a "$OUT/build_decws.log"; done
  lib=("$B"/dw/moe_*.o "$B"/dw/routing.o "$B"/dw/lane_major.o)
  $NVCC $FA -o "$B/lutb_decws_tests" "$B"/dw/t/*.o "${lib[@]}" "$B"/dw/c/*.o "$B/obj/gtest-all.o" "$B/obj/gtest_main.o" \
    -Xcompiler -fopenmp -L"$DEPS_LIB" -lhwy -lpthread -Xlinker -rpath="$DEPS_LIB" 2>&1 | tee -a "$OUT/build_decws.log"
  $NVCC $FA -o "$B/bench_moe_gpu_sm90" "$B/dw/bench_moe_gpu.o" "${lib[@]}" "$B"/dw/c/core_*.o -lcublas \
    -Xcompiler -fopenmp -L"$DEPS_LIB" -lhwy -lpthread -Xlinker -rpath="$DEPS_LIB" 2>&1 | tee -a "$OUT/build_decws.log"
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,memory.total --format=csv | tee "$OUT/gpu.txt" || true
  export LD_LIBRARY_PATH="$DEPS_LIB:${LD_LIBRARY_PATH:-}"
  echo "build: ${SECONDS} s" | tee -a "$OUT/build_decws.log"
  export BENCH="$B/bench_moe_gpu_sm90"
  # DECWS_BENCH_FIRST=1: the benchmark commands before the tests (a short lease keeps the figures).
  run_cmds() { for cmd in "$@"; do echo "## $cmd"; stdbuf -oL -eL bash -c "$cmd"; done 2>&1 | tee -a "$OUT/bench_decws.md"; }
  [ "${DECWS_BENCH_FIRST:-0}" = 1 ] && run_cmds "$@"
  timeout 240 "$B/lutb_decws_tests" --gtest_filter="${DECWS_TESTS:-*}" 2>&1 | tail -60 | tee "$OUT/tests_decws.log" || true
  echo "tests: ${SECONDS} s" | tee -a "$OUT/tests_decws.log"
  timeout 120 compute-sanitizer --tool memcheck --error-exitcode 9 "$B/lutb_decws_tests" \
    --gtest_filter='Shapes/MoeRandom.*E16_H200*:Shapes/MoeRandom.*E8_H320*:Shapes/MoeRandom.*E8_H256*:MoeCuda.GoldenLayer:MoeCuda.SingleTokenInvalidAndRepeatedExperts' 2>&1 |
    tail -12 | tee "$OUT/sanitizer_decws.log" || true
  timeout 60 compute-sanitizer --tool racecheck --error-exitcode 9 "$B/lutb_decws_tests" --gtest_filter='MoeCuda.GoldenLayer' 2>&1 |
    tail -6 | tee -a "$OUT/sanitizer_decws.log" || true
  timeout 60 compute-sanitizer --tool synccheck --error-exitcode 9 "$B/lutb_decws_tests" --gtest_filter='MoeCuda.GoldenLayer' 2>&1 |
    tail -6 | tee -a "$OUT/sanitizer_decws.log" || true
  echo "sanitizers: ${SECONDS} s" | tee -a "$OUT/sanitizer_decws.log"
  [ "${DECWS_BENCH_FIRST:-0}" = 1 ] || run_cmds "$@"
  echo "gpu_run.sh decws: ${SECONDS} s"
  exit 0
fi

if [ "$WHAT" = fit ]; then
  build_fit 2>&1 | tee "$OUT/build_fit.log"
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,memory.total --format=csv | tee "$OUT/gpu.txt" || true
  export LD_LIBRARY_PATH="$DEPS_LIB:${LD_LIBRARY_PATH:-}"
  "$B/lutb_fit_gpu_tests" 2>&1 | tee "$OUT/fit_tests.log" || true
  fit_bench() {
    local local_args=("$@")
    [ ${#local_args[@]} -ge 3 ] || local_args=(8 4096 7168)
    { "$B/bench_fit_gpu" "${local_args[@]:0:3}"; echo; "$B/bench_fit_gpu" "${local_args[@]:0:3}" student; } 2>&1 |
      tee "$OUT/bench_fit_gpu.md" || true
  }
  # LUTB_FIT_BENCH_FIRST=1: the benchmark before the sanitizers (a short device lease keeps its figures);
  # LUTB_FIT_SAN_FILTER=gtest-filter: the three sanitizers on those tests only.
  [ "${LUTB_FIT_BENCH_FIRST:-0}" = 1 ] && fit_bench "$@"
  local_mf='FitGpu.EdgeTiles:FitGpu.FullRangeDpEdgeTiles:FitGpu.ErrorsMatchCpu:FitGpu.DeviceEntryWithoutStats:FitGpu.ScanVariantsSameBytes:FitGpuOptimal.EdgeTiles:FitGpuOptimal.ScaleSearchBelowRceil:FitGpuOptimal.DeviceEntryWithoutStats:OnlineGpu.RandomLayer*:OnlineGpu.Errors*:OnlineGpu.LaneMajor*:OnlineGpu.Optimal*'
  local_rf='FitGpu.EdgeTiles:FitGpu.FullRangeDpEdgeTiles:FitGpuOptimal.EdgeTiles:FitGpuOptimal.ScaleSearchBelowRceil:OnlineGpu.LaneMajor*'
  local_sf='FitGpu.EdgeTiles:FitGpu.FullRangeDpEdgeTiles:FitGpuOptimal.EdgeTiles'
  if [ -n "${LUTB_FIT_SAN_FILTER:-}" ]; then local_mf=$LUTB_FIT_SAN_FILTER; local_rf=$LUTB_FIT_SAN_FILTER; local_sf=$LUTB_FIT_SAN_FILTER; fi
  compute-sanitizer --tool memcheck --error-exitcode 9 "$B/lutb_fit_gpu_tests" --gtest_filter="$local_mf" 2>&1 |
    tail -12 | tee "$OUT/fit_sanitizer.log" || true
  compute-sanitizer --tool racecheck --error-exitcode 9 "$B/lutb_fit_gpu_tests" --gtest_filter="$local_rf" 2>&1 |
    tail -6 | tee -a "$OUT/fit_sanitizer.log" || true
  compute-sanitizer --tool synccheck --error-exitcode 9 "$B/lutb_fit_gpu_tests" --gtest_filter="$local_sf" 2>&1 |
    tail -4 | tee -a "$OUT/fit_sanitizer.log" || true
  [ "${LUTB_FIT_BENCH_FIRST:-0}" = 1 ] || fit_bench "$@"
  exit 0
fi

build 2>&1 | tee "$OUT/build.log"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,memory.total --format=csv | tee "$OUT/gpu.txt" || true
if [ "$WHAT" = tests ] || [ "$WHAT" = all ]; then
  LD_LIBRARY_PATH="$DEPS_LIB:${LD_LIBRARY_PATH:-}" "$B/lutb_cuda_tests" 2>&1 | tee "$OUT/tests.log" || true
fi
if [ "$WHAT" = sanitize ] || [ "$WHAT" = all ]; then
  compute-sanitizer --tool memcheck --error-exitcode 9 "$B/lutb_cuda_tests" \
    --gtest_filter='Shapes/MoeRandom.*E16_H200*:Shapes/MoeRandom.*E8_H320*:MoeCuda.ToLaneMajor*:MoeCuda.GoldenLayer:MoeCuda.InvalidExpertIdWritesNanRow:MoeCuda.Bf16BaselineMatchesHost:MoeCuda.SingleTokenInvalidAndRepeatedExperts:RoutingCuda.*:MoeCudaVsCpu.*' 2>&1 |
    tail -40 | tee "$OUT/sanitizer.log" || true
  compute-sanitizer --tool racecheck --error-exitcode 9 "$B/lutb_cuda_tests" --gtest_filter='MoeCuda.GoldenLayer' 2>&1 |
    tail -8 | tee -a "$OUT/sanitizer.log" || true
fi
if [ "$WHAT" = bench ] || [ "$WHAT" = all ]; then
  "$B/bench_moe_gpu" "$@" 2>&1 | tee "$OUT/bench_moe_gpu.md"
fi
