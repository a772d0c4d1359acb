// src/cuda/moe/lutb_moe_routing.cu: router top-k kernels (spec section 5). One warp per token; the token's E
// scores live in shared memory; selections are warp arg-max rounds (ties: lower index), so the
// output order is descending score, as the golden vectors expect.
#include <cmath>
#include <stdexcept>
#include <string>

#include "cuda/common.cuh"
#include "lutb/cuda/moe.hpp"

namespace lutb::cuda {
namespace {

constexpr int kWarpsPerBlock = 4;
constexpr int kMaxExperts = 1024;

/// Warp arg-max of (v, i) with ties to the lower index. Invalid entries carry v = -inf, i = INT_MAX.
__device__ __forceinline__ void warp_argmax(float& v, int& i) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const float ov = __shfl_xor_sync(0xffffffffu, v, o);
    const int oi = __shfl_xor_sync(0xffffffffu, i, o);
    if (ov > v || (ov == v && oi < i)) {
      v = ov;
      i = oi;
    }
  }
}

__global__ void __launch_bounds__(kWarpsPerBlock * 32)
    lutb_moe_routing_softmax_topk(const float* __restrict__ logits, long long tokens, int E, int k, bool renorm,
                             int* __restrict__ ids, float* __restrict__ weights) {
  extern __shared__ float smem[];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const long long t = static_cast<long long>(blockIdx.x) * kWarpsPerBlock + warp;
  if (t >= tokens) return;
  float* p = smem + warp * E;
  const float* l = logits + t * E;
  float m = -INFINITY;
  for (int e = lane; e < E; e += 32) {
    p[e] = l[e];
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
  float sel_sum = 0.0f;
  for (int j = 0; j < k; ++j) {
    float v = -INFINITY;
    int i = 0x7fffffff;
    for (int e = lane; e < E; e += 32)
      if (p[e] > v || (p[e] == v && e < i)) {
        v = p[e];
        i = e;
      }
    warp_argmax(v, i);
    if (lane == 0) {
      ids[t * k + j] = i;
      weights[t * k + j] = v;
      p[i] = -1.0f;  // taken (probabilities are >= 0)
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
  float* ch = sc + E;                           // choice scores (bias added); -inf outside kept groups
  float* gs = ch + E;                           // group scores
  const float* l = logits + t * E;
  for (int e = lane; e < E; e += 32) {
    const float s = 1.0f / (1.0f + expf(-l[e]));
    sc[e] = s;
    ch[e] = s + (bias ? bias[e] : 0.0f);
  }
  __syncwarp();
  const int per = E / n_group;
  for (int g = lane; g < n_group; g += 32) {
    float b1 = -INFINITY, b2 = -INFINITY;
    for (int e = g * per; e < (g + 1) * per; ++e) {
      const float v = ch[e];
      if (v > b1) {
        b2 = b1;
        b1 = v;
      } else if (v > b2) {
        b2 = v;
      }
    }
    gs[g] = b1 + b2;
  }
  __syncwarp();
  // Kept groups are marked by setting their score to +inf.
  for (int j = 0; j < topk_group; ++j) {
    float v = -INFINITY;
    int i = 0x7fffffff;
    for (int g = lane; g < n_group; g += 32)
      if (gs[g] != INFINITY && (gs[g] > v || (gs[g] == v && g < i))) {
        v = gs[g];
        i = g;
      }
    warp_argmax(v, i);
    if (lane == 0 && i < n_group) gs[i] = INFINITY;
    __syncwarp();
  }
  for (int e = lane; e < E; e += 32)
    if (gs[e / per] != INFINITY) ch[e] = -INFINITY;
  __syncwarp();
  float sel_sum = 0.0f;
  for (int j = 0; j < k; ++j) {
    float v = -INFINITY;
    int i = 0x7fffffff;
    for (int e = lane; e < E; e += 32)
      if (ch[e] != -INFINITY && (ch[e] > v || (ch[e] == v && e < i))) {
        v = ch[e];
        i = e;
      }
    warp_argmax(v, i);
    const float w = (i < E) ? sc[i] : NAN;
    if (lane == 0) {
      ids[t * k + j] = i < E ? i : -1;
      weights[t * k + j] = w;
      if (i < E) ch[i] = -INFINITY;
    }
    sel_sum += w;
    __syncwarp();
  }
  if (lane < k) {
    float w = weights[t * k + lane];
    if (renorm) w = w / (sel_sum + 1e-20f);
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
  const std::size_t smem = sizeof(float) * kWarpsPerBlock * experts;
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
  const std::size_t smem = sizeof(float) * kWarpsPerBlock * (2 * experts + n_group);
  lutb_moe_routing_deepseek<<<blocks, kWarpsPerBlock * 32, smem, stream>>>(
      logits, bias, tokens, experts, n_group, topk_group, k, renormalize, routed_scaling_factor, topk_ids,
      topk_weights);
  detail::check_launch("lutb_moe_routing_deepseek");
}

}  // namespace lutb::cuda
