// src/cuda/moe_prefill.hpp: the large-batch (prefill) LUT-B GEMM path of the fused MoE forward.
//
// What it is: GEMM1 (+ SiLU*up + MXFP8 of h) and GEMM2 of spec section 4 as CTA-tiled BF16
// tensor-core GEMMs (mma.sync.m16n8k16, FP32 accumulators, ldmatrix from swizzled shared memory);
// on sm_90 wgmma variants (moe_lutb_prefill_sm90.cuh, PrefillTile W*), the default there: WB64,
// and WB128 from kPrefillWb128MinPairs pairs per touched expert (prefill_tile_for).
// A CTA owns 64 or 128 token rows of one expert (one token tile of the grouping; PrefillTile) x 128
// weight rows; every LUT-B tile it needs is decoded ONCE per CTA into shared memory and then feeds
// all of its tokens.
//
// Numerics (spec section 4, exact): both power-of-two scales are folded into BF16 operands.
//   weights:     BF16(e4m3(codebook[i]) * 2^(s-127)), exact for every scale byte 3..246 (spec 2:
//                fitters write only those); the 8 scaled entries of a tile are computed once per
//                tile and looked up by PRMT (lo/hi byte tables), so decoding is ~1.5 integer ops
//                per weight and no per-block FP32 rescaling is left in the K loop.
//   activations: BF16(e4m3 * 2^(b-127)) = mxfp8_qdq(x) as BF16: exact for every block scale
//                b = 10..254 (BF16 has FP32's exponent range; an E4M3 value has 4 significant bits).
//                b = 0..9 (a 32-value block whose amax is below ~1.3e-33) would need BF16
//                subnormals below 2^-133 and is rounded there (|error| < 2^-134 per element); no
//                activation of a real model is that small, but the claim is "exact for b >= 10".
//   The tensor cores then sum exact products; because they truncate while accumulating, each
//   128-column partial sum is added to FP32 registers with round-to-nearest adds ("promotion";
//   without it the DeepSeek-V3 shape was 2.2e-3 rel. L2 from the reference, with it 4.3e-5). The
//   result equals the CPU emulation up to the order (and tensor-core rounding) of the FP32
//   additions, as the decode path's does.
//
// Weights must be resident in LANE-MAJOR order (lutb/cuda/lane_major.hpp: tile_to_lane_major /
// to_lane_major, DeviceLutb::lane_major set); codebooks and scales as in the checkpoint.
#pragma once

#include <cstddef>
#include <cstdint>

#include "lutb/cuda/moe.hpp"

