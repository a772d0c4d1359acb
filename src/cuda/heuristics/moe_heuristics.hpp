// src/cuda/heuristics/moe_heuristics.hpp: the only place that chooses the GPU MoE forward's kernels,
// tiles and splits (private; host only, no device query: the caller passes what it knows of the
// device). Each rule has one line of reason; the measurements behind every crossover live in
// docs/perf/moe-gpu.md and docs/perf/moe-gpu-prefill.md, the phases in docs/design/cuda-moe.md.
// None of these choices changes a result beyond the order of FP32 additions (most are bit-identical).
// docs/design/cuda-moe.md#heuristics has one row per rule with its figure and the perf page section.
#pragma once

#include <cstdint>

#include "lutb/cuda/moe.hpp"

namespace lutb::cuda::heuristics {

// --- strategy --------------------------------------------------------------------------------

/// Prefill from 36 tokens per touched expert with the sm_80 mma.sync tile: swap-AB decode won at 32,
/// prefill at 40 on all four benchmark shapes (docs/design/cuda-moe.md#heuristics).
inline constexpr double kPrefillMinTokensPerExpert = 36.0;
/// ... and from 28 with the sm_90a wgmma tile: decode won at 24, prefill at 32 (same section).
inline constexpr double kPrefillMinTokensPerExpertWgmma = 28.0;
/// The BF16 baseline: its 4-m16-tile kernel from 48 tokens per touched expert.
inline constexpr double kBf16PrefillMinTokensPerExpert = 48.0;

/// Mean tokens per touched expert, T k / min(E, T k) (0 when nothing is routed).
double tokens_per_expert(std::int64_t tokens, int top_k, std::int64_t experts);

/// Decode or Prefill (never Auto): packed = LUT-B weights, wgmma_prefill = the prefill would run
/// the sm_90a wgmma tile.
MoeStrategy choose_strategy(std::int64_t tokens, int top_k, std::int64_t experts, bool packed = true,
                            bool wgmma_prefill = false);

// --- swap-AB decode --------------------------------------------------------------------------

/// One 8-token block per tile up to 10 tokens per touched expert, two above: one block won at 8,
/// two at 12 (docs/design/cuda-moe.md#heuristics).
inline constexpr double kSwapOneBlockMaxTokensPerExpert = 10.0;
int decode_token_blocks(std::int64_t tokens, int top_k, std::int64_t experts);

/// Direct (ungrouped) forward: every pair its own one-token tile, no grouping kernel. T = 1 always;
/// else up to 4 tokens and 1.10 expected pairs per touched expert under uniform routing: direct won
/// at 1.099 and T <= 4, lost at 1.117 and at T = 6, 7 (docs/design/cuda-moe.md#heuristics).
inline constexpr double kDirectMaxPairsPerExpert = 1.10;
inline constexpr std::int64_t kDirectMaxTokens = 4;
bool decode_direct(std::int64_t tokens, int top_k, std::int64_t experts);

/// Top-k reduction fused into GEMM2 (clusters of k CTAs, sm_90a, direct forwards, k <= 8) when
/// GEMM2 has at most 2 CTAs per SM: faster at 128-256 CTAs, slower at 512-1024
/// (docs/design/cuda-moe.md#heuristics).
bool decode_fuse_reduce(std::int64_t gemm2_ctas, int top_k, int sms);

/// Warps per swap-AB CTA (they split K): from 2, doubled up to 8 while ctas x warps < 132 x 12 and
/// every warp keeps >= 4 K-tiles; 16 when ctas <= 132 and tiles_k >= 64; with `one_wave`, no
/// doubling that turns a grid resident at once into two waves. resident[i]: CTAs of 2^i warps one
/// SM holds (docs/design/cuda-moe.md#heuristics). 1 when tiles_k < 4.
int decode_swap_warps(std::int64_t ctas, std::int64_t tiles_k, int most, int sms, const int (&resident)[5],
                      bool one_wave);

/// Split-K of GEMM1 across 2 cluster CTAs of half the warps when that shortens the busiest SM's
/// share of a one-wave grid (warps >= 4, >= 4 K-tiles per warp, split grid resident at once):
/// 0.6-1.3 us faster where it fires, slower on balanced grids (docs/design/cuda-moe.md#heuristics).
struct DecodeSplit {
  int ksplit = 1;
  int warps = 1;
};
DecodeSplit decode_k_split(std::int64_t ctas, std::int64_t tiles_k, int warps, int sms);

/// Late tile scales in the K-loop (Cvt decoder; bit-identical) for two token blocks or H <= 2048:
/// faster on Qwen3-30B and two-block rows, not on H >= 4096 (docs/design/cuda-moe.md#heuristics).
inline constexpr std::int64_t kLateScalesMaxHidden = 2048;
bool decode_late_scales(std::int64_t hidden, int token_blocks);

/// One-token tiles exchange one accumulator column (bit-identical) up to 2.0 expected pairs per
/// touched expert: 1.004-1.055x there (docs/design/cuda-moe.md#heuristics).
inline constexpr double kOneTokenTailMaxPairsPerExpert = 2.0;
bool decode_one_token_tail(std::int64_t tokens, int top_k, std::int64_t experts);

/// Separate activation kernel between GEMM1 and GEMM2 (bit-identical) above 1.5 expected pairs
/// per touched expert and for GEMM1 K-loops of at most 64 K-tiles: faster above 1.5, even at 112
/// K-tiles (docs/design/cuda-moe.md#heuristics). The workspace holds GEMM1's sums for
/// act_rows(P, E) rows (pair x split rank) and the kernel takes splits of at most 2.
inline constexpr double kActMinPairsPerExpert = 1.5;
inline constexpr std::int64_t kActMaxTilesK = 64;
inline constexpr std::int64_t kActMaxRows = 1024;
inline constexpr int kActMaxSplit = 2;
bool decode_act_kernel(std::int64_t tokens, int top_k, std::int64_t experts, std::int64_t hidden);
/// min(P x kActMaxSplit, kActMaxRows, ceil(kPrefillMinTokensPerExpert x E)): every Auto decode
/// batch of the benchmark shapes fits; 0 when pairs or experts < 1.
std::int64_t act_rows(std::int64_t pairs, std::int64_t experts);

// --- prefill ---------------------------------------------------------------------------------

/// Prefill GEMM kernels: the sm_80 mma.sync tile of 64 tokens (every device other than sm_90),
/// the sm_90a wgmma tile of 64 tokens (bit-identical to the mma.sync tile), and the sm_90a
/// warp-specialised kernels with the weights as wgmma's register operand and 64 or 128 tokens as N
/// (sm90_lutb_moe_prefill_rs.cuh; equal to the others up to FP32 addition order).
enum class PrefillKernel : std::uint8_t { Sm80Mma64, Sm90Wgmma64, Sm90WgmmaRs64, Sm90WgmmaRs128 };
/// The register-weight kernels take 128 tokens per tile, and the rule picks them (Rs128) from 128
/// pairs per touched expert, a full N tile each: 1.20-1.38x the wgmma tiles there on the four
/// benchmark shapes (H100: 128-1024 pairs per expert), even or 0.96x at 32-64
/// (docs/perf/moe-gpu-prefill.md), so below it the wgmma tile of 64 tokens stays. Rs64 runs only
/// when forced.
inline constexpr std::int64_t kPrefillRs128MinPairs = 128;
/// The kernel for `pairs` (token, expert) pairs over `experts` experts; `rs` forces the
/// register-weight kernels on sm_90a (MoeOptions::prefill), Rs64 below kPrefillRs128MinPairs.
PrefillKernel prefill_kernel(std::int64_t pairs, std::int64_t experts, bool sm90a, bool rs = false);
/// Token rows per CTA (= the grouping's tile rows).
int prefill_tile_rows(PrefillKernel k);

// --- the plan of one forward -------------------------------------------------------------------

/// GEMM kernels of a forward: swap-AB decode, the m16 token-tile kernels (LUT-B: only for expert
/// stacks whose packed bytes pass 2^31 per expert, beyond the swap-AB kernels' 32-bit offsets),
/// or the prefill tiles.
enum class MoeKernel : std::uint8_t { SwapAB, TokenM16, Prefill };

/// Everything a LUT-B forward chooses. plan_moe fills it by the rules above; the forward checks
/// the conditions each choice needs (a fused reduction needs a direct forward on sm_90a, the
/// activation kernel needs workspace rows) and otherwise runs the default path, so tests may set
/// any field to compare the paths bit for bit.
struct MoePlan {
  MoeKernel kernel = MoeKernel::SwapAB;
  bool cvt_decoder = false;     // sm_89+ cvt E4M3 -> FP16 (the sm_90a image), else the byte trick
  int token_blocks = 1;         // swap-AB: 8-token blocks per tile (1 or 2)
  bool direct = false;          // swap-AB: no grouping kernel (one token block only)
  bool fuse_reduce = false;     // swap-AB: top-k reduction inside GEMM2
  int gemm1_ksplit = 0;         // swap-AB: 0 = decode_k_split's rule, 1 = none, 2 = forced
  bool late_scales = false;     // swap-AB, Cvt decoder: late tile scales
  bool one_token_tail = false;  // swap-AB: one-column exchange in one-token tiles
  bool act_kernel = false;      // swap-AB: separate activation kernel
  PrefillKernel prefill = PrefillKernel::Sm80Mma64;
};

/// What the plan needs of the device: the sm_90a image runs (cvt, clusters, wgmma) and its SMs.
struct MoeDevice {
  bool sm90a = false;
  int sms = 132;
};

/// The plan for T tokens, top-k, E experts, hidden size H, expert stacks small enough for the
/// swap-AB kernels (`small_experts`) and the caller's options.
MoePlan plan_moe(std::int64_t tokens, int top_k, std::int64_t experts, std::int64_t hidden, bool small_experts,
                 const MoeOptions& options, const MoeDevice& device);

}  // namespace lutb::cuda::heuristics
