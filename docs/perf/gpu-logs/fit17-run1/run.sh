#!/usr/bin/env bash
# fit17 device run 1 (copied into the staged tree as run_fit17.sh): build + fitter/online GPU tests +
# fit17's same-run comparison (LUTB_BENCH_FIT17: block shapes and persistent grids, ABBA x 4) on the
# Gaussian and Student-t(3) w13-shaped stacks [8, 4096, 7168] (benchmark before the sanitizers), the
# three sanitizers on FitGpu.BlockShapeEdgeTiles, then the same comparison on the Gaussian w2-shaped
# stack [8, 7168, 2048].
export LD_LIBRARY_PATH=$PWD/deps/lib:${LD_LIBRARY_PATH:-}
LUTB_FIT_BENCH_FIRST=1 LUTB_BENCH_FIT17=1 LUTB_FIT_SAN_FILTER='FitGpu.BlockShapeEdgeTiles' OUT=$OUT \
  timeout 190 scripts/gpu_run.sh fit 8 4096 7168 > "$OUT/run.log" 2>&1
echo "fit rc $? ${SECONDS}s" >> "$OUT/run.log"
LUTB_BENCH_FIT17=1 timeout 30 build/gpu/bench_fit_gpu 8 7168 2048 > "$OUT/bench_w2.md" 2>&1
echo "w2 rc $? ${SECONDS}s" >> "$OUT/run.log"