namespace lutb::cuda {

/// CTA token tile of the prefill GEMMs (src/cuda/moe_lutb_prefill.cuh, Cfg*). The grouping must be
/// made with prefill_tile_rows(tile) rows per token tile.
///   M64:   the session-10 kernel and the heuristic's choice at every size on devices other than
///          sm_90: 64 token rows, 8 warps (warp tile 32 x 32), 2 CTAs per SM, each K-tile's weights
///          decoded before its mma steps;
///   M64IL: the same tile with the decode of the next K-tile interleaved between the mma steps
///          (kept for A/B measurements: 3-5 % slower, session 12);
///   M128:  128 token rows, 16 warps (warp tile 32 x 32), 1 CTA per SM, decode interleaved: every
///          decoded weight tile feeds 128 tokens (half the decode work per FLOP);
///   M128W: 128 token rows, 8 warps (warp tile 64 x 32), 1 CTA per SM, decode interleaved.
///   W64:   sm_90a only (session 13, moe_lutb_prefill_sm90.cuh): 64 token rows x 128 weight rows,
///          2 warpgroups issuing FP8 wgmma (m64n64k32 .e4m3) on E4M3 operands (the decode is a pure
///          codebook byte lookup), each 32-column MXFP8 block's partial sum promoted to FP32 with the
///          block and tile scales (per-32 promotion). Throws std::runtime_error on other devices.
///          EXPERIMENTAL, NOT within the tests' error bounds: Hopper's FP8 tensor core rounds inside
///          the 32-product sum (measured rel. L2 1.2e-3..4.2e-3 to the reference, 65-96 % bit-equal
///          BF16 outputs, docs/perf/moe-gpu-prefill.md session 13); 1-9 % faster than M64 on the
///          H200; never chosen by the heuristic.
///   WB64:  sm_90a only (session 13): the same CTA and pipeline with BF16 operands (both scales folded
///          in, exact, as M64) and BF16 wgmma (m64n64k16), promotion every 2 K-tiles as M64. THE
///          HEURISTIC'S CHOICE ON sm_90 devices below 320 pairs per touched expert (helper pf13b): with its operands in the 128B-swizzle
///          layout (no shared-memory bank conflicts) it is 1.18-1.26x M64's throughput on the H200 on
///          all four model shapes at T = 1024 and 4096, with output bit-identical to M64 (asserted by
///          the prefill tests; docs/perf/moe-gpu-prefill.md, session 13, pf13b).
///   W64D, WB64D: W64 / WB64 with a deeper cp.async ring (8 / 6 K-tiles instead of 4).
///   The other BF16-fold wgmma tiles (WB64D, WB64T, WS64) are also bit-identical to M64; WB64T is
///   within 1 % of WB64; WB64D takes 1-2 % and WS64 13-16 % longer than WB64 (pf13b run 1).
///   WB64T: WB64 with the grid transposed (token tiles along x): CTAs running together share weights.
///   WS64:  sm_90a only: WB64's tile and numerics, warp-specialised (a producer warpgroup copies and
///          decodes 4 K-tiles ahead into a 6-deep ring, two consumer warpgroups only wait on mbarriers
///          and issue wgmma; no CTA-wide barrier in the K loop).
/// M64IL, M128 and M128W were slower than M64 on the H200 (docs/perf/moe-gpu-prefill.md, session
/// 12) and are kept, tested, for the next attempts (set_prefill_tile).
///   WB128: sm_90a only (session 14, helper pf14): WB64's numerics (bit-identical to M64) with 128 token
///          rows per CTA: 512 threads = 4 warpgroups (2 along tokens x 2 along weight rows, each
///          m64n64), all fed by ONE decoded B tile per K-step, the decode split over all 16 warps
///          (one strip each): half WB64's decode work per FLOP; 112.5 KB shared memory, 1 CTA per SM.
///          THE HEURISTIC'S CHOICE ON sm_90 FROM kPrefillWb128MinPairs (320) PAIRS PER TOUCHED
///          EXPERT: 1.00-1.12x WB64 there, 0.59-0.95x below 256 (1 CTA per SM: the K-step barrier
///          drains the tensor cores, and small experts leave 128-row tiles half empty).
///   WB128P: WB128 with each K-tile pair's first wgmma group left in flight across the next barrier
///          (5-stage ring, 3 B buffers, 148.5 KB); selectable only.
enum class PrefillTile { Auto, M64, M64IL, M128, M128W, W64, WB64, W64D, WB64D, WB64T, WS64, WB128, WB128P };

/// M128 from this many (token, expert) pairs per touched expert on average (prefill_tile); 0: never.
/// 0 since the H200 runs of 2026-11-30 (docs/perf/moe-gpu-prefill.md, session 12): M128 and M128W
/// were 0-47 % slower than M64 on all four model shapes at T = 1024 and 4096.
inline constexpr std::int64_t kPrefillTile128MinPairs = 0;

/// On sm_90: WB128 instead of WB64 from this many (token, expert) pairs per touched expert on
/// average (prefill_tile_for); 0: never. Measured on the H200 (pf14 run 1, 2026-11-30,
/// docs/perf/moe-gpu-prefill.md "Session 14"), WB128 / WB64 throughput by pairs per touched expert:
///   32: 0.59x (DeepSeek-V3, T = 1024); 64: 0.83x (both Qwen3, T = 1024); 128: 0.95x (DeepSeek-V3,
///   T = 4096); 256: 1.01x, 0.98x, 1.04x (Qwen3-235B, Qwen3-30B T = 4096; Mixtral T = 1024);
///   512: 1.06x (DeepSeek-V3, T = 16384); 1024: 1.07x, 1.02x, 1.10x (both Qwen3 T = 16384, Mixtral
///   T = 4096); 4096: 1.12x (Mixtral, T = 16384).
/// Session 15 measured the gap between 256 and 512 (device run rules15-run1, 2026-11-30, WB128 / WB64
/// in the same process, docs/perf/moe-gpu-prefill.md "Session 15"): 192: 0.95x (Qwen3-30B), 1.01x
/// (Mixtral); 256: 0.98x, 1.01x, 1.02x (Qwen3-30B, Mixtral, DeepSeek-V3); 320: 1.00x (0.998),
/// 1.05x; 384: 1.00x, 1.06x, 1.04x; 448: 1.01x, 1.05x; 512: 1.02x, 1.07x, 1.06x.
/// So from 320: the smallest count where WB128 is at least even on every shape measured there.
inline constexpr std::int64_t kPrefillWb128MinPairs = 320;

/// The tile the prefill path uses for `pairs` = T*k pairs over `experts` experts: the value forced by
/// set_prefill_tile (benchmarks' A/B), else prefill_tile_for(pairs, experts, the current device is
/// sm_90). Never Auto. Queries the current device (cached) unless a tile is forced.
PrefillTile prefill_tile(std::int64_t pairs, std::int64_t experts);
/// The heuristic itself (host only, no device query): M128 when kPrefillTile128MinPairs > 0 and the
/// mean number of pairs per touched expert, pairs / min(E, pairs), is at least that; else on sm_90
/// (the wgmma kernels are built for sm_90a only) WB128 when kPrefillWb128MinPairs > 0 and that mean
/// is at least kPrefillWb128MinPairs, else WB64; M64 on every other device.
PrefillTile prefill_tile_for(std::int64_t pairs, std::int64_t experts, bool sm90);
/// Token rows per CTA (= the grouping's tile rows) of a resolved tile (M64*, W64*, WB64*: 64; M128*: 128).
int prefill_tile_rows(PrefillTile t);
/// Forces the prefill tile for every later call in this process (Auto: the heuristic again).
/// For benchmarks and tests; not thread-safe against concurrent forwards.
void set_prefill_tile(PrefillTile t);

/// Heuristic for the dispatcher: true when the prefill GEMMs are expected to beat the swap-AB
/// decode kernels, i.e. when the mean number of (token, expert) pairs per touched expert,
/// T*k / min(E, T*k), is at least kPrefillMinTokensPerExpert (36, the mma.sync tile M64: the
/// crossover lies between 32 and 40 on every benchmark shape) or, with wgmma_prefill (the sm_90a
/// wgmma tiles), kPrefillMinTokensPerExpertWgmma (28: between 24 and 32); the measurements are
/// beside them in lutb/cuda/moe.hpp. The dispatcher's rule is choose_strategy; this is the same
/// rule, kept for the prefill tests.
inline bool prefer_lutb_prefill(std::int64_t tokens, int top_k, std::int64_t experts, bool wgmma_prefill = false) {
  return tokens > 0 && choose_strategy(tokens, top_k, experts, true, wgmma_prefill) == MoeStrategy::Prefill;
}

/// A complete MoE forward (same contract, arguments and workspace rule as moe_forward in
/// lutb/cuda/moe.hpp) that runs the prefill GEMMs at any batch: MXFP8 of x (natural column order),
/// grouping into token tiles of prefill_tile_rows(prefill_tile(T*k, E)) rows, launch_lutb_prefill_gemms,
/// weighted top-k reduction.
/// Weights in lane-major order. No host synchronisation (CUDA-graph friendly).
/// Throws std::invalid_argument on bad arguments (before any launch).
void moe_forward_lutb_prefill(const DeviceMoeWeights& w, const std::uint16_t* x, std::int64_t tokens, int top_k,
                              const std::int32_t* topk_ids, const float* topk_weights, std::uint16_t* out,
                              void* workspace, std::size_t workspace_bytes, cudaStream_t stream);

}  // namespace lutb::cuda

