// Bulk number-format conversions and LUT-B dequantisation throughput.
//
//   cmake --build build/release --target bench_numerics && build/release/bench/bench_numerics
//
// Each bulk conversion is measured three ways in the same run:
//   Scalar/...   a plain loop over the scalar reference in numerics.hpp, compiled like the library
//                (-O3, baseline x86-64 ISA: whatever the compiler auto-vectorises);
//   Bulk/...     the library's Highway kernel with runtime dispatch (best target of this CPU);
//   Bulk/.../T   the same kernel pinned to one Highway target T (AVX3, AVX2, SSE4, ...).
// Items are elements; bytes are input + output bytes.
#include <benchmark/benchmark.h>

#include <hwy/targets.h>

#include <cstdint>
#include <random>
#include <vector>

#include "lutb/numerics.hpp"
#include "lutb/tile.hpp"

namespace {
using namespace lutb;

constexpr std::size_t kN = 1 << 16;  // 64 Ki elements: in L2

std::vector<float> make_floats() {
  std::mt19937 rng(1);
  std::normal_distribution<float> nd(0.0f, 100.0f);
  std::vector<float> v(kN);
  for (auto& x : v) x = nd(rng);
  return v;
}
std::vector<std::uint8_t> make_bytes() {
  std::mt19937 rng(2);
  std::vector<std::uint8_t> v(kN);
  for (auto& x : v) x = static_cast<std::uint8_t>(rng());
  return v;
}
std::vector<std::uint16_t> make_halves() {
  std::mt19937 rng(3);
  std::vector<std::uint16_t> v(kN);
  for (auto& x : v) x = static_cast<std::uint16_t>(rng());
  return v;
}

// Pins dispatch to target `t` (0 = best) for the benchmark's lifetime.
struct PinTarget {
  explicit PinTarget(std::int64_t t) { hwy::SetSupportedTargetsForTest(t); }
  ~PinTarget() { hwy::SetSupportedTargetsForTest(0); }
};

template <class In, class Out>
void finish(benchmark::State& st) {
  st.SetItemsProcessed(static_cast<std::int64_t>(st.iterations() * kN));
  st.SetBytesProcessed(static_cast<std::int64_t>(st.iterations() * kN * (sizeof(In) + sizeof(Out))));
}

// ---- E4M3 encode ----
void Scalar_F32ToE4M3(benchmark::State& st) {
  const auto in = make_floats();
  std::vector<std::uint8_t> out(kN);
  for (auto _ : st) {
    for (std::size_t i = 0; i < kN; ++i) out[i] = e4m3_from_float(in[i]);
    benchmark::DoNotOptimize(out.data());
    benchmark::ClobberMemory();
  }
  finish<float, std::uint8_t>(st);
}
void Bulk_F32ToE4M3(benchmark::State& st, std::int64_t target) {
  PinTarget pin(target);
  const auto in = make_floats();
  std::vector<std::uint8_t> out(kN);
  for (auto _ : st) {
    e4m3_from_float_n(in.data(), out.data(), kN);
    benchmark::DoNotOptimize(out.data());
    benchmark::ClobberMemory();
  }
  finish<float, std::uint8_t>(st);
}

// ---- E4M3 decode ----
void Scalar_E4M3ToF32(benchmark::State& st) {
  const auto in = make_bytes();
  std::vector<float> out(kN);
  for (auto _ : st) {
    for (std::size_t i = 0; i < kN; ++i) out[i] = e4m3_to_float(in[i]);
    benchmark::DoNotOptimize(out.data());
    benchmark::ClobberMemory();
  }
  finish<std::uint8_t, float>(st);
}
void Bulk_E4M3ToF32(benchmark::State& st, std::int64_t target) {
  PinTarget pin(target);
  const auto in = make_bytes();
  std::vector<float> out(kN);
  for (auto _ : st) {
    e4m3_to_float_n(in.data(), out.data(), kN);
    benchmark::DoNotOptimize(out.data());
    benchmark::ClobberMemory();
  }
  finish<std::uint8_t, float>(st);
}

// ---- BF16 encode / decode, FP16 decode ----
void Scalar_F32ToBF16(benchmark::State& st) {
  const auto in = make_floats();
  std::vector<std::uint16_t> out(kN);
  for (auto _ : st) {
    for (std::size_t i = 0; i < kN; ++i) out[i] = bf16_from_float(in[i]);
    benchmark::DoNotOptimize(out.data());
    benchmark::ClobberMemory();
  }
  finish<float, std::uint16_t>(st);
}
void Bulk_F32ToBF16(benchmark::State& st, std::int64_t target) {
  PinTarget pin(target);
  const auto in = make_floats();
  std::vector<std::uint16_t> out(kN);
  for (auto _ : st) {
    bf16_from_float_n(in.data(), out.data(), kN);
    benchmark::DoNotOptimize(out.data());
    benchmark::ClobberMemory();
  }
  finish<float, std::uint16_t>(st);
}
void Scalar_BF16ToF32(benchmark::State& st) {
  const auto in = make_halves();
  std::vector<float> out(kN);
  for (auto _ : st) {
    for (std::size_t i = 0; i < kN; ++i) out[i] = bf16_to_float(in[i]);
    benchmark::DoNotOptimize(out.data());
    benchmark::ClobberMemory();
  }
  finish<std::uint16_t, float>(st);
}
void Bulk_BF16ToF32(benchmark::State& st, std::int64_t target) {
  PinTarget pin(target);
  const auto in = make_halves();
  std::vector<float> out(kN);
  for (auto _ : st) {
    bf16_to_float_n(in.data(), out.data(), kN);
    benchmark::DoNotOptimize(out.data());
    benchmark::ClobberMemory();
  }
  finish<std::uint16_t, float>(st);
}
void Scalar_FP16ToF32(benchmark::State& st) {
  const auto in = make_halves();
  std::vector<float> out(kN);
  for (auto _ : st) {
    for (std::size_t i = 0; i < kN; ++i) out[i] = fp16_to_float(in[i]);
    benchmark::DoNotOptimize(out.data());
    benchmark::ClobberMemory();
  }
  finish<std::uint16_t, float>(st);
}
void Bulk_FP16ToF32(benchmark::State& st, std::int64_t target) {
  PinTarget pin(target);
  const auto in = make_halves();
  std::vector<float> out(kN);
  for (auto _ : st) {
    fp16_to_float_n(in.data(), out.data(), kN);
    benchmark::DoNotOptimize(out.data());
    benchmark::ClobberMemory();
  }
  finish<std::uint16_t, float>(st);
}

// ---- LUT-B dequantisation of a 2048 x 2048 weight ----
LutbTensor make_lutb(std::int64_t n, std::int64_t k) {
  LutbTensor t(LutbShape{1, n, k, false});
  std::mt19937 rng(4);
  for (auto& b : t.packed) b = static_cast<std::uint8_t>(rng());
  for (std::size_t i = 0; i < t.codebook.size(); ++i) t.codebook[i] = static_cast<std::uint8_t>(0x20 + (i % 8) * 4);
  for (auto& s : t.scale) s = static_cast<std::uint8_t>(120 + rng() % 8);
  return t;
}
void Dequant_LutbToF32(benchmark::State& st) {
  const auto t = make_lutb(2048, 2048);
  std::vector<float> out(2048 * 2048);
  for (auto _ : st) {
    dequantize(t.view(), out.data());
    benchmark::DoNotOptimize(out.data());
    benchmark::ClobberMemory();
  }
  st.SetItemsProcessed(static_cast<std::int64_t>(st.iterations() * out.size()));
  st.SetBytesProcessed(static_cast<std::int64_t>(st.iterations() * (t.bytes() + out.size() * 4)));
}
void Dequant_LutbToBF16(benchmark::State& st) {
  const auto t = make_lutb(2048, 2048);
  std::vector<std::uint16_t> out(2048 * 2048);
  for (auto _ : st) {
    dequantize_bf16(t.view(), out.data());
    benchmark::DoNotOptimize(out.data());
    benchmark::ClobberMemory();
  }
  st.SetItemsProcessed(static_cast<std::int64_t>(st.iterations() * out.size()));
  st.SetBytesProcessed(static_cast<std::int64_t>(st.iterations() * (t.bytes() + out.size() * 2)));
}

// Registers Bulk_* once with the best target (0: normal dispatch) and once per supported target.
void register_all() {
  benchmark::RegisterBenchmark("Scalar/F32ToE4M3", Scalar_F32ToE4M3);
  benchmark::RegisterBenchmark("Scalar/E4M3ToF32", Scalar_E4M3ToF32);
  benchmark::RegisterBenchmark("Scalar/F32ToBF16", Scalar_F32ToBF16);
  benchmark::RegisterBenchmark("Scalar/BF16ToF32", Scalar_BF16ToF32);
  benchmark::RegisterBenchmark("Scalar/FP16ToF32", Scalar_FP16ToF32);
  struct B {
    const char* name;
    void (*fn)(benchmark::State&, std::int64_t);
  };
  const B bulk[] = {{"F32ToE4M3", Bulk_F32ToE4M3}, {"E4M3ToF32", Bulk_E4M3ToF32}, {"F32ToBF16", Bulk_F32ToBF16},
                    {"BF16ToF32", Bulk_BF16ToF32}, {"FP16ToF32", Bulk_FP16ToF32}};
  for (const B& b : bulk) {
    benchmark::RegisterBenchmark((std::string("Bulk/") + b.name + "/best").c_str(), b.fn, std::int64_t{0});
    for (const std::int64_t t : hwy::SupportedAndGeneratedTargets())
      benchmark::RegisterBenchmark((std::string("Bulk/") + b.name + "/" + hwy::TargetName(t)).c_str(), b.fn, t);
  }
  benchmark::RegisterBenchmark("Dequant/LutbToF32/2048x2048", Dequant_LutbToF32)->Unit(benchmark::kMillisecond);
  benchmark::RegisterBenchmark("Dequant/LutbToBF16/2048x2048", Dequant_LutbToBF16)->Unit(benchmark::kMillisecond);
}

}  // namespace

int main(int argc, char** argv) {
  register_all();
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
