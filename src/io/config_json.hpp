// Typed reading of config.json keys, shared by the two config parsers (checkpoint: ModelConfig in
// src/io/checkpoint_config.cpp; model: TransformerConfig in src/model/config.cpp), so that the same
// fault reads the same from `lutb quantize` and `lutb eval`:
//   WHERE: key 'KEY': REASON
// e.g. "m/config.json: key 'hidden_size': required but missing",
//      "m/config.json: key 'hidden_size': must be an integer, got \"2048\"".
// WHERE is the file (or a description such as "synthetic qwen3_moe"); KEY is the JSON key, dotted
// for a nested object ("rope_parameters.factor").
#pragma once

#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <string_view>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

namespace lutb::detail {

/// "WHERE: key 'KEY': REASON".
std::string config_key_message(std::string_view where, std::string_view key, std::string_view reason);
/// Throws ConfigError(config_key_message(where, key, reason)).
[[noreturn]] void throw_config_key(std::string_view where, std::string_view key, std::string_view reason);
/// nlohmann::json's exception text without its "[json.exception.parse_error.101] " tag, which named
/// the library's error id to the user, and with the bytes a terminal cannot show written as \xNN: the
/// text quotes the input ("last read: '...'"), which may hold control characters or bytes that are not
/// UTF-8 (a config.json saved in Latin-1). Well-formed UTF-8 sequences stay as they are.
inline std::string json_error_text(const char* what) {
  std::string m = what;
  if (m.rfind("[json.exception.", 0) == 0)
    if (const std::size_t p = m.find("] "); p != std::string::npos) m.erase(0, p + 2);
  std::string out;
  out.reserve(m.size());
  const auto byte = [&](std::size_t i) { return static_cast<unsigned char>(m[i]); };
  for (std::size_t i = 0; i < m.size();) {
    const unsigned char b = byte(i);
    // The length of the UTF-8 sequence a lead byte starts (RFC 3629: C2..DF, E0..EF, F0..F4), else 0.
    const std::size_t n = b < 0x80                 ? 1
                          : b >= 0xC2 && b <= 0xDF ? 2
                          : b >= 0xE0 && b <= 0xEF ? 3
                          : b >= 0xF0 && b <= 0xF4 ? 4
                                                   : 0;
    bool ok = n > 0 && i + n <= m.size() && !(n == 1 && (b < 0x20 || b == 0x7F));
    for (std::size_t k = 1; ok && k < n; ++k) ok = (byte(i + k) & 0xC0) == 0x80;
    if (ok) {
      out.append(m, i, n);
      i += n;
    } else {
      out += fmt::format("\\x{:02X}", b);
      ++i;
    }
  }
  return out;
}
/// A JSON value for a message: its dump, cut to 60 characters.
std::string json_excerpt(const nlohmann::json& v);

/// What `p` is when it exists but is not a regular file (symbolic links followed): "a named pipe
/// (FIFO)", "a directory", "a character device", "a block device", "a socket" or "a special file";
/// "" for a regular file or a path that does not exist. Readers check it before opening: a named
/// pipe blocks open() until a writer appears, so a config.json or model.safetensors that is one
/// would hang the command.
std::string non_regular_kind(const std::filesystem::path& p);

/// Why the files of checkpoint folder `dir` cannot be looked up, as "DIR: cannot look inside the
/// checkpoint directory: REASON" ("" when they can, or when `dir` is not a directory). A folder
/// without search permission (mode 0) made std::filesystem throw "filesystem error: status:
/// Permission denied [qu/config.json]", naming a file and not the folder.
std::string folder_access_problem(const std::filesystem::path& dir);

/// ": cannot open: REASON" for an open() that failed with `err` (errno; ": cannot open" when 0).
/// The reason tells an unreadable config.json from a missing one.
std::string cannot_open(int err);

/// Readers: nullopt when `key` is absent or null; ConfigError in the format above when the value has
/// the wrong type. `name` is the key as reported (defaults to `key`; give "rope_parameters.factor"
/// for a nested object).
///   int:    a JSON integer (a float such as 2048.0 is a wrong type), within int64
///   number: any JSON number
///   bool:   true / false
///   string: a JSON string
std::optional<std::int64_t> config_int(const nlohmann::json& j, const char* key, std::string_view where,
                                       std::string_view name = {});
std::optional<double> config_number(const nlohmann::json& j, const char* key, std::string_view where,
                                    std::string_view name = {});
std::optional<bool> config_bool(const nlohmann::json& j, const char* key, std::string_view where,
                                std::string_view name = {});
std::optional<std::string> config_string(const nlohmann::json& j, const char* key, std::string_view where,
                                         std::string_view name = {});

/// The value of a required key; ConfigError "...: key 'K': required but missing" when absent.
template <class T>
T config_required(const std::optional<T>& v, const char* key, std::string_view where) {
  if (!v) throw_config_key(where, key, "required but missing");
  return *v;
}

}  // namespace lutb::detail
