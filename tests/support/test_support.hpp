// Shared helpers for the test suites: where the golden vectors and models are, JSON loading, hex.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <exception>
#include <filesystem>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

#include <nlohmann/json.hpp>

namespace lutb::test {

/// ../shared relative to the source tree (LUTB_SHARED_DIR overrides); nullopt when absent.
std::optional<std::filesystem::path> shared_dir();
/// The golden vectors: $LUTB_GOLDEN_DIR, else ../shared/golden; nullopt when absent.
std::optional<std::filesystem::path> golden_dir();
/// A model folder of ../shared/models (e.g. "tiny-qwen3-moe"); nullopt when absent.
std::optional<std::filesystem::path> model_dir(const std::string& name);
/// Loads golden/<file>; nullopt when the golden directory is absent.
std::optional<nlohmann::json> load_golden(const std::string& file);

/// "0x3f800000" or "3f800000" -> value.
std::uint64_t parse_hex(const std::string& s);
/// Hex string "d1581f..." -> bytes.
std::vector<std::uint8_t> parse_hex_bytes(const std::string& s);
/// FP32 from its hex bit pattern.
float f32_hex(const std::string& s);

/// The bytes of file `p` ("" when it cannot be read).
std::string read_file(const std::filesystem::path& p);

/// Whether `text` contains `part`.
inline bool has(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

/// A fresh temporary directory, removed by the destructor.
struct TempDir {
  TempDir();
  ~TempDir();
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  std::filesystem::path path;
};

/// The message of the exception `f` throws when it is an `Ex`; "wrong exception type: WHAT" for any
/// other std::exception, "no exception" when `f` returns. Tests compare it with the whole expected
/// message, so a failure prints both.
template <class Ex = std::exception, class F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const std::exception& e) {
    if constexpr (!std::is_same_v<Ex, std::exception>) {
      if (dynamic_cast<const Ex*>(&e) == nullptr) return std::string("wrong exception type: ") + e.what();
    }
    return e.what();
  }
  return "no exception";
}

}  // namespace lutb::test

/// Skips the current test with a message when the golden file is absent; else binds `var`.
#define LUTB_GOLDEN_OR_SKIP(var, file)                                                   \
  auto var##_opt = ::lutb::test::load_golden(file);                                      \
  if (!var##_opt) GTEST_SKIP() << "golden directory absent (../shared/golden or LUTB_GOLDEN_DIR): skipping " file; \
  const nlohmann::json& var = *var##_opt

/// Skips when the shared model `name` is absent; else binds `var` (a std::filesystem::path).
#define LUTB_MODEL_OR_SKIP(var, name)                                                    \
  auto var##_opt = ::lutb::test::model_dir(name);                                        \
  if (!var##_opt) GTEST_SKIP() << "model " << (name) << " absent (../shared/models): skipping"; \
  const std::filesystem::path var = *var##_opt
