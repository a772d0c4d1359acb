// bench/bench_fit.cpp: quality and speed of every LUT-B fitter, and of INT3-g128 / MXFP4 / NVFP4
// through the same harness (issue 3; results in docs/perf/fitting.md).
//
//   bench_fit [--models DIR] [--synthetic-tiles N] [--time-tiles N] [--repeats R] [--fitters a,b,..]
//
// Data sets: i.i.d. Gaussian, Student-t (nu = 5) and Laplace matrices [*, 256, 512] (FP32, sigma
// 0.02; N tiles each), and every routed-expert weight ("...experts.E....weight", BF16) of the three
// models in DIR (default ../shared/models next to the source tree). For each data set and fitter:
//   SQNR = 10 log10(sum w^2 / sum (w - w_hat)^2) over all tiles (fitted on all cores), the gap to
//   "optimal", throughput on one core (fit_tile over a fixed sample of tiles, thread CPU time, best
//   of R repeats) and on all cores (OpenMP over the same sample, wall time, best of R), and the
//   implied time for the 654e9 routed weights of DeepSeek-V3 on all cores of this machine.
// The baselines quantise-dequantise each whole matrix (blocks along K) and report SQNR and speed.
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <time.h>
#include <filesystem>
#include <random>
#include <string>
#include <vector>

#include "lutb/baselines.hpp"
#include "lutb/fit.hpp"
#include "lutb/safetensors.hpp"
#include "lutb/tile.hpp"

namespace fs = std::filesystem;
using namespace lutb;

namespace {

struct Matrix {
  std::int64_t rows = 0, cols = 0;
  std::vector<float> w;
};

struct DataSet {
  std::string name;
  std::vector<Matrix> mats;
  std::vector<float> tiles;  // all tiles, 512 floats each
  std::int64_t weights = 0;  // logical weights
  std::int64_t n_tiles() const { return static_cast<std::int64_t>(tiles.size() / kTileSize); }
};

void cut_tiles(DataSet& d) {
  for (const auto& m : d.mats) {
    const LutbShape sh{1, m.rows, m.cols, false};
    for (std::int64_t tn = 0; tn < sh.tiles_n(); ++tn)
      for (std::int64_t tk = 0; tk < sh.tiles_k(); ++tk) {
        const std::size_t off = d.tiles.size();
        d.tiles.resize(off + kTileSize);
        gather_tile(m.w.data(), m.rows, m.cols, tn, tk, d.tiles.data() + off);
      }
    d.weights += m.rows * m.cols;
  }
}

DataSet synthetic(const std::string& kind, std::int64_t tiles, std::uint64_t seed) {
  DataSet d;
  d.name = kind;
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> n01(0.0, 1.0);
  std::student_t_distribution<double> t5(5.0);
  std::exponential_distribution<double> ex(1.0);
  std::bernoulli_distribution coin(0.5);
  const std::int64_t per = (256 / 8) * (512 / 64);
  for (std::int64_t made = 0; made < tiles; made += per) {
    Matrix m;
    m.rows = 256;
    m.cols = 512;
    m.w.resize(256 * 512);
    for (auto& v : m.w) {
      double z = kind == "gaussian" ? n01(rng) : kind == "student-t5" ? t5(rng) : ex(rng) * (coin(rng) ? 1 : -1);
      v = static_cast<float>(0.02 * z);
    }
    d.mats.push_back(std::move(m));
  }
  cut_tiles(d);
  return d;
}

DataSet model(const fs::path& dir) {
  DataSet d;
  d.name = dir.filename().string();
  SafetensorsFile f(dir / "model.safetensors");
  for (const auto& name : f.names()) {
    if (name.find(".experts.") == std::string::npos || name.size() < 7 || name.substr(name.size() - 7) != ".weight")
      continue;
    const TensorView& t = f.get(name);
    if (t.shape.size() != 2) continue;
    Matrix m;
    m.rows = t.shape[0];
    m.cols = t.shape[1];
    m.w = t.to_float();
    d.mats.push_back(std::move(m));
  }
  cut_tiles(d);
  return d;
}

double now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}
// CPU time of the calling thread: the single-core figures use it, so that other processes on a
// shared machine inflate them less than wall time would.
double thread_cpu() {
  timespec ts;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return ts.tv_sec + 1e-9 * ts.tv_nsec;
}

