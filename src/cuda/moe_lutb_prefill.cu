// src/cuda/moe_lutb_prefill.cu: launches of the large-batch (prefill) LUT-B GEMM path
// (moe_prefill.hpp) and a complete forward built on it (moe_forward_lutb_prefill). Kernel names
// follow the DeepGEMM habit: sm80_lutb_mxfp8_moe_{gemm1,gemm2}_prefill_bf16fold, and for the sm_90a
// wgmma tiles sm90_lutb_mxfp8_moe_{gemm1,gemm2}_prefill_wgmma_{fp8,bf16fold}[_s8|_s6|_tokfast|_ws].
#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <string>

#include "common.cuh"
#include "lutb/cuda/moe.hpp"
#include "moe_internal.hpp"
#include "moe_lutb_prefill.cuh"
#include "moe_lutb_prefill_sm90.cuh"
#include "moe_prefill.hpp"

namespace lutb::cuda {
namespace {

void check_stack(const DeviceLutb& d, std::int64_t E, std::int64_t N, std::int64_t K, const char* what) {
  const std::string w = std::string("moe_forward_lutb_prefill: ") + what;
  if (d.shape.experts != E || d.shape.rows != N || d.shape.cols != K)
    throw std::invalid_argument(w + " shape must be [" + std::to_string(E) + ", " + std::to_string(N) + ", " +
                                std::to_string(K) + "], got [" + std::to_string(d.shape.experts) + ", " +
                                std::to_string(d.shape.rows) + ", " + std::to_string(d.shape.cols) + "]");
  if (!d.packed || !d.codebook || !d.scale) throw std::invalid_argument(w + " has a null pointer");
  if (reinterpret_cast<std::uintptr_t>(d.packed) % 16 || reinterpret_cast<std::uintptr_t>(d.codebook) % 8)
    throw std::invalid_argument(w + " packed must be 16-byte and codebook 8-byte aligned");
  if (!d.lane_major)
    throw std::invalid_argument(w + " is in checkpoint index order; convert it once with lutb::cuda::to_lane_major");
}

}  // namespace

namespace {

/// GEMM1 and GEMM2 with CTA configuration C (moe_lutb_prefill.cuh); grouping made with C::kBM rows.
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
    detail::check(cudaFuncSetAttribute(pf::prefill_gemm1_kernel<C>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                               C::kSmemBytes),
          "cudaFuncSetAttribute(prefill_gemm1)");
    detail::check(cudaFuncSetAttribute(pf::prefill_gemm2_kernel<C>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                               C::kSmemBytes),
          "cudaFuncSetAttribute(prefill_gemm2)");
    if (dev < 64) smem_opt_in[dev] = true;
  }
  const dim3 g1(static_cast<unsigned>(Ip / 64), static_cast<unsigned>(slots));
  detail::launch_kernel(name1, true, pf::prefill_gemm1_kernel<C>, g1, dim3(C::kThreads), C::kSmemBytes, stream, w13, ws.xa,
                static_cast<long long>(Hp), r, static_cast<long long>(I), static_cast<long long>(Ip), ws.hq);
  const dim3 g2(static_cast<unsigned>(detail::ceil_div(w2.tiles_n, pf::kStrips)), static_cast<unsigned>(slots));
  detail::launch_kernel(name2, true, pf::prefill_gemm2_kernel<C>, g2, dim3(C::kThreads), C::kSmemBytes, stream, w2, ws.hq,
                static_cast<long long>(Ip), r, static_cast<long long>(H), ws.y);
}

PrefillTile g_tile = PrefillTile::Auto;

/// True when the current device is sm_90 (the W64 kernels are built for sm_90a only).
bool device_is_sm90() {
  static int cc[64] = {};
  int dev = 0;
  detail::check(cudaGetDevice(&dev), "cudaGetDevice");
  int c = dev < 64 ? cc[dev] : 0;
  if (c == 0) {
    int major = 0, minor = 0;
    detail::check(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev), "cudaDeviceGetAttribute");
    detail::check(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev), "cudaDeviceGetAttribute");
    c = 10 * major + minor;
    if (dev < 64) cc[dev] = c;
  }
  return c == 90;
}

