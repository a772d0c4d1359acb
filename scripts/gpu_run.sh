#!/usr/bin/env bash
# The GPU machine's run: builds the `gpu` preset (dependencies from .deps, scripts/gpu_stage.sh),
# then runs one step, or all of them in order; it builds the targets that step runs
# (`cmake --build --preset gpu` builds every one). Logs go to $OUT (default build/gpu/out).
#
#   scripts/gpu_run.sh [all]              test, python, sanitize, then bench_moe_gpu and bench_fit_gpu
#                                         with their default arguments
#   scripts/gpu_run.sh test [CTEST ARGS]  ctest -L cuda: every GPU test (e.g. -R Prefill)
#   scripts/gpu_run.sh sanitize           compute-sanitizer memcheck, racecheck and synccheck on
#                                         the small cases of the GPU tests
#   scripts/gpu_run.sh bench NAME [ARGS]  one GPU benchmark (bench/gpu/NAME.cu) with ARGS
#   scripts/gpu_run.sh python [PYTEST ARGS]
#                                         the Python package on the gpu build (pip install
#                                         --no-build-isolation into the machine's python3), then
#                                         its CUDA tests (pytest -m cuda tests/python)
#   scripts/gpu_run.sh bench-hf [ARGS]    the package, then transformers end to end on one GPU:
#                                         bench/python/bench_hf_generate.py with ARGS (--small: a
#                                         minute)
#   scripts/gpu_run.sh peers [ARGS]       the MoE layers a user would pick instead of LUT-B
#                                         (triton_kernels' MXFP4 matmul_ogs, torch BF16 _grouped_mm):
#                                         bench/peer-moe/peer_moe.py of the shared data with ARGS;
#                                         run it in the same call as bench_moe_gpu to compare
#
# The tests read the golden vectors and models from LUTB_SHARED_DIR (default: .shared, staged by
# scripts/gpu_stage.sh). Exit status: 1 when any step failed, after running the others.
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT" || exit 2
export PATH="$PATH:/usr/local/cuda/bin:/usr/local/cuda/compute-sanitizer"
[ -n "${LUTB_SHARED_DIR:-}" ] || [ ! -d .shared ] || export LUTB_SHARED_DIR="$ROOT/.shared"
OUT=${OUT:-$ROOT/build/gpu/out}
mkdir -p "$OUT"
STEP=${1:-all}
shift || true
failed=0

# The sanitizers' cases: small shapes of every kernel family (decode, prefill, fitters, online
# method, routing), a few seconds each under memcheck.
MEMCHECK='MoeCuda.GoldenLayer:MoeCuda.SingleTokenInvalidAndRepeatedExperts:RoutingCuda.*:MoeDecodePaths.ActKernelBitIdenticalToDefault:MoeDecodePaths.ActKernelAbove128PairsSanitizerCase:MoeDecodePaths.FusedBackToBackBitIdentical:Shapes/MoeRandom.*E16_H200*:Shapes/PrefillRandom.MatchesHostReference/padded_odd:PrefillCuda.InvalidExpertIdWritesNanRowOnly:PrefillCuda.SkewedRouting1To300TokensPerExpert:FitGpuSmall.*:FitGpu.EdgeTiles:FitGpu.DeviceEntryWithoutStats:FitGpuOptimal.EdgeTiles:OnlineGpu.RandomLayer*'
RACECHECK='MoeCuda.GoldenLayer:MoeDecodePaths.ActKernelAbove128PairsSanitizerCase:Shapes/MoeRandom.*E16_H200*:Shapes/PrefillRandom.MatchesHostReference/padded_odd:FitGpuSmall.*'
SYNCCHECK='MoeCuda.GoldenLayer:Shapes/MoeRandom.*E16_H200*:FitGpuSmall.*'

# build [TARGET...]: configure and build the gpu preset (every target when none is named).
build() {
  { cmake --preset gpu && cmake --build --preset gpu ${1:+--target "$@"}; } > "$OUT/build.log" 2>&1 ||
    { tail -n 40 "$OUT/build.log"; echo "gpu_run.sh: the build failed ($OUT/build.log)"; exit 1; }
  echo "gpu_run.sh: build done (${SECONDS} s)"
}

run_tests() {
  ctest --preset gpu -L cuda "$@" > "$OUT/ctest.log" 2>&1 || failed=1
  tail -n 15 "$OUT/ctest.log"
}

