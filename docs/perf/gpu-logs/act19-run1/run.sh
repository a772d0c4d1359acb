#!/usr/bin/env bash
# act19-run1: the MoE GPU tests, the activation-kernel A/B above 128 pairs (two processes, ABBA inside each,
# opposite orders; variant 0 first in each row absorbs the first-variant penalty), memcheck + racecheck on
# the new case. Run as: cd .gpu-act19 && OUT=$OUT bash run1.sh
cd "$(dirname "$0")"
T=16,24,32,48,64,128
MOETESTS_SANITIZE=0 scripts/gpu_run.sh moetests \
  "\$BENCH --tokens $T --variants 0,74,70,75,76" \
  "\$BENCH --tokens $T --variants 0,70,74,76,75" > "$OUT/moetests.txt" 2>&1
echo "moetests rc=$?"
grep -E "^\[  (PASSED|FAILED) |FAILED  \]|tests from .* ran" "$OUT/moetests.txt" | head -20
export LD_LIBRARY_PATH=$PWD/deps/lib:${LD_LIBRARY_PATH:-}
F=MoeDecodePaths.ActKernelAbove128PairsSanitizerCase
{ timeout 90 compute-sanitizer --tool memcheck --error-exitcode 9 build/gpu/lutb_moe_tests --gtest_filter=$F 2>&1 | tail -4
  timeout 120 compute-sanitizer --tool racecheck --error-exitcode 9 build/gpu/lutb_moe_tests --gtest_filter=$F 2>&1 | tail -3; } > "$OUT/sanitizer.log"
cat "$OUT/sanitizer.log"
echo "run1 total ${SECONDS} s"
