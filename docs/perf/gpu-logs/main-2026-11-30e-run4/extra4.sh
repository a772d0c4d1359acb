#!/usr/bin/env bash
# session 11, device run 4: per-warp FP32 tile-scale table in the swap-AB K-loop vs commit 00ef9f8
# (per-K-tile scale load + conversion + 8 shuffles), alternating, twice; GPU tests ran before.
set -uo pipefail
B=build/gpu
export LD_LIBRARY_PATH=deps/lib:${LD_LIBRARY_PATH:-}
ARCH="-gencode=arch=compute_80,code=sm_80 -gencode=arch=compute_90a,code=sm_90a"
lib=$(ls $B/obj/moe_*.o $B/obj/routing.o $B/obj/lane_major.o $B/obj/fit_*.o | grep -v '/moe_lutb.o')
rm -rf /tmp/base_inc && mkdir -p /tmp/base_inc && cp -r src /tmp/base_inc/ && cp base_src/cuda/moe_swapab.cuh /tmp/base_inc/src/cuda/
nvcc -std=c++20 -O3 --expt-relaxed-constexpr -lineinfo $ARCH -Iinclude -I/tmp/base_inc/src -c /tmp/base_inc/src/cuda/moe_lutb.cu -o $B/obj/base_moe_lutb.o &&
nvcc $ARCH -o $B/bench_base $B/obj/b_bench_moe_gpu.o $B/obj/base_moe_lutb.o $lib $B/obj/c_core_*.o $B/obj/c_fit_*.o -lcublas \
    -Xcompiler -fopenmp -Ldeps/lib -lhwy -lpthread -Xlinker -rpath=deps/lib
echo "== A/B rows: T | us (variant 0 = default forward)"
for rep in 1 2; do
  for sh in deepseek-v3 qwen3-235b qwen3-30b mixtral-8x7b; do
    r() { echo "$1 $rep $sh $($2 --shape $sh --tokens 1,4,16,64 --variants 0 | grep "^| $sh" | cut -d'|' -f3,5 | tr '\n' ' ')"; }
    r "shfl-scales" "$B/bench_base"
    r "scale-table" "$B/bench_moe_gpu"
  done
done
echo "== ncu, DeepSeek-V3 T = 1"
for bin in bench_base bench_moe_gpu; do
  ncu --clock-control none --kernel-name regex:swapab --launch-count 2 --metrics smsp__inst_executed.sum,gpu__time_duration.sum,smsp__inst_executed_pipe_alu.sum,smsp__issue_active.avg.pct_of_peak_sustained_active,smsp__warps_active.avg.per_cycle_active \
    $B/$bin --shape deepseek-v3 --tokens 1 --variants 0 2>&1 | grep -E "swapab|inst_executed|duration|issue_active|warps_active" | sed 's/ \+/ /g' | cut -c1-110
done
