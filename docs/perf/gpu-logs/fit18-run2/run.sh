#!/usr/bin/env bash
# fit18 device run 2 (copied into the staged tree as run_fit18.sh; `cd .gpu-fit18 && OUT=$OUT bash
# run_fit18.sh`), after launch_warp's selection was switched to layout 0 mode 6 in 4-warp blocks for
# fits with the per-tile sums: build, the whole fitter and online-method GPU test binary (so the new
# selection is tested against the CPU through quantize_gpu, fit_device and the online method), the three
# sanitizers on FitGpu.EdgeTiles (the default launch with the sums), and the short A/B
# (LUTB_BENCH_FIT18=2: fit17's default with the sums against layout 0 mode 6 in 4- and 8-warp blocks,
# ABBA x 4) on the Gaussian and Student-t(3) w13 stacks [8, 4096, 7168] and the Gaussian w2 stack
# [8, 7168, 2048].
export LD_LIBRARY_PATH=$PWD/deps/lib:${LD_LIBRARY_PATH:-}
B=$PWD/build/gpu
O2=$B/out18
mkdir -p "$O2"
{ date -u; nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,memory.total --format=csv; } > "$OUT/run.log" 2>&1
LUTB_FIT_BENCH_FIRST=1 LUTB_BENCH_FIT18=2 LUTB_FIT_SAN_FILTER='FitGpu.EdgeTiles' OUT=$O2 \
  timeout 88 scripts/gpu_run.sh fit 8 4096 7168 >> "$O2/gpu_run.log" 2>&1
echo "fit rc $? ${SECONDS}s" >> "$OUT/run.log"
cp "$O2/bench_fit_gpu.md" "$O2/fit_tests.log" "$O2/fit_sanitizer.log" "$OUT/" 2>/dev/null
tail -30 "$O2/build_fit.log" > "$OUT/build_fit.log" 2>/dev/null
grep -E '^\[  (PASSED|FAILED|SKIPPED) |tests? from .* ran' "$O2/fit_tests.log" | head -20 >> "$OUT/run.log"
[ -x "$B/bench_fit_gpu" ] && LUTB_BENCH_FIT18=2 timeout 15 "$B/bench_fit_gpu" 8 7168 2048 > "$OUT/bench_w2.md" 2>&1
echo "w2 rc $? ${SECONDS}s" >> "$OUT/run.log"
