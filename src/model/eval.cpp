// The evaluation protocol of spec section 8 and the token reader.
#include <cstring>
#include <chrono>

#include <fmt/core.h>
#include <fmt/ranges.h>

#include "lutb/model.hpp"
#include "lutb/safetensors.hpp"

namespace lutb::model {

std::vector<std::int32_t> load_token_ids(const std::filesystem::path& file) {
  if (!std::filesystem::exists(file)) throw ModelError(fmt::format("{}: tokens file not found", file.string()));
  const SafetensorsFile f(file);
  if (!f.contains("input_ids")) throw ModelError(fmt::format("{}: no tensor input_ids", file.string()));
  const TensorView& t = f.get("input_ids");
  const bool shape_ok = t.shape.size() == 1 || (t.shape.size() == 2 && t.shape[0] == 1);
  if (!shape_ok)
    throw ModelError(fmt::format("{}: tensor input_ids has shape [{}], expected [n] or [1, n]", file.string(), fmt::join(t.shape, ", ")));
  std::vector<std::int32_t> ids;
  // Copied element by element with memcpy: a valid file need not align the data (the header
  // length is free), so typed views over the mapping cannot be assumed.
  const std::int64_t n = t.numel();
  if (t.dtype == DType::I32) {
    ids.resize(static_cast<std::size_t>(n));
    if (n > 0) std::memcpy(ids.data(), t.data, static_cast<std::size_t>(n) * sizeof(std::int32_t));
  } else if (t.dtype == DType::I64) {
    ids.reserve(static_cast<std::size_t>(n));
    for (std::int64_t i = 0; i < n; ++i) {
      std::int64_t v;
      std::memcpy(&v, t.data + i * sizeof(std::int64_t), sizeof v);
      if (v < INT32_MIN || v > INT32_MAX) throw ModelError(fmt::format("{}: input_ids value {} is out of range", file.string(), v));
      ids.push_back(static_cast<std::int32_t>(v));
    }
  } else {
    throw ModelError(fmt::format("{}: tensor input_ids has dtype {}, expected I32 or I64", file.string(), dtype_name(t.dtype)));
  }
  return ids;
}

EvalResult evaluate(LanguageModel& model, const std::vector<std::int32_t>& tokens, const EvalOptions& opt) {
  if (opt.window < 2) throw ModelError(fmt::format("evaluation window {} must be at least 2 tokens", opt.window));
  std::int64_t windows = static_cast<std::int64_t>(tokens.size()) / opt.window;
  if (windows == 0)
    throw ModelError(fmt::format("{} tokens are fewer than one window of {}", tokens.size(), opt.window));
  if (opt.max_windows > 0) windows = std::min(windows, opt.max_windows);
  const std::int64_t batch = std::max<std::int64_t>(1, opt.batch);
  const auto t0 = std::chrono::steady_clock::now();
  double total = 0.0;
  for (std::int64_t w = 0; w < windows; w += batch) {
    const std::int64_t b = std::min(batch, windows - w);
    total += model.forward(tokens.data() + w * opt.window, b, opt.window);
    if (opt.progress) opt.progress(w + b, windows);
  }
  EvalResult r;
  r.windows = windows;
  r.tokens = windows * (opt.window - 1);
  r.val_loss = total / static_cast<double>(r.tokens);
  r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return r;
}

}  // namespace lutb::model
