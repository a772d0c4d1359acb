#include "support/test_support.hpp"

#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iterator>
#include <random>
#include <stdexcept>

#include <unistd.h>

namespace lutb::test {
namespace fs = std::filesystem;

std::optional<fs::path> shared_dir() {
  if (const char* env = std::getenv("LUTB_SHARED_DIR"); env && *env) {
    if (fs::is_directory(env)) return fs::path(env);
    return std::nullopt;
  }
#ifdef LUTB_SOURCE_DIR
  fs::path p = fs::path(LUTB_SOURCE_DIR) / ".." / "shared";
  if (fs::is_directory(p)) return fs::weakly_canonical(p);
#endif
  return std::nullopt;
}

std::optional<fs::path> golden_dir() {
  if (const char* env = std::getenv("LUTB_GOLDEN_DIR"); env && *env) {
    if (fs::is_directory(env)) return fs::path(env);
    return std::nullopt;
  }
  auto s = shared_dir();
  if (s && fs::is_directory(*s / "golden")) return *s / "golden";
  return std::nullopt;
}

std::optional<fs::path> model_dir(const std::string& name) {
  auto s = shared_dir();
  if (!s) return std::nullopt;
  fs::path p = *s / "models" / name;
  if (!fs::is_directory(p)) return std::nullopt;
  return p;
}

std::optional<nlohmann::json> load_golden(const std::string& file) {
  auto g = golden_dir();
  if (!g) return std::nullopt;
  std::ifstream in(*g / file);
  if (!in) return std::nullopt;
  return nlohmann::json::parse(in);
}

std::uint64_t parse_hex(const std::string& s) {
  std::size_t pos = 0;
  if (s.size() > 1 && s[0] == '0' && (s[1] == 'x' || s[1] == 'X')) pos = 2;
  return std::stoull(s.substr(pos), nullptr, 16);
}

std::vector<std::uint8_t> parse_hex_bytes(const std::string& s) {
  if (s.size() % 2) throw std::invalid_argument("odd hex string length");
  std::vector<std::uint8_t> out(s.size() / 2);
  for (std::size_t i = 0; i < out.size(); ++i) out[i] = static_cast<std::uint8_t>(std::stoul(s.substr(2 * i, 2), nullptr, 16));
  return out;
}

float f32_hex(const std::string& s) {
  const auto u = static_cast<std::uint32_t>(parse_hex(s));
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

std::string read_file(const fs::path& p) {
  std::ifstream f(p, std::ios::binary);
  return {std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>()};
}

TempDir::TempDir() {
  std::random_device rd;
  for (int attempt = 0; attempt < 100; ++attempt) {
    path = fs::temp_directory_path() / ("lutb-test-" + std::to_string(::getpid()) + "-" + std::to_string(rd()));
    if (fs::create_directory(path)) return;
  }
  throw std::runtime_error("cannot create a temporary directory");
}

TempDir::~TempDir() {
  std::error_code ec;
  fs::remove_all(path, ec);
}

}  // namespace lutb::test
