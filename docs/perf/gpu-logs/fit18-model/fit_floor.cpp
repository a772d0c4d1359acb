// fit18: the binned-dp fitter's work per tile and what cheaper variants cost in accuracy, on the CPU.
// For the routed-expert tiles (BF16 "...experts...weight" matrices) of the shared models, and for
// synthetic Gaussian / Student-t(3) tiles rounded to BF16 (sigma 0.02, as bench/gpu/bench_fit_gpu.cu),
// each variant of binned-dp -- kBins equal-count bins (+ the 8 + 8 tail values), the local exact
// refinement with window half-width w and at most R rounds, or none -- is run at the rceil scale as
// src/fit/binned_dp.cpp does (same functions: build_sorted, dp_fit, dp_refine, encode_tile), and
// reports: SQNR = 10 log10(sum w^2 / sum (w - w_hat)^2) over all tiles, the gap to "optimal"
// (fit_optimal: every distinct value, with its scale search), the run-cost evaluations per tile of the
// binned DP (dp_fit) and of the refinement (dp_refine), distinct values n and bin edges m per tile.
// Evaluations are counted by compiling src/fit/dp.cpp into this program with run_cost wrapped in a
// counter (the library's dp.o is then not linked; the arithmetic is unchanged). The default variant
// (32 bins, w 8, R 4) is checked to give fit_binned_dp's sse on every tile.
// Build (from the worktree root, after the release build):
//   g++ -std=c++20 -O2 -fopenmp -ffp-contract=off -Iinclude -Isrc docs/perf/gpu-logs/fit18-model/fit_floor.cpp
//       -o /tmp/fit_floor build/release/liblutb.a -lfmt -lhwy   (one line with the previous)
// Run: /tmp/fit_floor ../shared/models [synthetic tiles]
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <cstdio>
#include <filesystem>
#include <random>
#include <string>
#include <vector>

#include "fit/fit_internal.hpp"
#include "lutb/safetensors.hpp"
#include "lutb/tile.hpp"

thread_local long long g_evals = 0;
#define run_cost(...) (++g_evals, ::lutb::fit_detail::run_cost(__VA_ARGS__))
#include "../../../../src/fit/dp.cpp"
#undef run_cost

namespace fs = std::filesystem;
using namespace lutb;
using namespace lutb::fit_detail;

namespace {

struct Variant {
  const char* name;
  int bins, w, rounds;  // rounds 0: no refinement
};

// binned_dp.cpp's fit at the rceil scale with `v`'s parameters; evaluation counts added to dp_e / ref_e.
TileFit fit_variant(const float* x, const Variant& v, long long& dp_e, long long& ref_e, int& n, int& m_out) {
  constexpr int kTail = 8;
  SortedTile st;
  build_sorted(x, st);
  n = st.n;
  std::vector<int> pos(static_cast<std::size_t>(v.bins + 2 * kTail + 2));
  int m = 0;
  if (st.n <= v.bins) {
    for (int i = 0; i <= st.n; ++i) pos[static_cast<std::size_t>(i)] = i;
    m = st.n;
  } else {
    pos[0] = 0;
    int i = 0;
    auto push = [&](int e) {
      if (e > pos[static_cast<std::size_t>(m)] && e < st.n) pos[static_cast<std::size_t>(++m)] = e;
    };
    while (i < st.n && st.cnt[i] < kTail) push(i++);
    for (int b = 1; b < v.bins; ++b) {
      const int target = b * (kTileSize / v.bins);
      while (i < st.n && st.cnt[i] < target) ++i;
      push(i);
    }
    while (i < st.n && st.cnt[i] <= kTileSize - kTail) ++i;
    while (i < st.n) push(i++);
    pos[static_cast<std::size_t>(++m)] = st.n;
  }
  m_out = m;
  if (st.amax == 0.0f) {
    const std::uint8_t zero = 0x00;
    return encode_tile(x, 127, &zero, 1);
  }
  const int s = std::max(rceil_scale(st.amax), kMinScale);
  g_evals = 0;
  DpResult r = dp_fit(st, pos.data(), m, s);
  dp_e += g_evals;
  if (m != st.n && v.rounds > 0) {
    g_evals = 0;
    dp_refine(st, s, v.w, v.rounds, r);
    ref_e += g_evals;
  }
  return encode_tile(x, s, r.entries, r.n_entries);
}

void cut(const std::vector<float>& w, std::int64_t rows, std::int64_t cols, std::vector<float>& tiles) {
  const LutbShape sh{1, rows, cols, false};
  for (std::int64_t tn = 0; tn < sh.tiles_n(); ++tn)
    for (std::int64_t tk = 0; tk < sh.tiles_k(); ++tk) {
      const std::size_t off = tiles.size();
      tiles.resize(off + kTileSize);
      gather_tile(w.data(), rows, cols, tn, tk, tiles.data() + off);
    }
}

float bf16(float v) {
  std::uint32_t b;
  std::memcpy(&b, &v, 4);
  b = (b + 0x7fffu + ((b >> 16) & 1u)) & 0xffff0000u;
  std::memcpy(&v, &b, 4);
  return v;
}

}  // namespace

