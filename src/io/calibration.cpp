// Calibration statistics file (lutb/calibration.hpp): reading, writing, and the column weights of the
// weighted fit, with the rule for rarely routed experts.
#include "lutb/calibration.hpp"

#include <cmath>
#include <cstring>
#include <regex>
#include <stdexcept>

#include <fmt/core.h>

#include "io/checkpoint_internal.hpp"
#include "lutb/safetensors.hpp"

namespace lutb {
namespace {

constexpr const char* kGateUp = ".gate_up.x2";
constexpr const char* kDown = ".down.x2";
constexpr const char* kTokens = ".tokens";
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
  // PREFIX.e.{gate_up.x2, down.x2, tokens}; the layer index is the number after "layers." in PREFIX.
  static const std::regex name_re(R"(^(.*\.layers\.(\d+)\..*)\.(\d+)\.(gate_up\.x2|down\.x2|tokens)$)");
  struct Seen {
    std::map<std::int64_t, std::vector<float>> gu, dn, tk;
  };
  std::map<int, Seen> seen;
  for (const auto& n : f.names()) {
    std::smatch m;
    if (!std::regex_match(n, m, name_re))
      throw std::runtime_error(fmt::format(
          "{}: tensor {} is not a calibration statistic (expected PREFIX.e.gate_up.x2, PREFIX.e.down.x2 or "
          "PREFIX.e.tokens, with PREFIX the experts' prefix such as model.layers.L.mlp.experts and e the expert; "
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
    std::vector<float> x = read_f32(file, v);
    const std::string kind = m[4].str();
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
    for (std::int64_t e = 0; e < lc.experts; ++e) {
      const auto columns = [&](const std::vector<float>& v, std::int64_t cols, const char* what) {
        for (std::int64_t c = 0; c < cols; ++c)
          if (const float x = v[static_cast<std::size_t>(e * cols + c)]; !std::isfinite(x) || x < 0.0f)
            throw std::runtime_error(fmt::format("{}, expert {}, {} column {} is {}; statistics are finite and >= 0",
                                                 where, e, what, c, value_text(x)));
      };
      columns(lc.gate_up_x2, lc.hidden, "gate_up.x2");
      columns(lc.down_x2, lc.intermediate, "down.x2");
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
  auto add = [&](const std::string& name, const float* p, std::int64_t n) {
    OwnedTensor o{DType::F32, {n}, std::vector<std::uint8_t>(static_cast<std::size_t>(n) * sizeof(float))};
    if (n > 0) std::memcpy(o.bytes.data(), p, o.bytes.size());
    t.emplace_back(name, std::move(o));
  };
  for (const auto& [layer, lc] : layers)
    for (std::int64_t e = 0; e < lc.experts; ++e) {
      const std::string base = fmt::format("{}.{}", lc.prefix, e);
      add(base + kGateUp, lc.gate_up_x2.data() + e * lc.hidden, lc.hidden);
      add(base + kDown, lc.down_x2.data() + e * lc.intermediate, lc.intermediate);
      add(base + kTokens, lc.tokens.data() + e, 1);
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

std::optional<std::vector<float>> CalibrationStats::weights_for_tensor(const std::string& name, std::int64_t experts,
                                                                       std::int64_t cols,
                                                                       const std::string& file_for_errors) const {
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
                                             file_for_errors, name, e0, layer, lc.experts));
    } else if (rest == "gate_up_proj" || rest == "down_proj") {
      in = rest == "down_proj" ? CalibratedInput::kDown : CalibratedInput::kGateUp;
    } else {
      throw std::runtime_error(fmt::format("{}: tensor {} lies under the experts of layer {} ({}) but is no projection "
                                           "the statistics describe",
                                           file_for_errors, name, layer, lc.prefix));
    }
    const std::int64_t want = in == CalibratedInput::kDown ? lc.intermediate : lc.hidden;
    if (experts != n_e || cols != want)
      throw std::runtime_error(fmt::format(
          "{}: tensor {} is fitted as {} expert(s) x {} columns, but the statistics of its input ({}) have {} expert(s) "
          "x {} columns (were they collected on this model?)",
          file_for_errors, name, experts, cols, in == CalibratedInput::kDown ? "down" : "gate_up", n_e, want));
    const std::vector<float> all = column_weights(layer, in);
    return std::vector<float>(all.begin() + e0 * want, all.begin() + (e0 + n_e) * want);
  }
  return std::nullopt;
}

}  // namespace lutb