sanitize() {
  local tool filter
  for tool in memcheck racecheck synccheck; do
    case $tool in memcheck) filter=$MEMCHECK;; racecheck) filter=$RACECHECK;; synccheck) filter=$SYNCCHECK;; esac
    # A renamed test would silently drop out of a filter: every pattern must still match a test.
    local pattern patterns
    IFS=: read -ra patterns <<< "$filter"
    for pattern in "${patterns[@]}"; do
      build/gpu/tests/lutb_cuda_tests --gtest_list_tests --gtest_filter="$pattern" | grep -q '^  ' ||
        { echo "gpu_run.sh: the $tool filter pattern $pattern matches no test"; failed=1; }
    done
    compute-sanitizer --tool "$tool" --error-exitcode 9 build/gpu/tests/lutb_cuda_tests --gtest_filter="$filter" \
      > "$OUT/sanitizer_$tool.log" 2>&1 || failed=1
    echo "== $tool"; tail -n 4 "$OUT/sanitizer_$tool.log"
  done
}

# install_python: the package built in build/gpu, installed into the machine's python3, and the
# test requirements the image lacks from the carried wheels (.deps/wheels, scripts/gpu_stage.sh).
install_python() {
  python3 -c 'import accelerate' 2>/dev/null || [ ! -d .deps/wheels ] ||
    python3 -m pip install -q --no-index --no-deps .deps/wheels/*.whl > "$OUT/pip_wheels.log" 2>&1 ||
    { tail -n 10 "$OUT/pip_wheels.log"; echo "gpu_run.sh: the carried wheels did not install"; failed=1; }
  python3 -m pip install --no-build-isolation -C build-dir=build/gpu "$ROOT" > "$OUT/pip.log" 2>&1 && return
  tail -n 30 "$OUT/pip.log"; echo "gpu_run.sh: the Python package did not build ($OUT/pip.log)"; failed=1; return 1
}

# python [PYTEST ARGS...]: the package, then pytest's CUDA tests.
python_tests() {
  install_python || return
  LUTB_CLI="$ROOT/build/gpu/lutb" python3 -m pytest "$ROOT/tests/python" -q -rs -m cuda -p no:cacheprovider "$@" \
    > "$OUT/pytest.log" 2>&1 || failed=1
  tail -n 15 "$OUT/pytest.log"
}

# bench_hf [ARGS...]: the package, then bench/python/bench_hf_generate.py; its table is appended to
# $OUT/bench_hf_generate.md.
bench_hf() {
  install_python || return
  { echo "## bench_hf_generate $*"; PYTHONUNBUFFERED=1 python3 "$ROOT/bench/python/bench_hf_generate.py" "$@"; } 2>&1 |
    tee -a "$OUT/bench_hf_generate.md" || failed=1
}

# bench NAME [ARGS...]: the benchmark's tables are appended to $OUT/NAME.md under the command.
bench() {
  local name=$1; shift
  { echo "## $name $*"; "build/gpu/bench/$name" "$@"; } 2>&1 | tee -a "$OUT/$name.md" || failed=1
}

# peers [ARGS...]: ../shared/bench/peer-moe/peer_moe.py (triton_kernels unpacked from its tarball);
# its table is appended to $OUT/peer_moe.md, its JSONL to $OUT/peer.jsonl.
peers() {
  local dir=$LUTB_SHARED_DIR/bench/peer-moe tk=$ROOT/build/gpu/peer-moe
  mkdir -p "$tk" && tar -xJf "$dir"/triton_kernels-*.tar.xz -C "$tk" ||
    { echo "gpu_run.sh: no peer benchmark under $dir (scripts/gpu_stage.sh stages it)"; failed=1; return; }
  { echo "## peer_moe $*"; PYTHONPATH="$tk/triton_kernels" PYTHONUNBUFFERED=1 OUT="$OUT" python3 "$dir/peer_moe.py" "$@"; } 2>&1 |
    tee -a "$OUT/peer_moe.md" || failed=1
}

{ nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,memory.total --format=csv; nvcc --version | tail -n 2
  git -C "$ROOT" log -1 --format='commit %h %s' 2>/dev/null; date -u; } > "$OUT/gpu.txt" 2>&1
case $STEP in
  all) build lutb_cuda_tests lutb_cli bench_moe_gpu bench_fit_gpu; run_tests; python_tests; sanitize; bench bench_moe_gpu; bench bench_fit_gpu;;
  test) build lutb_cuda_tests lutb_cli; run_tests "$@";;
  sanitize) build lutb_cuda_tests lutb_cli; sanitize;;
  python) build lutb_cuda lutb_cli; python_tests "$@";;
  bench-hf) build lutb_cuda lutb_cli; bench_hf "$@";;
  peers) peers "$@";;
  bench) [ $# -ge 1 ] || { echo "usage: gpu_run.sh bench NAME [ARGS...]" >&2; exit 2; }
         build "$1"; bench "$@";;
  *) echo "usage: gpu_run.sh [all | test [CTEST ARGS] | sanitize | python [PYTEST ARGS] | bench NAME [ARGS...] | bench-hf [ARGS...] | peers [ARGS...]]" >&2; exit 2;;
esac
echo "gpu_run.sh $STEP: ${SECONDS} s, $([ $failed = 0 ] && echo 'every step passed' || echo 'a step FAILED (logs in '"$OUT"')')"
exit $failed
