// src/cuda/heuristics/moe_heuristics.cpp: the rules of moe_heuristics.hpp (host only).
#include "cuda/heuristics/moe_heuristics.hpp"

#include <algorithm>
#include <cmath>

namespace lutb::cuda::heuristics {
namespace {

/// Expected pairs per touched expert under uniform routing: T k / (E (1 - (1 - min(1, k/E))^T)).
double expected_pairs_per_expert(std::int64_t tokens, int top_k, std::int64_t experts) {
  const double p = std::min(1.0, static_cast<double>(top_k) / static_cast<double>(experts));
  const double touched = static_cast<double>(experts) * (1.0 - std::pow(1.0 - p, static_cast<double>(tokens)));
  return touched > 0 ? static_cast<double>(tokens) * top_k / touched : 0.0;
}

}  // namespace

double tokens_per_expert(std::int64_t tokens, int top_k, std::int64_t experts) {
  const double pairs = static_cast<double>(tokens) * top_k;
  const double touched = std::min<double>(static_cast<double>(experts), pairs);
  return touched > 0 ? pairs / touched : 0.0;
}

MoeStrategy choose_strategy(std::int64_t tokens, int top_k, std::int64_t experts, bool packed, bool wgmma_prefill) {
  const double a = tokens_per_expert(tokens, top_k, experts);
  const double from = !packed        ? kBf16PrefillMinTokensPerExpert
                      : wgmma_prefill ? kPrefillMinTokensPerExpertWgmma
                                      : kPrefillMinTokensPerExpert;
  return a >= from ? MoeStrategy::Prefill : MoeStrategy::Decode;
}

int decode_token_blocks(std::int64_t tokens, int top_k, std::int64_t experts) {
  return tokens_per_expert(tokens, top_k, experts) <= kSwapOneBlockMaxTokensPerExpert ? 1 : 2;
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

bool decode_fuse_reduce(std::int64_t gemm2_ctas, int top_k, int sms) {
  return top_k >= 1 && top_k <= 8 && gemm2_ctas >= 1 && gemm2_ctas <= 2ll * sms;
}

int decode_swap_warps(std::int64_t ctas, std::int64_t tiles_k, int most, int sms, const int (&resident)[5],
                      bool one_wave) {
  if (tiles_k < 4) return 1;
  // resident[i]: CTAs of 2^i warps per SM; a doubling w -> 2w that turns one wave into two is skipped.
  auto lg = [](int w) { return w == 1 ? 0 : w == 2 ? 1 : w == 4 ? 2 : w == 8 ? 3 : 4; };
  auto breaks_wave = [&](int w) {
    if (!one_wave) return false;
    const std::int64_t now = static_cast<std::int64_t>(sms) * resident[lg(w)];
    const std::int64_t next = static_cast<std::int64_t>(sms) * resident[lg(2 * w)];
    return ctas <= now && ctas > next;
  };
  int w = 2;
  while (w < 8 && w < most && ctas * w < 132 * 12 && tiles_k >= 4 * w && !breaks_wave(w)) w *= 2;
  if (w == 8 && most >= 16 && ctas <= 132 && tiles_k >= 64 && !breaks_wave(8)) w = 16;
  return w;
}

DecodeSplit decode_k_split(std::int64_t ctas, std::int64_t tiles_k, int warps, int sms) {
  if (warps < 4 || ctas < 1 || sms < 1 || tiles_k < 4ll * warps) return {1, warps};
  const std::int64_t before = (ctas + sms - 1) / sms, after = (2 * ctas + sms - 1) / sms;
  if (after * (warps / 2) <= 16 && after < 2 * before) return {2, warps / 2};
  return {1, warps};
}

bool decode_late_scales(std::int64_t hidden, int token_blocks) {
  return token_blocks == 2 || (hidden >= 1 && hidden <= kLateScalesMaxHidden);
}

bool decode_one_token_tail(std::int64_t tokens, int top_k, std::int64_t experts) {
  if (tokens < 1 || top_k < 1 || experts < 1) return false;
  if (tokens == 1) return true;
  return expected_pairs_per_expert(tokens, top_k, experts) <= kOneTokenTailMaxPairsPerExpert;
}

bool decode_act_kernel(std::int64_t tokens, int top_k, std::int64_t experts, std::int64_t hidden) {
  if (tokens <= 1 || top_k < 1 || experts < 1 || hidden < 1) return false;
  if ((hidden + 63) / 64 > kActMaxTilesK) return false;  // GEMM1's K-tiles
  return expected_pairs_per_expert(tokens, top_k, experts) > kActMinPairsPerExpert;
}

std::int64_t act_rows(std::int64_t pairs, std::int64_t experts) {
  if (pairs < 1 || experts < 1) return 0;
  // Auto's swap-AB decode ends below kPrefillMinTokensPerExpert pairs per touched expert (the larger
  // of the two crossovers): P < 36 E once every expert is touched.
  const auto auto_decode = static_cast<std::int64_t>(std::ceil(kPrefillMinTokensPerExpert * static_cast<double>(experts)));
  return std::min({pairs * kActMaxSplit, kActMaxRows, auto_decode});
}

PrefillKernel prefill_kernel(std::int64_t pairs, std::int64_t experts, bool sm90a, bool rs) {
  if (!sm90a) return PrefillKernel::Sm80Mma64;
  const std::int64_t touched = std::max<std::int64_t>(1, std::min(pairs, experts));
  if (pairs >= kPrefillRs128MinPairs * touched) return PrefillKernel::Sm90WgmmaRs128;
  if (rs) return PrefillKernel::Sm90WgmmaRs64;
  return PrefillKernel::Sm90Wgmma64;
}

int prefill_tile_rows(PrefillKernel k) {
  return k == PrefillKernel::Sm90WgmmaRs128 ? 128 : 64;
}

MoePlan plan_moe(std::int64_t tokens, int top_k, std::int64_t experts, std::int64_t hidden, bool small_experts,
                 const MoeOptions& options, const MoeDevice& device) {
  MoePlan p;
  const std::int64_t pairs = tokens * top_k;
  p.cvt_decoder = device.sm90a;
  p.prefill = prefill_kernel(pairs, experts, device.sm90a, options.prefill == MoePrefillKernel::RegisterWeights);
  MoeStrategy s = options.strategy;
  if (s == MoeStrategy::Auto) s = choose_strategy(tokens, top_k, experts, true, p.prefill != PrefillKernel::Sm80Mma64);
  if (s == MoeStrategy::Prefill) {
    p.kernel = MoeKernel::Prefill;
    return p;
  }
  if (!small_experts) {  // the swap-AB kernels' byte offsets inside one expert are 32-bit
    p.kernel = MoeKernel::TokenM16;
    return p;
  }
  p.kernel = MoeKernel::SwapAB;
  p.token_blocks = decode_token_blocks(tokens, top_k, experts);
  // T = 1 is direct even with top_k > E (repeated experts: one slot per pair).
  p.direct = p.token_blocks == 1 && pairs <= 65535 && (tokens == 1 || decode_direct(tokens, top_k, experts));
  // GEMM2's CTAs in a direct forward: 64-row groups of w2 (ceil(ceil(H / 8) / 8)) x pairs.
  const std::int64_t gemm2_ctas = ((hidden + 7) / 8 + 7) / 8 * pairs;
  p.fuse_reduce = p.direct && device.sm90a && decode_fuse_reduce(gemm2_ctas, top_k, device.sms);
  p.late_scales = p.cvt_decoder && decode_late_scales(hidden, p.token_blocks);
  p.one_token_tail = decode_one_token_tail(tokens, top_k, experts);
  p.act_kernel = decode_act_kernel(tokens, top_k, experts, hidden);
  return p;
}

}  // namespace lutb::cuda::heuristics
