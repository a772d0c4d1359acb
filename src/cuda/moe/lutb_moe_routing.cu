// src/cuda/moe/lutb_moe_routing.cu: router top-k kernels (spec section 5). One warp per token; the token's E
// scores live in shared memory; selections are warp arg-max rounds (ties: lower index), so the
// output order is descending score, as the golden vectors expect. Selections rank as the CPU router
// (src/moe/routing.cpp): a NaN score ranks below every number, and taken or excluded entries are
// flagged apart from their scores, so every id written is in 0..E-1 whatever the logits hold.
#include <cmath>
#include <stdexcept>
#include <string>

#include "cuda/common.cuh"
#include "lutb/cuda/moe.hpp"

namespace lutb::cuda {
namespace {

constexpr int kWarpsPerBlock = 4;
constexpr int kMaxExperts = 1024;

/// Whether (a, ia) ranks before (b, ib): a number beats NaN; equal numbers, and NaN against NaN, go
/// to the lower index (the CPU router's `better`). The empty candidate (NaN, kNone) ranks after every
/// entry.
constexpr int kNone = 0x7fffffff;
__device__ __forceinline__ bool better(float a, int ia, float b, int ib) {
  const bool na = isnan(a), nb = isnan(b);
  if (na != nb) return nb;
  if (!na && a != b) return a > b;
  return ia < ib;
}

/// Warp arg-max of (v, i) by `better`. Lanes without a candidate carry (NaN, kNone).
__device__ __forceinline__ void warp_argmax(float& v, int& i) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const float ov = __shfl_xor_sync(0xffffffffu, v, o);
    const int oi = __shfl_xor_sync(0xffffffffu, i, o);
    if (better(ov, oi, v, i)) {
      v = ov;
      i = oi;
    }
  }
}

/// The best entry by `better` among score[e], e < n, whose flag[e] is 0, over the warp: (v, i) in
/// every lane, or (NaN, kNone) when every entry is flagged. One top-k selection round.
__device__ __forceinline__ void warp_best_unflagged(const float* score, const unsigned char* flag, int n, int lane,
                                                    float& v, int& i) {
  for (int e = lane; e < n; e += 32)
    if (!flag[e] && better(score[e], e, v, i)) {
      v = score[e];
      i = e;
    }
  warp_argmax(v, i);
}

