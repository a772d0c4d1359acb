// lutb/cuda/moe_layer.hpp: one MoE layer's routed experts resident on the GPU, with the router's
// top-k and the fused forward of lutb/cuda/moe.hpp behind a host-memory interface. The seam the
// command-line tool uses (`lutb moe/eval --device cuda`, the default job's GPU section; src/cli/gpu.cpp)
// so that no CUDA type reaches the CLI's sources.
//
// GpuMoeLayer owns every device buffer: the weights (LUT-B packed in lane-major order, or BF16), the
// correction bias, and the per-call inputs, routing, output and moe_forward workspace (grown to the
// largest token count seen, never shrunk). It runs on its own CUDA stream; forward() is synchronous
// (it returns once `out` is on the host). Not thread-safe (one caller at a time).
//
// Numerics: exactly those of moe_forward / moe_forward_bf16 (spec section 4) for the routing of
// route_softmax_topk / route_deepseek (spec section 5), or for a routing given by the caller.
// Errors: std::invalid_argument for bad shapes or a routing rule without a GPU kernel (message names
// the rule), std::runtime_error naming the CUDA call and CUDA's error string, or "no usable CUDA GPU
// (...)" when no device can be used.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "lutb/moe.hpp"
#include "lutb/tile.hpp"

namespace lutb::cuda {

/// "" when a CUDA device can be used by this process; otherwise why not, e.g. "no usable CUDA GPU
/// (CUDA driver version is insufficient for CUDA runtime version)" or "no usable CUDA GPU (no
/// device)". Never throws.
std::string gpu_unavailable_reason();

/// The current device in words: "NVIDIA H200 (sm_90, 132 SMs, 139.8 GiB)". Throws std::runtime_error
/// when no device is usable (gpu_unavailable_reason()'s text).
std::string gpu_description();

/// True when the router's rule has a GPU kernel: softmax top-k (routed_scaling_factor 1) or DeepSeek-V3
/// grouped sigmoid (lutb/cuda/moe.hpp route_softmax_topk / route_deepseek: E <= 1024, top_k <= 32,
/// sigmoid: >= 2 experts per group). `why` (may be null) receives the reason when false.
bool gpu_routing_supported(const moe::RouterConfig& rc, std::string* why = nullptr);

class GpuMoeLayer {
 public:
  /// LUT-B routed experts. w13: logical [E, 2I, H], w2: [E, H, I] host LutbTensors in the checkpoint
  /// layout (spec 2.2); uploaded once and permuted to lane-major on the device (to_lane_major).
  /// Needs I % 8 == 0. Throws std::invalid_argument naming the tensor for shapes that do not match.
  static GpuMoeLayer lutb(const LutbTensor& w13, const LutbTensor& w2);
  /// BF16 routed experts (the BF16 baseline moe_forward_bf16): host bits w13 [E, 2I, H], w2 [E, H, I]
  /// row-major. Needs H % 64 == 0 and I % 64 == 0 (std::invalid_argument otherwise, naming H and I).
  static GpuMoeLayer bf16(const std::vector<std::uint16_t>& w13, const std::vector<std::uint16_t>& w2,
                          std::int64_t experts, std::int64_t hidden, std::int64_t intermediate);

  GpuMoeLayer(GpuMoeLayer&&) noexcept;
  GpuMoeLayer& operator=(GpuMoeLayer&&) noexcept;
  ~GpuMoeLayer();

  std::int64_t experts() const;
  std::int64_t hidden() const;
  std::int64_t intermediate() const;
  bool packed() const;  // LUT-B (true) or BF16 weights
  /// Bytes of device memory held (weights + buffers).
  std::size_t device_bytes() const;

  /// The routing rule forward() runs on the GPU; correction_bias: [E] FP32 host (sigmoid only; null
  /// = zeros). Throws std::invalid_argument when gpu_routing_supported(rc) is false or rc's experts
  /// differ from the layer's.
  void set_router(const moe::RouterConfig& rc, const float* correction_bias);

  /// out [T, H] BF16 bits (host) = moe_forward of x [T, H] BF16 bits (host) routed on the GPU from
  /// logits [T, E] FP32 (host) with set_router's rule. The chosen ids / weights are copied back into
  /// ids_out / weights_out ([T, k] host) when those are non-null. Synchronous.
  void forward(const float* logits, const std::uint16_t* x, std::int64_t tokens, std::uint16_t* out,
               std::int32_t* ids_out = nullptr, float* weights_out = nullptr);
  /// The same with the routing given: ids [T, k] int32 (0..E-1), weights [T, k] FP32 (host), k >= 1.
  void forward_routed(const std::uint16_t* x, std::int64_t tokens, int top_k, const std::int32_t* ids,
                      const float* weights, std::uint16_t* out);

  /// Median over `reps` (>= 1) runs of the routed-expert forward alone (moe_forward /
  /// moe_forward_bf16 on the inputs and routing of the last forward call, already on the device), in
  /// milliseconds, timed with CUDA events on the layer's stream after one untimed warm-up run.
  /// Throws std::logic_error before any forward.
  double time_last_forward_ms(int reps);

 private:
  struct Impl;
  explicit GpuMoeLayer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace lutb::cuda
