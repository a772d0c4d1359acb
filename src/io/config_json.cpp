// Typed reading of config.json keys with one error wording (see config_json.hpp).
#include "io/config_json.hpp"

#include <cerrno>
#include <cstdint>
#include <cstring>
#include <system_error>

#include <fmt/core.h>

#include "lutb/checkpoint.hpp"

namespace lutb::detail {

namespace {
const nlohmann::json* find_value(const nlohmann::json& j, const char* key) {
  if (!j.is_object()) return nullptr;
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) return nullptr;
  return &*it;
}
std::string_view shown(const char* key, std::string_view name) { return name.empty() ? std::string_view(key) : name; }
}  // namespace

std::string config_key_message(std::string_view where, std::string_view key, std::string_view reason) {
  return fmt::format("{}: key '{}': {}", where, key, reason);
}

void throw_config_key(std::string_view where, std::string_view key, std::string_view reason) {
  throw ConfigError(config_key_message(where, key, reason));
}

std::string json_excerpt(const nlohmann::json& v) {
  std::string s = v.dump();
  if (s.size() > 60) s = s.substr(0, 57) + "...";
  return s;
}

std::optional<std::int64_t> config_int(const nlohmann::json& j, const char* key, std::string_view where,
                                       std::string_view name) {
  const nlohmann::json* v = find_value(j, key);
  if (!v) return std::nullopt;
  if (v->is_number_unsigned()) {
    if (v->get<std::uint64_t>() > static_cast<std::uint64_t>(INT64_MAX))
      throw_config_key(where, shown(key, name), fmt::format("integer {} is too large", v->dump()));
    return static_cast<std::int64_t>(v->get<std::uint64_t>());
  }
  if (!v->is_number_integer())
    throw_config_key(where, shown(key, name), fmt::format("must be an integer, got {}", json_excerpt(*v)));
  return v->get<std::int64_t>();
}

std::optional<double> config_number(const nlohmann::json& j, const char* key, std::string_view where,
                                    std::string_view name) {
  const nlohmann::json* v = find_value(j, key);
  if (!v) return std::nullopt;
  if (!v->is_number()) throw_config_key(where, shown(key, name), fmt::format("must be a number, got {}", json_excerpt(*v)));
  return v->get<double>();
}

std::optional<bool> config_bool(const nlohmann::json& j, const char* key, std::string_view where, std::string_view name) {
  const nlohmann::json* v = find_value(j, key);
  if (!v) return std::nullopt;
  if (!v->is_boolean())
    throw_config_key(where, shown(key, name), fmt::format("must be true or false, got {}", json_excerpt(*v)));
  return v->get<bool>();
}

std::optional<std::string> config_string(const nlohmann::json& j, const char* key, std::string_view where,
                                         std::string_view name) {
  const nlohmann::json* v = find_value(j, key);
  if (!v) return std::nullopt;
  if (!v->is_string()) throw_config_key(where, shown(key, name), fmt::format("must be a string, got {}", json_excerpt(*v)));
  return v->get<std::string>();
}

std::string non_regular_kind(const std::filesystem::path& p) {
  namespace fs = std::filesystem;
  std::error_code ec;
  const fs::file_status st = fs::status(p, ec);
  if (ec || !fs::exists(st) || fs::is_regular_file(st)) return {};
  switch (st.type()) {
    case fs::file_type::fifo: return "a named pipe (FIFO)";
    case fs::file_type::directory: return "a directory";
    case fs::file_type::character: return "a character device";
    case fs::file_type::block: return "a block device";
    case fs::file_type::socket: return "a socket";
    default: return "a special file";
  }
}

std::string folder_access_problem(const std::filesystem::path& dir) {
  namespace fs = std::filesystem;
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) return {};
  // A file name inside the folder: its status needs search (x) permission on the folder, which
  // listing (r) alone does not give.
  (void)fs::status(dir / "config.json", ec);
  if (!ec || ec == std::errc::no_such_file_or_directory) {
    fs::directory_iterator it(dir, ec);  // read permission
    if (!ec) return {};
  }
  return fmt::format("{}: cannot look inside the checkpoint directory: {}", dir.string(), ec.message());
}

std::string cannot_open(int err) {
  return err == 0 ? std::string(": cannot open") : fmt::format(": cannot open: {}", std::strerror(err));
}

}  // namespace lutb::detail
