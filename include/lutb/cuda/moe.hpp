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
/// baseline forward (spec section 4 last paragraph: no MXFP8 steps). Needs H % 64 == 0 and
/// I % 64 == 0.
struct DeviceMoeWeightsBf16 {
  std::int64_t experts = 0, hidden = 0, intermediate = 0;
  const std::uint16_t* w13 = nullptr;
  const std::uint16_t* w2 = nullptr;
};

// ---------------------------------------------------------------------------
// Routing (spec section 5). Outputs are ordered by descending choice score (ties: lower expert); a
// NaN score ranks below every number, as in lutb::moe::route, so ids are in 0..E-1 for any logits.
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
/// Which GEMM kernels a forward runs (docs/design/cuda-moe.md).
///   Auto: by the mean tokens per touched expert (the rule lives in src/cuda/heuristics/).
///   Decode: the swap-AB kernels: weights are the M operand of mma.sync, tokens the N operand in
///     blocks of 8 (the BF16 baseline: its 16-token tile kernel).
///   Prefill: CTA-tiled GEMMs, every weight tile decoded once per CTA into shared memory as BF16
///     with both power-of-two scales folded in (sm_80: mma.sync; sm_90a: wgmma).
/// Every strategy gives the spec section 4 result up to the order of the FP32 additions.
enum class MoeStrategy : std::uint8_t { Auto, Decode, Prefill };

/// The prefill GEMMs of a LUT-B forward on sm_90a (other devices ignore it).
///   Auto: the library's rule (src/cuda/heuristics/): the warp-specialised kernel with the decoded
///     weights as wgmma's register operand and 128 tokens as its shared-memory operand from 128
///     (token, expert) pairs per touched expert, the wgmma tile of 64 tokens below.
///   RegisterWeights: the register-weight kernels at every batch, with 64 tokens below 128 pairs per
///     expert (tests and the benchmark's A/B).
enum class MoePrefillKernel : std::uint8_t { Auto, RegisterWeights };

/// Options of one moe_forward / moe_forward_bf16 call (nothing is process-wide). The defaults are
/// the library's choice; tests and benchmarks force a strategy or a prefill kernel.
struct MoeOptions {
  MoeStrategy strategy = MoeStrategy::Auto;
  MoePrefillKernel prefill = MoePrefillKernel::Auto;
};

/// Bytes of device workspace moe_forward needs for at most `max_tokens` tokens.
std::size_t moe_workspace_bytes(std::int64_t max_tokens, int top_k, std::int64_t experts, std::int64_t hidden,
                                std::int64_t intermediate);

/// out[T, H] (BF16 bits) = spec section 4 for x[T, H] (BF16 bits) and the given routing:
///   a = mxfp8_qdq(x) along H; for each (t, j): g, u = a[t] . w13[e]^T (FP32 accumulation);
///   h = bf16(silu(g) * u); h = mxfp8_qdq(h) along I; y = h . w2[e]^T (FP32);
///   out[t] = bf16(sum_j topk_weights[t, j] * y) (FP32, j ascending).
/// topk_ids: [T, k] int32 in 0..E-1 (checked on the device: an id out of range writes NaN rows);
/// topk_weights: [T, k] FP32. workspace: moe_workspace_bytes(T, k, E, H, I) bytes, 256-aligned.
/// Every output element is written. No host synchronisation. On sm_90 devices the forward's
/// kernels after the first use programmatic dependent launch (each starts while its predecessor
/// finishes; results are the same either way).
/// out_f32: optional second form of the output. When null (the default) the forward is the one
/// described above. When non-null it points to [T, H] FP32 on the device, which receives the FP32
/// sums of the last step, sum_j topk_weights[t, j] * y, before their BF16 rounding (NaN rows for an
/// invalid expert id, as in `out`); `out` is then not written and may be null. The sums come from the
/// separate top-k reduction kernel (the reduction fused into GEMM2 writes BF16 only), so their FP32
/// addition order is the one above. Expert parallelism uses it: every rank sums the pairs of its own
/// experts, the ranks add their partial sums, and the total is rounded to BF16 once.
void moe_forward(const DeviceMoeWeights& w, const std::uint16_t* x, std::int64_t tokens, int top_k,
                 const std::int32_t* topk_ids, const float* topk_weights, std::uint16_t* out, void* workspace,
                 std::size_t workspace_bytes, cudaStream_t stream, const MoeOptions& options = {},
                 float* out_f32 = nullptr);

/// The BF16 baseline on the same kernel skeleton: BF16 weights, BF16 activations, no MXFP8 steps
/// (h = bf16(silu(g) * u)). Same arguments (out_f32 included) and workspace rule as moe_forward. Used
/// by the benchmark's baseline, the CLI's --quant none on the GPU and the Python package's
/// act_format="bf16".
void moe_forward_bf16(const DeviceMoeWeightsBf16& w, const std::uint16_t* x, std::int64_t tokens, int top_k,
                      const std::int32_t* topk_ids, const float* topk_weights, std::uint16_t* out, void* workspace,
                      std::size_t workspace_bytes, cudaStream_t stream, const MoeOptions& options = {},
                      float* out_f32 = nullptr);

/// Packed bytes (packed + codebook + scale) of one expert's w13 and w2, for bandwidth accounting:
/// a forward reads touched_experts times this.
std::int64_t lutb_bytes_per_expert(const DeviceMoeWeights& w);

}  // namespace lutb::cuda
