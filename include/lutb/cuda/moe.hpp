// lutb/cuda/moe.hpp: fused LUT-B MoE forward on NVIDIA GPUs (Ampere sm_80 and Hopper sm_90a).
//
// The routed experts stay PACKED in GPU memory in the checkpoint's own layout (spec section 2.2:
// packed [E, N/8, K/64, 192] u8, codebook [E, N/8, K/64, 8] E4M3, scale [E, N/8, K/64] UE8M0),
// except that the 192 index bytes of every tile are bit-permuted once at load time into the
// lane-major order of lutb/cuda/lane_major.hpp (to_lane_major, in place, same bytes per tile), and
// are decoded tile by tile in registers inside the GEMM kernels; no BF16 copy of a weight is ever
// written to global memory. The numerics are spec section 4 exactly: the values that enter each
// multiply are the LUT-B weights e4m3(codebook) * 2^(s-127) and the MXFP8 (rceil) activations; only
// the order of the FP32 additions differs from the CPU emulation (tensor-core partial sums per
// 32-column MXFP8 block, then scaled by the two power-of-two scales, which is exact).
//
// Every function takes a CUDA stream, launches asynchronously, never synchronises with the host
// and never allocates: the whole forward (routing included) can be captured in a CUDA graph.
// Errors in arguments throw std::invalid_argument before anything is launched; launch failures
// throw std::runtime_error with the CUDA error string.
//
// Index arithmetic that can pass 2^31 (expert stacks: DeepSeek-V3 w13 has 7.5e9 weights, 2.9e9
// packed bytes) is 64-bit throughout; see lutb::cuda::tile_offset.
#pragma once

#include <cstddef>
#include <cstdint>

#include "lutb/tile.hpp"

typedef struct CUstream_st* cudaStream_t;

