// Defect a new user found (session 12, helper nu12): `lutb eval` on a checkpoint whose layer norm is
// stored with an integer dtype said "m: tensor X: tensor 'X': dtype I16 cannot be read as floating
// point", naming the folder instead of the file and the tensor twice. Fails before the fix.
#include <gtest/gtest.h>

#include <cstdint>
#include <fstream>
#include <string>

#include <nlohmann/json.hpp>

#include "model/model_test_util.hpp"
#include "support/test_support.hpp"

namespace lutb {
namespace {

namespace fs = std::filesystem;
using test::TempDir;

// Sets the dtype of tensor `name` in the header of `file` (same element size), keeping the header length.
void set_dtype(const fs::path& file, const std::string& name, const std::string& dtype) {
  std::fstream f(file, std::ios::in | std::ios::out | std::ios::binary);
  std::uint64_t hn = 0;
  f.read(reinterpret_cast<char*>(&hn), 8);
  std::string header(hn, '\0');
  f.read(header.data(), static_cast<std::streamsize>(hn));
  auto j = nlohmann::json::parse(header);
  j[name]["dtype"] = dtype;
  std::string out = j.dump();
  ASSERT_LE(out.size(), hn);
  out.resize(hn, ' ');
  f.seekp(8);
  f.write(out.data(), static_cast<std::streamsize>(out.size()));
}

TEST(NewUserNu12, NonFloatTensorErrorNamesTheFileOnce) {
  LUTB_MODEL_OR_SKIP(dir, "tiny-mixtral");
  TempDir t;
  const fs::path m = t.path / "m";
  fs::create_directories(m);
  for (const char* f : {"config.json", "model.safetensors", "val_tokens.safetensors"}) {
    fs::copy_file(dir / f, m / f);
    fs::permissions(m / f, fs::perms::owner_read | fs::perms::owner_write);
  }
  set_dtype(m / "model.safetensors", "model.layers.0.input_layernorm.weight", "I16");
  const test::CliResult r = test::run_cli("eval " + test::quote(m) + " --max-windows 1");
  EXPECT_EQ(r.status, 1);
  EXPECT_NE(r.err.find("lutb: error: " + (m / "model.safetensors").string() +
                       ": tensor 'model.layers.0.input_layernorm.weight': dtype I16 cannot be read as floating point"),
            std::string::npos)
      << r.err;
}

}  // namespace
}  // namespace lutb
