// src/cuda/moe/lutb_moe_steps.cu: the small kernels of the MoE forward (lutb_moe_steps_quantize_x:
// MXFP8 of x; lutb_moe_steps_group: grouping of the pairs by expert; lutb_moe_steps_reduce_topk:
// weighted top-k reduction), the workspace layout and the device queries.
#include <algorithm>
#include <stdexcept>

#include "cuda/common.cuh"
#include "cuda/e4m3_encode.cuh"
#include "cuda/heuristics/moe_heuristics.hpp"
#include "lutb/cuda/moe.hpp"
#include "cuda/moe/lutb_moe_launch.hpp"

namespace lutb::cuda {
namespace {

__global__ void __launch_bounds__(256)
    lutb_moe_steps_quantize_x(const uint16_t* __restrict__ x, long long H, long long Hp, bool swap,
                              uint16_t* __restrict__ xa, unsigned char* __restrict__ xs, float* __restrict__ xsf) {
  // Reads only x (the caller's input) and writes buffers no kernel still running reads (the
  // forward's first kernel, the grouping, started after all earlier work), so it works first and
  // waits for the grouping at the end: the GEMM it triggers reads the grouping's routing.
  const long long t = blockIdx.y;
  const long long blk = static_cast<long long>(blockIdx.x) * 8 + threadIdx.x / 32;
  const int lane = threadIdx.x & 31;
  if (blk * 32 < Hp) {
    const long long col = blk * 32 + lane;
    const float v = col < H ? bf16_to_float(x[t * H + col]) : 0.0f;
    float a = isfinite(v) ? fabsf(v) : INFINITY;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) a = fmaxf(a, __shfl_xor_sync(0xffffffffu, a, o));
    const unsigned char b = mx_block_scale(a, MxScaleRule::Rceil);
    // mx_encode_dev: the hardware E4M3 conversion, the same bytes as mx_encode (e4m3_encode.cuh).
    const unsigned char q8 = (b == 255) ? 0 : kern::mx_encode_dev(v, b);
    xa[t * Hp + blk * 32 + (lane & ~7) + kern::perm8(lane & 7, swap)] =
        __half_as_ushort(__float2half_rn(e4m3_to_float(q8)));
    if (lane == 0) xs[t * (Hp / 32) + blk] = b;
    if (xsf && lane == 0) xsf[t * (Hp / 32) + blk] = kern::ue8m0_f(b);
  }
  kern::pdl_wait();
  kern::pdl_trigger();
}

/// Block-wide exclusive scan of one int per thread (blockDim.x == 1024).
__device__ int block_exclusive_scan(int v, int* total) {
  __shared__ int warp_sums[32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  int inc = v;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const int n = __shfl_up_sync(0xffffffffu, inc, o);
    if (lane >= o) inc += n;
  }
  if (lane == 31) warp_sums[warp] = inc;
  __syncthreads();
  if (warp == 0) {
    int s = warp_sums[lane];
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const int n = __shfl_up_sync(0xffffffffu, s, o);
      if (lane >= o) s += n;
    }
    warp_sums[lane] = s;  // inclusive
  }
  __syncthreads();
  const int before = warp ? warp_sums[warp - 1] : 0;
  *total = warp_sums[31];
  __syncthreads();
  return before + inc - v;
}

__global__ void __launch_bounds__(1024)
    lutb_moe_steps_group(const int* __restrict__ ids, long long P, int E, int tile_rows, int* __restrict__ sorted,
                         int* __restrict__ tile_expert, int* __restrict__ tile_start, int* __restrict__ tile_count,
                         int* __restrict__ num_tiles) {
  __shared__ int cnt[1024], off[1024], cur[1024];
  // The forward's first kernel (a normal launch: everything before it has completed). The next
  // kernel (MXFP8 of x) does not read the routing, so it may start now.
  kern::pdl_trigger();
  const int tid = threadIdx.x;
  cnt[tid] = 0;
  cur[tid] = 0;
  __syncthreads();
  for (long long p = tid; p < P; p += 1024) {
    const int e = ids[p];
    if (e >= 0 && e < E) atomicAdd(&cnt[e], 1);
  }
  __syncthreads();
  const int c = tid < E ? cnt[tid] : 0;
  const int nt = (c + tile_rows - 1) / tile_rows;
  int total_pairs, total_tiles;
  const int o = block_exclusive_scan(c, &total_pairs);
  const int to = block_exclusive_scan(nt, &total_tiles);
  off[tid] = o;
  for (int j = 0; j < nt; ++j) {
    tile_expert[to + j] = tid;
    tile_start[to + j] = o + j * tile_rows;
    tile_count[to + j] = min(tile_rows, c - j * tile_rows);
  }
  if (tid == 0) *num_tiles = total_tiles;
  __syncthreads();
  for (long long p = tid; p < P; p += 1024) {
    const int e = ids[p];
    if (e >= 0 && e < E) sorted[off[e] + atomicAdd(&cur[e], 1)] = static_cast<int>(p);
  }
}

