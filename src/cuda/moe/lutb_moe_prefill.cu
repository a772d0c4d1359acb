// src/cuda/moe/lutb_moe_prefill.cu: launches of the large-batch (prefill) LUT-B GEMMs: the sm_80
// mma.sync tile (sm80_lutb_moe_prefill.cuh), the sm_90a wgmma tile of 64 token rows
// (sm90_lutb_moe_prefill_wgmma.cuh) and the sm_90a register-weight kernels
// (sm90_lutb_moe_prefill_rs.cuh); heuristics::prefill_kernel chooses.
#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <string>

#include "cuda/common.cuh"
#include "cuda/heuristics/moe_heuristics.hpp"
#include "cuda/moe/lutb_moe_forward_plan.hpp"
#include "cuda/moe/lutb_moe_launch.hpp"
#include "cuda/moe/sm80_lutb_moe_prefill.cuh"
#include "cuda/moe/sm90_lutb_moe_prefill_rs.cuh"
#include "cuda/moe/sm90_lutb_moe_prefill_wgmma.cuh"
#include "lutb/cuda/moe.hpp"

namespace lutb::cuda {
namespace {

/// GEMM1 and GEMM2 with CTA configuration C (sm80_lutb_moe_prefill.cuh); grouping made with C::kBM rows.
template <class C>
void launch_cfg(const kern::LutbW& w13, const kern::LutbW& w2, const kern::Routing& r, const detail::Workspace& ws,
                std::int64_t slots, std::int64_t I, std::int64_t H, std::int64_t Hp, std::int64_t Ip,
                cudaStream_t stream, const char* name1, const char* name2) {
  namespace pf = kern::prefill;
  // The dynamic shared memory (77-109 KB) needs the opt-in above 48 KB: once per device and
  // configuration (not a stream operation, so also fine when the first call is being captured).
  static bool smem_opt_in[64] = {};  // per template instantiation
  int dev = 0;
  detail::check(cudaGetDevice(&dev), "cudaGetDevice");
  if (dev >= 64 || !smem_opt_in[dev]) {
    detail::check(cudaFuncSetAttribute(pf::sm80_lutb_moe_prefill_gemm1<C>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                               C::kSmemBytes),
          "cudaFuncSetAttribute(prefill_gemm1)");
    detail::check(cudaFuncSetAttribute(pf::sm80_lutb_moe_prefill_gemm2<C>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                               C::kSmemBytes),
          "cudaFuncSetAttribute(prefill_gemm2)");
    if (dev < 64) smem_opt_in[dev] = true;
  }
  const dim3 g1(static_cast<unsigned>(Ip / 64), static_cast<unsigned>(slots));
  detail::launch_kernel(name1, true, pf::sm80_lutb_moe_prefill_gemm1<C>, g1, dim3(C::kThreads), C::kSmemBytes, stream, w13, ws.xa,
                static_cast<long long>(Hp), r, static_cast<long long>(I), static_cast<long long>(Ip), ws.hq);
  const dim3 g2(static_cast<unsigned>(detail::ceil_div(w2.tiles_n, pf::kStrips)), static_cast<unsigned>(slots));
  detail::launch_kernel(name2, true, pf::sm80_lutb_moe_prefill_gemm2<C>, g2, dim3(C::kThreads), C::kSmemBytes, stream, w2, ws.hq,
                static_cast<long long>(Ip), r, static_cast<long long>(H), ws.y);
}

/// GEMM1 and GEMM2 of the sm_90a wgmma tile (sm90_lutb_moe_prefill_wgmma.cuh, configuration C);
/// grouping made with C::kBM rows. xa -> BF16 a in place (as the mma.sync tile); h goes through ws.hq
/// as BF16.
template <class C>
void launch_w90(const kern::LutbW& w13, const kern::LutbW& w2, const kern::Routing& r, const detail::Workspace& ws,
                std::int64_t slots, std::int64_t T, std::int64_t I, std::int64_t H, std::int64_t Hp, std::int64_t Ip,
                cudaStream_t stream, const char* name1, const char* name2) {
  namespace p9 = kern::prefill90;
  if (!detail::sm90a_device())
    throw std::runtime_error(std::string("launch_lutb_prefill_gemms: ") + name1 + " (wgmma) needs an sm_90 device");
  static bool smem_opt_in[64] = {};  // per template instantiation
  int dev = 0;
  detail::check(cudaGetDevice(&dev), "cudaGetDevice");
  if (dev >= 64 || !smem_opt_in[dev]) {
    detail::check(cudaFuncSetAttribute(p9::sm90_lutb_moe_prefill_wgmma_gemm1<C>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       C::kSmemBytes),
                  "cudaFuncSetAttribute(wgmma_gemm1)");
    detail::check(cudaFuncSetAttribute(p9::sm90_lutb_moe_prefill_wgmma_gemm2<C>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       C::kSmemBytes),
                  "cudaFuncSetAttribute(wgmma_gemm2)");
    if (dev < 64) smem_opt_in[dev] = true;
  }
  const std::int64_t n8 = T * Hp / 8;
  const dim3 cg(static_cast<unsigned>(detail::ceil_div(n8, 256)));
  detail::launch_kernel("sm80_lutb_moe_prefill_xa_to_bf16", true, kern::prefill::sm80_lutb_moe_prefill_xa_to_bf16, cg,
                        dim3(256), 0, stream, ws.xa, ws.xs, static_cast<long long>(n8), static_cast<long long>(Hp));
  const auto* a = reinterpret_cast<const unsigned char*>(ws.xa);
  auto* h = reinterpret_cast<unsigned char*>(ws.hq);
  const dim3 g1(static_cast<unsigned>(Ip / 64), static_cast<unsigned>(slots));
  detail::launch_kernel(name1, true, p9::sm90_lutb_moe_prefill_wgmma_gemm1<C>, g1, dim3(C::kThreads), C::kSmemBytes, stream, w13,
                        a, static_cast<long long>(Hp), r, static_cast<long long>(I), static_cast<long long>(Ip), h);
  const dim3 g2(static_cast<unsigned>(detail::ceil_div(w2.tiles_n, kern::prefill::kStrips)), static_cast<unsigned>(slots));
  detail::launch_kernel(name2, true, p9::sm90_lutb_moe_prefill_wgmma_gemm2<C>, g2, dim3(C::kThreads), C::kSmemBytes, stream, w2,
                        static_cast<const unsigned char*>(h), static_cast<long long>(Ip), r, static_cast<long long>(H),
                        ws.y);
}

/// GEMM1 and GEMM2 of the sm_90a register-weight kernels (sm90_lutb_moe_prefill_rs.cuh, configuration
/// C); grouping made with C::kBN rows. xa -> BF16 a in rs_col order in place; h goes through ws.hq as
/// BF16 in rs_col order. Persistent grids of at most one CTA per SM.
template <class C>
void launch_rs(const kern::LutbW& w13, const kern::LutbW& w2, const kern::Routing& r, const detail::Workspace& ws,
               std::int64_t slots, std::int64_t T, std::int64_t I, std::int64_t H, std::int64_t Hp, std::int64_t Ip,
               cudaStream_t stream, const char* name1, const char* name2) {
  namespace rs = kern::prefill90rs;
  if (!detail::sm90a_device())
    throw std::runtime_error(std::string("launch_lutb_prefill_gemms: ") + name1 + " (wgmma) needs an sm_90 device");
  static bool smem_opt_in[64] = {};  // per template instantiation
  int dev = 0;
  detail::check(cudaGetDevice(&dev), "cudaGetDevice");
  if (dev >= 64 || !smem_opt_in[dev]) {
    detail::check(cudaFuncSetAttribute(rs::sm90_lutb_moe_prefill_rs_gemm1<C>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       C::kSmemBytes),
                  "cudaFuncSetAttribute(rs_gemm1)");
    detail::check(cudaFuncSetAttribute(rs::sm90_lutb_moe_prefill_rs_gemm2<C>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       C::kSmemBytes),
                  "cudaFuncSetAttribute(rs_gemm2)");
    // setmaxnreg moves registers between the roles inside what the launch allocated (CfgRs): a build
    // that gave the kernels another count would leave the consumers' setmaxnreg.inc waiting for ever.
    cudaFuncAttributes f1{}, f2{};
    detail::check(cudaFuncGetAttributes(&f1, rs::sm90_lutb_moe_prefill_rs_gemm1<C>), "cudaFuncGetAttributes(rs_gemm1)");
    detail::check(cudaFuncGetAttributes(&f2, rs::sm90_lutb_moe_prefill_rs_gemm2<C>), "cudaFuncGetAttributes(rs_gemm2)");
    if (f1.numRegs != C::kLaunchRegs || f2.numRegs != C::kLaunchRegs)
      throw std::runtime_error(std::string("launch_lutb_prefill_gemms: ") + name1 + " / " + name2 + " were built with " +
                               std::to_string(f1.numRegs) + " / " + std::to_string(f2.numRegs) +
                               " registers per thread; their setmaxnreg split needs " +
                               std::to_string(C::kLaunchRegs));
    if (dev < 64) smem_opt_in[dev] = true;
  }
  const std::int64_t sms = detail::moe_device().sms;
  const std::int64_t n64 = T * Hp / 64;
  detail::launch_kernel("sm90_lutb_moe_prefill_rs_xa_to_bf16", true, rs::sm90_lutb_moe_prefill_rs_xa_to_bf16,
                        dim3(static_cast<unsigned>(detail::ceil_div(n64, 256))), dim3(256), 0, stream, ws.xa, ws.xs,
                        static_cast<long long>(n64), static_cast<long long>(Hp));
  const auto* a = reinterpret_cast<const unsigned char*>(ws.xa);
  auto* h = reinterpret_cast<unsigned char*>(ws.hq);
  // Work items: token-tile slots (at most `slots`; the device count decides) x weight blocks.
  const std::int64_t items1 = slots * (Ip / 64), items2 = slots * detail::ceil_div(w2.tiles_n, 16);
  const dim3 g1(static_cast<unsigned>(std::max<std::int64_t>(1, std::min(sms, items1))));
  detail::launch_kernel(name1, true, rs::sm90_lutb_moe_prefill_rs_gemm1<C>, g1, dim3(C::kThreads), C::kSmemBytes, stream,
                        w13, a, static_cast<long long>(Hp), r, static_cast<long long>(I), static_cast<long long>(Ip), h);
  const dim3 g2(static_cast<unsigned>(std::max<std::int64_t>(1, std::min(sms, items2))));
  detail::launch_kernel(name2, true, rs::sm90_lutb_moe_prefill_rs_gemm2<C>, g2, dim3(C::kThreads), C::kSmemBytes, stream,
                        w2, static_cast<const unsigned char*>(h), static_cast<long long>(Ip), r,
                        static_cast<long long>(H), ws.y);
}

}  // namespace

namespace detail {

void launch_lutb_prefill_gemms(const DeviceMoeWeights& w, const kern::Routing& r, const Workspace& ws, std::int64_t P,
                               heuristics::PrefillKernel kernel, cudaStream_t stream) {
  namespace pf = kern::prefill;
  namespace p9 = kern::prefill90;
  const std::int64_t I = w.intermediate, H = w.hidden;
  const std::int64_t Hp = w.w13.shape.padded_cols(), Ip = w.w2.shape.padded_cols();
  const std::int64_t T = P / r.top_k;
  const std::int64_t slots = max_tiles(P, w.experts, heuristics::prefill_tile_rows(kernel));
  if (P <= 0) return;
  const kern::LutbW w13{w.w13.packed, w.w13.codebook, w.w13.scale, w.w13.shape.tiles_n(), w.w13.shape.tiles_k(),
                        w.w13.shape.tiles()};
  const kern::LutbW w2{w.w2.packed, w.w2.codebook, w.w2.scale, w.w2.shape.tiles_n(), w.w2.shape.tiles_k(),
                       w.w2.shape.tiles()};
  switch (kernel) {
    case heuristics::PrefillKernel::Sm90Wgmma64:
      launch_w90<p9::Cfg90Bf>(w13, w2, r, ws, slots, T, I, H, Hp, Ip, stream, "sm90_lutb_moe_prefill_wgmma_gemm1 (m64)",
                               "sm90_lutb_moe_prefill_wgmma_gemm2 (m64)");
      return;
    case heuristics::PrefillKernel::Sm90WgmmaRs64:
      launch_rs<kern::prefill90rs::CfgRs64>(w13, w2, r, ws, slots, T, I, H, Hp, Ip, stream,
                                            "sm90_lutb_moe_prefill_rs_gemm1 (n64)", "sm90_lutb_moe_prefill_rs_gemm2 (n64)");
      return;
    case heuristics::PrefillKernel::Sm90WgmmaRs128:
      launch_rs<kern::prefill90rs::CfgRs128>(w13, w2, r, ws, slots, T, I, H, Hp, Ip, stream,
                                             "sm90_lutb_moe_prefill_rs_gemm1 (n128)",
                                             "sm90_lutb_moe_prefill_rs_gemm2 (n128)");
      return;
    case heuristics::PrefillKernel::Sm80Mma64: {
      // a = mxfp8_qdq(x) as BF16, in place over xa.
      const std::int64_t n8 = T * Hp / 8;
      launch_kernel("sm80_lutb_moe_prefill_xa_to_bf16", true, pf::sm80_lutb_moe_prefill_xa_to_bf16,
                    dim3(static_cast<unsigned>(ceil_div(n8, 256))), dim3(256), 0, stream, ws.xa, ws.xs,
                    static_cast<long long>(n8), static_cast<long long>(Hp));
      launch_cfg<pf::Cfg64>(w13, w2, r, ws, slots, I, H, Hp, Ip, stream, "sm80_lutb_moe_prefill_gemm1",
                            "sm80_lutb_moe_prefill_gemm2");
      return;
    }
  }
}

}  // namespace detail
}  // namespace lutb::cuda