/// GEMM1 and GEMM2 of the sm_90a wgmma tiles (moe_lutb_prefill_sm90.cuh, configuration C); grouping
/// made with C::kBM rows (64; WB128: 128). FP8 (W64): first converts xa/xs (quantize_x's FP16 E4M3 values and UE8M0
/// scales) to E4M3 bytes (ws.xq8) and FP32 scales (ws.xsf); h goes through ws.hq8 / ws.hsf.
/// BF16 (WB64): xa -> BF16 a in place (as M64); h goes through ws.hq as BF16.
template <class C>
void launch_w90(const kern::LutbW& w13, const kern::LutbW& w2, const kern::Routing& r, const detail::Workspace& ws,
                std::int64_t slots, std::int64_t T, std::int64_t I, std::int64_t H, std::int64_t Hp, std::int64_t Ip,
                cudaStream_t stream, const char* name1, const char* name2) {
  namespace p9 = kern::prefill90;
  if (!device_is_sm90())
    throw std::runtime_error(std::string("launch_lutb_prefill_gemms: ") + name1 + " (wgmma) needs an sm_90 device");
  static bool smem_opt_in[64] = {};  // per template instantiation
  int dev = 0;
  detail::check(cudaGetDevice(&dev), "cudaGetDevice");
  if (dev >= 64 || !smem_opt_in[dev]) {
    detail::check(cudaFuncSetAttribute(p9::wgmma_gemm1_kernel<C>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       C::kSmemBytes),
                  "cudaFuncSetAttribute(wgmma_gemm1)");
    detail::check(cudaFuncSetAttribute(p9::wgmma_gemm2_kernel<C>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       C::kSmemBytes),
                  "cudaFuncSetAttribute(wgmma_gemm2)");
    if (dev < 64) smem_opt_in[dev] = true;
  }
  const std::int64_t n8 = T * Hp / 8;
  const dim3 cg(static_cast<unsigned>(detail::ceil_div(n8, 256)));
  unsigned char *a, *h;
  float *asf = nullptr, *hsf = nullptr;
  if constexpr (C::kBf16) {
    detail::launch_kernel("sm80_lutb_moe_prefill_xa_to_bf16", true, kern::prefill::xa_to_bf16_kernel, cg, dim3(256), 0,
                          stream, ws.xa, ws.xs, static_cast<long long>(n8), static_cast<long long>(Hp));
    a = reinterpret_cast<unsigned char*>(ws.xa);
    h = reinterpret_cast<unsigned char*>(ws.hq);
  } else {
    detail::launch_kernel("sm90_lutb_moe_prefill_xa_to_fp8", true, p9::xa_to_fp8_kernel, cg, dim3(256), 0, stream,
                          ws.xa, ws.xs, ws.xq8, ws.xsf, static_cast<long long>(n8));
    a = ws.xq8;
    h = ws.hq8;
    asf = ws.xsf;
    hsf = ws.hsf;
  }
  auto grid = [&](std::int64_t nblocks) {
    return C::kTokFast ? dim3(static_cast<unsigned>(slots), static_cast<unsigned>(nblocks))
                       : dim3(static_cast<unsigned>(nblocks), static_cast<unsigned>(slots));
  };
  const dim3 g1 = grid(Ip / 64);
  detail::launch_kernel(name1, true, p9::wgmma_gemm1_kernel<C>, g1, dim3(C::kThreads), C::kSmemBytes, stream, w13,
                        static_cast<const unsigned char*>(a), static_cast<const float*>(asf),
                        static_cast<long long>(Hp), r, static_cast<long long>(I), static_cast<long long>(Ip), h, hsf);
  const dim3 g2 = grid(detail::ceil_div(w2.tiles_n, kern::prefill::kStrips));
  detail::launch_kernel(name2, true, p9::wgmma_gemm2_kernel<C>, g2, dim3(C::kThreads), C::kSmemBytes, stream, w2,
                        static_cast<const unsigned char*>(h), static_cast<const float*>(hsf),
                        static_cast<long long>(Ip), r, static_cast<long long>(H), ws.y);
}