__device__ __forceinline__ void store_sum(uint16_t* out, long long i, float v) { out[i] = bf16_from_float(v); }
__device__ __forceinline__ void store_sum(float* out, long long i, float v) { out[i] = v; }

// OutT uint16_t: BF16 bits (spec 4 step 6); float: the FP32 sums before that rounding.
template <typename OutT>
__global__ void __launch_bounds__(256)
    lutb_moe_steps_reduce_topk(const int* __restrict__ ids, const float* __restrict__ w, const float* __restrict__ y,
                               long long T, int k, int E, long long H, OutT* __restrict__ out) {
  kern::pdl_wait();  // y comes from GEMM2
  kern::pdl_trigger();
  const long long t = blockIdx.y;
  const long long n = static_cast<long long>(blockIdx.x) * 256 + threadIdx.x;
  if (n >= H) return;
  float acc = 0.0f;
  for (int j = 0; j < k; ++j) {
    const long long p = t * k + j;
    const int e = ids[p];
    if (e < 0 || e >= E) {
      acc = __int_as_float(0x7fc00000);
      break;
    }
    acc = __fadd_rn(acc, __fmul_rn(w[p], y[p * H + n]));
  }
  store_sum(out, t * H + n, acc);
}

std::size_t align256(std::size_t v) { return (v + 255) / 256 * 256; }

}  // namespace

std::size_t moe_workspace_bytes(std::int64_t max_tokens, int top_k, std::int64_t experts, std::int64_t hidden,
                                std::int64_t intermediate) {
  return detail::carve(nullptr, max_tokens, top_k, experts, hidden, intermediate).bytes;
}

std::int64_t lutb_bytes_per_expert(const DeviceMoeWeights& w) {
  return (w.w13.shape.tiles_per_expert() + w.w2.shape.tiles_per_expert()) * 201;
}

namespace detail {

std::int64_t max_tiles(std::int64_t pairs, std::int64_t experts, int rows) {
  return std::min(experts, pairs) + pairs / rows;
}

Workspace carve(void* base, std::int64_t T, int k, std::int64_t E, std::int64_t H, std::int64_t I) {
  const std::int64_t Hp = ceil_div(H, 64) * 64, Ip = ceil_div(I, 64) * 64, P = T * k;
  const std::int64_t mt = max_tiles(P, E, 8);  // the smallest token tile (swap-AB decode, 8 rows)
  Workspace w;
  std::size_t o = 0;
  auto take = [&](std::size_t bytes) {
    const std::size_t at = o;
    o = align256(o + bytes);
    return base ? static_cast<char*>(base) + at : nullptr;
  };
  w.xa = reinterpret_cast<std::uint16_t*>(take(sizeof(std::uint16_t) * T * Hp));
  w.xs = reinterpret_cast<std::uint8_t*>(take(T * Hp / 32));
  w.xsf = reinterpret_cast<float*>(take(sizeof(float) * T * Hp / 32));
  w.sorted = reinterpret_cast<int*>(take(sizeof(int) * P));
  w.tile_expert = reinterpret_cast<int*>(take(sizeof(int) * mt));
  w.tile_start = reinterpret_cast<int*>(take(sizeof(int) * mt));
  w.tile_count = reinterpret_cast<int*>(take(sizeof(int) * mt));
  w.num_tiles = reinterpret_cast<int*>(take(sizeof(int)));
  w.hq = reinterpret_cast<std::uint16_t*>(take(sizeof(std::uint16_t) * P * Ip));
  w.hs = reinterpret_cast<std::uint8_t*>(take(P * Ip / 32));
  w.hsf = reinterpret_cast<float*>(take(sizeof(float) * P * Ip / 32));
  w.y = reinterpret_cast<float*>(take(sizeof(float) * P * H));
  // GEMM1's sums for the activation kernel (at most 2 x kActMaxRows x Ip x 4 bytes).
  w.hpart_rows = heuristics::act_rows(P, E);
  w.hpart = reinterpret_cast<float*>(take(sizeof(float) * w.hpart_rows * 2 * Ip));
  w.bytes = o;
  return w;
}


namespace {
int device_cc() {
  static int cc[64] = {0};
  int dev = 0;
  check(cudaGetDevice(&dev), "cudaGetDevice");
  if (dev < 64 && cc[dev] == 0) {
    int major = 0, minor = 0;
    check(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev), "cudaDeviceGetAttribute");
    check(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev), "cudaDeviceGetAttribute");
    cc[dev] = major * 10 + minor;
  }
  return dev < 64 ? cc[dev] : 0;
}
}  // namespace

