#!/usr/bin/env bash
# session 10, device run 5: where the swap-AB GEMMs' time goes at T = 1 (ncu --set full)
B=build/gpu/bench_moe_gpu
export LD_LIBRARY_PATH=deps/lib:${LD_LIBRARY_PATH:-}
for sh in deepseek-v3 qwen3-30b; do
  echo "######## $sh T=1"
  ncu --clock-control none --set full --import-source no --kernel-name regex:swapab --launch-count 2 $B --shape $sh --tokens 1 2>&1 |
    grep -vE "^\s*$|==PROF==|^\||^#" 
done
