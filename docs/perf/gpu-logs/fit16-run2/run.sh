#!/usr/bin/env bash
# fit16 device run 2 (copied into the staged tree as run_fit16.sh): build + fitter/online GPU tests +
# fit16's same-run comparison on both data sets (w13-shaped) and the w2-shaped stack, the three
# sanitizers on FitGpu.CostTableDpEdgeTiles, then Nsight Compute on one launch each of layout 1's DP
# modes 0, 13, 14, 10, 9, 6 (expert 0 of the Gaussian stack, 57,344 tiles, with per-tile sums).
export LD_LIBRARY_PATH=$PWD/deps/lib:${LD_LIBRARY_PATH:-}
LUTB_FIT_BENCH_FIRST=1 LUTB_BENCH_FIT16=1 LUTB_FIT_SAN_FILTER='FitGpu.CostTableDpEdgeTiles' OUT=$OUT \
  timeout 300 scripts/gpu_run.sh fit 8 4096 7168 > "$OUT/run.log" 2>&1
echo "fit rc $? ${SECONDS}s" >> "$OUT/run.log"
LUTB_BENCH_FIT16=1 timeout 70 build/gpu/bench_fit_gpu 8 7168 2048 > "$OUT/bench_w2.md" 2>&1
echo "w2 rc $? ${SECONDS}s" >> "$OUT/run.log"
K='regex:fit_compact_kernel'
LUTB_BENCH_PROFILE_ONLY=3 timeout 150 ncu --clock-control none --kernel-name "$K" --launch-count 6 \
  --section SpeedOfLight --section Occupancy --section LaunchStats --section SchedulerStats --section WarpStateStats \
  --section InstructionStats --section MemoryWorkloadAnalysis_Tables build/gpu/bench_fit_gpu 1 4096 7168 > "$OUT/ncu.txt" 2>&1
echo "ncu1 rc $? ${SECONDS}s" >> "$OUT/run.log"
LUTB_BENCH_PROFILE_ONLY=3 timeout 100 ncu --clock-control none --kernel-name "$K" --launch-count 6 --metrics \
  smsp__inst_executed.sum,l1tex__data_pipe_lsu_wavefronts_mem_shared.sum,l1tex__data_bank_conflicts_pipe_lsu_mem_shared.sum,smsp__thread_inst_executed_per_inst_executed.ratio,sm__warps_active.avg.per_cycle_active,gpu__time_duration.sum \
  build/gpu/bench_fit_gpu 1 4096 7168 >> "$OUT/ncu.txt" 2>&1
echo "ncu2 rc $? ${SECONDS}s" >> "$OUT/run.log"
