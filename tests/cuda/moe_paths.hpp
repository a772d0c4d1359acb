// tests/cuda/moe_paths.hpp: the kept GEMM paths of the GPU MoE forward, as plans of
// src/cuda/heuristics/moe_heuristics.hpp that the tests run through detail::moe_forward_plan, so that
// every path (also the sm_80 ones on an sm_90 device) is compared with the CPU reference.
#pragma once

#include <string>
#include <vector>

#include "cuda/heuristics/moe_heuristics.hpp"
#include "cuda/moe/lutb_moe_forward_plan.hpp"
#include "lutb/cuda/moe.hpp"

namespace lutb::test {

struct MoePath {
  std::string name;
  cuda::heuristics::MoePlan plan;
};

/// The plan the library would run for this batch with `strategy` (small expert stacks).
inline cuda::heuristics::MoePlan default_plan(std::int64_t T, int k, std::int64_t E, std::int64_t H,
                                               cuda::MoeStrategy strategy = cuda::MoeStrategy::Auto) {
  cuda::MoeOptions o;
  o.strategy = strategy;
  return cuda::heuristics::plan_moe(T, k, E, H, true, o, cuda::detail::moe_device());
}

/// Every kept path for this batch: swap-AB decode as planned, with the byte decoder, with each
/// bit-identical option flipped; the m16 token-tile kernels; the prefill tile as planned and the
/// mma.sync tile (on sm_90 the wgmma tile of 64 rows and the register-weight kernels of 64 and 128
/// tokens too).
inline std::vector<MoePath> all_paths(std::int64_t T, int k, std::int64_t E, std::int64_t H) {
  namespace hx = cuda::heuristics;
  std::vector<MoePath> v;
  const hx::MoePlan dec = default_plan(T, k, E, H, cuda::MoeStrategy::Decode);
  v.push_back({"swapab", dec});
  hx::MoePlan p = dec;
  p.cvt_decoder = false;
  p.late_scales = false;
  v.push_back({"swapab byte decoder", p});
  p = dec;
  p.late_scales = !p.late_scales;
  v.push_back({"swapab late scales flipped", p});
  p = dec;
  p.direct = !p.direct;
  p.fuse_reduce = p.direct;
  v.push_back({"swapab direct flipped", p});
  p = dec;
  p.act_kernel = !p.act_kernel;
  p.one_token_tail = !p.one_token_tail;
  v.push_back({"swapab act kernel, tail flipped", p});
  p = dec;
  p.gemm1_ksplit = 2;
  v.push_back({"swapab split-K forced", p});
  p = dec;
  p.token_blocks = 3 - p.token_blocks;
  p.direct = p.direct && p.token_blocks == 1;
  v.push_back({"swapab token blocks flipped", p});
  p = dec;
  p.kernel = hx::MoeKernel::TokenM16;
  v.push_back({"m16 token tiles", p});
  const hx::MoePlan pre = default_plan(T, k, E, H, cuda::MoeStrategy::Prefill);
  v.push_back({"prefill", pre});
  p = pre;
  p.prefill = hx::PrefillKernel::Sm80Mma64;
  v.push_back({"prefill mma.sync 64", p});
  if (cuda::detail::moe_device().sm90a) {
    p.prefill = hx::PrefillKernel::Sm90Wgmma64;
    v.push_back({"prefill wgmma 64", p});
    p.prefill = hx::PrefillKernel::Sm90WgmmaRs64;
    v.push_back({"prefill wgmma rs 64", p});
    p.prefill = hx::PrefillKernel::Sm90WgmmaRs128;
    v.push_back({"prefill wgmma rs 128", p});
  }
  return v;
}

}  // namespace lutb::test