namespace lutb::cuda {

/// Device pointers to one LUT-B expert stack in the checkpoint layout (see LutbView).
/// shape.experts = E, shape.rows = N (logical), shape.cols = K (logical).
struct DeviceLutb {
  LutbShape shape;
  const std::uint8_t* packed = nullptr;    // [E, Np/8, Kp/64, 192]
  const std::uint8_t* codebook = nullptr;  // [E, Np/8, Kp/64, 8] E4M3 bytes
  const std::uint8_t* scale = nullptr;     // [E, Np/8, Kp/64] UE8M0 bytes (3..246 for valid data)
  /// Index order of `packed`: false = checkpoint order (spec 2.2), true = lane-major
  /// (lutb/cuda/lane_major.hpp). moe_forward needs lane-major; to_lane_major converts and sets it.
  bool lane_major = false;
};

/// Permutes the index bytes of every tile of `w` from checkpoint order into lane-major order, in
/// place on the device (w.packed must point to writable device memory; no other memory is used),
/// asynchronously on `stream`, and sets w.lane_major. Memory-bound: one read and one write of the
/// packed bytes. Throws std::invalid_argument when w is already lane-major or has a null pointer.
void to_lane_major(DeviceLutb& w, cudaStream_t stream);

/// The same permutation on `tiles` consecutive tiles (192 bytes each) at d_packed, in place,
/// asynchronously on `stream` (the online method permutes each chunk as soon as it is fitted).
/// Throws std::invalid_argument for a null or unaligned pointer (4 bytes), std::runtime_error when
/// the launch fails.
void packed_to_lane_major(std::uint8_t* d_packed, std::int64_t tiles, cudaStream_t stream);

/// 64-bit flat tile index of tile (tn, tk) of expert e: the only index that can pass 2^31
/// (times 192 for the packed bytes). Host and device.
LUTB_HD constexpr std::int64_t tile_offset(std::int64_t e, std::int64_t tn, std::int64_t tk, std::int64_t tiles_n,
                                           std::int64_t tiles_k) {
  return (e * tiles_n + tn) * tiles_k + tk;
}

/// The routed experts of one MoE layer on the GPU, LUT-B packed.
///   w13: [E, 2I, H] (rows 0..I-1 gate = w1, rows I..2I-1 up = w3), w2: [E, H, I].
/// Requirements: I % 8 == 0 (so the up rows start on a tile boundary), H >= 1, E >= 1.
struct DeviceMoeWeights {
  std::int64_t experts = 0;       // E
  std::int64_t hidden = 0;        // H (hidden_size)
  std::int64_t intermediate = 0;  // I (moe_intermediate_size)
  DeviceLutb w13;
  DeviceLutb w2;
};

/// The same layer with BF16 weights ([E, 2I, H] and [E, H, I] row-major bits), for the BF16
/// baseline pipeline (spec section 4 last paragraph: no MXFP8 steps). Needs H % 64 == 0 and
/// I % 64 == 0.
struct DeviceMoeWeightsBf16 {
  std::int64_t experts = 0, hidden = 0, intermediate = 0;
  const std::uint16_t* w13 = nullptr;
  const std::uint16_t* w2 = nullptr;
};

// ---------------------------------------------------------------------------
// Routing (spec section 5). Outputs are ordered by descending choice score (ties: lower expert).
// ---------------------------------------------------------------------------
/// softmax top-k (Mixtral, Qwen2/3-MoE, OLMoE): p = softmax(logits[t, :]) in FP32 (max-subtracted,
/// expf), the k largest p (ties: lower expert index), renormalised to sum 1 when `renormalize`.
/// logits: [T, E] FP32 device; topk_ids: [T, k] int32; topk_weights: [T, k] FP32.
/// 1 <= k <= 32, 1 <= E <= 1024.
void route_softmax_topk(const float* logits, std::int64_t tokens, int experts, int k, bool renormalize,
                        std::int32_t* topk_ids, float* topk_weights, cudaStream_t stream);

/// DeepSeek-V3 grouped sigmoid top-k (Kimi K2 too): s = sigmoid(logits); choice = s + bias; a
/// group's score is the sum of its two best choices; the topk_group best groups (ties: lower
/// group); the k best choices inside them; weights = s (divided by their sum when `renormalize`)
/// times routed_scaling_factor. bias: [E] FP32 (may be null = zeros). E % n_group == 0, E <= 1024,
/// experts per group >= 2, 1 <= k <= 32.
void route_deepseek(const float* logits, const float* bias, std::int64_t tokens, int experts, int n_group,
                    int topk_group, int k, bool renormalize, float routed_scaling_factor, std::int32_t* topk_ids,
                    float* topk_weights, cudaStream_t stream);

// ---------------------------------------------------------------------------
// Fused forward
// ---------------------------------------------------------------------------
/// Strategy of the GEMM kernels. Auto picks by the expected tokens per expert (choose_strategy).
///   Decode: LUT-B "swap AB" kernels (src/cuda/moe_swapab.cuh): the weights are the M operand of
///     the mma (256 weights per instruction), tokens the N operand in blocks of 8, 8*NB tokens per
///     tile (decode_token_blocks); the CTA's warps split K (1-8 warps by the expected CTA count;
///     the environment variable LUTB_SWAPAB_WARPS = 1/2/4/8 forces it, for benchmarking). The BF16
///     baseline's Decode is its 16-token tile kernel.
///   Prefill: LUT-B: CTA-tiled GEMMs (src/cuda/moe_prefill.hpp): 64-token tiles, every weight tile
///     decoded once per CTA into shared memory as BF16 with both power-of-two scales folded in,
///     ldmatrix + mma.sync (tile M64), on sm_90a wgmma on the same exact BF16 operands (tile WB64,
///     src/cuda/moe_lutb_prefill_sm90.cuh; bit-identical to M64). BF16 baseline: 4 m16 token tiles
///     per warp.
///   DecodeM16: LUT-B with tokens as the M operand, one m16 token tile per warp (the previous
///     decode kernel, kept as the benchmark's same-run baseline; Auto does not pick it); the same
///     as Decode on the BF16 path.
enum class MoeStrategy : std::uint8_t { Auto, Decode, Prefill, DecodeM16 };

/// LUT-B: the CTA-tiled Prefill kernels from this many tokens per touched expert
/// (T*k / min(E, T*k)) on, the swap-AB Decode kernels below. Measured on the H200 (2026-11-30
/// ~13:20 UTC, docs/perf/moe-gpu.md "What changed in session 12", log gpu-logs/main-2026-11-30f-run1/
/// threshold_sweep.md; both strategies forced, twice, every shape): swap-AB Decode is 1.19-1.46x
/// faster than Prefill at 24 tokens per expert and 1.13-1.18x at 32 (Qwen3-30B: even), Prefill is
/// 1.01-1.19x faster at 40 and 1.16-1.35x at 48, on DeepSeek-V3, Qwen3-235B, Qwen3-30B and
/// Mixtral alike: the crossover lies between 32 and 40 on every shape. (It was 24 until then,
/// chosen against the older DecodeM16 kernel, which swap-AB replaced.) Auto never picks DecodeM16:
/// swap-AB is 1.4-3.0x faster at 1-4 tokens per expert and 1.0-1.2x beyond.
inline constexpr double kPrefillMinTokensPerExpert = 36.0;

/// The same crossover when the prefill runs the sm_90a BF16-fold wgmma tile (WB64, the prefill
/// default on Hopper since session 13, 1.18-1.26x the mma.sync tile's throughput). Measured on the
/// H200 (2026-11-30 ~16:35 UTC, docs/perf/moe-gpu.md "Changed late in session 13", log
/// gpu-logs/main-2026-11-30g-run2/; both strategies forced, one run): at 24 tokens per expert
/// swap-AB Decode is 1.11-1.15x faster on DeepSeek-V3, Qwen3-235B and Mixtral (Qwen3-30B: Prefill
/// 1.02x); at 32 Prefill is 1.07-1.23x faster on all four shapes. The crossover lies between 24
/// and 32; 28 is its midpoint.
inline constexpr double kPrefillMinTokensPerExpertWgmma = 28.0;

/// Heuristic, kept apart from the kernels (host only; no device query).
///   BF16 weights (packed_weights = false): Prefill when the mean number of tokens per touched
///     expert reaches 48, else Decode.
///   LUT-B weights: Prefill from kPrefillMinTokensPerExpert tokens per touched expert (from
///     kPrefillMinTokensPerExpertWgmma when wgmma_prefill: the prefill would run the sm_90a wgmma
///     tile), else Decode. moe_forward passes wgmma_prefill for the tile the current device uses.
MoeStrategy choose_strategy(std::int64_t tokens, int top_k, std::int64_t experts, bool packed_weights = true,
                            bool wgmma_prefill = false);

/// Swap-AB decode: one 8-token block per tile up to this many mean tokens per touched expert, two
/// 8-token blocks (16-token tiles) above. Measured on the H200 (2026-11-30 ~13:36 UTC,
/// docs/perf/moe-gpu.md "Also changed in session 12", log gpu-logs/main-2026-11-30f-run3/; both
/// forced by LUTB_SWAPAB_NB): one block is 1.08-1.20x faster at 8 tokens per expert on all four
/// benchmark shapes (1.17-1.40x at 4-6); at 12 two blocks win on DeepSeek-V3 (1.08x) and Mixtral
/// (1.03x), tie on Qwen3-235B and lose on Qwen3-30B (0.91x); at 16 two blocks win on DeepSeek-V3
/// (1.06x). The crossover lies between 8 and 12 (it was 6 until then, not swept).
inline constexpr double kSwapOneBlockMaxTokensPerExpert = 10.0;

/// Token n-blocks of 8 per tile of the swap-AB decode kernels (1 or 2) for a batch: 1 up to
/// kSwapOneBlockMaxTokensPerExpert mean tokens per touched expert, else 2 (experts with more tokens
/// than a tile get several tiles; blocks past an expert's token count are skipped). 4 blocks
/// (32-token tiles) needed 255 registers and spilled: at 16 tokens per expert they were 17-23 %
/// slower than two 16-token tiles on the H200 (docs/perf/moe-gpu.md), so they were dropped.
int decode_token_blocks(std::int64_t tokens, int top_k, std::int64_t experts);

/// Swap-AB decode without the grouping kernel ("direct" forward): every pair p = t*k + j is its own
/// one-token tile (expert topk_ids[p]), so the grouping by expert is skipped, the MXFP8 of x is the
/// forward's first kernel and the one-token K-loop runs everywhere; a pair whose expert another pair
/// of the batch also uses reads that expert's weights again (the same sum). Chosen when the expected
/// pairs per touched expert under uniform routing, T*k / (E * (1 - (1 - k/E)^T)), is at most this
/// (always at T = 1, where it is exactly 1). Measured on the H200 (2026-11-30, docs/perf/moe-gpu.md
/// "Session 14: small-batch fixed costs", device runs small14-run1/run2, direct forced against
/// grouped in the same process): direct is 1.6-3.5 % faster at T = 4 on DeepSeek-V3 (expected ratio
/// 1.049), Qwen3-235B and Qwen3-30B (1.099), and 8 % slower at DeepSeek-V3 T = 8 (1.117; 12-13 %
/// more weight reads) and 25-250 % slower at T = 16, 64. The limit lies between 1.099 and 1.117.
inline constexpr double kDirectMaxPairsPerExpert = 1.10;
/// ... and only up to this many tokens. Session 15 measured DeepSeek-V3 at T = 5..7, where the
/// ratio alone chose direct (1.064, 1.081, 1.097; device run rules15-run1, 2026-11-30, both orders
/// in one process): direct was even at T = 5 (270.5 / 269.9 us vs grouped 269.9 / 269.2) and
/// 3.7-4.9 % slower at T = 6 and 7 (319.9 vs 308.2, 365.8 vs 349.1 us), while T = 4 stays 1.02x
/// faster direct; every measured win is at T <= 4 (the ratio cannot separate DeepSeek-V3 T = 6,
/// 1.081, a loss, from Qwen3 T = 4, 1.099, a win).
inline constexpr std::int64_t kDirectMaxTokens = 4;

/// True when the swap-AB decode of this batch runs "direct" (above): tokens <= kDirectMaxTokens and
/// the expected pairs per touched expert at most kDirectMaxPairsPerExpert. Host only, no device
/// query. tokens >= 1, 1 <= top_k <= experts; false when top_k > experts (repeated experts per token).
bool decode_direct(std::int64_t tokens, int top_k, std::int64_t experts);

/// In a direct forward on sm_90a with top_k <= 8 (mma.sync kernels: not CvtWs, not Fp8Wgmma), the
/// weighted top-k reduction runs inside GEMM2
/// (kDecodeClusterReduce, below) when GEMM2's grid (strip groups x pairs) has at most 2 CTAs per SM.
/// Measured on the H200 (docs/perf/moe-gpu.md "Session 14", run small14-run2, same process, twice):
/// Qwen3-30B T = 1 (256 CTAs) 1.1-1.8 us faster, Mixtral T = 1 (128 CTAs) 0.4-0.6 us faster; with
/// 512-1024 CTAs (Qwen3-235B T = 1, DeepSeek-V3 T = 1, every T = 4) 2.5-8 us slower (cause not
/// established; likely the scheduling of k-CTA clusters beside GEMM1's CTAs). Host only.
bool decode_fuse_reduce(std::int64_t gemm2_ctas, int top_k, int sms);

/// Fixed-cost paths of the small-batch (swap-AB decode) forward, session 14 (process-wide; for
/// testing and benchmarking; flags of set_decode_paths; all results equal up to FP32 summation
/// order, the fused reduction bit-identical to the separate kernel):
///   kDecodeDirect: the direct forward for T > 1 where decode_direct() says so (T = 1 is always
///     direct unless kDecodeNoDirect1);
///   kDecodeDirectAlways: the direct forward for every one-token-block swap-AB batch (benchmark only);
///   kDecodeClusterReduce: in direct forwards on sm_90a where decode_fuse_reduce() says so, the
///     weighted top-k reduction inside GEMM2: the k CTAs of one token and one 64-row group are a
///     thread-block cluster; each keeps its FP32 rows in shared memory and the first reads the
///     others' (distributed shared memory) and writes the BF16 output in the same j order as the
///     separate reduction kernel (bit-identical results); kDecodeClusterReduceAlways: in every direct
///     forward with top_k <= 8 (tests and benchmark);
///   kDecodeNoDirect1: T = 1 also goes through the grouping kernel (session 10's old path; benchmark only);
///   kDecodeSplitK: GEMM1 split across the CTAs of a cluster where decode_k_split says so (sm_90a);
///   kDecodeLateScales (session 16, dec16; Cvt decoder only, the others ignore it): the swap-AB
///     K-loop keeps the next K-tile's tile-scale byte raw (one register per lane instead of 8 FP32
///     shuffled values) and converts / shuffles it in the K-tile that uses it: 14 fewer values live
///     across the loop (one token block: 120-124 registers instead of 127-128), bit-identical results
///     (same values, same FP32 operations and order). Measured in docs/perf/moe-gpu.md "Session 16";
///   kDecodeLateScales96 (same session; Cvt decoder; benchmark and tests only): kDecodeLateScales'
///     K-loop in kernels capped at 96 registers per thread for one-token-block batches (20 resident
///     warps per SM instead of 16 where the grid has them; the unsplit kernels' K-loops stay free of
///     spill loads), and kDecodeLateScales' kernels for two token blocks. Bit-identical results as
///     well; 0.87-0.98x on 10 of the 16 decode rows of the benchmark (more warps, no more issue):
///     not used by default;
///   kDecodeLateScalesRule: kDecodeLateScales where decode_late_scales() says so (below);
///   kDecodeOneTokenTail (session 17, small17; mma.sync swap-AB kernels): in tiles of one token
///     (every tile of a direct forward, grouped tiles of one pair) the cross-warp reduction and the
///     cluster split-K combine exchange only the accumulator column that holds the token, and GEMM1's
///     SiLU*up / MXFP8 epilogue skips the token-less column instead of computing it up to its amax
///     and dropping it (and converts its FP16 copies of E4M3 bytes in hardware, exactly).
///     Bit-identical outputs. The phase timing of session 17 (docs/perf/moe-gpu.md) measured GEMM1's
///     epilogue at 3.8-5.3 us of warp 0 at T = 1; kDecodeOneTokenTailRule: kDecodeOneTokenTail where
///     decode_one_token_tail() says so (below);
///   kDecodeOneWave (session 17, small17): decode_swap_warps' one-wave condition (below): the warps
///     per CTA are not doubled where that would turn a grid that is resident at once into two waves
///     (Qwen3-235B T = 1 GEMM1: 384 CTAs of 8 warps, 2 resident per SM, ran in two waves). Applied to
///     kernels of one token block only: with two (Mixtral T = 64's GEMM2, 512 CTAs of 224 K-tiles) it
///     kept 2 warps where the old rule's 4 (two full waves) ran 1.077x faster (device run k-run1,
///     docs/perf/moe-gpu.md "Current figures").
///   kDecodeActKernel (session 18, act18; mma.sync swap-AB kernels, forwards whose pairs x GEMM1
///     split fit in act_rows() and whose split is at most kActMaxSplit): GEMM1 stops after its
///     cross-warp reduction and stores each CTA's FP32 gate / up sums (per split rank) to the
///     workspace; a small activation kernel between GEMM1 and GEMM2 (PDL chain) adds the ranks' sums
///     in rank order and does the SiLU*up / BF16 / MXFP8-of-h epilogue with one warp per 32-column
///     block (one column per lane), instead of GEMM1's cluster combine and warp 0's epilogue. Bit-identical outputs (the
///     same operations in the same order). kDecodeActKernelRule: kDecodeActKernel where
///     decode_act_kernel() says so (below), for launches of one or two token blocks.
inline constexpr unsigned kDecodeDirect = 1u, kDecodeDirectAlways = 2u, kDecodeClusterReduce = 4u,
                          kDecodeNoDirect1 = 8u, kDecodeSplitK = 16u, kDecodeClusterReduceAlways = 32u,
                          kDecodeLateScales = 64u, kDecodeLateScales96 = 128u, kDecodeLateScalesRule = 256u,
                          kDecodeOneTokenTail = 512u, kDecodeOneWave = 1024u, kDecodeOneTokenTailRule = 2048u,
                          kDecodeActKernel = 4096u, kDecodeActKernelRule = 8192u;
/// Limits of kDecodeActKernel (session 19, act19; session 18 held 128 pairs). The workspace
/// (moe_workspace_bytes) holds GEMM1's FP32 gate / up sums in rows of 2 Ip values, one per pair and
/// split rank (act_part_row), for act_rows(P, E) = min(P x kActMaxSplit, kActMaxRows,
/// ceil(kPrefillMinTokensPerExpert x E)) rows: 2 x act_rows x Ip x 4 bytes, at most 8 KiB x Ip
/// (16 MiB at Ip = 2048: DeepSeek-V3; 12 / 6 MiB for Qwen3-235B / Qwen3-30B; Mixtral-8x7B's 288 rows
/// (36 x 8 experts), 31.5 MiB at Ip = 14336, where session 18 had 256 rows, 28 MiB). A forward takes
/// the kernel only when its P pairs x GEMM1's split fit in those rows and the split is at most
/// kActMaxSplit; otherwise the default GEMM1 tail runs. Why a limit and not every pair the swap-AB
/// decode can see: the sums cost 8 Ip bytes per pair and rank (4x the BF16 h), more than the rest of
/// the workspace per pair on Mixtral (4 H + ~3.3 Ip bytes); every decode batch of the benchmark
/// shapes up to T = 128 at top-8 (1024 pairs, one unsplit rank) fits, and the E term keeps Mixtral's
/// region at session 18's size (its Auto forward leaves swap-AB decode at 28-36 pairs per expert,
/// choose_strategy; an explicit MoeStrategy::Decode beyond the rows runs the default tail).
inline constexpr std::int64_t kActMaxRows = 1024;
inline constexpr int kActMaxSplit = 2;
/// The GEMM1-sum rows (pair x split rank) that the workspace of a forward of `pairs` pairs over
/// `experts` experts holds (above; host only). 0 when pairs or experts < 1.
std::int64_t act_rows(std::int64_t pairs, std::int64_t experts);
/// The default set (the paths measured faster, docs/perf/moe-gpu.md "Session 14", "Session 16",
/// "Session 17" and "Session 18").
inline constexpr unsigned kDecodePathsDefault =
    kDecodeDirect | kDecodeClusterReduce | kDecodeSplitK | kDecodeLateScalesRule | kDecodeOneTokenTailRule |
    kDecodeOneWave | kDecodeActKernelRule;

/// kDecodeActKernel by rule (host only; the forward applies it to swap-AB launches within
/// act_rows / kActMaxSplit): T > 1, the expected pairs per touched expert under uniform routing,
/// T k / (E (1 - (1 - min(1, k/E))^T)) (as decode_one_token_tail), above kActMinPairsPerExpert, and
/// GEMM1's K-loop at most kActMaxTilesK K-tiles (ceil(hidden / 64)). Measured on the H200
/// (docs/perf/moe-gpu.md "Session 19", "Session 18" and "Current figures"): act18-run2 (four
/// processes, ABBA, before cvt18's shorter GEMM1 epilogue) had the kernel faster on every row above
/// 1.2 pairs per expert and slower or even at or below 1.12 (every T = 1: 0.949-0.985x; T = 4 with
/// k = 8: 0.928-0.998x). The final run of session 18 (two processes, both orders, with cvt18's
/// hardware encode in GEMM1's epilogue) moved the threshold to 1.5: Mixtral T = 4 (1.46) now lost
/// 1.3-1.7 % with the kernel, the rows at 1.24-1.26 (Qwen3 T = 8, DeepSeek-V3 T = 16) gained only
/// 0.3-1.8 %, while the rows above 1.5 kept their gains -- Qwen3-235B / Qwen3-30B T = 16 (1.55:
/// 1.025x / 1.05x), Mixtral T = 8, 16 (2.2, 4.0: 1.016x, 1.008x) and T = 64 (16.0, two token blocks:
/// 1.056x). Session 19 (act19-run1, two processes, ABBA in each, opposite orders) above 128 pairs:
/// Qwen3-30B (32 K-tiles) T = 24..128 1.028-1.075x in both orders, Qwen3-235B (64 K-tiles) T = 24..64
/// 1.007-1.036x in both orders (T = 128: 1.010x / 0.998x), but DeepSeek-V3 (112 K-tiles) T = 32, 48
/// 0.960x / 1.056x and 1.045x / 0.973x, T = 64, 128 1.002-1.013x: the epilogue the kernel takes off
/// each GEMM1 CTA is a fixed cost, worth less the longer the CTA's K-loop, and at 112 K-tiles its gain
/// was not shown (means 1.005-1.009x in a row noise of +-5 %); hence the K-tile bound.
inline constexpr double kActMinPairsPerExpert = 1.5;
inline constexpr std::int64_t kActMaxTilesK = 64;
bool decode_act_kernel(std::int64_t tokens, int top_k, std::int64_t experts, std::int64_t hidden);

/// kDecodeOneTokenTail by rule (host only): where the expected pairs per touched expert under uniform
/// routing, T k / (E (1 - (1 - min(1, k/E))^T)), are at most kOneTokenTailMaxPairsPerExpert (T = 1
/// always). Measured on the H200 (docs/perf/moe-gpu.md "Session 17", device run small17-run2, four
/// processes in ABBA order, same process as the forward without it): 1.004-1.055x on every T = 1, 4,
/// 16 row of the four benchmark shapes (expected pairs per expert 1.0-1.55) except Mixtral T = 16
/// (4.0 pairs per expert, few one-token tiles), 0.984-0.989x there (not explained: the flag only acts
/// on tiles of one token).
inline constexpr double kOneTokenTailMaxPairsPerExpert = 2.0;
bool decode_one_token_tail(std::int64_t tokens, int top_k, std::int64_t experts);

/// Warps per CTA of a swap-AB decode GEMM (they split the K-tiles of the CTA's rows; host only).
/// Inputs: `ctas` the GEMM's CTAs (touched experts x strip groups), `tiles_k` its K-tiles per row,
/// `most` the kernel's largest CTA (16 warps with one token block, 8 with two), `sms` the device's
/// SM count, `resident[i]` how many CTAs of 2^i warps (i = 0..4: 1..16 warps) one SM holds at once
/// (cudaOccupancyMaxActiveBlocksPerMultiprocessor of the kernel; 0 where not applicable).
/// Rule (sessions 9-10, the LUTB_SWAPAB_WARPS sweeps of docs/perf/moe-gpu.md): start at 2 warps and
/// double up to 8 while ctas x warps < 132 x 12 (about 12 warps per SM) and every warp keeps >= 4
/// K-tiles; 16 warps (most >= 16) when ctas <= 132 and tiles_k >= 64. `one_wave` (kDecodeOneWave,
/// session 17): a doubling from w to 2w is also skipped when the grid is resident at once with w
/// warps (ctas <= sms x resident(w)) but not with 2w (ctas > sms x resident(2w)). Returns 1 when
/// tiles_k < 4.
int decode_swap_warps(std::int64_t ctas, std::int64_t tiles_k, int most, int sms, const int (&resident)[5],
                      bool one_wave);

/// The late-tile-scale K-loop (kDecodeLateScales) by rule: for two token blocks (token_blocks = 2,
/// decode_token_blocks) or hidden <= kLateScalesMaxHidden (GEMM1's K range per weight row at most
/// 32 K-tiles, so every warp's K range is short). Measured on the H200 (docs/perf/moe-gpu.md
/// "Session 16", device runs dec16-run1/run2, six benchmark processes, the old and the late loop
/// in the same process in both orders): faster in all six on Qwen3-30B (H = 2048) at T = 1, 16, 64
/// (1.052-1.061x, 1.013-1.022x, 1.015-1.023x; T = 4 0.991-1.009x) and on Mixtral T = 64, the one
/// two-block row (1.011-1.016x); on the other rows (H = 4096, 7168, one block) not consistently
/// faster (0.970-1.016x; Qwen3-235B T = 4 0.984-0.990x, Mixtral T = 1 0.991-0.996x). Host only.
inline constexpr std::int64_t kLateScalesMaxHidden = 2048;
bool decode_late_scales(std::int64_t hidden, int token_blocks);
void set_decode_paths(unsigned paths);

/// Split-K of a swap-AB decode GEMM across the CTAs of a thread-block cluster (sm_90a; the
/// kernels' kern::swap_cluster_combine): `ksplit` CTAs (1, 2 or 4) share one strip group and token
/// tile, each takes a contiguous share of the K-tiles with `warps` warps, and rank 0 adds the
/// others' sums in rank order (deterministic). Input: the GEMM's CTAs without a split (touched
/// experts x strip groups), its K-tiles per expert, the warps per CTA the warp rule chose and the
/// device's SM count. Rule: 2 CTAs of half the warps when that shortens the busiest SM's share of
/// a one-wave grid: warps >= 4, every warp keeps >= 4 K-tiles, the split grid is resident at once
/// (ceil(2 ctas / sms) * warps / 2 <= 16 warps per SM) and ceil(2 ctas / sms) < 2 ceil(ctas / sms)
/// (e.g. 192 CTAs of 8 warps on 132 SMs: 60 SMs run two and 72 one; split, no SM runs more than
/// 1.5 CTAs' worth). Else no split. Measured on the H200 (docs/perf/moe-gpu.md "Session 14"): the
/// rule fires on Qwen3-30B GEMM1 at T = 1 among the benchmark shapes, 0.6-1.3 us faster; forced on
/// DeepSeek-V3 T = 1 (512 CTAs, balanced already) it was 3 us slower. The forward applies it to
/// GEMM1 only, and only with kDecodeSplitK. Host only.
struct DecodeSplit {
  int ksplit = 1;
  int warps = 1;
};
DecodeSplit decode_k_split(std::int64_t ctas, std::int64_t tiles_k, int warps, int sms);

/// L2 prefetch of GEMM2's weights while GEMM1 runs (session 14, l2pf14; sm_90a swap-AB decode with
/// the mma.sync decoders). Both decode GEMMs are latency / issue bound at 13-57 % of the H200's DRAM
/// bandwidth, and GEMM2's warps start with a long wait on their first ring loads; so GEMM1's CTAs,
/// which know their expert, issue cp.async.bulk.prefetch.L2 (one instruction per contiguous range,
/// by the last warp of each CTA before its programmatic-dependent-launch wait, after its own ring
/// prologue) for a share of THEIR expert's w2 slice: the first `k` K-tiles of every GEMM2 warp's K
/// range of every row strip (lane-major index bytes), plus the expert's w2 codebooks and tile scales.
/// Prefetch only changes timing: outputs are bit-identical (tested).
/// decode_l2_prefetch_tiles is the byte rule: `k` = the whole range (`range_tiles`) when the w2 bytes
/// of the touched experts (`w2_bytes`) fit in `budget_bytes`, else range_tiles * budget / w2_bytes
/// rounded down, at least 1; 0 when budget_bytes <= 0 or range_tiles <= 0. Host only.
int decode_l2_prefetch_tiles(std::int64_t w2_bytes, std::int64_t range_tiles, std::int64_t budget_bytes);
/// The prefetch budget of later swap-AB forwards (process-wide; bytes of w2 per forward, 0 = off;
/// kDecodeL2PrefetchDefault unless changed) and whether the prefetch carries an L2::evict_last hint
/// (createpolicy; so GEMM1's own weight stream does not evict the prefetched lines first), and whether
/// it is issued after each GEMM1 CTA's K-loop (`after_k_loop`) instead of before its PDL wait.
/// Measured on the H200 (docs/perf/moe-gpu.md "Session 14: L2 prefetch of GEMM2's weights (l2pf14)",
/// runs l2pf14-run1/run2, same process as off): GEMM2 got 0.7-2.5 us shorter at T = 1 where the w2
/// fits, but GEMM1 2.6-6.3 us longer (the issuing warp waits on its prefetches), so every budget,
/// hint and placement was 1-16 % slower at T = 1..64 on the four benchmark shapes: off by default.
inline constexpr std::int64_t kDecodeL2PrefetchDefault = 0;
void set_decode_l2_prefetch(std::int64_t budget_bytes, bool evict_last = false, bool after_k_loop = false);

/// Benchmark only: forces the K split of GEMM1 (ksplit1, warps divided by 2^warp_shift1) and of
/// GEMM2 (ksplit2, warp_shift2) of later swap-AB forwards on sm_90a; ksplit 0 = decode_k_split's rule.
void set_decode_split(int ksplit1, int warp_shift1, int ksplit2, int warp_shift2);

/// Benchmark only (stage timing of a graph-launched forward): stage > 0 ends every later swap-AB
/// (Decode, mma.sync) forward
/// after its `stage`-th step (1: grouping and MXFP8 of x; 2: GEMM1; 3: GEMM2, with the fused
/// reduction when that path runs); `out` is then NOT written. 0 (default): the whole forward.
void set_forward_stop_after(int stage);

#ifdef LUTB_SWAPAB_PHASES
/// Benchmark-only build (-DLUTB_SWAPAB_PHASES=1 on src/cuda/moe_lutb.cu and the benchmark; session 17,
/// small17; never in a production build): phase timing of the swap-AB decode GEMMs. Lane 0 of every
/// warp of every swap-AB GEMM CTA (mma.sync kernels, swapab_gemm{1,2}_kernel) stores %globaltimer
/// (ns, one clock for the whole GPU) and clock64 (this SM's cycles) at 8 marks of its life:
///   0 kernel entry; 1 prologue done (routing of the tile, strips, row pointers, K range: just before
///   the K-loop function); 2 ring prologue issued (the first kStages - 1 K-tiles' cp.async and the
///   first tile-scale load), just before the programmatic-dependent-launch wait; 3 after that wait
///   (GEMM1: the MXFP8 of x has completed; GEMM2: GEMM1 has); 4 the first K-tile's ring data has
///   arrived (cp.async.wait_group of K-tile 0); 5 K-loop done; 6 the cross-warp reduction done
///   (swap_reduce, and the cluster split-K combine where it runs); 7 warp 0: epilogue done (GEMM1:
///   SiLU*up and the MXFP8 of h written; GEMM2: y written, or the fused top-k cluster reduction done).
/// A mark a warp does not reach stays 0. Record of warp w of CTA c (c = blockIdx.y * gridDim.x +
/// blockIdx.x) of GEMM g (0, 1): buf[g * kSwapPhaseMaxWarps + c * warps + w], when below
/// kSwapPhaseMaxWarps (later warps record nothing).
struct SwapPhaseRecord {
  unsigned long long gt[8];  // %globaltimer at each mark, ns
  long long clk[8];          // clock64 at each mark, SM cycles
  unsigned smid;             // %smid of the CTA
  unsigned cta;              // blockIdx.y * gridDim.x + blockIdx.x
  unsigned warp_info;        // warp | warps per CTA << 8 | GEMM (0, 1) << 16
  unsigned ktiles;           // K-tiles of this warp's range
};
inline constexpr int kSwapPhaseMaxWarps = 1 << 16;
/// Device buffer of 2 * kSwapPhaseMaxWarps records that later swap-AB GEMMs write (null: none).
void set_swap_phase_buffer(SwapPhaseRecord* buf);
#endif

/// Bytes of device workspace moe_forward needs for at most `max_tokens` tokens.
std::size_t moe_workspace_bytes(std::int64_t max_tokens, int top_k, std::int64_t experts, std::int64_t hidden,
                                std::int64_t intermediate);

/// out[T, H] (BF16 bits) = spec section 4 for x[T, H] (BF16 bits) and the given routing:
///   a = mxfp8_qdq(x) along H; for each (t, j): g, u = a[t] . w13[e]^T (FP32 accumulation);
///   h = bf16(silu(g) * u); h = mxfp8_qdq(h) along I; y = h . w2[e]^T (FP32);
///   out[t] = bf16(sum_j topk_weights[t, j] * y) (FP32, j ascending).
/// topk_ids: [T, k] int32 in 0..E-1 (checked on the device: an id out of range writes NaN rows);
/// topk_weights: [T, k] FP32. workspace: moe_workspace_bytes(T, k, E, H, I) bytes, 256-aligned.
/// Every output element is written. No host synchronisation.
/// out_f32: when non-null, [T, H] FP32 receives the sums before their BF16 rounding and `out` is not
/// written (expert parallelism adds the partial sums of several ranks, then rounds once).
void moe_forward(const DeviceMoeWeights& w, const std::uint16_t* x, std::int64_t tokens, int top_k,
                 const std::int32_t* topk_ids, const float* topk_weights, std::uint16_t* out, void* workspace,
                 std::size_t workspace_bytes, cudaStream_t stream, MoeStrategy strategy = MoeStrategy::Auto,
                 float* out_f32 = nullptr);

/// The BF16 baseline on the same kernel skeleton: BF16 weights, BF16 activations, no MXFP8 steps
/// (h = bf16(silu(g) * u)). Same arguments and workspace rule as moe_forward.
void moe_forward_bf16(const DeviceMoeWeightsBf16& w, const std::uint16_t* x, std::int64_t tokens, int top_k,
                      const std::int32_t* topk_ids, const float* topk_weights, std::uint16_t* out, void* workspace,
                      std::size_t workspace_bytes, cudaStream_t stream, MoeStrategy strategy = MoeStrategy::Auto,
                      float* out_f32 = nullptr);

/// Weight decoder (process-wide; for testing and benchmarking). All are exact in the products:
///   BytePermute: codebook lookup by PRMT, E4M3 -> FP16 by bit moves (any sm_80+ device);
///   Cvt: codebook lookup by PRMT, E4M3 -> FP16 by sm_89+'s cvt.rn.f16x2.e4m3x2 (sm_90 devices only,
///        else BytePermute);
///   Fp8Mma: swap-AB decode kernels only: the looked-up E4M3 bytes go into mma.sync.m16n8k32.e4m3
///        with E4M3 activation bytes (sm_90 devices only, else BytePermute); the other kernels use
///        Cvt's policy. sm_90 has no FP8 mma.sync: ptxas lowers it to E4M3 -> FP16 conversions of
///        both operands, two FP16 mma and an FADD per accumulator (SASS in docs/perf/moe-gpu.md), so
///        it is slower than Cvt there; kept for comparison and for GPUs with a native FP8 mma.sync.
///        The tensor core sums each 32-column MXFP8 block before the FP32 promotion, as in the FP16
///        decoders.
///   Fp8Wgmma: swap-AB decode kernels only, sm_90a (else BytePermute): the same looked-up E4M3 bytes
///        are the REGISTER A operand of Hopper's native FP8 wgmma.mma_async.m64n8k32.f32.e4m3.e4m3
///        (src/cuda/moe_swapab_sm90.cuh, kernels sm90_lutb_mxfp8_moe_gemm{1,2}_swapab_wgmma): a
///        warpgroup takes 64 weight rows (8 strips; warp w = m16 tile w) and a K range, the E4M3
///        activations of the tile's 8 (16) tokens are the B operand in shared memory (staged per
///        K-tile with the weights). One wgmma (scale-d = 0) per 32-column block and token block;
///        its FP32 result is promoted by the token's block scale, and per K-tile by the tile scale,
///        as in the other decoders. Numerics: the tensor core's sum of one block's 32 products
///        rounds (Hopper's FP8 path keeps a limited number of bits, DeepSeek-V3 report 3.3.2):
///        measured on the H200 against the CPU emulation, normalised error 0.6-5.1e-3 and 72-95 %
///        of the BF16 outputs bit-equal (the other decoders: <= 8e-5, >= 99.9 %), outside the
///        "FP32 up to summation order" above. Speed: 1.15-1.73x slower than Cvt at T = 1..256
///        (docs/perf/moe-gpu.md, "session 13"), so Auto never picks it. The other kernels use
///        Cvt's policy.
///   CvtWs: swap-AB decode kernels only, sm_90a (else BytePermute): Cvt's decode in warp-specialised
///        kernels (src/cuda/moe_swapab_ws_sm90.cuh, sm90_lutb_mxfp8_moe_gemm{1,2}_swapab_ws): one
///        producer warp per CTA streams the weight strips (lane-major index bytes by cp.async.bulk,
///        codebooks and tile scales) into a shared-memory ring guarded by mbarriers, the math warps
///        only read shared memory, decode, mma and promote. Same CTA work split and per-K-tile
///        arithmetic as Cvt, but the math warps take K-tiles interleaved (warp w: w, w + nw, ...;
///        so one bulk copy per strip serves all warps of a stage): only the FP32 addition order
///        differs from Cvt (fixed, deterministic). The other kernels use Cvt's policy. Speed: 0.70-
///        1.10x Cvt's on the H200 at T = 1..64 (faster only at T = 1 on Qwen3-235B / Qwen3-30B and
///        T = 64 on Mixtral; docs/perf/moe-gpu.md "Session 14: warp-specialised TMA decode
///        (dec14)"), so Auto never picks it.
///   Auto (default): swap-AB kernels Cvt on sm_90, the m16 decode kernel Cvt on sm_90, the prefill
///        kernel BytePermute (docs/perf/moe-gpu.md).
enum class WeightDecoder : std::uint8_t { Auto, BytePermute, Cvt, Fp8Mma, Fp8Wgmma, CvtWs };
void set_weight_decoder(WeightDecoder d);

/// Programmatic dependent launch (process-wide; for testing and benchmarking): on sm_90+ the
/// forward's kernels after the first are launched with cudaLaunchAttributeProgrammaticStreamSerialization,
/// so each one starts (and the decode GEMMs prefetch their first weight tiles) while its predecessor
/// finishes; results are bit-identical either way (tested). On by default; off with false here or
/// LUTB_PDL=0 in the environment. Applies to launches (and graph captures) made afterwards.
void set_dependent_launch(bool enabled);

/// Packed bytes (packed + codebook + scale) of the experts a routing touches, for bandwidth
/// accounting: touched_experts * (w13 + w2 bytes per expert).
std::int64_t lutb_bytes_per_expert(const DeviceMoeWeights& w);

}  // namespace lutb::cuda