struct Row {
  std::string set, method;
  double bpw = 0, sqnr = 0, gap = 0, wps_core = 0, wps_all = 0;
};

std::vector<Row> g_rows;

void print_row(const Row& r) {
  const double t_all = 654e9 / r.wps_all;
  std::printf("| %-16s | %-10s | %6.3f | %7.3f | %7s | %8.2f | %8.2f | %10.1f |\n", r.set.c_str(), r.method.c_str(), r.bpw,
              r.sqnr, r.method == "optimal" || r.gap != r.gap ? "-" : (std::to_string(r.gap).substr(0, 6)).c_str(),
              r.wps_core / 1e6, r.wps_all / 1e6, t_all / 3600.0);
  std::fflush(stdout);
}

}  // namespace

int main(int argc, char** argv) {
  // Default: $LUTB_SHARED_DIR/models, else the first shared/models found walking up from the cwd
  // (the repository's ../shared/models).
  fs::path models;
  if (const char* e = std::getenv("LUTB_SHARED_DIR")) models = fs::path(e) / "models";
  for (fs::path p = fs::current_path(); models.empty() && !p.empty(); p = p.parent_path()) {
    if (fs::exists(p / "shared" / "models")) models = p / "shared" / "models";
    if (p == p.parent_path()) break;
  }
  std::int64_t syn_tiles = 2048, time_tiles = 512;
  int repeats = 3;
  std::vector<std::string> fitters = fitter_names();
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto next = [&]() { return std::string(i + 1 < argc ? argv[++i] : ""); };
    if (a == "--models") models = next();
    else if (a == "--synthetic-tiles") syn_tiles = std::stoll(next());
    else if (a == "--time-tiles") time_tiles = std::stoll(next());
    else if (a == "--repeats") repeats = std::stoi(next());
    else if (a == "--fitters") {
      fitters.clear();
      std::string s = next();
      for (std::size_t p = 0; p <= s.size();) {
        const std::size_t q = std::min(s.find(',', p), s.size());
        fitters.push_back(s.substr(p, q - p));
        p = q + 1;
      }
    } else {
      std::fprintf(stderr, "usage: %s [--models DIR] [--synthetic-tiles N] [--time-tiles N] [--repeats R] [--fitters a,b]\n", argv[0]);
      return 2;
    }
  }
  for (const auto& f : fitters) check_fitter_name(f);
  // "optimal" first: the others report their gap to it.
  std::stable_partition(fitters.begin(), fitters.end(), [](const std::string& f) { return f == "optimal"; });

  const int threads = omp_get_max_threads();
  const std::time_t tt = std::time(nullptr);
  char date[64];
  std::strftime(date, sizeof date, "%Y-%m-%d %H:%M UTC", std::gmtime(&tt));
  std::printf("bench_fit: %s, %d threads (all cores), timing sample %lld tiles, best of %d\n\n", date, threads,
              static_cast<long long>(time_tiles), repeats);
  std::printf("| data set         | method     | bits/w | SQNR dB | gap dB  | Mw/s/core | Mw/s all | DSV3 h all |\n");
  std::printf("|------------------|------------|--------|---------|---------|-----------|----------|------------|\n");

  std::vector<DataSet> sets;
  sets.push_back(synthetic("gaussian", syn_tiles, 1));
  sets.push_back(synthetic("student-t5", syn_tiles, 2));
  sets.push_back(synthetic("laplace", syn_tiles, 3));
  for (const char* m : {"tiny-qwen3-moe", "tiny-mixtral", "tiny-deepseek-v3"}) {
    if (fs::exists(models / m / "model.safetensors")) sets.push_back(model(models / m));
    else std::fprintf(stderr, "bench_fit: %s absent, skipped\n", (models / m).c_str());
  }
  // All real tiles together as one more row set (aggregate over the three models).
  if (sets.size() > 3) {
    DataSet all;
    all.name = "all-models";
    for (std::size_t i = 3; i < sets.size(); ++i) {
      all.tiles.insert(all.tiles.end(), sets[i].tiles.begin(), sets[i].tiles.end());
      all.weights += sets[i].weights;
      for (const auto& m : sets[i].mats) all.mats.push_back(m);
    }
    sets.push_back(std::move(all));
  }

  for (const auto& d : sets) {
    const std::int64_t nt = d.n_tiles();
    // Timing sample: tiles spread over the whole set.
    const std::int64_t ns = std::min(time_tiles, nt);
    std::vector<std::int64_t> sample(static_cast<std::size_t>(ns));
    for (std::int64_t i = 0; i < ns; ++i) sample[static_cast<std::size_t>(i)] = i * nt / ns;
    double opt_sqnr = NAN;
    for (const auto& name : fitters) {
      FitOptions o;
      o.fitter = name;
      std::vector<double> sse(static_cast<std::size_t>(nt)), ss(static_cast<std::size_t>(nt));
#pragma omp parallel for schedule(dynamic, 8)
      for (std::int64_t t = 0; t < nt; ++t) {
        const TileFit f = fit_tile(d.tiles.data() + t * kTileSize, o);
        sse[static_cast<std::size_t>(t)] = f.sse;
        ss[static_cast<std::size_t>(t)] = f.sum_sq;
      }
      FitStats st;
      for (std::int64_t t = 0; t < nt; ++t) {
        st.sse += sse[static_cast<std::size_t>(t)];
        st.sum_sq += ss[static_cast<std::size_t>(t)];
      }
      double best1 = 1e300, bestn = 1e300;
      for (int r = 0; r < repeats; ++r) {
        double t0 = thread_cpu();
        double sink = 0;
        for (std::int64_t i : sample) sink += fit_tile(d.tiles.data() + i * kTileSize, o).sse;
        best1 = std::min(best1, thread_cpu() - t0);
        t0 = now();
#pragma omp parallel for schedule(dynamic, 4) reduction(+ : sink)
        for (std::int64_t i = 0; i < ns; ++i) sink += fit_tile(d.tiles.data() + sample[static_cast<std::size_t>(i)] * kTileSize, o).sse;
        bestn = std::min(bestn, now() - t0);
        if (sink < 0) std::printf("?");
      }
      Row row;
      row.set = d.name;
      row.method = name;
      row.bpw = kBitsPerWeight;
      row.sqnr = st.sqnr_db();
      if (name == "optimal") opt_sqnr = row.sqnr;
      row.gap = opt_sqnr - row.sqnr;
      row.wps_core = ns * kTileSize / best1;
      row.wps_all = ns * kTileSize / bestn;
      print_row(row);
      g_rows.push_back(row);
    }
    for (const auto f : baselines::all_formats()) {
      double sse = 0, ss = 0, best = 1e300;
      for (int r = 0; r < repeats; ++r) {
        sse = ss = 0;
        const double t0 = thread_cpu();
        for (const auto& m : d.mats) {
          std::vector<float> out(m.w.size());
          baselines::qdq(f, m.w.data(), m.rows, m.cols, out.data());
          for (std::size_t i = 0; i < out.size(); ++i) {
            const double e = static_cast<double>(m.w[i]) - out[i];
            sse += e * e;
            ss += static_cast<double>(m.w[i]) * m.w[i];
          }
        }
        best = std::min(best, thread_cpu() - t0);
      }
      Row row;
      row.set = d.name;
      row.method = baselines::format_name(f);
      row.bpw = baselines::bits_per_weight(f);
      row.sqnr = 10 * std::log10(ss / sse);
      row.gap = opt_sqnr - row.sqnr;
      row.wps_core = d.weights / best;
      row.wps_all = row.wps_core;  // single-threaded harness
      print_row(row);
    }
  }
  std::printf("\ngap dB = SQNR(optimal) - SQNR(method) on the same data (negative: better than LUT-B optimal).\n");
  std::printf("DSV3 h all = 654e9 / (weights/s on all %d cores) / 3600; baselines are single-threaded qdq.\n", threads);
  std::printf("Mw/s/core: thread CPU time (fit_tile on one core); Mw/s all: wall time with %d OpenMP threads.\n", threads);
  return 0;
}
