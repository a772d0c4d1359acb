#!/usr/bin/env bash
# fit18 device run 1 (copied into the staged tree as run_fit18.sh; run there as
# `cd .gpu-fit18 && OUT=$OUT bash run_fit18.sh`): build (scripts/gpu_run.sh fit: sm_90a, -fmad=false),
# the fitter and online-method GPU tests, fit18's same-run comparison (LUTB_BENCH_FIT18: 8- and
# 16-warp blocks against the 4-warp defaults, layout 0 with the sums, ABBA x 4) on the Gaussian and
# Student-t(3) w13-shaped stacks [8, 4096, 7168], the three sanitizers on FitGpu.BlockShapeEdgeTiles;
# then Nsight Compute (clocks left alone) on one launch each of (1, 10) in 4-, 1-warp blocks, 4-warp
# blocks on the persistent counter grid, 8- and 16-warp blocks (with the sums), (0, 6) in 4- and
# 2-warp blocks (bytes only), expert 0 (57,344 tiles): sections + the stall reasons + SM clock; the
# instruction-cache metrics this ncu offers (queried first); the source counters (instructions per
# CUDA line and per SASS instruction) of the default launch.
export LD_LIBRARY_PATH=$PWD/deps/lib:${LD_LIBRARY_PATH:-}
B=$PWD/build/gpu
O2=$B/out18
mkdir -p "$O2"
{ date -u; nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,clocks.mem,memory.total --format=csv; nproc; ncu --version | tail -1; } > "$OUT/run.log" 2>&1
LUTB_FIT_BENCH_FIRST=1 LUTB_BENCH_FIT18=1 LUTB_FIT_SAN_FILTER='FitGpu.BlockShapeEdgeTiles' OUT=$O2 \
  timeout 170 scripts/gpu_run.sh fit 8 4096 7168 >> "$O2/gpu_run.log" 2>&1
echo "fit rc $? ${SECONDS}s" >> "$OUT/run.log"
cp "$O2/bench_fit_gpu.md" "$O2/fit_tests.log" "$O2/fit_sanitizer.log" "$OUT/" 2>/dev/null
tail -40 "$O2/build_fit.log" > "$OUT/build_fit.log" 2>/dev/null
grep -E '^\[  (PASSED|FAILED) |tests? from .* ran|FAILED' "$O2/fit_tests.log" | head -20 >> "$OUT/run.log"
[ -x "$B/bench_fit_gpu" ] || exit 0
K='regex:fit_shape'
ST=barrier,branch_resolving,dispatch_stall,drain,imc_miss,lg_throttle,long_scoreboard,math_pipe_throttle,membar,mio_throttle,misc,no_instruction,not_selected,selected,short_scoreboard,sleeping,tex_throttle,wait
M=$(for r in ${ST//,/ }; do printf 'smsp__average_warps_issue_stalled_%s_per_issue_active.ratio,' "$r"; done)
M="${M}sm__cycles_elapsed.avg.per_second,smsp__inst_executed.sum,smsp__issue_active.avg.pct_of_peak_sustained_active,sm__warps_active.avg.per_cycle_active,smsp__warps_eligible.avg.per_cycle_active,smsp__thread_inst_executed_per_inst_executed.ratio,gpu__time_duration.sum,sm__cycles_active.avg"
LUTB_BENCH_PROFILE_ONLY=4 timeout 60 ncu --clock-control none --kernel-name "$K" --launch-count 7 \
  --section SpeedOfLight --section Occupancy --section LaunchStats --section SchedulerStats --section WarpStateStats \
  --section InstructionStats --metrics "$M" "$B/bench_fit_gpu" 1 4096 7168 > "$OUT/ncu.txt" 2>&1
echo "ncu1 rc $? ${SECONDS}s" >> "$OUT/run.log"
{
  echo "== ncu --query-metrics --chip gh100, instruction-cache names"
  ncu --query-metrics --chip gh100 2>&1 | grep -iE 'icc|icache|inst_cache|instruction cache|l0i|l1i|l15|imc' | head -40
} > "$OUT/ncu_icache.txt" 2>&1
IC=$(ncu --query-metrics --chip gh100 2>/dev/null | grep -iE 'icc|icache|inst_cache|instruction cache' | awk '{print $1}' |
     grep -E '^[a-z0-9]+__[a-z0-9_]+$' | head -10 | sed 's/$/.sum/' | paste -sd, -)
echo "== metrics: $IC" >> "$OUT/ncu_icache.txt"
if [ -n "$IC" ]; then
  LUTB_BENCH_PROFILE_ONLY=4 timeout 25 ncu --clock-control none --kernel-name "$K" --launch-count 7 \
    --metrics "$IC,smsp__inst_executed.sum,sm__cycles_active.avg" "$B/bench_fit_gpu" 1 4096 7168 >> "$OUT/ncu_icache.txt" 2>&1
  echo "ncu2 rc $? ${SECONDS}s" >> "$OUT/run.log"
fi
LUTB_BENCH_PROFILE_ONLY=4 timeout 40 ncu --clock-control none --kernel-name "$K" --launch-count 1 --import-source yes \
  --section SourceCounters --section InstructionStats -o "$B/src18" "$B/bench_fit_gpu" 1 4096 7168 > "$B/ncu3.log" 2>&1
echo "ncu3 rc $? ${SECONDS}s" >> "$OUT/run.log"
tail -3 "$B/ncu3.log" >> "$OUT/run.log"
if [ -f "$B/src18.ncu-rep" ]; then
  ncu -i "$B/src18.ncu-rep" --page source --csv --print-source cuda 2>&1 | gzip -c > "$OUT/ncu_src_cuda.csv.gz"
  ncu -i "$B/src18.ncu-rep" --page source --csv --print-source sass 2>&1 | gzip -c > "$OUT/ncu_src_sass.csv.gz"
fi
echo "all done ${SECONDS}s" >> "$OUT/run.log"
