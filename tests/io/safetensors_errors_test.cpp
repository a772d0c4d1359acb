// Damaged safetensors files: truncated data, overlapping data_offsets, invalid JSON and NUL bytes in
// the header are refused, naming the file and what is wrong.
#include <gtest/gtest.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <random>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "io/checkpoint_internal.hpp"
#include "io/config_json.hpp"
#include "lutb/checkpoint.hpp"
#include "lutb/model.hpp"
#include "lutb/safetensors.hpp"
#include "support/checkpoint_support.hpp"
#include "support/test_support.hpp"

namespace lutb {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;
using test::error_of;
using test::TempDir;
using test::two_shard_checkpoint;

// A weights file cut short (an interrupted download or copy: 13.9 of tiny-qwen3-moe's 27.8 MB) is refused as
// truncated, saying how many bytes are missing: a tensor's data_offsets out of range would leave the user to
// work out that the file, not its header, is at fault.
TEST(SafetensorsErrors, TruncatedFileSaysHowManyBytesAreMissing) {
  namespace fs = std::filesystem;
  test::TempDir t;
  const fs::path full = t.path / "full.safetensors", cut = t.path / "cut.safetensors";
  write_safetensors(full, {{"a", OwnedTensor{DType::U8, {100}, std::vector<std::uint8_t>(100, 1)}},
                           {"b", OwnedTensor{DType::U8, {300}, std::vector<std::uint8_t>(300, 2)}}});
  const auto size = fs::file_size(full);
  fs::copy_file(full, cut);
  fs::resize_file(cut, size - 250);  // b's data [100, 400) now ends 250 bytes past the file's end
  std::string what = "no exception";
  try {
    SafetensorsFile f(cut);
  } catch (const SafetensorsError& e) {
    what = e.what();
  }
  EXPECT_EQ(what, fmt::format("{}: tensor 'b': data_offsets [100, 400] out of range: the data buffer has 150 bytes; the "
                              "header's tensors need 400 bytes of data, 250 more than the file ({} bytes) holds: the file is "
                              "truncated (an interrupted download or copy?) or its header is corrupt",
                              cut.string(), size - 250));
}

// A tensor whose data_offsets were copied from another tensor's is reported as the two tensors that share
// bytes, not as the gap left at its own place.
TEST(SafetensorsErrors, SharedBytesAreReportedAsTheOverlapNotAGap) {
  TempDir t;
  const std::string header =
      R"({"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]},"b":{"dtype":"U8","shape":[4],"data_offsets":[8,12]},)"
      R"("c":{"dtype":"U8","shape":[4],"data_offsets":[8,12]}})";
  const fs::path f = t.path / "x.safetensors";
  {
    std::ofstream o(f, std::ios::binary);
    const std::uint64_t n = header.size();
    o.write(reinterpret_cast<const char*>(&n), 8);
    o << header << std::string(12, '\0');
  }
  EXPECT_EQ(error_of([&] { SafetensorsFile x(f); }),
            f.string() + ": tensor 'c': data_offsets [8, 12] overlap tensor 'b' (which ends at 12)");
}

// A config.json, an index or a safetensors header that is not valid JSON is reported as "invalid JSON" with
// the place, without nlohmann's error id ("[json.exception.parse_error.101]").
TEST(SafetensorsErrors, JsonErrorsWithoutTheLibraryTag) {
  TempDir t;
  const fs::path dir = two_shard_checkpoint(t.path / "m");
  const std::string want = (dir / "config.json").string() + ": invalid JSON: parse error at line 1, column ";
  std::ofstream(dir / "config.json") << "{\"hidden_size\": 256,";
  const std::string a = error_of([&] { Checkpoint c(dir); });
  EXPECT_EQ(a.rfind(want, 0), 0u) << a;
  const std::string b = error_of([&] { (void)model::TransformerConfig::load(dir); });
  EXPECT_EQ(b.rfind(want, 0), 0u) << b;
  std::ofstream(dir / "model.safetensors.index.json") << "{\"weight_map\": {";
  const std::string c = error_of([&] { (void)SafetensorsCollection::open_dir(dir); });
  EXPECT_EQ(c.rfind((dir / "model.safetensors.index.json").string() + ": invalid JSON: parse error at line 1", 0), 0u)
      << c;
  for (const std::string& e : {a, b, c}) EXPECT_EQ(e.find("json.exception"), std::string::npos) << e;
}

// The message quotes the input; a byte that is not UTF-8 (a config.json saved in Latin-1) or a control
// character is written as \xNN, so the one-line message prints as text. UTF-8 stays as it is.
TEST(SafetensorsErrors, JsonErrorsShowBytesThatAreNotTextEscaped) {
  TempDir t;
  const fs::path dir = two_shard_checkpoint(t.path / "m");
  std::ofstream(dir / "config.json", std::ios::binary) << "{\"name\": \"caf\xE9\"}";
  const std::string a = error_of([&] { (void)model::TransformerConfig::load(dir); });
  EXPECT_NE(a.find("\\xE9"), std::string::npos) << a;
  for (const char ch : a) EXPECT_LT(static_cast<unsigned char>(ch), 0x80) << a;
  EXPECT_EQ(detail::json_error_text("[json.exception.parse_error.101] x: 'caf\xC3\xA9\x01\xC3'"),
            "x: 'caf\xC3\xA9\\x01\\xC3'");
}

// A NUL byte ends nlohmann's input, so a header "{...}\0<anything>" would parse as "{...}", a file the
// reference reader refuses (serde_json: trailing characters). Refused, naming the offset; spaces remain the
// header's padding.
TEST(SafetensorsErrors, HeaderWithANulByteIsRefused) {
  TempDir t;
  const std::string json = "{\"a\":{\"dtype\":\"U8\",\"shape\":[2],\"data_offsets\":[0,2]}}";
  const auto write = [&](const fs::path& p, const std::string& header) {
    std::ofstream f(p, std::ios::binary);
    const std::uint64_t n = header.size();
    f.write(reinterpret_cast<const char*>(&n), 8);
    f.write(header.data(), static_cast<std::streamsize>(header.size()));
    f.write("\x01\x02", 2);
  };
  write(t.path / "spaces.safetensors", json + "      ");
  EXPECT_EQ(SafetensorsFile(t.path / "spaces.safetensors").get("a").nbytes, 2u);
  write(t.path / "nul.safetensors", json + std::string("\0\0  xy", 6));
  EXPECT_EQ(error_of([&] { SafetensorsFile f(t.path / "nul.safetensors"); }),
            (t.path / "nul.safetensors").string() + ": header holds a NUL byte at offset " +
                std::to_string(json.size()) + " of its " + std::to_string(json.size() + 6) +
                " bytes: a safetensors header is UTF-8 JSON text, padded with spaces only (a corrupt or truncated "
                "header?)");
}

}  // namespace
}  // namespace lutb
