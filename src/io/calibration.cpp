// Calibration statistics file (lutb/calibration.hpp): reading, writing, and the column weights of the
// weighted fit, with the rule for rarely routed experts.
#include "lutb/calibration.hpp"

#include <cmath>
#include <cstring>
#include <memory>
#include <regex>
#include <stdexcept>

#include <fmt/core.h>
#include <fmt/ranges.h>

#include "io/checkpoint_internal.hpp"
#include "lutb/safetensors.hpp"

namespace lutb {
namespace {

constexpr const char* kGateUp = ".gate_up.x2";
constexpr const char* kDown = ".down.x2";
constexpr const char* kTokens = ".tokens";
constexpr const char* kGateUpFull = ".gate_up.xxT";
constexpr const char* kDownFull = ".down.hhT";
constexpr const char* kFormat = "lutb-calibration";  // the metadata "format" save() writes

// A statistic for messages: "NaN", "+Inf", "-Inf", or the number.
std::string value_text(float v) {
  if (std::isnan(v)) return "NaN";
  if (std::isinf(v)) return v > 0 ? "+Inf" : "-Inf";
  return fmt::format("{}", v);
}

std::vector<float> read_f32(const std::filesystem::path& file, const TensorView& v) {
  if (v.dtype != DType::F32)
    throw std::runtime_error(fmt::format("{}: tensor {} has dtype {}; calibration statistics are F32", file.string(),
                                         v.name, dtype_name(v.dtype)));
  std::vector<float> out(static_cast<std::size_t>(v.numel()));
  if (!out.empty()) std::memcpy(out.data(), v.data, out.size() * sizeof(float));
  for (std::size_t i = 0; i < out.size(); ++i)
    if (!std::isfinite(out[i]) || out[i] < 0.0f)
      throw std::runtime_error(fmt::format("{}: tensor {} holds {} at [{}]; calibration statistics are finite and >= 0",
                                           file.string(), v.name, out[i], i));
  return out;
}

}  // namespace

CalibrationStats CalibrationStats::load(const std::filesystem::path& file) {
  const SafetensorsFile f(file);
  CalibrationStats s;
  s.metadata = f.metadata();
  s.source = file.string();
  // A checkpoint's weights carry transformers' "format" "pt": named as a file of another kind, rather
  // than by its first tensor that is not a statistic.
  if (const auto it = s.metadata.find("format"); it != s.metadata.end() && it->second != kFormat)
    throw std::runtime_error(fmt::format("{}: not a statistics file of lutb calibrate (its metadata \"format\" is "
                                         "\"{}\", not \"{}\"); give the file that lutb calibrate -o wrote",
                                         file.string(), it->second, kFormat));
  // PREFIX.e.{gate_up.x2, down.x2, tokens, gate_up.xxT, down.hhT}; the layer index is the number after
  // "layers." in PREFIX.
  static const std::regex name_re(
      R"(^(.*\.layers\.(\d+)\..*)\.(\d+)\.(gate_up\.x2|down\.x2|tokens|gate_up\.xxT|down\.hhT)$)");
  struct Seen {
    std::map<std::int64_t, std::vector<float>> gu, dn, tk;
    std::map<std::int64_t, const TensorView*> gu_full, dn_full;  // checked once the column counts are known
  };
  std::map<int, Seen> seen;
  for (const auto& n : f.names()) {
    std::smatch m;
    if (!std::regex_match(n, m, name_re))
      throw std::runtime_error(fmt::format(
          "{}: tensor {} is not a calibration statistic (expected PREFIX.e.gate_up.x2, PREFIX.e.down.x2, "
          "PREFIX.e.tokens, PREFIX.e.gate_up.xxT or PREFIX.e.down.hhT, with PREFIX the experts' prefix such as model.layers.L.mlp.experts and e the expert; "
          "lutb/calibration.hpp){}",
          file.string(), n,
          s.metadata.count("format") ? ""
                                     : ", and its metadata has no \"format\": \"lutb-calibration\": it is not a "
                                       "statistics file of lutb calibrate"));
    const int layer = std::stoi(m[2].str());
    const std::int64_t e = std::stoll(m[3].str());
    LayerCalibration& lc = s.layers[layer];
    if (lc.prefix.empty()) lc.prefix = m[1].str();
    if (lc.prefix != m[1].str())
      throw std::runtime_error(fmt::format("{}: tensor {} has prefix {}, but layer {} has {}", file.string(), n,
                                           m[1].str(), layer, lc.prefix));
    const TensorView& v = f.get(n);
    const std::string kind = m[4].str();
    if (kind == "gate_up.xxT" || kind == "down.hhT") {
      (kind == "gate_up.xxT" ? seen[layer].gu_full : seen[layer].dn_full)[e] = &v;
      continue;
    }
    std::vector<float> x = read_f32(file, v);
    if (kind == "tokens" && x.size() != 1)
      throw std::runtime_error(fmt::format("{}: tensor {} has {} elements, expected 1 (a token count)", file.string(), n,
                                           x.size()));
    (kind == "tokens" ? seen[layer].tk : kind == "gate_up.x2" ? seen[layer].gu : seen[layer].dn)[e] = std::move(x);
  }
  for (auto& [layer, lc] : s.layers) {
    Seen& sn = seen[layer];
    const std::int64_t E = static_cast<std::int64_t>(sn.tk.size());
    lc.experts = E;
    for (std::int64_t e = 0; e < E; ++e)
      for (const auto* part : {&sn.gu, &sn.dn, &sn.tk})
        if (!part->count(e))
          throw std::runtime_error(fmt::format("{}: layer {} ({}) lacks tensor {}.{}{} (experts 0..{} need all three "
                                               "statistics)",
                                               file.string(), layer, lc.prefix, lc.prefix, e,
                                               part == &sn.gu ? kGateUp : part == &sn.dn ? kDown : kTokens, E - 1));
    if (static_cast<std::int64_t>(sn.gu.size()) != E || static_cast<std::int64_t>(sn.dn.size()) != E)
      throw std::runtime_error(fmt::format("{}: layer {} ({}): {} token counts but {} gate_up and {} down statistics",
                                           file.string(), layer, lc.prefix, E, sn.gu.size(), sn.dn.size()));
    lc.hidden = static_cast<std::int64_t>(sn.gu[0].size());
    lc.intermediate = static_cast<std::int64_t>(sn.dn[0].size());
    for (std::int64_t e = 0; e < E; ++e) {
      if (static_cast<std::int64_t>(sn.gu[e].size()) != lc.hidden ||
          static_cast<std::int64_t>(sn.dn[e].size()) != lc.intermediate)
        throw std::runtime_error(fmt::format("{}: layer {} expert {}: statistics of {} / {} columns, expert 0 has {} / {}",
                                             file.string(), layer, e, sn.gu[e].size(), sn.dn[e].size(), lc.hidden,
                                             lc.intermediate));
      lc.gate_up_x2.insert(lc.gate_up_x2.end(), sn.gu[e].begin(), sn.gu[e].end());
      lc.down_x2.insert(lc.down_x2.end(), sn.dn[e].begin(), sn.dn[e].end());
      lc.tokens.push_back(sn.tk[e][0]);
    }
    if (sn.gu_full.empty() && sn.dn_full.empty()) continue;
    // Full moments: all or none, F32 [cols, cols]; their values are checked when second_moments() reads them.
    for (std::int64_t e = 0; e < E; ++e)
      for (const bool gate_up : {true, false}) {
        const auto& part = gate_up ? sn.gu_full : sn.dn_full;
        const std::string name = fmt::format("{}.{}{}", lc.prefix, e, gate_up ? kGateUpFull : kDownFull);
        const auto it = part.find(e);
        if (it == part.end())
          throw std::runtime_error(fmt::format("{}: layer {} ({}) lacks tensor {} (the full second moments are "
                                               "stored for every expert of a layer or for none)",
                                               file.string(), layer, lc.prefix, name));
        const std::int64_t K = gate_up ? lc.hidden : lc.intermediate;
        const TensorView& v = *it->second;
        if (v.dtype != DType::F32)
          throw std::runtime_error(fmt::format("{}: tensor {} has dtype {}; calibration statistics are F32",
                                               file.string(), name, dtype_name(v.dtype)));
        if (v.shape != std::vector<std::int64_t>{K, K})
          throw std::runtime_error(fmt::format("{}: tensor {} has shape [{}], expected [{}, {}] (the {} columns of "
                                               "the expert's {}.x2)",
                                               file.string(), name, fmt::join(v.shape, ", "), K, K, K,
                                               gate_up ? "gate_up" : "down"));
      }
    if (static_cast<std::int64_t>(sn.gu_full.size()) != E || static_cast<std::int64_t>(sn.dn_full.size()) != E)
      throw std::runtime_error(fmt::format("{}: layer {} ({}): {} token counts but {} gate_up.xxT and {} down.hhT",
                                           file.string(), layer, lc.prefix, E, sn.gu_full.size(), sn.dn_full.size()));
    lc.full_moments = true;
  }
  return s;
}

void CalibrationStats::check() const {
  for (const auto& [layer, lc] : layers) {
    const std::string where = fmt::format("the calibration statistics of layer {} ({})", layer, lc.prefix);
    const auto sized = [&](const std::vector<float>& v, const char* what, const char* dims, std::int64_t cols) {
      const auto want = static_cast<std::size_t>(lc.experts * cols);
      if (lc.experts < 0 || cols < 0 || v.size() != want)
        throw std::runtime_error(fmt::format("{}, {} holds {} values, expected {} = {} x {}", where, what, v.size(),
                                             dims, lc.experts, cols));
    };
    sized(lc.gate_up_x2, "gate_up.x2", "experts x hidden", lc.hidden);
    sized(lc.down_x2, "down.x2", "experts x intermediate", lc.intermediate);
    sized(lc.tokens, "tokens", "experts x 1", 1);
    if (!lc.gate_up_xxT.empty() || !lc.down_hhT.empty()) {
      sized(lc.gate_up_xxT, "gate_up.xxT", "experts x hidden^2", lc.hidden * lc.hidden);
      sized(lc.down_hhT, "down.hhT", "experts x intermediate^2", lc.intermediate * lc.intermediate);
    }
    for (std::int64_t e = 0; e < lc.experts; ++e) {
      const auto columns = [&](const std::vector<float>& v, std::int64_t cols, const char* what) {
        for (std::int64_t c = 0; c < cols; ++c)
          if (const float x = v[static_cast<std::size_t>(e * cols + c)]; !std::isfinite(x) || x < 0.0f)
            throw std::runtime_error(fmt::format("{}, expert {}, {} column {} is {}; statistics are finite and >= 0",
                                                 where, e, what, c, value_text(x)));
      };
      columns(lc.gate_up_x2, lc.hidden, "gate_up.x2");
      columns(lc.down_x2, lc.intermediate, "down.x2");
      const auto full = [&](const std::vector<float>& v, std::int64_t cols, const char* what) {
        if (v.empty()) return;
        for (std::int64_t i = 0; i < cols; ++i)
          for (std::int64_t j = 0; j < cols; ++j)
            if (const float x = v[static_cast<std::size_t>((e * cols + i) * cols + j)];
                !std::isfinite(x) || (i == j && x < 0.0f))
              throw std::runtime_error(fmt::format("{}, expert {}, {} [{}][{}] is {}; statistics are finite and the "
                                                   "diagonal >= 0",
                                                   where, e, what, i, j, value_text(x)));
      };
      full(lc.gate_up_xxT, lc.hidden, "gate_up.xxT");
      full(lc.down_hhT, lc.intermediate, "down.hhT");
      if (const float n = lc.tokens[static_cast<std::size_t>(e)]; !std::isfinite(n) || n < 0.0f)
        throw std::runtime_error(
            fmt::format("{}, expert {}, tokens is {}; statistics are finite and >= 0", where, e, value_text(n)));
    }
  }
}

void CalibrationStats::save(const std::filesystem::path& file) const {
  try {
    check();
  } catch (const std::runtime_error& e) {
    throw std::runtime_error(fmt::format("{}: {}; nothing written", file.string(), e.what()));
  }
  std::vector<std::pair<std::string, OwnedTensor>> t;
  auto add = [&](const std::string& name, const float* p, std::int64_t n, std::int64_t square = 0) {
    OwnedTensor o{DType::F32, square > 0 ? std::vector<std::int64_t>{square, square} : std::vector<std::int64_t>{n},
                  std::vector<std::uint8_t>(static_cast<std::size_t>(n) * sizeof(float))};
    if (n > 0) std::memcpy(o.bytes.data(), p, o.bytes.size());
    t.emplace_back(name, std::move(o));
  };
  for (const auto& [layer, lc] : layers)
    for (std::int64_t e = 0; e < lc.experts; ++e) {
      const std::string base = fmt::format("{}.{}", lc.prefix, e);
      add(base + kGateUp, lc.gate_up_x2.data() + e * lc.hidden, lc.hidden);
      add(base + kDown, lc.down_x2.data() + e * lc.intermediate, lc.intermediate);
      add(base + kTokens, lc.tokens.data() + e, 1);
      if (lc.gate_up_xxT.empty()) continue;
      const std::int64_t h2 = lc.hidden * lc.hidden, i2 = lc.intermediate * lc.intermediate;
      add(base + kGateUpFull, lc.gate_up_xxT.data() + e * h2, h2, lc.hidden);
      add(base + kDownFull, lc.down_hhT.data() + e * i2, i2, lc.intermediate);
    }
  std::map<std::string, std::string> md = metadata;
  md["format"] = kFormat;
  // The writer's errors name its temporary (FILE.tmp.PID), which is gone when they propagate: they are
  // reported against FILE, with what became of it.
  try {
    write_safetensors(file, t, md);
  } catch (const SafetensorsError& e) {
    const std::string tmp = detail::temp_sibling(file).string(), m = e.what();
    if (m.rfind(tmp + ": ", 0) != 0) throw;
    throw std::runtime_error(fmt::format("{}: cannot write the calibration statistics ({}); {}", file.string(),
                                         m.substr(tmp.size() + 2), detail::target_left_clause(file)));
  }
}

std::vector<float> CalibrationStats::column_weights(int layer, CalibratedInput input) const {
  const auto it = layers.find(layer);
  if (it == layers.end()) throw std::runtime_error(fmt::format("calibration statistics: no statistics for layer {}", layer));
  const LayerCalibration& lc = it->second;
  const std::int64_t E = lc.experts, C = input == CalibratedInput::kGateUp ? lc.hidden : lc.intermediate;
  const std::vector<float>& x2 = input == CalibratedInput::kGateUp ? lc.gate_up_x2 : lc.down_x2;
  std::vector<float> out(static_cast<std::size_t>(E * C), 1.0f);
  // m_layer = sum_e n_e m_e / sum_e n_e, in double, experts in order.
  double n_total = 0.0;
  std::vector<double> m_layer(static_cast<std::size_t>(C), 0.0);
  for (std::int64_t e = 0; e < E; ++e) {
    const double n = lc.tokens[static_cast<std::size_t>(e)];
    n_total += n;
    for (std::int64_t c = 0; c < C; ++c) m_layer[static_cast<std::size_t>(c)] += n * x2[static_cast<std::size_t>(e * C + c)];
  }
  if (!(n_total > 0.0)) return out;  // no calibration token reached the layer: unweighted
  for (auto& v : m_layer) v /= n_total;
  std::vector<double> d(static_cast<std::size_t>(C));
  for (std::int64_t e = 0; e < E; ++e) {
    const double n = lc.tokens[static_cast<std::size_t>(e)];
    double mean = 0.0;
    for (std::int64_t c = 0; c < C; ++c) {
      const std::size_t i = static_cast<std::size_t>(c);
      d[i] = (n * x2[static_cast<std::size_t>(e * C + c)] + kPriorTokens * m_layer[i]) / (n + kPriorTokens);
      mean += d[i];
    }
    mean /= static_cast<double>(C);
    if (!(mean > 0.0)) continue;  // every column silent in the whole layer: unweighted
    for (std::int64_t c = 0; c < C; ++c)
      out[static_cast<std::size_t>(e * C + c)] =
          static_cast<float>(std::max(d[static_cast<std::size_t>(c)] / mean, kMinRelativeWeight));
  }
  return out;
}

namespace {

// Which statistics a routed-expert tensor of a checkpoint reads (lutb quantize's names).
struct TensorStats {
  int layer;
  CalibratedInput input;
  std::int64_t e0, n_e, cols;
};

// The statistics of tensor `name`, fitted as `experts` x `cols`: per-expert PREFIX.e.{gate_proj,
// up_proj,w1,w3}.weight -> gate/up of expert e, PREFIX.e.{down_proj,w2}.weight -> down of expert e;
// stacked PREFIX.gate_up_proj / PREFIX.down_proj -> all experts. nullopt under no layer's prefix.
std::optional<TensorStats> find_tensor_stats(const std::map<int, LayerCalibration>& layers, const std::string& name,
                                             std::int64_t experts, std::int64_t cols, const std::string& file) {
  for (const auto& [layer, lc] : layers) {
    const std::string p = lc.prefix + ".";
    if (name.compare(0, p.size(), p) != 0) continue;
    const std::string rest = name.substr(p.size());
    static const std::regex per_expert(R"(^(\d+)\.(gate_proj|up_proj|down_proj|w1|w2|w3)\.weight$)");
    std::smatch m;
    std::int64_t e0 = 0, n_e = lc.experts;
    CalibratedInput in;
    if (std::regex_match(rest, m, per_expert)) {
      e0 = std::stoll(m[1].str());
      n_e = 1;
      in = m[2] == "down_proj" || m[2] == "w2" ? CalibratedInput::kDown : CalibratedInput::kGateUp;
      if (e0 >= lc.experts)
        throw std::runtime_error(fmt::format("{}: tensor {} is expert {}, but layer {} has statistics of {} experts",
                                             file, name, e0, layer, lc.experts));
    } else if (rest == "gate_up_proj" || rest == "down_proj") {
      in = rest == "down_proj" ? CalibratedInput::kDown : CalibratedInput::kGateUp;
    } else {
      throw std::runtime_error(fmt::format("{}: tensor {} lies under the experts of layer {} ({}) but is no projection "
                                           "the statistics describe",
                                           file, name, layer, lc.prefix));
    }
    const std::int64_t want = in == CalibratedInput::kDown ? lc.intermediate : lc.hidden;
    if (experts != n_e || cols != want)
      throw std::runtime_error(fmt::format(
          "{}: tensor {} is fitted as {} expert(s) x {} columns, but the statistics of its input ({}) have {} expert(s) "
          "x {} columns (were they collected on this model?)",
          file, name, experts, cols, in == CalibratedInput::kDown ? "down" : "gate_up", n_e, want));
    return TensorStats{layer, in, e0, n_e, want};
  }
  return std::nullopt;
}

}  // namespace

std::optional<std::vector<float>> CalibrationStats::weights_for_tensor(const std::string& name, std::int64_t experts,
                                                                       std::int64_t cols,
                                                                       const std::string& file_for_errors) const {
  const std::optional<TensorStats> t = find_tensor_stats(layers, name, experts, cols, file_for_errors);
  if (!t) return std::nullopt;
  const std::vector<float> all = column_weights(t->layer, t->input);
  return std::vector<float>(all.begin() + t->e0 * t->cols, all.begin() + (t->e0 + t->n_e) * t->cols);
}

bool CalibrationStats::has_second_moments() const {
  if (layers.empty()) return false;
  for (const auto& [layer, lc] : layers)
    if (!lc.full_moments) return false;
  return true;
}

std::vector<float> CalibrationStats::second_moments(int layer, CalibratedInput input, std::int64_t e0, std::int64_t n,
                                                    SecondMomentsCache* cache) const {
  const auto it = layers.find(layer);
  const std::string file = source.empty() ? std::string("calibration statistics") : source;
  if (it == layers.end()) throw std::runtime_error(fmt::format("{}: no statistics for layer {}", file, layer));
  const LayerCalibration& lc = it->second;
  const bool gate_up = input == CalibratedInput::kGateUp;
  if (!lc.full_moments)
    throw std::runtime_error(fmt::format("{}: layer {} ({}) has no full second moments (PREFIX.e.{}; lutb calibrate "
                                         "--full-moments stores them)",
                                         file, layer, lc.prefix, gate_up ? "gate_up.xxT" : "down.hhT"));
  const std::int64_t E = lc.experts, K = gate_up ? lc.hidden : lc.intermediate;
  if (e0 < 0 || n < 0 || e0 + n > E)
    throw std::runtime_error(fmt::format("{}: layer {} ({}): experts {}..{} asked, the statistics have {}", file, layer,
                                         lc.prefix, e0, e0 + n - 1, E));
  const std::size_t K2 = static_cast<std::size_t>(K * K);
  const std::vector<float>& mem = gate_up ? lc.gate_up_xxT : lc.down_hhT;
  std::unique_ptr<SafetensorsFile> f;
  if (mem.empty()) f = std::make_unique<SafetensorsFile>(source);
  // Expert e's moments (K2 floats), checked: from memory, or from the file with its dtype, shape and
  // values checked (the file may have changed since load()).
  const auto expert = [&](std::int64_t e) -> const float* {
    if (!mem.empty()) return mem.data() + static_cast<std::size_t>(e) * K2;
    const std::string name = fmt::format("{}.{}{}", lc.prefix, e, gate_up ? kGateUpFull : kDownFull);
    if (!f->contains(name))
      throw std::runtime_error(fmt::format("{}: tensor {} is missing (the file changed after it was read?)", file, name));
    const TensorView& v = f->get(name);
    if (v.dtype != DType::F32 || v.shape != std::vector<std::int64_t>{K, K})
      throw std::runtime_error(fmt::format("{}: tensor {} has dtype {} and shape [{}], expected F32 [{}, {}]", file,
                                           name, dtype_name(v.dtype), fmt::join(v.shape, ", "), K, K));
    // The file's data need not be 4-byte aligned: the checks and the sums below read a copy.
    thread_local std::vector<float> buf;
    buf.resize(K2);
    std::memcpy(buf.data(), v.data, K2 * sizeof(float));
    for (std::int64_t i = 0; i < K; ++i)
      for (std::int64_t j = 0; j < K; ++j)
        if (const float x = buf[static_cast<std::size_t>(i * K + j)]; !std::isfinite(x) || (i == j && x < 0.0f))
          throw std::runtime_error(fmt::format("{}: tensor {} holds {} at [{}, {}]; second moments are finite with a "
                                               "diagonal >= 0",
                                               file, name, value_text(x), i, j));
    return buf.data();
  };
  // M_layer = sum_e n_e M_e / sum_e n_e, in double, experts in order (or the cache's).
  SecondMomentsCache local;
  SecondMomentsCache& c = cache ? *cache : local;
  if (c.layer != layer || c.input != input || c.mean.size() != K2) {
    c.layer = -1;  // empty until complete (a read below may throw)
    c.n_total = 0.0;
    c.mean.assign(K2, 0.0);
    for (std::int64_t e = 0; e < E; ++e) {
      const double ne = lc.tokens[static_cast<std::size_t>(e)];
      if (!(ne > 0.0)) continue;
      c.n_total += ne;
      const float* M = expert(e);
      for (std::size_t i = 0; i < K2; ++i) c.mean[i] += ne * M[i];
    }
    if (c.n_total > 0.0)
      for (auto& v : c.mean) v /= c.n_total;
    c.layer = layer;
    c.input = input;
  }
  const std::vector<double>& m_layer = c.mean;
  std::vector<float> out(static_cast<std::size_t>(n) * K2, 0.0f);
  if (!(c.n_total > 0.0)) return out;  // no calibration token reached the layer: no feedback
  for (std::int64_t k = 0; k < n; ++k) {
    const std::int64_t e = e0 + k;
    const double ne = lc.tokens[static_cast<std::size_t>(e)];
    const float* M = ne > 0.0 ? expert(e) : nullptr;
    float* o = out.data() + static_cast<std::size_t>(k) * K2;
    for (std::size_t i = 0; i < K2; ++i)
      o[i] = static_cast<float>(((M ? ne * M[i] : 0.0) + kPriorTokens * m_layer[i]) / (ne + kPriorTokens));
  }
  return out;
}

std::optional<std::vector<float>> CalibrationStats::second_moments_for_tensor(const std::string& name,
                                                                              std::int64_t experts, std::int64_t cols,
                                                                              const std::string& file_for_errors,
                                                                              SecondMomentsCache* cache) const {
  const std::optional<TensorStats> t = find_tensor_stats(layers, name, experts, cols, file_for_errors);
  if (!t) return std::nullopt;
  return second_moments(t->layer, t->input, t->e0, t->n_e, cache);
}

}  // namespace lutb
