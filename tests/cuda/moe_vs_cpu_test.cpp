// tests/cuda/moe_vs_cpu_test.cpp: the CUDA forward against the project's CPU emulation
// (lutb/moe.hpp: LutbReferenceExperts, the oracle, and LutbCpuExperts, the fast kernel) on the same
// packed weights and routing: equal up to FP32 summation order (spec section 4).
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

#include "cuda/reference.hpp"
#include "cuda/moe_paths.hpp"
#include "lutb/cuda/moe.hpp"
#include "lutb/moe.hpp"

namespace lutb::test {
namespace {
using namespace lutb::moe;

bool gpu_present() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
}

void ok(cudaError_t e) {
  if (e != cudaSuccess) throw std::runtime_error(cudaGetErrorString(e));
}

LutbTensor to_tensor(const HostLutb& h) {
  LutbTensor t(h.shape);
  t.packed = h.packed;
  t.codebook = h.codebook;
  t.scale = h.scale;
  return t;
}

struct Dev {
  void* p = nullptr;
  explicit Dev(std::size_t n) { ok(cudaMalloc(&p, n ? n : 1)); }
  ~Dev() { cudaFree(p); }
  template <class T>
  T* as() const { return static_cast<T*>(p); }
};

std::vector<std::uint16_t> gpu_forward(const HostLutb& w13, const HostLutb& w2, std::int64_t E, std::int64_t H,
                                       std::int64_t I, const std::vector<std::uint16_t>& x, std::int64_t T, int k,
                                       const std::vector<std::int32_t>& ids, const std::vector<float>& wts,
                                       const cuda::heuristics::MoePlan& plan) {
  Dev p13(w13.packed.size()), c13(w13.codebook.size()), s13(w13.scale.size());
  Dev p2(w2.packed.size()), c2(w2.codebook.size()), s2(w2.scale.size());
  ok(cudaMemcpy(p13.p, w13.packed.data(), w13.packed.size(), cudaMemcpyHostToDevice));
  ok(cudaMemcpy(c13.p, w13.codebook.data(), w13.codebook.size(), cudaMemcpyHostToDevice));
  ok(cudaMemcpy(s13.p, w13.scale.data(), w13.scale.size(), cudaMemcpyHostToDevice));
  ok(cudaMemcpy(p2.p, w2.packed.data(), w2.packed.size(), cudaMemcpyHostToDevice));
  ok(cudaMemcpy(c2.p, w2.codebook.data(), w2.codebook.size(), cudaMemcpyHostToDevice));
  ok(cudaMemcpy(s2.p, w2.scale.data(), w2.scale.size(), cudaMemcpyHostToDevice));
  cuda::DeviceMoeWeights w{E, H, I, {w13.shape, p13.as<std::uint8_t>(), c13.as<std::uint8_t>(), s13.as<std::uint8_t>()},
                           {w2.shape, p2.as<std::uint8_t>(), c2.as<std::uint8_t>(), s2.as<std::uint8_t>()}};
  cuda::to_lane_major(w.w13, nullptr);
  cuda::to_lane_major(w.w2, nullptr);
  Dev dx(x.size() * 2), dout(T * H * 2), did(ids.size() * 4), dw(wts.size() * 4);
  ok(cudaMemcpy(dx.p, x.data(), x.size() * 2, cudaMemcpyHostToDevice));
  ok(cudaMemcpy(did.p, ids.data(), ids.size() * 4, cudaMemcpyHostToDevice));
  ok(cudaMemcpy(dw.p, wts.data(), wts.size() * 4, cudaMemcpyHostToDevice));
  ok(cudaMemset(dout.p, 0xff, T * H * 2));  // poison: NaN everywhere
  const std::size_t wsb = cuda::moe_workspace_bytes(T, k, E, H, I);
  Dev ws(wsb);
  cuda::detail::moe_forward_plan(w, dx.as<std::uint16_t>(), T, k, did.as<std::int32_t>(), dw.as<float>(),
                                 dout.as<std::uint16_t>(), ws.p, wsb, nullptr, plan);
  ok(cudaDeviceSynchronize());
  std::vector<std::uint16_t> out(T * H);
  ok(cudaMemcpy(out.data(), dout.p, out.size() * 2, cudaMemcpyDeviceToHost));
  return out;
}

TEST(MoeCudaVsCpu, EqualsProjectEmulationUpToSummationOrder) {
  if (!gpu_present()) GTEST_SKIP() << "no CUDA device: skipping GPU test";
  const std::int64_t E = 16, H = 320, I = 192, T = 40;  // H: padded K of w13 and N of w2
  const int k = 4;
  std::mt19937 rng(2026);
  const HostLutb w13 = random_lutb({E, 2 * I, H, true}, rng), w2 = random_lutb({E, H, I, true}, rng);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<std::uint16_t> x(T * H);
  for (auto& v : x) v = bf16_from_float(nd(rng));
  // Routing by the project's router on random logits (softmax top-k, renormalised).
  std::vector<float> logits(T * E);
  for (auto& v : logits) v = nd(rng);
  RouterConfig rc;
  rc.num_experts = static_cast<int>(E);
  rc.top_k = k;
  rc.norm_topk_prob = true;
  const moe::Routing r = route(rc, logits, T, nullptr);
  MoeConfig cfg;
  cfg.global_experts = static_cast<int>(E);
  cfg.top_k = k;
  cfg.hidden_size = H;
  cfg.intermediate_size_per_partition = I;
  cfg.finalize();
  const HiddenStates hx = HiddenStates::bf16(x.data(), T);
  const TopK tk{r.ids.data(), r.weights.data(), k};
  for (auto kernel : {EmulationKernel::Reference, EmulationKernel::Fast}) {
    auto cpu = make_lutb_experts(cfg, to_tensor(w13), to_tensor(w2), kernel);
    std::vector<std::uint16_t> ref(T * H);
    cpu->apply(hx, tk, ref.data());
    for (const MoePath& path : all_paths(T, k, E, H)) {
      const auto got = gpu_forward(w13, w2, E, H, I, x, T, k, r.ids, r.weights, path.plan);
      double num = 0, den = 0;
      std::int64_t exact = 0, nan = 0;
      for (std::size_t i = 0; i < got.size(); ++i) {
        const double g = bf16_to_float(got[i]), f = bf16_to_float(ref[i]);
        if (std::isnan(g)) ++nan;
        num += (g - f) * (g - f);
        den += f * f;
        exact += got[i] == ref[i];
      }
      SCOPED_TRACE(::testing::Message() << cpu->name() << " path " << path.name);
      EXPECT_EQ(nan, 0);
      EXPECT_LT(std::sqrt(num / den), 1e-3);
      EXPECT_GT(exact, static_cast<std::int64_t>(got.size()) * 8 / 10);
    }
  }
}


}  // namespace
}  // namespace lutb::test