/// The warp-specialised BF16-fold tile (WS64, moe_lutb_prefill_sm90.cuh CfgWS); grouping made with 64 rows.
void launch_ws(const kern::LutbW& w13, const kern::LutbW& w2, const kern::Routing& r, const detail::Workspace& ws,
               std::int64_t slots, std::int64_t T, std::int64_t I, std::int64_t H, std::int64_t Hp, std::int64_t Ip,
               cudaStream_t stream) {
  namespace p9 = kern::prefill90;
  if (!device_is_sm90())
    throw std::runtime_error("launch_lutb_prefill_gemms: PrefillTile::WS64 (wgmma) needs an sm_90 device");
  static bool smem_opt_in[64] = {};
  int dev = 0;
  detail::check(cudaGetDevice(&dev), "cudaGetDevice");
  if (dev >= 64 || !smem_opt_in[dev]) {
    detail::check(cudaFuncSetAttribute(p9::ws_gemm1_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       p9::CfgWS::kSmemBytes),
                  "cudaFuncSetAttribute(ws_gemm1)");
    detail::check(cudaFuncSetAttribute(p9::ws_gemm2_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       p9::CfgWS::kSmemBytes),
                  "cudaFuncSetAttribute(ws_gemm2)");
    if (dev < 64) smem_opt_in[dev] = true;
  }
  const std::int64_t n8 = T * Hp / 8;
  detail::launch_kernel("sm80_lutb_moe_prefill_xa_to_bf16", true, kern::prefill::xa_to_bf16_kernel,
                        dim3(static_cast<unsigned>(detail::ceil_div(n8, 256))), dim3(256), 0, stream, ws.xa, ws.xs,
                        static_cast<long long>(n8), static_cast<long long>(Hp));
  const unsigned char* a = reinterpret_cast<const unsigned char*>(ws.xa);
  unsigned char* h = reinterpret_cast<unsigned char*>(ws.hq);
  detail::launch_kernel("sm90_lutb_mxfp8_moe_gemm1_prefill_wgmma_bf16fold_ws", true, p9::ws_gemm1_kernel,
                        dim3(static_cast<unsigned>(Ip / 64), static_cast<unsigned>(slots)),
                        dim3(p9::CfgWS::kThreads), p9::CfgWS::kSmemBytes, stream, w13, a, static_cast<long long>(Hp),
                        r, static_cast<long long>(I), static_cast<long long>(Ip), h);
  detail::launch_kernel("sm90_lutb_mxfp8_moe_gemm2_prefill_wgmma_bf16fold_ws", true, p9::ws_gemm2_kernel,
                        dim3(static_cast<unsigned>(detail::ceil_div(w2.tiles_n, kern::prefill::kStrips)),
                             static_cast<unsigned>(slots)),
                        dim3(p9::CfgWS::kThreads), p9::CfgWS::kSmemBytes, stream, w2,
                        static_cast<const unsigned char*>(h), static_cast<long long>(Ip), r, static_cast<long long>(H),
                        ws.y);
}

}  // namespace

void set_prefill_tile(PrefillTile t) { g_tile = t; }

PrefillTile prefill_tile_for(std::int64_t pairs, std::int64_t experts, bool sm90) {
  const std::int64_t touched = std::max<std::int64_t>(1, std::min(pairs, experts));
  if (kPrefillTile128MinPairs > 0 && pairs >= kPrefillTile128MinPairs * touched) return PrefillTile::M128;
  if (!sm90) return PrefillTile::M64;
  if (kPrefillWb128MinPairs > 0 && pairs >= kPrefillWb128MinPairs * touched) return PrefillTile::WB128;
  return PrefillTile::WB64;
}

PrefillTile prefill_tile(std::int64_t pairs, std::int64_t experts) {
  if (g_tile != PrefillTile::Auto) return g_tile;
  return prefill_tile_for(pairs, experts, device_is_sm90());
}

int prefill_tile_rows(PrefillTile t) {
  return t == PrefillTile::M128 || t == PrefillTile::M128W || t == PrefillTile::WB128 ||
                 t == PrefillTile::WB128P
             ? 128
             : 64;
}