int device_sms() {
  static int sms[64] = {0};
  int dev = 0;
  check(cudaGetDevice(&dev), "cudaGetDevice");
  if (dev >= 64) return 132;
  if (sms[dev] == 0)
    check(cudaDeviceGetAttribute(&sms[dev], cudaDevAttrMultiProcessorCount, dev), "cudaDeviceGetAttribute");
  return sms[dev];
}

// The binary carries sm_80 and sm_90a code: the E4M3 conversion, clusters and wgmma exist only in the
// sm_90a image.
bool sm90a_device() {
  const int c = device_cc();
  return c >= 90 && c < 100;
}

int sm_count() { return device_sms(); }

heuristics::MoeDevice moe_device() { return {sm90a_device(), device_sms()}; }

bool pdl_enabled() { return device_cc() >= 90; }

void launch_quantize_x(const std::uint16_t* x, std::int64_t T, std::int64_t H, std::int64_t Hp, bool swap,
                       std::uint16_t* xa, std::uint8_t* xs, float* xsf, cudaStream_t stream, bool first) {
  const dim3 grid(static_cast<unsigned>(ceil_div(Hp / 32, 8)), static_cast<unsigned>(T));
  launch_kernel("lutb_moe_steps_quantize_x", !first, lutb_moe_steps_quantize_x, grid, dim3(256), 0, stream, x,
                static_cast<long long>(H), static_cast<long long>(Hp), swap, xa, xs, xsf);
}

void launch_group(const int* ids, std::int64_t P, std::int64_t E, int tile_rows, const Workspace& ws,
                  cudaStream_t stream) {
  launch_kernel("lutb_moe_steps_group", false, lutb_moe_steps_group, dim3(1), dim3(1024), 0, stream, ids,
                static_cast<long long>(P), static_cast<int>(E), tile_rows, ws.sorted, ws.tile_expert, ws.tile_start,
                ws.tile_count, ws.num_tiles);
}

void launch_reduce(const int* ids, const float* weights, const float* y, std::int64_t T, int k, std::int64_t E,
                   std::int64_t H, std::uint16_t* out, cudaStream_t stream, float* out_f32) {
  const dim3 grid(static_cast<unsigned>(ceil_div(H, 256)), static_cast<unsigned>(T));
  if (out_f32 != nullptr)
    launch_kernel("lutb_moe_steps_reduce_topk", true, lutb_moe_steps_reduce_topk<float>, grid, dim3(256), 0, stream,
                  ids, weights, y, static_cast<long long>(T), k, static_cast<int>(E), static_cast<long long>(H), out_f32);
  else
    launch_kernel("lutb_moe_steps_reduce_topk", true, lutb_moe_steps_reduce_topk<uint16_t>, grid, dim3(256), 0, stream,
                  ids, weights, y, static_cast<long long>(T), k, static_cast<int>(E), static_cast<long long>(H), out);
}

}  // namespace detail


}  // namespace lutb::cuda