int main(int argc, char** argv) {
  const fs::path models = argc > 1 ? argv[1] : "../shared/models";
  const std::int64_t nsyn = argc > 2 ? std::atoll(argv[2]) : 4096;
  std::vector<std::pair<std::string, std::vector<float>>> sets;
  for (const auto& e : fs::directory_iterator(models)) {
    if (!fs::exists(e.path() / "model.safetensors")) continue;
    SafetensorsFile f(e.path() / "model.safetensors");
    std::vector<float> tiles;
    for (const auto& name : f.names()) {
      if (name.find(".experts.") == std::string::npos || name.size() < 7 || name.substr(name.size() - 7) != ".weight")
        continue;
      const TensorView& t = f.get(name);
      if (t.shape.size() != 2) continue;
      cut(t.to_float(), t.shape[0], t.shape[1], tiles);
    }
    sets.emplace_back(e.path().filename().string(), std::move(tiles));
  }
  std::sort(sets.begin(), sets.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
  for (int student = 0; student < 2; ++student) {
    std::mt19937_64 g(7 + student);
    std::normal_distribution<double> n01(0.0, 1.0);
    std::vector<float> w(static_cast<std::size_t>(nsyn * kTileSize));
    for (auto& v : w) {
      double z = n01(g);
      if (student) {
        const double a = n01(g), b = n01(g), c = n01(g);
        z /= std::sqrt((a * a + b * b + c * c) / 3.0);
      }
      v = bf16(static_cast<float>(0.02 * z));
    }
    std::vector<float> tiles;
    cut(w, 8, 64 * nsyn, tiles);  // [8, 64 nsyn]: nsyn tiles
    sets.emplace_back(student ? "Student-t(3) BF16" : "Gaussian BF16", std::move(tiles));
  }
  const Variant vs[] = {{"32 bins, refinement w 8 R 4 (default)", 32, 8, 4},
                        {"32 bins, refinement w 8 R 1", 32, 8, 1},
                        {"32 bins, refinement w 4 R 4", 32, 4, 4},
                        {"32 bins, no refinement", 32, 0, 0},
                        {"24 bins, refinement w 8 R 4", 24, 8, 4},
                        {"16 bins, refinement w 8 R 4", 16, 8, 4},
                        {"16 bins, no refinement", 16, 0, 0},
                        {"64 bins, no refinement", 64, 0, 0}};
  std::printf("| data | tiles | variant | SQNR dB | gap to optimal dB | DP evaluations / tile | refinement evaluations / tile | distinct n | bin edges m |\n"
              "|---|---|---|---|---|---|---|---|---|\n");
  for (const auto& [name, tiles] : sets) {
    const std::int64_t nt = static_cast<std::int64_t>(tiles.size() / kTileSize);
    double sq = 0, se_opt = 0;
#pragma omp parallel for reduction(+ : sq, se_opt) schedule(dynamic, 64)
    for (std::int64_t t = 0; t < nt; ++t) {
      const TileFit o = fit_optimal(tiles.data() + t * kTileSize, -1);
      sq += o.sum_sq;
      se_opt += o.sse;
    }
    const double sqnr_opt = 10 * std::log10(sq / se_opt);
    std::printf("| %s | %lld | optimal | %.4f | 0 | | | | |\n", name.c_str(), static_cast<long long>(nt), sqnr_opt);
    for (const Variant& v : vs) {
      double se = 0, nn = 0, mm = 0;
      long long dp_e = 0, ref_e = 0, mism = 0;
      const bool is_default = v.bins == 32 && v.w == 8 && v.rounds == 4;
#pragma omp parallel for reduction(+ : se, nn, mm, dp_e, ref_e, mism) schedule(dynamic, 64)
      for (std::int64_t t = 0; t < nt; ++t) {
        int n = 0, m = 0;
        long long a = 0, b = 0;
        const TileFit f = fit_variant(tiles.data() + t * kTileSize, v, a, b, n, m);
        se += f.sse;
        nn += n;
        mm += m;
        dp_e += a;
        ref_e += b;
        if (is_default && f.sse != fit_binned_dp(tiles.data() + t * kTileSize, -1).sse) ++mism;
      }
      const double sqnr = 10 * std::log10(sq / se);
      std::printf("| %s | %lld | %s | %.4f | %.4f | %.0f | %.0f | %.1f | %.1f |\n", name.c_str(), static_cast<long long>(nt),
                  v.name, sqnr, sqnr_opt - sqnr, static_cast<double>(dp_e) / nt, static_cast<double>(ref_e) / nt, nn / nt,
                  mm / nt);
      if (is_default && mism != 0) std::printf("DEFAULT VARIANT DIFFERS FROM fit_binned_dp ON %lld TILES\n", mism);
    }
    std::fflush(stdout);
  }
  return 0;
}
