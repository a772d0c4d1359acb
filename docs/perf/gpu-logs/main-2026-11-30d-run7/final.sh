#!/usr/bin/env bash
# session 10, device run 7: GPU tests + sanitizer on main with the 16-warp rule, and Mixtral T=1 with/without it
B=build/gpu
export LD_LIBRARY_PATH=deps/lib:${LD_LIBRARY_PATH:-}
compute-sanitizer --tool memcheck --error-exitcode 9 $B/lutb_cuda_tests \
  --gtest_filter='Shapes/MoeRandom.*E16_H200*:Shapes/MoeRandom.*E2_H4096*:MoeCuda.ToLaneMajor*:MoeCuda.GoldenLayer:MoeCuda.InvalidExpertIdWritesNanRow:MoeCuda.SingleTokenInvalidAndRepeatedExperts:RoutingCuda.*' 2>&1 | tail -4
compute-sanitizer --tool racecheck --error-exitcode 9 $B/lutb_cuda_tests --gtest_filter='MoeCuda.GoldenLayer:Shapes/MoeRandom.*E2_H4096*' 2>&1 | tail -3
for rep in 1 2; do
  echo "16-warp  $($B/bench_moe_gpu --shape mixtral-8x7b --tokens 1 | tail -1 | cut -d'|' -f2-7)"
  echo "8-warp   $(LUTB_SWAPAB_WARPS16=0 $B/bench_moe_gpu --shape mixtral-8x7b --tokens 1 | tail -1 | cut -d'|' -f2-7)"
done