__global__ void __launch_bounds__(kWarpsPerBlock * 32)
    lutb_moe_routing_softmax_topk(const float* __restrict__ logits, long long tokens, int E, int k, bool renorm,
                             int* __restrict__ ids, float* __restrict__ weights) {
  extern __shared__ float smem[];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const long long t = static_cast<long long>(blockIdx.x) * kWarpsPerBlock + warp;
  if (t >= tokens) return;
  float* p = smem + warp * E;
  unsigned char* taken = reinterpret_cast<unsigned char*>(smem + kWarpsPerBlock * E) + warp * E;
  const float* l = logits + t * E;
  float m = -INFINITY;
  for (int e = lane; e < E; e += 32) {
    p[e] = l[e];
    taken[e] = 0;
    m = fmaxf(m, p[e]);
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
  float s = 0.0f;
  for (int e = lane; e < E; e += 32) {
    const float v = expf(p[e] - m);
    p[e] = v;
    s += v;
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
  for (int e = lane; e < E; e += 32) p[e] = p[e] / s;
  __syncwarp();
  // A row holding NaN or +inf, or only -inf, has NaN probabilities: ids 0..k-1 (ties), NaN weights.
  float sel_sum = 0.0f;
  for (int j = 0; j < k; ++j) {
    float v = NAN;
    int i = kNone;
    warp_best_unflagged(p, taken, E, lane, v, i);  // k <= E untaken entries remain, so i < E
    if (lane == 0) {
      ids[t * k + j] = i;
      weights[t * k + j] = v;
      taken[i] = 1;
    }
    sel_sum += v;
    __syncwarp();
  }
  if (renorm && lane < k) weights[t * k + lane] = weights[t * k + lane] / sel_sum;
}

__global__ void __launch_bounds__(kWarpsPerBlock * 32)
    lutb_moe_routing_deepseek(const float* __restrict__ logits, const float* __restrict__ bias, long long tokens,
                              int E, int n_group, int topk_group, int k, bool renorm, float scaling,
                              int* __restrict__ ids, float* __restrict__ weights) {
  extern __shared__ float smem[];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const long long t = static_cast<long long>(blockIdx.x) * kWarpsPerBlock + warp;
  if (t >= tokens) return;
  float* sc = smem + warp * (2 * E + n_group);  // sigmoid scores
  float* ch = sc + E;                           // choice scores (bias added)
  float* gs = ch + E;                           // group scores
  // Per expert: 1 once taken or outside the kept groups; then per group: 1 once kept.
  unsigned char* excluded =
      reinterpret_cast<unsigned char*>(smem + kWarpsPerBlock * (2 * E + n_group)) + warp * (E + n_group);
  unsigned char* kept = excluded + E;
  const float* l = logits + t * E;
  for (int e = lane; e < E; e += 32) {
    const float s = 1.0f / (1.0f + expf(-l[e]));
    sc[e] = s;
    ch[e] = s + (bias ? bias[e] : 0.0f);
  }
  __syncwarp();
  const int per = E / n_group;
  for (int g = lane; g < n_group; g += 32) {  // the sum of the group's two best choices (per >= 2)
    float b1 = NAN, b2 = NAN;
    int i1 = kNone, i2 = kNone;
    for (int e = g * per; e < (g + 1) * per; ++e) {
      if (better(ch[e], e, b1, i1)) {
        b2 = b1;
        i2 = i1;
        b1 = ch[e];
        i1 = e;
      } else if (better(ch[e], e, b2, i2)) {
        b2 = ch[e];
        i2 = e;
      }
    }
    gs[g] = b1 + b2;
    kept[g] = 0;
  }
  __syncwarp();
  for (int j = 0; j < topk_group; ++j) {
    float v = NAN;
    int i = kNone;
    for (int g = lane; g < n_group; g += 32)
      if (!kept[g] && better(gs[g], g, v, i)) {
        v = gs[g];
        i = g;
      }
    warp_argmax(v, i);  // topk_group <= n_group, so i < n_group
    if (lane == 0) kept[i] = 1;
    __syncwarp();
  }
  for (int e = lane; e < E; e += 32) excluded[e] = !kept[e / per];
  __syncwarp();
  float sel_sum = 0.0f;
  for (int j = 0; j < k; ++j) {
    float v = NAN;
    int i = kNone;
    warp_best_unflagged(ch, excluded, E, lane, v, i);  // k <= topk_group * per candidates, so i < E
    const float w = sc[i];
    if (lane == 0) {
      ids[t * k + j] = i;
      weights[t * k + j] = w;
      excluded[i] = 1;
    }
    sel_sum += w;
    __syncwarp();
  }
  if (lane < k) {
    float w = weights[t * k + lane];
    if (renorm) w = w / sel_sum;  // spec 5 and the CPU router: 0 / 0 is NaN when every chosen sigmoid is 0
    weights[t * k + lane] = w * scaling;
  }
}

}  // namespace

void route_softmax_topk(const float* logits, std::int64_t tokens, int experts, int k, bool renormalize,
                        std::int32_t* topk_ids, float* topk_weights, cudaStream_t stream) {
  if (experts < 1 || experts > kMaxExperts) throw std::invalid_argument("route_softmax_topk: E must be 1..1024");
  if (k < 1 || k > 32 || k > experts) throw std::invalid_argument("route_softmax_topk: k must be 1..min(32, E)");
  if (tokens <= 0) return;
  const auto blocks = static_cast<unsigned>(detail::ceil_div(tokens, kWarpsPerBlock));
  const std::size_t smem = (sizeof(float) + 1) * kWarpsPerBlock * experts;  // probabilities, taken flags
  lutb_moe_routing_softmax_topk<<<blocks, kWarpsPerBlock * 32, smem, stream>>>(logits, tokens, experts, k, renormalize,
                                                                          topk_ids, topk_weights);
  detail::check_launch("lutb_moe_routing_softmax_topk");
}

void route_deepseek(const float* logits, const float* bias, std::int64_t tokens, int experts, int n_group,
                    int topk_group, int k, bool renormalize, float routed_scaling_factor, std::int32_t* topk_ids,
                    float* topk_weights, cudaStream_t stream) {
  if (experts < 1 || experts > kMaxExperts) throw std::invalid_argument("route_deepseek: E must be 1..1024");
  if (n_group < 1 || experts % n_group != 0 || experts / n_group < 2)
    throw std::invalid_argument("route_deepseek: E must be a multiple of n_group with >= 2 experts per group");
  if (topk_group < 1 || topk_group > n_group) throw std::invalid_argument("route_deepseek: topk_group must be 1..n_group");
  if (k < 1 || k > 32 || k > topk_group * (experts / n_group))
    throw std::invalid_argument("route_deepseek: k must be 1..min(32, experts in the kept groups)");
  if (tokens <= 0) return;
  const auto blocks = static_cast<unsigned>(detail::ceil_div(tokens, kWarpsPerBlock));
  // scores, choices and group scores; then expert and group flags (at most 47,104 bytes: E = 1024, n_group = 512)
  const std::size_t smem = sizeof(float) * kWarpsPerBlock * (2 * experts + n_group) +
                           std::size_t{kWarpsPerBlock} * (experts + n_group);
  lutb_moe_routing_deepseek<<<blocks, kWarpsPerBlock * 32, smem, stream>>>(
      logits, bias, tokens, experts, n_group, topk_group, k, renormalize, routed_scaling_factor, topk_ids,
      topk_weights);
  detail::check_launch("lutb_moe_routing_deepseek");
}

}  // namespace lutb::cuda