namespace detail {

void launch_lutb_prefill_gemms(const DeviceMoeWeights& w, const kern::Routing& r, const Workspace& ws, std::int64_t P,
                               PrefillTile tile, cudaStream_t stream) {
  namespace pf = kern::prefill;
  const std::int64_t I = w.intermediate, H = w.hidden;
  const std::int64_t Hp = w.w13.shape.padded_cols(), Ip = w.w2.shape.padded_cols();
  const std::int64_t T = P / r.top_k;
  if (tile == PrefillTile::Auto) throw std::invalid_argument("launch_lutb_prefill_gemms: resolve the tile first");
  const std::int64_t slots = max_tiles(P, w.experts, prefill_tile_rows(tile));
  if (P <= 0) return;
  const kern::LutbW w13{w.w13.packed, w.w13.codebook, w.w13.scale, w.w13.shape.tiles_n(), w.w13.shape.tiles_k(),
                        w.w13.shape.tiles()};
  const kern::LutbW w2{w.w2.packed, w.w2.codebook, w.w2.scale, w.w2.shape.tiles_n(), w.w2.shape.tiles_k(),
                       w.w2.shape.tiles()};
  if (tile == PrefillTile::W64) {
    launch_w90<kern::prefill90::Cfg90F8>(w13, w2, r, ws, slots, T, I, H, Hp, Ip, stream,
                                          "sm90_lutb_mxfp8_moe_gemm1_prefill_wgmma_fp8",
                                          "sm90_lutb_mxfp8_moe_gemm2_prefill_wgmma_fp8");
    return;
  }
  if (tile == PrefillTile::W64D) {
    launch_w90<kern::prefill90::Cfg90F8D>(w13, w2, r, ws, slots, T, I, H, Hp, Ip, stream,
                                           "sm90_lutb_mxfp8_moe_gemm1_prefill_wgmma_fp8_s8",
                                           "sm90_lutb_mxfp8_moe_gemm2_prefill_wgmma_fp8_s8");
    return;
  }
  if (tile == PrefillTile::WB64) {
    launch_w90<kern::prefill90::Cfg90Bf>(w13, w2, r, ws, slots, T, I, H, Hp, Ip, stream,
                                          "sm90_lutb_mxfp8_moe_gemm1_prefill_wgmma_bf16fold",
                                          "sm90_lutb_mxfp8_moe_gemm2_prefill_wgmma_bf16fold");
    return;
  }
  if (tile == PrefillTile::WB128) {
    launch_w90<kern::prefill90::Cfg90Bf128>(w13, w2, r, ws, slots, T, I, H, Hp, Ip, stream,
                                             "sm90_lutb_mxfp8_moe_gemm1_prefill_wgmma_bf16fold_m128",
                                             "sm90_lutb_mxfp8_moe_gemm2_prefill_wgmma_bf16fold_m128");
    return;
  }
  if (tile == PrefillTile::WB128P) {
    launch_w90<kern::prefill90::Cfg90Bf128P>(w13, w2, r, ws, slots, T, I, H, Hp, Ip, stream,
                                              "sm90_lutb_mxfp8_moe_gemm1_prefill_wgmma_bf16fold_m128_pipe",
                                              "sm90_lutb_mxfp8_moe_gemm2_prefill_wgmma_bf16fold_m128_pipe");
    return;
  }
  if (tile == PrefillTile::WS64) {
    launch_ws(w13, w2, r, ws, slots, T, I, H, Hp, Ip, stream);
    return;
  }
  if (tile == PrefillTile::WB64T) {
    launch_w90<kern::prefill90::Cfg90BfT>(w13, w2, r, ws, slots, T, I, H, Hp, Ip, stream,
                                           "sm90_lutb_mxfp8_moe_gemm1_prefill_wgmma_bf16fold_tokfast",
                                           "sm90_lutb_mxfp8_moe_gemm2_prefill_wgmma_bf16fold_tokfast");
    return;
  }
  if (tile == PrefillTile::WB64D) {
    launch_w90<kern::prefill90::Cfg90BfD>(w13, w2, r, ws, slots, T, I, H, Hp, Ip, stream,
                                           "sm90_lutb_mxfp8_moe_gemm1_prefill_wgmma_bf16fold_s6",
                                           "sm90_lutb_mxfp8_moe_gemm2_prefill_wgmma_bf16fold_s6");
    return;
  }
  // a = mxfp8_qdq(x) as BF16, in place over xa.
  const std::int64_t n8 = T * Hp / 8;
  launch_kernel("sm80_lutb_moe_prefill_xa_to_bf16", true, pf::xa_to_bf16_kernel,
                dim3(static_cast<unsigned>(ceil_div(n8, 256))), dim3(256), 0, stream, ws.xa, ws.xs,
                static_cast<long long>(n8), static_cast<long long>(Hp));

  switch (tile) {
    case PrefillTile::M64:
      launch_cfg<pf::Cfg64>(w13, w2, r, ws, slots, I, H, Hp, Ip, stream, "sm80_lutb_mxfp8_moe_gemm1_prefill_bf16fold",
                            "sm80_lutb_mxfp8_moe_gemm2_prefill_bf16fold");
      break;
    case PrefillTile::M64IL:
      launch_cfg<pf::Cfg64IL>(w13, w2, r, ws, slots, I, H, Hp, Ip, stream,
                              "sm80_lutb_mxfp8_moe_gemm1_prefill_bf16fold_il",
                              "sm80_lutb_mxfp8_moe_gemm2_prefill_bf16fold_il");
      break;
    case PrefillTile::M128W:
      launch_cfg<pf::Cfg128W>(w13, w2, r, ws, slots, I, H, Hp, Ip, stream,
                              "sm80_lutb_mxfp8_moe_gemm1_prefill_bf16fold_m128w",
                              "sm80_lutb_mxfp8_moe_gemm2_prefill_bf16fold_m128w");
      break;
    default:
      launch_cfg<pf::Cfg128>(w13, w2, r, ws, slots, I, H, Hp, Ip, stream,
                             "sm80_lutb_mxfp8_moe_gemm1_prefill_bf16fold_m128",
                             "sm80_lutb_mxfp8_moe_gemm2_prefill_bf16fold_m128");
      break;
  }
}

}  // namespace detail

