// src/cuda/moe_common.cu: the small kernels of the MoE forward (MXFP8 of x, grouping of tokens by
// expert, weighted top-k reduction), the workspace layout and the strategy heuristic.
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <stdexcept>

#include "common.cuh"
#include "e4m3_encode.cuh"
#include "lutb/cuda/moe.hpp"
#include "moe_internal.hpp"

namespace lutb::cuda {
namespace {

__global__ void __launch_bounds__(256)
    quantize_x_kernel(const uint16_t* __restrict__ x, long long H, long long Hp, bool swap, uint16_t* __restrict__ xa,
                      unsigned char* __restrict__ xq8, unsigned char* __restrict__ xs, float* __restrict__ xsf,
                      bool q8_wg) {
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
    if (xq8) xq8[t * Hp + (q8_wg ? blk * 32 + kern::wg_pos(lane) : col)] = q8;
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
    group_by_expert_kernel(const int* __restrict__ ids, long long P, int E, int tile_rows, int* __restrict__ sorted,
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
    reduce_topk_kernel(const int* __restrict__ ids, const float* __restrict__ w, const float* __restrict__ y, long long T,
                       int k, int E, long long H, OutT* __restrict__ out) {
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

namespace {
/// Mean tokens per touched expert (pairs / min(E, pairs)).
double tokens_per_expert(std::int64_t tokens, int top_k, std::int64_t experts) {
  const double pairs = static_cast<double>(tokens) * top_k;
  const double touched = std::min<double>(static_cast<double>(experts), pairs);
  return touched > 0 ? pairs / touched : 0.0;
}
}  // namespace

MoeStrategy choose_strategy(std::int64_t tokens, int top_k, std::int64_t experts, bool packed_weights,
                            bool wgmma_prefill) {
  const double a = tokens_per_expert(tokens, top_k, experts);
  const double from = wgmma_prefill ? kPrefillMinTokensPerExpertWgmma : kPrefillMinTokensPerExpert;
  if (packed_weights) return a >= from ? MoeStrategy::Prefill : MoeStrategy::Decode;
  return a >= 48.0 ? MoeStrategy::Prefill : MoeStrategy::Decode;
}

bool decode_direct(std::int64_t tokens, int top_k, std::int64_t experts) {
  if (tokens < 1 || top_k < 1 || experts < 1 || top_k > experts) return false;
  if (tokens == 1) return true;
  if (tokens > kDirectMaxTokens) return false;
  // Expected distinct experts of T tokens with k distinct uniform choices each: E (1 - (1 - k/E)^T).
  const double q = 1.0 - static_cast<double>(top_k) / static_cast<double>(experts);
  const double touched = static_cast<double>(experts) * (1.0 - std::pow(q, static_cast<double>(tokens)));
  return static_cast<double>(tokens) * top_k <= kDirectMaxPairsPerExpert * touched;
}

bool decode_late_scales(std::int64_t hidden, int token_blocks) {
  return token_blocks == 2 || (hidden >= 1 && hidden <= kLateScalesMaxHidden);
}

DecodeSplit decode_k_split(std::int64_t ctas, std::int64_t tiles_k, int warps, int sms) {
  if (warps < 4 || ctas < 1 || sms < 1 || tiles_k < 4ll * warps) return {1, warps};
  const std::int64_t before = (ctas + sms - 1) / sms, after = (2 * ctas + sms - 1) / sms;
  if (after * (warps / 2) <= 16 && after < 2 * before) return {2, warps / 2};
  return {1, warps};
}

int decode_l2_prefetch_tiles(std::int64_t w2_bytes, std::int64_t range_tiles, std::int64_t budget_bytes) {
  if (budget_bytes <= 0 || range_tiles <= 0) return 0;
  if (w2_bytes <= budget_bytes) return static_cast<int>(range_tiles);
  // range_tiles * budget / w2_bytes without overflow (range_tiles is at most a few thousand).
  const double k = static_cast<double>(range_tiles) * static_cast<double>(budget_bytes) / static_cast<double>(w2_bytes);
  return static_cast<int>(std::max<std::int64_t>(1, static_cast<std::int64_t>(k)));
}

bool decode_fuse_reduce(std::int64_t gemm2_ctas, int top_k, int sms) {
  return top_k >= 1 && top_k <= 8 && gemm2_ctas >= 1 && gemm2_ctas <= 2ll * sms;
}

int decode_token_blocks(std::int64_t tokens, int top_k, std::int64_t experts) {
  const double a = tokens_per_expert(tokens, top_k, experts);
  return a <= kSwapOneBlockMaxTokensPerExpert ? 1 : 2;
}

std::int64_t act_rows(std::int64_t pairs, std::int64_t experts) {
  if (pairs < 1 || experts < 1) return 0;
  // Auto's swap-AB decode ends below kPrefillMinTokensPerExpert pairs per touched expert (the larger
  // of the two crossovers, choose_strategy): P < 36 E once every expert is touched.
  const auto auto_decode = static_cast<std::int64_t>(std::ceil(kPrefillMinTokensPerExpert * static_cast<double>(experts)));
  return std::min({pairs * kActMaxSplit, kActMaxRows, auto_decode});
}

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
  w.xq8 = reinterpret_cast<std::uint8_t*>(take(T * Hp));
  w.xs = reinterpret_cast<std::uint8_t*>(take(T * Hp / 32));
  w.xsf = reinterpret_cast<float*>(take(sizeof(float) * T * Hp / 32));
  w.sorted = reinterpret_cast<int*>(take(sizeof(int) * P));
  w.tile_expert = reinterpret_cast<int*>(take(sizeof(int) * mt));
  w.tile_start = reinterpret_cast<int*>(take(sizeof(int) * mt));
  w.tile_count = reinterpret_cast<int*>(take(sizeof(int) * mt));
  w.num_tiles = reinterpret_cast<int*>(take(sizeof(int)));
  w.hq = reinterpret_cast<std::uint16_t*>(take(sizeof(std::uint16_t) * P * Ip));
  w.hq8 = reinterpret_cast<std::uint8_t*>(take(P * Ip));
  w.hs = reinterpret_cast<std::uint8_t*>(take(P * Ip / 32));
  w.hsf = reinterpret_cast<float*>(take(sizeof(float) * P * Ip / 32));
  w.y = reinterpret_cast<float*>(take(sizeof(float) * P * H));
  // GEMM1's sums for the activation kernel (act_rows, moe.hpp: at most 2 x kActMaxRows x Ip x 4 bytes).
  w.hpart_rows = act_rows(P, E);
  w.hpart = reinterpret_cast<float*>(take(sizeof(float) * w.hpart_rows * 2 * Ip));
  w.bytes = o;
  return w;
}

int resolve_mt(MoeStrategy s, std::int64_t tokens, int top_k, std::int64_t experts, bool packed) {
  if (s == MoeStrategy::Auto) s = choose_strategy(tokens, top_k, experts, packed);
  return s == MoeStrategy::Prefill ? 4 : 1;  // Decode and DecodeM16 are the same BF16 kernel
}

static WeightDecoder g_decoder = WeightDecoder::Auto;
int device_sms();  // below
static unsigned g_decode_paths = kDecodePathsDefault;
static int g_stop_after = 0;
static int g_split[4] = {0, 0, 0, 0};  // set_decode_split (benchmark only)
static std::int64_t g_l2pf_budget = kDecodeL2PrefetchDefault;  // set_decode_l2_prefetch
static bool g_l2pf_evict_last = false;
static bool g_l2pf_late = false;

DecodeSplit gemm_k_split(int gemm, std::int64_t ctas, std::int64_t tiles_k, int warps) {
  const int s = g_split[2 * (gemm - 1)], shift = g_split[2 * (gemm - 1) + 1];
  if (s == 1 || s == 2 || s == 4) return {s, std::max(1, warps >> std::max(0, shift))};
  // The rule: GEMM1 only, with kDecodeSplitK.
  if (gemm != 1 || !(g_decode_paths & kDecodeSplitK)) return {1, warps};
  return decode_k_split(ctas, tiles_k, warps, device_sms());
}

unsigned decode_paths() { return g_decode_paths; }
std::int64_t l2_prefetch_budget() { return g_l2pf_budget; }
bool l2_prefetch_evict_last() { return g_l2pf_evict_last; }
bool l2_prefetch_late() { return g_l2pf_late; }
int sm_count() { return device_sms(); }
int forward_stop_after() { return g_stop_after; }

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

namespace {
// The binary carries sm_80 and sm_90a code: the E4M3 conversion and E4M3 mma exist only in the
// sm_90a image.
bool sm90_image() {
  const int c = device_cc();
  return c >= 90 && c < 100;
}
}  // namespace

bool cluster_launch_ok() { return sm90_image(); }

bool use_cvt_decoder(int mt) {
  if (g_decoder == WeightDecoder::BytePermute) return false;
  if (g_decoder == WeightDecoder::Auto && mt != 1) return false;
  return sm90_image();
}

int swap_decoder() {
  if (g_decoder == WeightDecoder::BytePermute || !sm90_image()) return kern::kDecByte;
  if (g_decoder == WeightDecoder::Fp8Wgmma) return kern::kDecWg;
  if (g_decoder == WeightDecoder::CvtWs) return kern::kDecWs;
  return g_decoder == WeightDecoder::Fp8Mma ? kern::kDecFp8 : kern::kDecCvt;
}

// Programmatic dependent launch: on unless LUTB_PDL=0 in the environment or set_dependent_launch(false).
static int g_pdl = -1;  // -1: not set yet (read the environment)

bool pdl_enabled() {
  if (g_pdl < 0) {
    const char* v = std::getenv("LUTB_PDL");
    g_pdl = (v && std::strcmp(v, "0") == 0) ? 0 : 1;
  }
  return g_pdl == 1 && device_cc() >= 90;
}

void launch_quantize_x(const std::uint16_t* x, std::int64_t T, std::int64_t H, std::int64_t Hp, bool swap,
                       std::uint16_t* xa, std::uint8_t* xq8, std::uint8_t* xs, float* xsf, cudaStream_t stream,
                       bool first, bool q8_wg) {
  const dim3 grid(static_cast<unsigned>(ceil_div(Hp / 32, 8)), static_cast<unsigned>(T));
  launch_kernel("quantize_x_kernel", !first, quantize_x_kernel, grid, dim3(256), 0, stream, x,
                static_cast<long long>(H), static_cast<long long>(Hp), swap, xa, xq8, xs, xsf, q8_wg);
}

void launch_group(const int* ids, std::int64_t P, std::int64_t E, int tile_rows, const Workspace& ws,
                  cudaStream_t stream) {
  launch_kernel("group_by_expert_kernel", false, group_by_expert_kernel, dim3(1), dim3(1024), 0, stream, ids,
                static_cast<long long>(P), static_cast<int>(E), tile_rows, ws.sorted, ws.tile_expert, ws.tile_start,
                ws.tile_count, ws.num_tiles);
}

void launch_reduce(const int* ids, const float* weights, const float* y, std::int64_t T, int k, std::int64_t E,
                   std::int64_t H, std::uint16_t* out, cudaStream_t stream, float* out_f32) {
  const dim3 grid(static_cast<unsigned>(ceil_div(H, 256)), static_cast<unsigned>(T));
  if (out_f32 != nullptr)
    launch_kernel("reduce_topk_kernel", true, reduce_topk_kernel<float>, grid, dim3(256), 0, stream, ids, weights, y,
                  static_cast<long long>(T), k, static_cast<int>(E), static_cast<long long>(H), out_f32);
  else
    launch_kernel("reduce_topk_kernel", true, reduce_topk_kernel<uint16_t>, grid, dim3(256), 0, stream, ids, weights,
                  y, static_cast<long long>(T), k, static_cast<int>(E), static_cast<long long>(H), out);
}

}  // namespace detail

void set_decode_paths(unsigned paths) { detail::g_decode_paths = paths; }

void set_decode_l2_prefetch(std::int64_t budget_bytes, bool evict_last, bool after_k_loop) {
  detail::g_l2pf_budget = budget_bytes > 0 ? budget_bytes : 0;
  detail::g_l2pf_evict_last = evict_last;
  detail::g_l2pf_late = after_k_loop;
}

void set_decode_split(int ksplit1, int warp_shift1, int ksplit2, int warp_shift2) {
  detail::g_split[0] = ksplit1;
  detail::g_split[1] = warp_shift1;
  detail::g_split[2] = ksplit2;
  detail::g_split[3] = warp_shift2;
}

void set_forward_stop_after(int stage) { detail::g_stop_after = stage > 0 ? stage : 0; }

void set_weight_decoder(WeightDecoder d) { detail::g_decoder = d; }

void set_dependent_launch(bool enabled) { detail::g_pdl = enabled ? 1 : 0; }

}  // namespace lutb::cuda
