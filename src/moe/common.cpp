// MoE configuration, expert maps, logging, the Experts base class and the grouped pipeline driver.
#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <iostream>
#include <mutex>
#include <set>
#include <stdexcept>
#include <string>

#include <fmt/format.h>

#include "lutb/mxfp8.hpp"
#include "lutb/numerics.hpp"
#include "moe/moe_internal.hpp"

namespace lutb::moe {

// ---------------------------------------------------------------------------
// ExpertMap, MoeConfig
// ---------------------------------------------------------------------------
ExpertMap ExpertMap::linear(int global_experts, int ep_rank, int ep_size) {
  if (ep_size < 1) throw std::invalid_argument(fmt::format("ExpertMap: ep_size={} must be >= 1", ep_size));
  if (ep_rank < 0 || ep_rank >= ep_size)
    throw std::invalid_argument(fmt::format("ExpertMap: ep_rank={} outside 0..{}", ep_rank, ep_size - 1));
  if (global_experts < ep_size)
    throw std::invalid_argument(
        fmt::format("ExpertMap: global_experts={} is smaller than ep_size={}", global_experts, ep_size));
  const int base = global_experts / ep_size, rem = global_experts % ep_size;
  const int begin = ep_rank * base + std::min(ep_rank, rem);
  const int count = base + (ep_rank < rem ? 1 : 0);
  std::vector<std::int32_t> l2g(count);
  for (int i = 0; i < count; ++i) l2g[i] = begin + i;
  return from_list(global_experts, std::move(l2g), ep_rank, ep_size);
}

ExpertMap ExpertMap::from_list(int global_experts, std::vector<std::int32_t> local_to_global, int ep_rank,
                               int ep_size) {
  if (global_experts < 1)
    throw std::invalid_argument(fmt::format("ExpertMap: global_experts={} must be >= 1", global_experts));
  ExpertMap m;
  m.global_experts = global_experts;
  m.ep_rank = ep_rank;
  m.ep_size = ep_size;
  m.global_to_local.assign(global_experts, -1);
  for (std::size_t i = 0; i < local_to_global.size(); ++i) {
    const int g = local_to_global[i];
    if (g < 0 || g >= global_experts)
      throw std::invalid_argument(fmt::format("ExpertMap: local expert {} maps to global id {} outside 0..{}", i,
                                              g, global_experts - 1));
    if (m.global_to_local[g] >= 0)
      throw std::invalid_argument(fmt::format("ExpertMap: global expert {} listed twice", g));
    m.global_to_local[g] = static_cast<std::int32_t>(i);
  }
  m.local_to_global = std::move(local_to_global);
  return m;
}

static LutbShape stack_shape(int experts, std::int64_t rows, std::int64_t cols) {
  LutbShape s;
  s.experts = experts;
  s.rows = rows;
  s.cols = cols;
  s.stacked = true;
  return s;
}
LutbShape MoeConfig::w13_shape() const {
  return stack_shape(local_experts(), 2 * intermediate_size_per_partition, hidden_size);
}
LutbShape MoeConfig::w2_shape() const { return stack_shape(local_experts(), hidden_size, intermediate_size_per_partition); }

MoeConfig& MoeConfig::finalize() {
  auto bad = [](const std::string& field, auto value, const char* why) {
    throw std::invalid_argument(fmt::format("MoeConfig: {}={} {}", field, value, why));
  };
  if (global_experts < 1) bad("global_experts", global_experts, "must be >= 1");
  if (top_k < 1 || top_k > global_experts) bad("top_k", top_k, "must be in 1..global_experts");
  if (hidden_size < 1) bad("hidden_size", hidden_size, "must be >= 1");
  if (intermediate_size_per_partition < 1)
    bad("intermediate_size_per_partition", intermediate_size_per_partition, "must be >= 1");
  if (hidden_size_unpadded == 0 || hidden_size_unpadded > hidden_size)
    bad("hidden_size_unpadded", hidden_size_unpadded, "must be in 1..hidden_size (or -1)");
  if (intermediate_size_per_partition_unpadded == 0 ||
      intermediate_size_per_partition_unpadded > intermediate_size_per_partition)
    bad("intermediate_size_per_partition_unpadded", intermediate_size_per_partition_unpadded,
        "must be in 1..intermediate_size_per_partition (or -1)");
  if (expert_map.global_experts == 0) expert_map = ExpertMap::linear(global_experts, 0, 1);
  if (expert_map.global_experts != global_experts ||
      expert_map.global_to_local.size() != static_cast<std::size_t>(global_experts))
    bad("expert_map.global_experts", expert_map.global_experts, "differs from global_experts");
  return *this;
}

std::string_view backend_name(Backend b) { return b == Backend::Native ? "native-sm107" : "emulation"; }

// ---------------------------------------------------------------------------
// Logging
// ---------------------------------------------------------------------------
namespace {
std::mutex g_log_mutex;
MoeLogger g_logger;
std::set<std::string> g_logged;
}  // namespace

MoeLogger set_moe_logger(MoeLogger logger) {
  std::lock_guard<std::mutex> lock(g_log_mutex);
  std::swap(g_logger, logger);
  return logger;
}

void log_once(LogLevel level, const std::string& message) {
  MoeLogger sink;
  {
    std::lock_guard<std::mutex> lock(g_log_mutex);
    if (!g_logged.insert(message).second) return;
    sink = g_logger;
  }
  if (sink) {
    sink(level, message);
  } else if (level != LogLevel::Debug) {
    std::cerr << "[lutb] " << message << "\n";
  }
}

void reset_log_once() {
  std::lock_guard<std::mutex> lock(g_log_mutex);
  g_logged.clear();
}

// ---------------------------------------------------------------------------
// Experts base
// ---------------------------------------------------------------------------
Experts::Experts(MoeConfig cfg) : cfg_(std::move(cfg)) { cfg_.finalize(); }
Experts::~Experts() = default;

void Experts::apply(const HiddenStates& x, const TopK& topk, std::uint16_t* out) const {
  const std::int64_t n = x.tokens * cfg_.hidden_size;
  std::vector<float> tmp(static_cast<std::size_t>(n));
  apply_f32(x, topk, tmp.data());
  for (std::int64_t i = 0; i < n; ++i) out[i] = bf16_from_float(tmp[i]);
}

std::unique_ptr<Experts> make_lutb_experts(const MoeConfig& cfg, LutbTensor w13, LutbTensor w2,
                                           EmulationKernel kernel, ActivationFormat act) {
  switch (kernel) {
    case EmulationKernel::Fast:
      return std::make_unique<LutbCpuExperts>(cfg, std::move(w13), std::move(w2), act);
    case EmulationKernel::Reference:
      return std::make_unique<LutbReferenceExperts>(cfg, std::move(w13), std::move(w2), act);
    case EmulationKernel::Dequantized: {
      MoeConfig c = cfg;
      c.finalize();
      if (w13.shape.rows != c.w13_shape().rows || w13.shape.cols != c.w13_shape().cols ||
          w13.shape.experts != c.local_experts() || w2.shape.rows != c.w2_shape().rows ||
          w2.shape.cols != c.w2_shape().cols || w2.shape.experts != c.local_experts())
        throw std::invalid_argument("make_lutb_experts: LUT-B shapes do not match the MoE config");
      std::vector<std::uint16_t> d13(static_cast<std::size_t>(w13.shape.experts * w13.shape.rows * w13.shape.cols));
      std::vector<std::uint16_t> d2(static_cast<std::size_t>(w2.shape.experts * w2.shape.rows * w2.shape.cols));
      dequantize_bf16(w13.view(), d13.data());
      dequantize_bf16(w2.view(), d2.data());
      w13 = LutbTensor();
      w2 = LutbTensor();
      return std::make_unique<DenseExperts>(c, std::move(d13), std::move(d2), act);
    }
  }
  throw std::invalid_argument("make_lutb_experts: unknown kernel");
}

namespace detail {

void check_inputs(const MoeConfig& cfg, const HiddenStates& x, const TopK& topk) {
  if (x.dtype != DType::BF16 && x.dtype != DType::F32)
    throw std::invalid_argument(
        fmt::format("apply experts: hidden states dtype {} is not BF16 or F32", dtype_name(x.dtype)));
  if (x.tokens < 0) throw std::invalid_argument(fmt::format("apply experts: tokens={} < 0", x.tokens));
  if (x.tokens > 0 && (x.data == nullptr || topk.ids == nullptr || topk.weights == nullptr))
    throw std::invalid_argument("apply experts: null hidden states or top-k arrays");
  if (topk.k != cfg.top_k)
    throw std::invalid_argument(fmt::format("apply experts: top-k arrays have k={}, the layer has top_k={}",
                                            topk.k, cfg.top_k));
}

int local_id(const MoeConfig& cfg, std::int32_t global_id, std::int64_t token, int slot) {
  if (global_id < 0 || global_id >= cfg.global_experts)
    throw std::out_of_range(fmt::format("apply experts: token {} slot {} routes to expert {} outside 0..{}", token,
                                        slot, global_id, cfg.global_experts - 1));
  return cfg.expert_map.global_to_local[global_id];
}

void load_activation_row(const MoeConfig& cfg, const HiddenStates& x, std::int64_t t, ActivationFormat act,
                         std::int64_t width, float* dst) {
  const std::int64_t H = cfg.hidden_size, Hu = cfg.hidden_unpadded();
  if (x.dtype == DType::BF16) {
    const auto* row = static_cast<const std::uint16_t*>(x.data) + t * H;
    for (std::int64_t i = 0; i < Hu; ++i) dst[i] = bf16_to_float(row[i]);
  } else {
    const auto* row = static_cast<const float*>(x.data) + t * H;
    std::copy(row, row + Hu, dst);
  }
  std::fill(dst + Hu, dst + width, 0.0f);
  if (act == ActivationFormat::MXFP8) mxfp8_qdq_rows(dst, 1, Hu, dst);
}

void gated_activation_row(const MoeConfig& cfg, const float* g, const float* u, ActivationFormat act,
                          std::int64_t width, float* h) {
  const std::int64_t Iu = cfg.intermediate_unpadded();
  for (std::int64_t i = 0; i < Iu; ++i) h[i] = bf16_round(silu_mul(g[i], u[i]));
  std::fill(h + Iu, h + width, 0.0f);
  if (act == ActivationFormat::MXFP8) mxfp8_qdq_rows(h, 1, Iu, h);
}

Grouping group_by_expert(const MoeConfig& cfg, const TopK& topk, std::int64_t tokens) {
  const int E = cfg.local_experts(), k = topk.k;
  Grouping g;
  g.offset.assign(E + 1, 0);
  g.m_of_slot.assign(static_cast<std::size_t>(tokens * k), -1);
  std::vector<int> lid(static_cast<std::size_t>(tokens * k));
  for (std::int64_t t = 0; t < tokens; ++t)
    for (int j = 0; j < k; ++j) {
      const int l = local_id(cfg, topk.ids[t * k + j], t, j);
      lid[t * k + j] = l;
      if (l >= 0) ++g.offset[l + 1];
    }
  for (int e = 0; e < E; ++e) g.offset[e + 1] += g.offset[e];
  g.token.resize(static_cast<std::size_t>(g.offset[E]));
  g.slot.resize(g.token.size());
  std::vector<std::int64_t> fill(g.offset.begin(), g.offset.end() - 1);
  for (std::int64_t t = 0; t < tokens; ++t)
    for (int j = 0; j < k; ++j) {
      const int l = lid[t * k + j];
      if (l < 0) continue;
      const std::int64_t m = fill[l]++;
      g.token[m] = static_cast<std::int32_t>(t);
      g.slot[m] = j;
      g.m_of_slot[t * k + j] = m;
    }
  return g;
}

void run_grouped(const MoeConfig& cfg, const HiddenStates& x, const TopK& topk, ActivationFormat act,
                 const GroupedGemm& gemm, std::int64_t job_weights, float* out) {
  check_inputs(cfg, x, topk);
  const std::int64_t T = x.tokens, H = cfg.hidden_size, I = cfg.intermediate_size_per_partition;
  const int k = topk.k, E = cfg.local_experts();
  if (T == 0) return;
  const Grouping grp = group_by_expert(cfg, topk, T);
  const std::int64_t M = grp.assignments();
  const std::int64_t Hp = round_up(H, 64), Ip = round_up(I, 64);
  if (M == 0) {
    std::fill(out, out + T * H, 0.0f);
    return;
  }

  // Step 2: activations of the tokens that reach a local expert (each token once).
  std::vector<std::int64_t> row_of_token(static_cast<std::size_t>(T), -1);
  std::int64_t used = 0;
  for (std::int64_t m = 0; m < M; ++m)
    if (row_of_token[grp.token[m]] < 0) row_of_token[grp.token[m]] = used++;
  std::vector<float> A(static_cast<std::size_t>(used * Hp));
#pragma omp parallel for schedule(static) if (T * H > (1 << 16))
  for (std::int64_t t = 0; t < T; ++t)
    if (row_of_token[t] >= 0) load_activation_row(cfg, x, t, act, Hp, A.data() + row_of_token[t] * Hp);

  // Jobs: (expert, row block) for a weight with N rows.
  struct Job {
    int e;
    std::int64_t n0, n1;
  };
  auto make_jobs = [&](std::int64_t N, std::int64_t K) {
    std::vector<Job> jobs;
    const std::int64_t step = std::max<std::int64_t>(8, job_weights / K / 8 * 8);
    for (int e = 0; e < E; ++e) {
      if (grp.offset[e + 1] == grp.offset[e]) continue;
      for (std::int64_t n = 0; n < N; n += step) jobs.push_back({e, n, std::min(N, n + step)});
    }
    return jobs;
  };
  auto run_jobs = [&](int which, const std::vector<Job>& jobs, const std::vector<const float*>& arows,
                      std::vector<float*>& crows) {
    const std::int64_t nj = static_cast<std::int64_t>(jobs.size());
#pragma omp parallel for schedule(dynamic, 1)
    for (std::int64_t j = 0; j < nj; ++j) {
      const Job& jb = jobs[j];
      const std::int64_t m0 = grp.offset[jb.e], m1 = grp.offset[jb.e + 1];
      gemm(which, jb.e, jb.n0, jb.n1, arows.data() + m0, static_cast<int>(m1 - m0), crows.data() + m0);
    }
  };

  // Step 3: g, u = a . w13^T.
  std::vector<float> G(static_cast<std::size_t>(M * 2 * I));
  {
    std::vector<const float*> arows(M);
    std::vector<float*> crows(M);
    for (std::int64_t m = 0; m < M; ++m) {
      arows[m] = A.data() + row_of_token[grp.token[m]] * Hp;
      crows[m] = G.data() + m * 2 * I;
    }
    run_jobs(0, make_jobs(2 * I, H), arows, crows);
  }
  A.clear();
  A.shrink_to_fit();

  // Step 4: h = mxfp8_qdq(bf16(silu(g) * u)).
  std::vector<float> Hbuf(static_cast<std::size_t>(M * Ip));
#pragma omp parallel for schedule(static) if (M * I > (1 << 16))
  for (std::int64_t m = 0; m < M; ++m)
    gated_activation_row(cfg, G.data() + m * 2 * I, G.data() + m * 2 * I + I, act, Ip, Hbuf.data() + m * Ip);
  G.clear();
  G.shrink_to_fit();

  // Step 5: y = h . w2^T.
  std::vector<float> Y(static_cast<std::size_t>(M * H));
  {
    std::vector<const float*> arows(M);
    std::vector<float*> crows(M);
    for (std::int64_t m = 0; m < M; ++m) {
      arows[m] = Hbuf.data() + m * Ip;
      crows[m] = Y.data() + m * H;
    }
    run_jobs(1, make_jobs(H, I), arows, crows);
  }

  // Step 6: out = sum_k weight_k * y (slot order); padded output columns are zero.
  const std::int64_t Hu = cfg.hidden_unpadded();
#pragma omp parallel for schedule(static) if (T * H > (1 << 16))
  for (std::int64_t t = 0; t < T; ++t) {
    float* o = out + t * H;
    std::fill(o, o + H, 0.0f);
    for (int j = 0; j < k; ++j) {
      const std::int64_t m = grp.m_of_slot[t * k + j];
      if (m < 0) continue;
      const float w = topk.weights[t * k + j];
      const float* y = Y.data() + m * H;
      for (std::int64_t i = 0; i < Hu; ++i) o[i] += w * y[i];
    }
  }
}

}  // namespace detail

CpuIsa best_cpu_isa() {
  static const CpuIsa best = [] {
    __builtin_cpu_init();
    if (!__builtin_cpu_supports("avx2") || !__builtin_cpu_supports("fma")) return CpuIsa::Scalar;
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl") &&
        __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vbmi"))
      return CpuIsa::Avx512;
    return CpuIsa::Avx2;
  }();
  return best;
}

const char* cpu_isa_name(CpuIsa isa) {
  switch (isa) {
    case CpuIsa::Avx512: return "avx512";
    case CpuIsa::Avx2: return "avx2";
    default: return "scalar";
  }
}

std::string cpu_isa() { return cpu_isa_name(best_cpu_isa()); }

}  // namespace lutb::moe
