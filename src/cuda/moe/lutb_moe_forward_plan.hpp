// src/cuda/moe/lutb_moe_forward_plan.hpp: the forward with an explicit plan (private, plain C++: the
// GPU tests include it to run every kept path against the CPU reference, bit for bit where the
// paths promise it). moe_forward runs heuristics::plan_moe(..., moe_device()).
#pragma once

#include <cstddef>
#include <cstdint>

#include "cuda/heuristics/moe_heuristics.hpp"
#include "lutb/cuda/moe.hpp"

namespace lutb::cuda::detail {

/// What the heuristics need of the current device (sm_90a image, SM count; cached per device).
heuristics::MoeDevice moe_device();

/// moe_forward with a given plan (same arguments, checks and contract). A choice the device or the
/// batch cannot take (a fused reduction without a direct forward, the cvt decoder off sm_90a, the
/// activation kernel beyond the workspace's rows) falls back to the default path; an sm_90a prefill
/// kernel on another device throws std::runtime_error. A non-null out_f32 (moe_forward's FP32 output)
/// also turns the fused reduction off.
void moe_forward_plan(const DeviceMoeWeights& w, const std::uint16_t* x, std::int64_t tokens, int top_k,
                      const std::int32_t* topk_ids, const float* topk_weights, std::uint16_t* out, void* workspace,
                      std::size_t workspace_bytes, cudaStream_t stream, const heuristics::MoePlan& plan,
                      float* out_f32 = nullptr);

}  // namespace lutb::cuda::detail