#ifdef __CUDACC__
#include "moe_internal.hpp"

namespace lutb::cuda::detail {

/// The prefill GEMMs on the workspace of the existing forward (moe_internal.hpp), for the
/// dispatcher. Preconditions (the caller's steps before it):
///   - ws.xa/ws.xs: launch_quantize_x(x, T, H, Hp, /*swap=*/false, ...) (natural column order);
///   - tile = prefill_tile(P, E) (or any resolved tile, not Auto);
///   - ws.sorted/tile_*: launch_group(ids, P, E, prefill_tile_rows(tile), ws, stream);
///   - r: the Routing over that grouping (r.top_k = k), P = T * k.
/// Effects: ws.xa is converted IN PLACE to BF16 a = mxfp8_qdq(x) (xa is not read afterwards by
/// anything else); ws.hq receives h = mxfp8_qdq(bf16(silu(g)*u)) as BF16 [P, Ip] (ws.hs unused);
/// ws.y receives y [P, H] FP32 for every valid pair. Then launch_reduce as usual.
void launch_lutb_prefill_gemms(const DeviceMoeWeights& w, const kern::Routing& r, const Workspace& ws, std::int64_t P,
                               PrefillTile tile, cudaStream_t stream);

}  // namespace lutb::cuda::detail
#endif