void moe_forward_lutb_prefill(const DeviceMoeWeights& w, const std::uint16_t* x, std::int64_t tokens, int top_k,
                              const std::int32_t* topk_ids, const float* topk_weights, std::uint16_t* out,
                              void* workspace, std::size_t workspace_bytes, cudaStream_t stream) {
  const std::int64_t E = w.experts, H = w.hidden, I = w.intermediate;
  if (E < 1 || E > 1024) throw std::invalid_argument("moe_forward_lutb_prefill: experts must be 1..1024");
  if (H < 1 || I < 8 || I % 8 != 0)
    throw std::invalid_argument("moe_forward_lutb_prefill: need H >= 1 and I a positive multiple of 8");
  if (top_k < 1 || top_k > 32) throw std::invalid_argument("moe_forward_lutb_prefill: top_k must be 1..32");
  if (tokens < 0 || tokens > 65535)
    throw std::invalid_argument("moe_forward_lutb_prefill: tokens must be 0..65535 per call");
  check_stack(w.w13, E, 2 * I, H, "w13");
  check_stack(w.w2, E, H, I, "w2");
  if (tokens == 0) return;
  const detail::Workspace ws = detail::carve(workspace, tokens, top_k, E, H, I);
  if (workspace_bytes < ws.bytes)
    throw std::invalid_argument("moe_forward_lutb_prefill: workspace of " + std::to_string(workspace_bytes) +
                                " bytes, need " + std::to_string(ws.bytes));
  const std::int64_t P = tokens * top_k;
  const PrefillTile tile = prefill_tile(P, E);
  detail::launch_group(topk_ids, P, E, prefill_tile_rows(tile), ws, stream);
  detail::launch_quantize_x(x, tokens, H, w.w13.shape.padded_cols(), /*swap=*/false, ws.xa, nullptr, ws.xs, nullptr,
                            stream);
  const kern::Routing r{topk_ids, topk_weights, ws.sorted, ws.tile_expert, ws.tile_start, ws.tile_count, ws.num_tiles,
                        top_k};
  detail::launch_lutb_prefill_gemms(w, r, ws, P, tile, stream);
  detail::launch_reduce(topk_ids, topk_weights, ws.y, tokens, top_k, E, H, out, stream);
}

}  // namespace lutb::cuda
