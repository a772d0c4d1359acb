// Output paths a fresh new user tried in session 15 (helper nu15): names near or above the file
// system's limit and a path through a loop of symbolic links. Each test failed on the code before
// its fix; every refusal leaves the destination folder as it was.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include <unistd.h>

#include <fmt/format.h>

#include "lutb/checkpoint.hpp"
#include "lutb/safetensors.hpp"
#include "support/test_support.hpp"

namespace lutb {
namespace {

namespace fs = std::filesystem;
using test::TempDir;

QuantizeOptions quiet() {
  QuantizeOptions o;
  o.progress = false;
  o.fit.threads = 1;
  return o;
}

// One 8 x 64 BF16 tensor "w" (values 1..512 / 512).
fs::path small_file(const fs::path& dir) {
  std::vector<std::uint8_t> bytes;
  for (int i = 0; i < 512; ++i) {
    const float f = static_cast<float>(i + 1) / 512.0f;
    std::uint32_t u;
    std::memcpy(&u, &f, 4);
    bytes.push_back(static_cast<std::uint8_t>(u >> 16));
    bytes.push_back(static_cast<std::uint8_t>(u >> 24));
  }
  const fs::path p = dir / "in.safetensors";
  write_safetensors(p, {{"w", OwnedTensor{DType::BF16, {8, 64}, bytes}}});
  return p;
}

template <class F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const CheckpointError& e) {
    return e.what();
  } catch (const std::exception& e) {
    return std::string("wrong exception type: ") + e.what();
  }
  return "no exception";
}

std::vector<std::string> entries(const fs::path& d) {
  std::vector<std::string> v;
  for (const auto& e : fs::directory_iterator(d)) v.push_back(e.path().filename().string());
  std::sort(v.begin(), v.end());
  return v;
}

// An output name too long for the file system, or one reached through a loop of links, made
// path_within's weakly_canonical fail and return an empty path, which it took for "/": lutb quantize
// refused with "the output contains the input ...; replacing it would delete the input", and lutb
// synth with "filesystem error: status: File name too long [...]".
TEST(CheckpointNewUserNu15, UnresolvableOutputsAreNamedForWhatTheyAre) {
  TempDir t;
  const fs::path in = small_file(t.path);
  const std::string huge(300, 'n');
  fs::create_directory_symlink("loop", t.path / "loop");  // loop -> loop
  const auto before = entries(t.path);
  for (const fs::path& out : {t.path / (huge + ".safetensors"), t.path / "loop" / "x.safetensors"}) {
    const std::string m = error_of([&] { quantize_file(in, out, "", quiet()); });
    EXPECT_EQ(m.find("contains the input"), std::string::npos) << m;
    EXPECT_EQ(m.rfind(out.string() + ": cannot be used as the output: ", 0), 0u) << m;
    EXPECT_NE(m.find("nothing written"), std::string::npos) << m;
  }
  EXPECT_NE(error_of([&] { quantize_file(in, t.path / (huge + ".safetensors"), "", quiet()); })
                .find("File name too long (a file or folder name may have at most 255 bytes"),
            std::string::npos);
  EXPECT_NE(error_of([&] { quantize_file(in, t.path / "loop" / "x.safetensors", "", quiet()); })
                .find("Too many levels of symbolic links"),
            std::string::npos);
  // Checkpoint mode and synth: the same check, before anything else looks at the output.
  const fs::path ck = t.path / "ck";
  fs::create_directory(ck);
  const std::string mq = error_of([&] { quantize_checkpoint(ck, t.path / huge, quiet()); });
  EXPECT_EQ(mq.rfind((t.path / huge).string() + ": cannot be used as the output: File name too long", 0), 0u) << mq;
  SynthOptions so;
  so.progress = false;
  so.hidden_size = 64;
  so.moe_intermediate_size = 64;
  so.num_experts = 2;
  const std::string ms = error_of([&] { synthesize_checkpoint(t.path / "loop" / "y", so); });
  EXPECT_EQ(ms.rfind((t.path / "loop" / "y").string() + ": cannot be used as the output: ", 0), 0u) << ms;
  fs::remove(ck);
  EXPECT_EQ(entries(t.path), before);
}

// A single-file output whose own name fits the limit but whose temporaries do not: the writer's
// OUT.tmp.PID.tmp.PID failed after the plan as "OUT.tmp.PID.tmp.PID: cannot create: File name too
// long" (names of 236-245 bytes with a 5-digit process id), and OUT.tmp.PID's failure said only
// "cannot create the output: File name too long" of a name the file system accepts.
TEST(CheckpointNewUserNu15, TemporaryNameTooLongSaysHowLongTheOutputMayBe) {
  TempDir t;
  const fs::path in = small_file(t.path);
  const long limit = ::pathconf(t.path.c_str(), _PC_NAME_MAX);
  ASSERT_GT(limit, 40);
  const std::size_t suffix = std::string(".tmp." + std::to_string(::getpid())).size();
  const auto before = entries(t.path);
  // Own name one byte below the limit (the first temporary is too long), then one that leaves room
  // for the first temporary only (the writer's nested one is too long).
  for (std::size_t own : {static_cast<std::size_t>(limit) - 1, static_cast<std::size_t>(limit) - suffix}) {
    const fs::path out = t.path / (std::string(own - 12, 'a') + ".safetensors");
    ASSERT_EQ(out.filename().string().size(), own);
    const std::string m = error_of([&] { quantize_file(in, out, "", quiet()); });
    EXPECT_EQ(m.rfind(out.string() + ": cannot create the output: File name too long: lutb writes the output under "
                                     "the temporary name ",
                      0),
              0u)
        << m;
    const std::size_t fits = static_cast<std::size_t>(limit) - 2 * suffix;
    EXPECT_NE(m.find(fmt::format("choose an output name of at most {} bytes (this one has {})", fits, own)),
              std::string::npos)
        << m;
    EXPECT_NE(m.find("nothing written"), std::string::npos) << m;
    EXPECT_EQ(entries(t.path), before);
  }
  // The longest name that works is written.
  const fs::path ok = t.path / (std::string(static_cast<std::size_t>(limit) - 2 * suffix - 12, 'a') + ".safetensors");
  quantize_file(in, ok, "", quiet());
  EXPECT_TRUE(SafetensorsFile(ok).contains("w_packed"));
}


}  // namespace
}  // namespace lutb
