#!/usr/bin/env bash
# session 10, device run 6: 96-register, 4-stage swap-AB NB=1 kernels (20 warps/SM) vs the default
B=build/gpu
export LD_LIBRARY_PATH=deps/lib:${LD_LIBRARY_PATH:-}
nvcc -std=c++20 -O3 --expt-relaxed-constexpr -lineinfo -gencode=arch=compute_90a,code=sm_90a -Iinclude -Isrc \
  -DLUTB_SWAPAB_STAGES=4 -DLUTB_SWAPAB_MAXNREG1=96 -c src/cuda/moe_lutb.cu -o $B/obj_v_moe_lutb.o
lib=$(ls $B/obj/moe_*.o $B/obj/routing.o $B/obj/lane_major.o $B/obj/fit_*.o | grep -v '/moe_lutb.o')
nvcc -gencode=arch=compute_90a,code=sm_90a -o $B/bench_v $B/obj/b_bench_moe_gpu.o $B/obj_v_moe_lutb.o $lib $B/obj/c_core_*.o $B/obj/c_fit_*.o \
  -lcublas -Xcompiler -fopenmp -Ldeps/lib -lhwy -lpthread -Xlinker -rpath=deps/lib
for cfg in "deepseek-v3 1" "deepseek-v3 4" "deepseek-v3 16" "deepseek-v3 64" "qwen3-235b 1" "qwen3-235b 16" "qwen3-30b 16"; do
  set -- $cfg
  echo "default $($B/bench_moe_gpu --shape $1 --tokens $2 | tail -1 | cut -d'|' -f2-7)"
  echo "r96s4   $($B/bench_v --shape $1 --tokens $2 | tail -1 | cut -d'|' -f2-7)"
done
