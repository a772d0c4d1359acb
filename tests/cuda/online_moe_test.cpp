// tests/cuda/online_moe_test.cpp: the online GPU method's output (lutb/cuda/online.hpp) feeds the
// CUDA MoE forward directly: moe_forward on it gives bit-identical outputs to moe_forward on the
// CPU method's bytes (lutb::quantize on the host, uploaded, to_lane_major). Needs the MoE kernels,
// so it is part of lutb_cuda_tests with them (`scripts/gpu_run.sh test`).
// Skips without a GPU.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <random>
#include <string>
#include <vector>

#include "lutb/cuda/moe.hpp"
#include "lutb/cuda/online.hpp"
#include "lutb/fit.hpp"
#include "lutb/numerics.hpp"

namespace lutb::test {
namespace {

bool gpu_here() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
}

template <class T>
T* dev_copy(const std::vector<T>& v) {
  T* p = nullptr;
  EXPECT_EQ(cudaMalloc(&p, v.size() * sizeof(T)), cudaSuccess);
  EXPECT_EQ(cudaMemcpy(p, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice), cudaSuccess);
  return p;
}

TEST(OnlineMoe, OnlineWeightsGiveTheCpuMethodsForward) {
  if (!gpu_here()) GTEST_SKIP() << "no CUDA device: skipping";
  const std::int64_t E = 4, H = 256, I = 128, T = 5;
  const int k = 2;
  std::mt19937 g(11);
  std::normal_distribution<float> nd(0.0f, 0.02f);
  std::vector<std::uint16_t> w13(static_cast<std::size_t>(E * 2 * I * H)), w2(static_cast<std::size_t>(E * H * I)),
      x(static_cast<std::size_t>(T * H));
  for (auto& v : w13) v = bf16_from_float(nd(g));
  for (auto& v : w2) v = bf16_from_float(nd(g));
  for (auto& v : x) v = bf16_from_float(50.0f * nd(g));
  std::vector<std::int32_t> ids(static_cast<std::size_t>(T * k));
  std::vector<float> wts(ids.size());
  for (std::int64_t t = 0; t < T; ++t) {
    ids[static_cast<std::size_t>(t * k)] = static_cast<std::int32_t>(t % E);
    ids[static_cast<std::size_t>(t * k + 1)] = static_cast<std::int32_t>((t + 1 + t / E) % E);
    wts[static_cast<std::size_t>(t * k)] = 0.6f;
    wts[static_cast<std::size_t>(t * k + 1)] = 0.4f;
  }

  // The CPU method's bytes, uploaded and permuted as a checkpoint load does.
  LutbShape s13, s2;
  s13.experts = s2.experts = E;
  s13.stacked = s2.stacked = true;
  s13.rows = 2 * I;
  s13.cols = H;
  s2.rows = H;
  s2.cols = I;
  LutbTensor c13, c2;
  quantize(w13.data(), DType::BF16, s13, c13, FitOptions{}, "w13_weight");
  quantize(w2.data(), DType::BF16, s2, c2, FitOptions{}, "w2_weight");
  std::vector<void*> owned;
  auto dev_lutb = [&](const LutbTensor& t) {
    cuda::DeviceLutb d;
    d.shape = t.shape;
    auto* p = dev_copy(t.packed);
    auto* c = dev_copy(t.codebook);
    auto* s = dev_copy(t.scale);
    owned.insert(owned.end(), {p, c, s});
    d.packed = p;
    d.codebook = c;
    d.scale = s;
    cuda::to_lane_major(d, nullptr);
    return d;
  };
  const cuda::DeviceMoeWeights cpu_w{E, H, I, dev_lutb(c13), dev_lutb(c2)};

  // The online method on the same weights, already on the device.
  auto* d13 = dev_copy(w13);
  auto* d2 = dev_copy(w2);
  cuda::DeviceExpertSource src;
  src.dtype = DType::BF16;
  src.experts = E;
  src.hidden = H;
  src.intermediate = I;
  src.w13 = {d13};
  src.w2 = {d2};
  src.release = [&](std::int64_t, std::int64_t e1) {
    if (e1 == E) {
      cudaFree(d13);
      cudaFree(d2);
    }
  };
  cuda::DeviceLutbLayer layer;
  cuda::quantize_experts_online(src, layer);

  auto* dx = dev_copy(x);
  auto* did = dev_copy(ids);
  auto* dw = dev_copy(wts);
  const std::size_t wsb = cuda::moe_workspace_bytes(T, k, E, H, I);
  void* ws = nullptr;
  std::uint16_t* out = nullptr;
  ASSERT_EQ(cudaMalloc(&ws, wsb), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&out, static_cast<std::size_t>(T * H) * 2), cudaSuccess);
  auto forward = [&](const cuda::DeviceMoeWeights& w) {
    std::vector<std::uint16_t> h(static_cast<std::size_t>(T * H));
    EXPECT_EQ(cudaMemset(out, 0xff, h.size() * 2), cudaSuccess);  // poison
    cuda::moe_forward(w, dx, T, k, did, dw, out, ws, wsb, nullptr);
    EXPECT_EQ(cudaMemcpy(h.data(), out, h.size() * 2, cudaMemcpyDeviceToHost), cudaSuccess);
    return h;
  };
  const std::vector<std::uint16_t> want = forward(cpu_w), got = forward(layer.weights());
  EXPECT_EQ(got, want);
  int nan = 0;
  for (std::uint16_t v : got) nan += f32_is_nan(bf16_to_float(v)) ? 1 : 0;
  EXPECT_EQ(nan, 0);
  for (void* p : owned) cudaFree(p);
  for (void* p : {static_cast<void*>(dx), static_cast<void*>(did), static_cast<void*>(dw), ws,
                  static_cast<void*>(out)})
    cudaFree(p);
}

}  // namespace
}  // namespace lutb::test
