// tests/cuda/online_gpu_test.cpp: the online LUT-B method on the GPU (lutb/cuda/online.hpp):
// device BF16/FP16 experts in, packed LUT-B out with the bytes of lutb::quantize on the host
// (then permuted to lane-major order), source released chunk by chunk, device memory bounded by the
// chunk, errors before anything is released, idempotence. Skips without a GPU.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "lutb/cuda/lane_major.hpp"
#include "lutb/cuda/online.hpp"
#include "lutb/fit.hpp"
#include "lutb/numerics.hpp"
#include "lutb/safetensors.hpp"
#include "support/test_support.hpp"

namespace lutb::test {
namespace {

bool gpu_present() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
}

#define LUTB_GPU_OR_SKIP() \
  if (!gpu_present()) GTEST_SKIP() << "no CUDA device: skipping"

#define CUDA_OK(x) ASSERT_EQ((x), cudaSuccess)

LutbShape stack(std::int64_t e, std::int64_t n, std::int64_t k) {
  LutbShape s;
  s.experts = e;
  s.rows = n;
  s.cols = k;
  s.stacked = true;
  return s;
}

// Host copy of one layer: w13 [E, 2I, H], w2 [E, H, I] (16-bit bits).
struct HostLayer {
  std::int64_t E = 0, H = 0, I = 0;
  DType dtype = DType::BF16;
  std::vector<std::uint16_t> w13, w2;
};

HostLayer random_layer(std::int64_t E, std::int64_t H, std::int64_t I, DType dt, std::uint32_t seed) {
  HostLayer l{E, H, I, dt, {}, {}};
  std::mt19937 g(seed);
  std::student_t_distribution<float> td(4.0f);
  auto enc = [&](float v) { return dt == DType::BF16 ? bf16_from_float(v) : fp16_from_float(v); };
  l.w13.resize(static_cast<std::size_t>(E * 2 * I * H));
  l.w2.resize(static_cast<std::size_t>(E * H * I));
  for (auto& x : l.w13) x = enc(0.02f * td(g));
  for (auto& x : l.w2) x = enc(0.03f * td(g));
  return l;
}

// The CPU method's bytes: lutb::quantize (binned-dp, or `fitter`; with column weights w13 [E][H]
// and w2 [E][I] when given), then every tile permuted to lane-major.
struct Expected {
  LutbTensor w13, w2;
  FitStats s13, s2;
};
Expected cpu_expected(const HostLayer& l, bool lane_major, const std::string& fitter = "",
                      const float* w13_weights = nullptr, const float* w2_weights = nullptr) {
  Expected x;
  FitOptions fo;
  fo.fitter = fitter;
  fo.column_weights = w13_weights;
  x.s13 = quantize(l.w13.data(), l.dtype, stack(l.E, 2 * l.I, l.H), x.w13, fo, "w13_weight");
  fo.column_weights = w2_weights;
  x.s2 = quantize(l.w2.data(), l.dtype, stack(l.E, l.H, l.I), x.w2, fo, "w2_weight");
  if (lane_major)
    for (LutbTensor* t : {&x.w13, &x.w2})
      for (std::size_t i = 0; i < t->packed.size(); i += kPackedBytes) {
        std::uint8_t lm[kPackedBytes];
        cuda::tile_to_lane_major(t->packed.data() + i, lm);
        std::memcpy(t->packed.data() + i, lm, kPackedBytes);
      }
  return x;
}

// Device copies of the layer, one allocation per expert and matrix (or one stack each).
struct DeviceSource {
  std::vector<void*> w13, w2;
  ~DeviceSource() { free_all(); }
  void free_all() {
    for (auto* v : {&w13, &w2})
      for (void*& p : *v) {
        if (p) cudaFree(p);
        p = nullptr;
      }
  }
};

void upload(const HostLayer& l, bool stacked, DeviceSource& d, cuda::DeviceExpertSource& src) {
  src = cuda::DeviceExpertSource{};
  src.dtype = l.dtype;
  src.experts = l.E;
  src.hidden = l.H;
  src.intermediate = l.I;
  const std::size_t n13 = static_cast<std::size_t>(2 * l.I * l.H), n2 = static_cast<std::size_t>(l.H * l.I);
  const std::int64_t parts = stacked ? 1 : l.E;
  const std::size_t per13 = stacked ? n13 * l.E : n13, per2 = stacked ? n2 * l.E : n2;
  for (std::int64_t e = 0; e < parts; ++e) {
    void* a = nullptr;
    void* b = nullptr;
    ASSERT_EQ(cudaMalloc(&a, per13 * 2), cudaSuccess);
    ASSERT_EQ(cudaMalloc(&b, per2 * 2), cudaSuccess);
    ASSERT_EQ(cudaMemcpy(a, l.w13.data() + e * n13, per13 * 2, cudaMemcpyHostToDevice), cudaSuccess);
    ASSERT_EQ(cudaMemcpy(b, l.w2.data() + e * n2, per2 * 2, cudaMemcpyHostToDevice), cudaSuccess);
    d.w13.push_back(a);
    d.w2.push_back(b);
    src.w13.push_back(a);
    src.w2.push_back(b);
  }
}

std::vector<std::uint8_t> to_host(const std::uint8_t* p, std::size_t n) {
  std::vector<std::uint8_t> h(n);
  EXPECT_EQ(cudaMemcpy(h.data(), p, n, cudaMemcpyDeviceToHost), cudaSuccess);
  return h;
}

void expect_equal_layer(const cuda::DeviceLutbLayer& out, const Expected& x) {
  const cuda::DeviceMoeWeights& w = out.weights();
  for (int which = 0; which < 2; ++which) {
    const cuda::DeviceLutb& d = which == 0 ? w.w13 : w.w2;
    const LutbTensor& c = which == 0 ? x.w13 : x.w2;
    SCOPED_TRACE(which == 0 ? "w13" : "w2");
    EXPECT_EQ(d.shape.tiles(), c.shape.tiles());
    const auto packed = to_host(d.packed, c.packed.size());
    std::int64_t bad = -1;
    for (std::size_t t = 0; t * kPackedBytes < c.packed.size() && bad < 0; ++t)
      if (std::memcmp(packed.data() + t * kPackedBytes, c.packed.data() + t * kPackedBytes, kPackedBytes) != 0)
        bad = static_cast<std::int64_t>(t);
    EXPECT_EQ(bad, -1) << "packed bytes differ first at tile " << bad;
    EXPECT_EQ(to_host(d.codebook, c.codebook.size()), c.codebook);
    EXPECT_EQ(to_host(d.scale, c.scale.size()), c.scale);
  }
}

TEST(OnlineGpu, RandomLayerMatchesCpuAndReleasesByChunk) {
  LUTB_GPU_OR_SKIP();
  // I = 40: w2's columns end mid-tile (padding); H = 200: w13's too.
  const HostLayer l = random_layer(5, 200, 40, DType::BF16, 1);
  const Expected x = cpu_expected(l, true);
  DeviceSource d;
  cuda::DeviceExpertSource src;
  upload(l, false, d, src);
  std::vector<std::pair<std::int64_t, std::int64_t>> released;
  src.release = [&](std::int64_t e0, std::int64_t e1) {
    released.emplace_back(e0, e1);
    for (std::int64_t e = e0; e < e1; ++e) {
      cudaFree(d.w13[static_cast<std::size_t>(e)]);
      cudaFree(d.w2[static_cast<std::size_t>(e)]);
      d.w13[static_cast<std::size_t>(e)] = d.w2[static_cast<std::size_t>(e)] = nullptr;
    }
  };
  cuda::GpuOnlineOptions opt;
  opt.chunk_bytes = 2 * (3 * 40 * 200 * 2) + 100;  // two experts per chunk
  cuda::DeviceLutbLayer out;
  const cuda::GpuOnlineReport rep = cuda::quantize_experts_online(src, out, opt);
  EXPECT_EQ(rep.experts_per_chunk, 2);
  EXPECT_EQ(rep.chunks, 3);
  const std::vector<std::pair<std::int64_t, std::int64_t>> want = {{0, 2}, {2, 4}, {4, 5}};
  EXPECT_EQ(released, want);
  EXPECT_EQ(rep.source_bytes, static_cast<std::size_t>(5 * 3 * 40 * 200 * 2));
  EXPECT_EQ(rep.w13.tiles, x.s13.tiles);
  EXPECT_EQ(rep.w13.sse, x.s13.sse);
  EXPECT_EQ(rep.w13.sum_sq, x.s13.sum_sq);
  EXPECT_EQ(rep.w2.sse, x.s2.sse);
  EXPECT_EQ(rep.w2.sum_sq, x.s2.sum_sq);
  EXPECT_TRUE(src.already_processed);
  EXPECT_TRUE(src.w13.empty());
  EXPECT_EQ(out.weights().experts, 5);
  EXPECT_EQ(out.weights().hidden, 200);
  EXPECT_EQ(out.weights().intermediate, 40);
  EXPECT_TRUE(out.weights().w13.lane_major);
  EXPECT_TRUE(out.weights().w2.lane_major);
  expect_equal_layer(out, x);
  // Idempotent: a second call does nothing (no release, empty report, output unchanged).
  const cuda::GpuOnlineReport again = cuda::quantize_experts_online(src, out, opt);
  EXPECT_EQ(again.chunks, 0);
  EXPECT_EQ(released.size(), 3u);
  expect_equal_layer(out, x);
}

// The online method with the optimal fitter: the CPU optimal fitter's bytes and FitStats, the
// selection message names it, and fitters without a GPU kernel are refused before anything runs.
TEST(OnlineGpu, OptimalFitterMatchesCpu) {
  LUTB_GPU_OR_SKIP();
  const HostLayer l = random_layer(3, 200, 40, DType::BF16, 5);  // padded tiles in both matrices
  const Expected x = cpu_expected(l, true, "optimal");
  DeviceSource d;
  cuda::DeviceExpertSource src;
  upload(l, false, d, src);
  int released = 0;
  src.release = [&](std::int64_t e0, std::int64_t e1) { released += static_cast<int>(e1 - e0); };
  cuda::GpuOnlineOptions opt;
  opt.fitter = "optimal";
  opt.chunk_bytes = 1;  // one expert per chunk
  std::vector<std::string> msgs;
  opt.log = [&](const std::string& m) { msgs.push_back(m); };
  cuda::DeviceLutbLayer out;
  const cuda::GpuOnlineReport rep = cuda::quantize_experts_online(src, out, opt);
  EXPECT_EQ(released, 3);
  EXPECT_EQ(rep.chunks, 3);
  EXPECT_EQ(rep.w13.sse, x.s13.sse);
  EXPECT_EQ(rep.w13.sum_sq, x.s13.sum_sq);
  EXPECT_EQ(rep.w2.sse, x.s2.sse);
  EXPECT_EQ(rep.w2.sum_sq, x.s2.sum_sq);
  expect_equal_layer(out, x);
  ASSERT_LE(msgs.size(), 1u);
  if (!msgs.empty()) {
    EXPECT_NE(msgs[0].find("quantised on the GPU (optimal)"), std::string::npos) << msgs[0];
  }

  DeviceSource d2;
  cuda::DeviceExpertSource src2;
  upload(l, false, d2, src2);
  int released2 = 0;
  src2.release = [&](std::int64_t, std::int64_t) { ++released2; };
  cuda::GpuOnlineOptions bad;
  bad.fitter = "ct-lloyd";
  cuda::DeviceLutbLayer out2;
  std::string msg;
  try {
    cuda::quantize_experts_online(src2, out2, bad);
  } catch (const std::invalid_argument& e) {
    msg = e.what();
  }
  EXPECT_EQ(msg,
            "quantize_experts_online: fitter 'ct-lloyd' has no GPU kernel (GPU fitters: binned-dp, optimal); "
            "lutb::quantize runs it on the CPU");
  EXPECT_EQ(released2, 0);
  EXPECT_TRUE(out2.empty());
  EXPECT_FALSE(src2.already_processed);
}

// The online method with column weights (GpuOnlineOptions::w13_column_weights / w2_column_weights,
// device memory, log-uniform over 1e-3..1e3): the CPU's weighted bytes and FitStats with both
// fitters, per-expert and stacked sources, and w13 alone weighted; a column weight that breaks the
// rule is refused before anything is released, in lutb::quantize's words.
TEST(OnlineGpu, WeightedLayerMatchesCpu) {
  LUTB_GPU_OR_SKIP();
  const HostLayer l = random_layer(3, 200, 40, DType::BF16, 9);  // padded tiles in both matrices
  std::mt19937 g(10);
  std::uniform_real_distribution<float> ud(-3.0f, 3.0f);
  std::vector<float> w13(3 * 200), w2(3 * 40);
  for (auto* v : {&w13, &w2})
    for (float& x : *v) x = std::pow(10.0f, ud(g));
  float* d_w13 = nullptr;
  float* d_w2 = nullptr;
  CUDA_OK(cudaMalloc(&d_w13, w13.size() * sizeof(float)));
  CUDA_OK(cudaMalloc(&d_w2, w2.size() * sizeof(float)));
  CUDA_OK(cudaMemcpy(d_w13, w13.data(), w13.size() * sizeof(float), cudaMemcpyHostToDevice));
  CUDA_OK(cudaMemcpy(d_w2, w2.data(), w2.size() * sizeof(float), cudaMemcpyHostToDevice));
  const Expected plain = cpu_expected(l, true);
  for (const std::string fitter : {"", "optimal"}) {
    for (const bool w2_too : {true, false}) {
      for (const bool stacked : {false, true}) {
        SCOPED_TRACE(fitter + (w2_too ? " both weighted" : " w13 weighted") + (stacked ? " stacked" : " per expert"));
        const Expected x = cpu_expected(l, true, fitter, w13.data(), w2_too ? w2.data() : nullptr);
        EXPECT_NE(x.w13.codebook, plain.w13.codebook);  // (the weights matter)
        DeviceSource d;
        cuda::DeviceExpertSource src;
        upload(l, stacked, d, src);
        cuda::GpuOnlineOptions opt;
        opt.fitter = fitter;
        opt.chunk_bytes = 1;  // one expert per chunk: the weights' offsets
        opt.w13_column_weights = d_w13;
        opt.w2_column_weights = w2_too ? d_w2 : nullptr;
        cuda::DeviceLutbLayer out;
        const cuda::GpuOnlineReport rep = cuda::quantize_experts_online(src, out, opt);
        EXPECT_EQ(rep.w13.sse, x.s13.sse);
        EXPECT_EQ(rep.w13.sum_sq, x.s13.sum_sq);
        EXPECT_EQ(rep.w2.sse, x.s2.sse);
        expect_equal_layer(out, x);
      }
    }
  }
  std::vector<float> bad = w2;
  bad[2 * 40 + 7] = -0.5f;  // expert 2, column 7
  CUDA_OK(cudaMemcpy(d_w2, bad.data(), bad.size() * sizeof(float), cudaMemcpyHostToDevice));
  FitOptions fo;
  fo.column_weights = bad.data();
  std::string cpu_msg, msg;
  LutbTensor t;
  try {
    quantize(l.w2.data(), DType::BF16, stack(3, 200, 40), t, fo, "w2_weight");
  } catch (const std::invalid_argument& e) {
    cpu_msg = e.what();
  }
  EXPECT_EQ(cpu_msg, "quantize: tensor w2_weight, expert 2: column weight 7 is -0.5; column weights must be finite and > 0");
  DeviceSource d;
  cuda::DeviceExpertSource src;
  upload(l, false, d, src);
  int releases = 0;
  src.release = [&](std::int64_t, std::int64_t) { ++releases; };
  cuda::GpuOnlineOptions opt;
  opt.w13_column_weights = d_w13;
  opt.w2_column_weights = d_w2;
  cuda::DeviceLutbLayer out;
  try {
    cuda::quantize_experts_online(src, out, opt);
  } catch (const std::invalid_argument& e) {
    msg = e.what();
  }
  EXPECT_EQ(msg, "quantize_experts_online: " + cpu_msg.substr(10));
  EXPECT_EQ(releases, 0);
  EXPECT_TRUE(out.empty());
  EXPECT_FALSE(src.already_processed);
  cudaFree(d_w13);
  cudaFree(d_w2);
}

TEST(OnlineGpu, StackedF16CheckpointOrder) {
  LUTB_GPU_OR_SKIP();
  const HostLayer l = random_layer(3, 128, 64, DType::F16, 2);
  const Expected x = cpu_expected(l, false);
  DeviceSource d;
  cuda::DeviceExpertSource src;
  upload(l, true, d, src);
  int calls = 0;
  src.release = [&](std::int64_t, std::int64_t e1) {
    ++calls;
    if (e1 == 3) d.free_all();  // a stack is freed once all of it is consumed
  };
  cuda::GpuOnlineOptions opt;
  opt.lane_major = false;
  opt.chunk_bytes = 1;  // one expert per chunk
  cuda::DeviceLutbLayer out;
  const cuda::GpuOnlineReport rep = cuda::quantize_experts_online(src, out, opt);
  EXPECT_FALSE(out.weights().w13.lane_major);
  EXPECT_EQ(calls, 3);
  EXPECT_EQ(rep.w2.sse, x.s2.sse);
  expect_equal_layer(out, x);
}

TEST(OnlineGpu, TinyQwen3MoeLayer) {
  LUTB_GPU_OR_SKIP();
  LUTB_MODEL_OR_SKIP(dir, "tiny-qwen3-moe");
  SafetensorsFile f(dir / "model.safetensors");
  HostLayer l;
  l.dtype = DType::BF16;
  for (int layer : {0, 1}) {
    l.w13.clear();
    l.w2.clear();
    std::int64_t e = 0;
    for (;; ++e) {
      const std::string p = "model.layers." + std::to_string(layer) + ".mlp.experts." + std::to_string(e) + ".";
      if (!f.contains(p + "gate_proj.weight")) break;
      for (const char* proj : {"gate_proj", "up_proj"}) {
        const auto span = f.get(p + proj + ".weight").as<std::uint16_t>(DType::BF16);
        l.w13.insert(l.w13.end(), span.begin(), span.end());
      }
      const TensorView& down = f.get(p + "down_proj.weight");
      l.H = down.shape[0];
      l.I = down.shape[1];
      const auto span = down.as<std::uint16_t>(DType::BF16);
      l.w2.insert(l.w2.end(), span.begin(), span.end());
    }
    if (e == 0) break;
    l.E = e;
    SCOPED_TRACE("layer " + std::to_string(layer));
    const Expected x = cpu_expected(l, true);
    DeviceSource d;
    cuda::DeviceExpertSource src;
    upload(l, false, d, src);
    cuda::GpuOnlineOptions opt;
    opt.chunk_bytes = 4 * static_cast<std::size_t>(3 * l.H * l.I * 2);
    cuda::DeviceLutbLayer out;
    const cuda::GpuOnlineReport rep = cuda::quantize_experts_online(src, out, opt);
    EXPECT_EQ(rep.w13.sse, x.s13.sse);
    EXPECT_EQ(rep.w2.sse, x.s2.sse);
    expect_equal_layer(out, x);
  }
}

// Peak device memory: the source (until released) + the output + the temporaries (two chunks'
// per-tile sums), measured with cudaMemGetInfo inside the release callback (before that chunk is
// freed), against a layer 16x the chunk.
TEST(OnlineGpu, MemoryBoundedByChunk) {
  LUTB_GPU_OR_SKIP();
  const std::int64_t E = 16, H = 1024, I = 512;
  const HostLayer l = random_layer(E, H, I, DType::BF16, 3);
  const std::size_t expert_bytes = static_cast<std::size_t>(3 * H * I * 2);  // 3 MiB
  {  // warm-up: kernels loaded, context settled
    const HostLayer w = random_layer(2, 64, 64, DType::BF16, 4);
    DeviceSource d;
    cuda::DeviceExpertSource src;
    upload(w, false, d, src);
    cuda::DeviceLutbLayer out;
    cuda::quantize_experts_online(src, out);
  }
  DeviceSource d;
  cuda::DeviceExpertSource src;
  upload(l, false, d, src);
  CUDA_OK(cudaDeviceSynchronize());
  std::size_t free0 = 0, total = 0;
  CUDA_OK(cudaMemGetInfo(&free0, &total));
  std::size_t min_free = free0;
  std::int64_t held = E;  // experts still allocated
  std::size_t worst_excess = 0;
  src.release = [&](std::int64_t e0, std::int64_t e1) {
    std::size_t f = 0, t = 0;
    cudaMemGetInfo(&f, &t);
    min_free = std::min(min_free, f);
    // Memory in use beyond the sources already freed: (free0 - f) - (E - held) * expert_bytes.
    const std::size_t used = free0 - f + static_cast<std::size_t>(E - held) * expert_bytes;
    worst_excess = std::max(worst_excess, used);
    for (std::int64_t e = e0; e < e1; ++e) {
      cudaFree(d.w13[static_cast<std::size_t>(e)]);
      cudaFree(d.w2[static_cast<std::size_t>(e)]);
      d.w13[static_cast<std::size_t>(e)] = d.w2[static_cast<std::size_t>(e)] = nullptr;
    }
    held -= e1 - e0;
  };
  cuda::GpuOnlineOptions opt;
  opt.chunk_bytes = expert_bytes;  // one expert per chunk: 1/16 of the layer
  cuda::DeviceLutbLayer out;
  const cuda::GpuOnlineReport rep = cuda::quantize_experts_online(src, out, opt);
  std::size_t free1 = 0;
  CUDA_OK(cudaMemGetInfo(&free1, &total));
  const std::size_t layer = static_cast<std::size_t>(E) * expert_bytes;
  const std::size_t slack = std::size_t{4} << 20;  // allocation granularity (2 MiB pages)
  std::printf("layer %zu B, output %zu B, temporaries %zu B, peak extra over the sources %zu B\n", layer,
              rep.quantized_bytes, rep.temp_bytes, worst_excess);
  EXPECT_EQ(rep.chunks, E);
  // Two chunks' per-tile sums (double-buffered) + the error words:
  // 2 x 2 x 8 B x 2048 tiles of w13 + 256 = 65,792 B for this 3 MiB chunk.
  EXPECT_LE(rep.temp_bytes, expert_bytes / 32 + 1024);
  // Extra memory at any release point: at most the output + temporaries (+ granularity), which is
  // far below the layer (a BF16 staging copy would be 48 MiB).
  EXPECT_LE(worst_excess, rep.quantized_bytes + rep.temp_bytes + slack);
  EXPECT_LT(worst_excess, layer / 3);
  // After the call: every source is freed and only the output remains.
  EXPECT_EQ(held, 0);
  EXPECT_GE(free1 + rep.quantized_bytes + slack, free0 + layer);
}

TEST(OnlineGpu, ErrorsBeforeAnythingIsReleased) {
  LUTB_GPU_OR_SKIP();
  HostLayer l = random_layer(3, 128, 64, DType::BF16, 5);
  // A NaN in w2 of expert 2 and a -Inf in w13 of expert 1: w13 is reported (the CPU fits it first).
  l.w2[static_cast<std::size_t>(2 * 128 * 64 + 70 * 64 + 5)] = 0x7fc0;
  std::string cpu_msg;
  LutbTensor t;
  try {
    quantize(l.w2.data(), DType::BF16, stack(3, 128, 64), t, FitOptions{}, "w2_weight");
  } catch (const std::invalid_argument& e) {
    cpu_msg = e.what();
  }
  ASSERT_EQ(cpu_msg.rfind("quantize: ", 0), 0u);
  for (bool with_w13_error : {false, true}) {
    if (with_w13_error) l.w13[static_cast<std::size_t>(1 * 128 * 128 + 9 * 128 + 100)] = 0xff80;  // -Inf
    // Per-expert and stacked sources.
    for (bool stacked : {false, true}) {
      SCOPED_TRACE(stacked ? "stacked" : "per expert");
      DeviceSource d;
      cuda::DeviceExpertSource src;
      upload(l, stacked, d, src);
      int releases = 0;
      src.release = [&](std::int64_t, std::int64_t) { ++releases; };
      cuda::GpuOnlineOptions opt;
      opt.chunk_bytes = 1;
      cuda::DeviceLutbLayer out;
      std::string msg;
      try {
        cuda::quantize_experts_online(src, out, opt);
      } catch (const std::invalid_argument& e) {
        msg = e.what();
      }
      EXPECT_EQ(releases, 0);
      EXPECT_FALSE(src.already_processed);
      EXPECT_EQ(src.w13.size(), stacked ? 1u : 3u);
      EXPECT_TRUE(out.empty());
      if (!with_w13_error) {
        EXPECT_EQ(msg, "quantize_experts_online: " + cpu_msg.substr(10));
      } else {
        EXPECT_EQ(msg, "quantize_experts_online: tensor w13_weight, expert 1, tile (1, 1): -Inf at row 9 col 100");
      }
    }
  }
  // Bad arguments.
  DeviceSource d;
  cuda::DeviceExpertSource good;
  upload(random_layer(2, 64, 64, DType::BF16, 6), false, d, good);
  auto msg_of = [&](cuda::DeviceExpertSource s, cuda::GpuOnlineOptions o = {}) {
    cuda::DeviceLutbLayer out;
    try {
      cuda::quantize_experts_online(s, out, o);
    } catch (const std::invalid_argument& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  cuda::DeviceExpertSource s = good;
  s.dtype = DType::F32;
  EXPECT_EQ(msg_of(s), "quantize_experts_online: weight dtype F32 is not BF16 or F16");
  s = good;
  s.intermediate = 12;
  EXPECT_NE(msg_of(s).find("intermediate size 12 is not a multiple of 8"), std::string::npos) << msg_of(s);
  s = good;
  s.w2.pop_back();
  s.w2.push_back(nullptr);
  EXPECT_EQ(msg_of(s), "quantize_experts_online: w2 pointer 1 is null");
  s = good;
  s.w13.push_back(s.w13[0]);
  EXPECT_NE(msg_of(s).find("w13 has 3 pointers; expected 1 (stacked) or 2"), std::string::npos) << msg_of(s);
  s = good;
  s.experts = 0;
  EXPECT_NE(msg_of(s).find("must be >= 1"), std::string::npos);
  cuda::GpuOnlineOptions o;
  o.forced_scale = 2;
  EXPECT_NE(msg_of(good, o).find("forced_scale 2 is outside"), std::string::npos);
}

// A weight too large for any scale byte <= 246 (BF16 0x7f78 = 3.3e38): the online method's message
// equals the CPU fitter's, magnitude printed as the shortest round-trip decimal (std::to_chars on
// both sides, not std::to_string's 39 digits and ".000000").
TEST(OnlineGpu, TooLargeMagnitudeMatchesCpu) {
  LUTB_GPU_OR_SKIP();
  HostLayer l = random_layer(2, 128, 64, DType::BF16, 7);
  l.w2[static_cast<std::size_t>(1 * 128 * 64 + 3 * 64 + 10)] = 0x7f78;
  std::string cpu_msg;
  LutbTensor t;
  try {
    quantize(l.w2.data(), DType::BF16, stack(2, 128, 64), t, FitOptions{}, "w2_weight");
  } catch (const std::invalid_argument& e) {
    cpu_msg = e.what();
  }
  ASSERT_EQ(cpu_msg.rfind("quantize: ", 0), 0u) << cpu_msg;
  EXPECT_NE(cpu_msg.find("magnitude 3.29"), std::string::npos) << cpu_msg;
  EXPECT_NE(cpu_msg.find("e+38 needs a scale byte above 246"), std::string::npos) << cpu_msg;
  DeviceSource d;
  cuda::DeviceExpertSource src;
  upload(l, false, d, src);
  cuda::DeviceLutbLayer out;
  std::string msg;
  try {
    cuda::quantize_experts_online(src, out);
  } catch (const std::invalid_argument& e) {
    msg = e.what();
  }
  EXPECT_EQ(msg, "quantize_experts_online: " + cpu_msg.substr(10));
}

TEST(OnlineGpu, SelectionLoggedOnce) {
  LUTB_GPU_OR_SKIP();
  std::vector<std::string> msgs;
  cuda::GpuOnlineOptions opt;
  opt.log = [&](const std::string& m) { msgs.push_back(m); };
  for (int i = 0; i < 2; ++i) {
    DeviceSource d;
    cuda::DeviceExpertSource src;
    upload(random_layer(1, 64, 64, DType::BF16, 7 + i), false, d, src);
    cuda::DeviceLutbLayer out;
    cuda::quantize_experts_online(src, out, opt);
  }
  // Once per process: at most one message (none if an earlier test in this process logged it).
  ASSERT_LE(msgs.size(), 1u);
  if (!msgs.empty()) {
    EXPECT_NE(msgs[0].find("quantised on the GPU (binned-dp)"), std::string::npos) << msgs[0];
  }
}

// The method writes the CPU method's bytes and FitStats and releases the chunks in expert order,
// over chunkings that reuse the double-buffered sums many times (one expert per chunk: 14 work
// items), a partial last chunk, stacked and per-expert sources, F16, checkpoint order, without
// stats, and on a caller's non-blocking stream.
TEST(OnlineGpu, ChunkingsMatchCpu) {
  LUTB_GPU_OR_SKIP();
  struct Case {
    DType dt;
    bool stacked, lane_major, stats, own_stream;
    std::int64_t per_chunk;
  };
  const Case cases[] = {{DType::BF16, false, true, true, false, 1}, {DType::BF16, false, true, true, true, 3},
                        {DType::BF16, true, true, true, false, 2},  {DType::F16, true, false, true, true, 1},
                        {DType::BF16, false, true, false, false, 2}, {DType::F16, false, true, true, false, 7}};
  const std::int64_t E = 7, H = 200, I = 40;  // padded tiles in both matrices
  const HostLayer lb = random_layer(E, H, I, DType::BF16, 11), lf = random_layer(E, H, I, DType::F16, 12);
  const Expected xb = cpu_expected(lb, true), xb_ck = cpu_expected(lb, false);
  const Expected xf = cpu_expected(lf, true), xf_ck = cpu_expected(lf, false);
  const std::size_t expert_bytes = static_cast<std::size_t>(3 * H * I * 2);
  cudaStream_t own = nullptr;
  CUDA_OK(cudaStreamCreateWithFlags(&own, cudaStreamNonBlocking));
  for (const Case& c : cases) {
    const HostLayer& l = c.dt == DType::BF16 ? lb : lf;
    const Expected& x = c.dt == DType::BF16 ? (c.lane_major ? xb : xb_ck) : (c.lane_major ? xf : xf_ck);
    std::vector<std::pair<std::int64_t, std::int64_t>> rel;
    {
      SCOPED_TRACE(std::string(c.dt == DType::BF16 ? "BF16" : "F16") +
                   (c.stacked ? ", stacked" : ", per expert") + ", " + std::to_string(c.per_chunk) +
                   " experts per chunk" + (c.stats ? "" : ", no stats") + (c.own_stream ? ", own stream" : ""));
      DeviceSource d;
      cuda::DeviceExpertSource src;
      upload(l, c.stacked, d, src);
      src.release = [&](std::int64_t e0, std::int64_t e1) { rel.emplace_back(e0, e1); };
      cuda::GpuOnlineOptions opt;
      opt.chunk_bytes = static_cast<std::size_t>(c.per_chunk) * expert_bytes;
      opt.lane_major = c.lane_major;
      opt.stats = c.stats;
      opt.stream = c.own_stream ? own : nullptr;
      cuda::DeviceLutbLayer out;
      const cuda::GpuOnlineReport rep = cuda::quantize_experts_online(src, out, opt);
      const std::int64_t chunks = (E + c.per_chunk - 1) / c.per_chunk;
      EXPECT_EQ(rep.experts_per_chunk, c.per_chunk);
      EXPECT_EQ(rep.chunks, chunks);
      ASSERT_EQ(rel.size(), static_cast<std::size_t>(chunks));
      for (std::int64_t k = 0; k < chunks; ++k) {
        EXPECT_EQ(rel[static_cast<std::size_t>(k)].first, k * c.per_chunk);
        EXPECT_EQ(rel[static_cast<std::size_t>(k)].second, std::min(E, (k + 1) * c.per_chunk));
      }
      EXPECT_EQ(rep.w13.tiles, x.s13.tiles);
      EXPECT_EQ(rep.w2.tiles, x.s2.tiles);
      if (c.stats) {
        EXPECT_EQ(rep.w13.sse, x.s13.sse);
        EXPECT_EQ(rep.w13.sum_sq, x.s13.sum_sq);
        EXPECT_EQ(rep.w2.sse, x.s2.sse);
        EXPECT_EQ(rep.w2.sum_sq, x.s2.sum_sq);
      } else {
        EXPECT_EQ(rep.w13.sse, 0.0);
        EXPECT_EQ(rep.w2.sum_sq, 0.0);
      }
      EXPECT_EQ(out.weights().w13.lane_major, c.lane_major);
      expect_equal_layer(out, x);
    }
  }
  CUDA_OK(cudaStreamDestroy(own));
}

// release(e0, e1) comes only after the device has finished reading experts [e0, e1) although
// the next chunk is already queued: the callback overwrites the released experts with NaN (0xffff,
// BF16 and F16) on a stream of its own, at once, while the next chunk's fit runs. A premature release
// would change the bytes or raise "tile error after the check pass".
TEST(OnlineGpu, ReleasedChunksAreNoLongerRead) {
  LUTB_GPU_OR_SKIP();
  const std::int64_t E = 6, H = 512, I = 256;
  const HostLayer l = random_layer(E, H, I, DType::BF16, 13);
  const Expected x = cpu_expected(l, true);
  cudaStream_t poison = nullptr;
  CUDA_OK(cudaStreamCreateWithFlags(&poison, cudaStreamNonBlocking));
  for (bool stacked : {false, true}) {
    SCOPED_TRACE(stacked ? "stacked" : "per expert");
    DeviceSource d;
    cuda::DeviceExpertSource src;
    upload(l, stacked, d, src);
    const std::size_t n13 = static_cast<std::size_t>(2 * I * H), n2 = static_cast<std::size_t>(H * I);
    int calls = 0;
    src.release = [&](std::int64_t e0, std::int64_t e1) {
      ++calls;
      for (std::int64_t e = e0; e < e1; ++e) {
        auto* a = static_cast<std::uint8_t*>(d.w13[stacked ? 0 : static_cast<std::size_t>(e)]) +
                  (stacked ? static_cast<std::size_t>(e) * n13 * 2 : 0);
        auto* b = static_cast<std::uint8_t*>(d.w2[stacked ? 0 : static_cast<std::size_t>(e)]) +
                  (stacked ? static_cast<std::size_t>(e) * n2 * 2 : 0);
        cudaMemsetAsync(a, 0xff, n13 * 2, poison);
        cudaMemsetAsync(b, 0xff, n2 * 2, poison);
      }
      cudaStreamSynchronize(poison);
    };
    cuda::GpuOnlineOptions opt;
    opt.chunk_bytes = 1;  // one expert per chunk
    cuda::DeviceLutbLayer out;
    const cuda::GpuOnlineReport rep = cuda::quantize_experts_online(src, out, opt);
    EXPECT_EQ(calls, E);
    EXPECT_EQ(rep.w13.sse, x.s13.sse);
    EXPECT_EQ(rep.w2.sum_sq, x.s2.sum_sq);
    expect_equal_layer(out, x);
  }
  CUDA_OK(cudaStreamDestroy(poison));
}

// The lowest failing tile over the experts of one tensor (the check kernel's launches share one
// error word per tensor, the tile index global in the stack), BF16 and F16, both source kinds; the message is the CPU fitter's for the same stack.
TEST(OnlineGpu, LowestFailingTileAcrossExperts) {
  LUTB_GPU_OR_SKIP();
  for (DType dt : {DType::BF16, DType::F16}) {
    HostLayer l = random_layer(4, 128, 64, dt, 14);
    const std::uint16_t nan = dt == DType::BF16 ? 0x7fc0 : 0x7e00, pinf = dt == DType::BF16 ? 0x7f80 : 0x7c00;
    // w2 [4, 128, 64]: a NaN in expert 3 at tile (0, 0), +Inf in expert 1 at tile (15, 0) row 126 col 7
    // and another in expert 1 further on in the same tile: expert 1's first one is reported.
    l.w2[static_cast<std::size_t>(3 * 128 * 64 + 0 * 64 + 1)] = nan;
    l.w2[static_cast<std::size_t>(1 * 128 * 64 + 126 * 64 + 7)] = pinf;
    l.w2[static_cast<std::size_t>(1 * 128 * 64 + 127 * 64 + 2)] = nan;
    std::string cpu_msg;
    LutbTensor t;
    try {
      quantize(l.w2.data(), dt, stack(4, 128, 64), t, FitOptions{}, "w2_weight");
    } catch (const std::invalid_argument& e) {
      cpu_msg = e.what();
    }
    ASSERT_EQ(cpu_msg, "quantize: tensor w2_weight, expert 1, tile (15, 0): +Inf at row 126 col 7");
    for (bool stacked : {false, true}) {
      SCOPED_TRACE(std::string(dt == DType::BF16 ? "BF16, " : "F16, ") + (stacked ? "stacked" : "per expert"));
      DeviceSource d;
      cuda::DeviceExpertSource src;
      upload(l, stacked, d, src);
      int releases = 0;
      src.release = [&](std::int64_t, std::int64_t) { ++releases; };
      cuda::GpuOnlineOptions opt;
      cuda::DeviceLutbLayer out;
      std::string msg;
      try {
        cuda::quantize_experts_online(src, out, opt);
      } catch (const std::invalid_argument& e) {
        msg = e.what();
      }
      EXPECT_EQ(msg, "quantize_experts_online: " + cpu_msg.substr(10));
      EXPECT_EQ(releases, 0);
      EXPECT_TRUE(out.empty());
    }
  }
}

TEST(OnlineGpu, LaneMajorKernelMatchesHost) {
  LUTB_GPU_OR_SKIP();
  const int tiles = 37;
  std::vector<std::uint8_t> h(static_cast<std::size_t>(tiles) * kPackedBytes);
  std::mt19937 g(9);
  for (auto& b : h) b = static_cast<std::uint8_t>(g());
  std::uint8_t* d = nullptr;
  CUDA_OK(cudaMalloc(&d, h.size()));
  CUDA_OK(cudaMemcpy(d, h.data(), h.size(), cudaMemcpyHostToDevice));
  cuda::packed_to_lane_major(d, tiles, nullptr);
  const auto got = to_host(d, h.size());
  cudaFree(d);
  for (int t = 0; t < tiles; ++t) {
    std::uint8_t want[kPackedBytes];
    cuda::tile_to_lane_major(h.data() + t * kPackedBytes, want);
    EXPECT_EQ(std::memcmp(got.data() + t * kPackedBytes, want, kPackedBytes), 0) << "tile " << t;
  }
}

}  // namespace
}  // namespace lutb::test
