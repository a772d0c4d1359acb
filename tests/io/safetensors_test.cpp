// Safetensors I/O: write-then-read of every dtype, sharded checkpoints, hostile files (each defect
// gives a SafetensorsError naming the file and the reason), atomic writes, the real tiny models.
#include <gtest/gtest.h>

#include <fcntl.h>
#include <sys/resource.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <new>
#include <cstring>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "lutb/numerics.hpp"
#include "lutb/safetensors.hpp"
#include "support/test_support.hpp"

namespace lutb {
namespace {
namespace fs = std::filesystem;
using test::read_file;
using test::TempDir;

constexpr DType kAllDTypes[] = {DType::BOOL, DType::U8,  DType::I8,   DType::U16,     DType::I16,     DType::U32,
                                DType::I32,  DType::U64, DType::I64,  DType::F16,     DType::BF16,    DType::F32,
                                DType::F64,  DType::F8_E4M3, DType::F8_E5M2, DType::F8_E8M0};

std::vector<std::uint8_t> random_bytes(std::size_t n, std::uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<std::uint8_t> v(n);
  for (auto& b : v) b = static_cast<std::uint8_t>(rng());
  return v;
}

// A raw file: 8-byte length, the header text as given, then `data`.
void write_raw(const fs::path& p, const std::string& header, const std::string& data, std::uint64_t len_override = 0) {
  std::ofstream out(p, std::ios::binary);
  const std::uint64_t n = len_override ? len_override : header.size();
  for (int i = 0; i < 8; ++i) out.put(static_cast<char>(n >> (8 * i)));
  out << header << data;
}

// Expects opening `p` to throw SafetensorsError whose message names the file and contains `reason`.
void expect_broken(const fs::path& p, const std::string& reason) {
  try {
    SafetensorsFile f(p);
    ADD_FAILURE() << "no error for " << p << " (expected: " << reason << ")";
  } catch (const SafetensorsError& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find(p.string()), std::string::npos) << m;
    EXPECT_NE(m.find(reason), std::string::npos) << "message: " << m << "\nexpected to contain: " << reason;
  }
}

TEST(Safetensors, WriteThenReadEveryDType) {
  TempDir tmp;
  const fs::path p = tmp.path / "all.safetensors";
  std::vector<std::pair<std::string, OwnedTensor>> tensors;
  std::uint32_t seed = 1;
  for (DType d : kAllDTypes) {
    // Odd sizes so that, without reordering, later tensors would be misaligned.
    const std::vector<std::int64_t> shape{3, static_cast<std::int64_t>(seed % 5 + 1)};
    const std::size_t n = static_cast<std::size_t>(shape[0] * shape[1]) * dtype_size(d);
    tensors.push_back({"t." + std::string(dtype_name(d)), OwnedTensor{d, shape, random_bytes(n, seed++)}});
  }
  tensors.push_back({"scalar", OwnedTensor{DType::F32, {}, random_bytes(4, 77)}});
  tensors.push_back({"empty", OwnedTensor{DType::BF16, {0, 5}, {}}});
  tensors.push_back({"name with \"quotes\" and unicode \xc3\xa9", OwnedTensor{DType::U8, {1}, {42}}});
  write_safetensors(p, tensors, {{"format", "pt"}, {"lutb", "test \"quoted\""}});
  ASSERT_FALSE(fs::exists(p.string() + ".tmp." + std::to_string(::getpid())));

  // The header is 8-byte padded with spaces, as the reference implementation writes it.
  const std::string raw = read_file(p);
  std::uint64_t n = 0;
  std::memcpy(&n, raw.data(), 8);
  EXPECT_EQ((8 + n) % 8, 0u);
  EXPECT_EQ(raw[8], '{');
  for (std::uint64_t i = 8 + n - 1; raw[i] != '}'; --i) EXPECT_EQ(raw[i], ' ');

  SafetensorsFile f(p);
  EXPECT_EQ(f.metadata().at("format"), "pt");
  EXPECT_EQ(f.metadata().at("lutb"), "test \"quoted\"");
  EXPECT_EQ(f.names().size(), tensors.size());
  for (const auto& [name, t] : tensors) {
    ASSERT_TRUE(f.contains(name)) << name;
    const TensorView& v = f.get(name);
    EXPECT_EQ(v.name, name);
    EXPECT_EQ(v.dtype, t.dtype);
    EXPECT_EQ(v.shape, t.shape);
    EXPECT_EQ(v.nbytes, t.bytes.size());
    EXPECT_EQ(v.numel() * static_cast<std::int64_t>(dtype_size(v.dtype)), static_cast<std::int64_t>(v.nbytes));
    if (!t.bytes.empty()) {
      EXPECT_EQ(std::memcmp(v.data, t.bytes.data(), t.bytes.size()), 0) << name;
    }
    // Every tensor is aligned to its element size (largest dtypes are stored first).
    EXPECT_EQ(reinterpret_cast<std::uintptr_t>(v.data) % dtype_size(v.dtype), 0u) << name;
  }
  // Names come in data order.
  const std::uint8_t* prev = nullptr;
  for (const auto& nm : f.names()) {
    EXPECT_GE(f.get(nm).data, prev);
    prev = f.get(nm).data;
  }
  // Typed views and conversions.
  const auto f32 = f.get("t.F32").as<float>(DType::F32);
  EXPECT_EQ(f32.size(), f.get("t.F32").nbytes / 4);
  EXPECT_THROW(f.get("t.F32").as<float>(DType::BF16), SafetensorsError);
  EXPECT_THROW(f.get("t.U16").as<float>(DType::U16), SafetensorsError);  // element size mismatch
  const auto bf = f.get("t.BF16").as<std::uint16_t>(DType::BF16);
  const auto bf_f = f.get("t.BF16").to_float();
  for (std::size_t i = 0; i < bf.size(); ++i) EXPECT_EQ(f32_bits(bf_f[i]), f32_bits(bf16_to_float(bf[i])));
  const auto h = f.get("t.F16").as<std::uint16_t>(DType::F16);
  const auto h_f = f.get("t.F16").to_float();
  for (std::size_t i = 0; i < h.size(); ++i) EXPECT_EQ(f32_bits(h_f[i]), f32_bits(fp16_to_float(h[i])));
  const auto e = f.get("t.F8_E4M3").as<std::uint8_t>(DType::F8_E4M3);
  const auto e_f = f.get("t.F8_E4M3").to_float();
  for (std::size_t i = 0; i < e.size(); ++i)
    if (!e4m3_is_nan(e[i])) {
      EXPECT_EQ(f32_bits(e_f[i]), f32_bits(e4m3_to_float(e[i])));
    }
  const auto d = f.get("t.F64").as<double>(DType::F64);
  const auto d_f = f.get("t.F64").to_float();
  for (std::size_t i = 0; i < d.size(); ++i)
    if (!std::isnan(d[i])) {
      EXPECT_EQ(d_f[i], static_cast<float>(d[i]));
    }
  EXPECT_EQ(f.get("empty").to_float().size(), 0u);
  try {
    f.get("t.I32").to_float();
    FAIL();
  } catch (const SafetensorsError& err) {
    EXPECT_NE(std::string(err.what()).find("t.I32"), std::string::npos);
  }
  try {
    f.get("missing");
    FAIL();
  } catch (const SafetensorsError& err) {
    EXPECT_NE(std::string(err.what()).find("missing"), std::string::npos);
    EXPECT_NE(std::string(err.what()).find(p.string()), std::string::npos);
  }
}

TEST(Safetensors, StreamingWriterChunksAcrossTensors) {
  TempDir tmp;
  const fs::path p = tmp.path / "s.safetensors";
  const auto a = random_bytes(3 * 1000, 1), b = random_bytes(4 * 777, 2), c = random_bytes(5, 3);
  {
    SafetensorsWriter w(p);
    w.declare("a", DType::U8, {3, 1000});
    w.declare("z", DType::F32, {0});
    w.declare("b", DType::F32, {777});
    w.declare("c", DType::I8, {5});
    // Stream in odd-sized chunks that straddle tensor boundaries.
    std::vector<std::uint8_t> all(a);
    all.insert(all.end(), b.begin(), b.end());
    all.insert(all.end(), c.begin(), c.end());
    for (std::size_t i = 0; i < all.size(); i += 333) w.write(all.data() + i, std::min<std::size_t>(333, all.size() - i));
    EXPECT_THROW(w.write(all.data(), 1), SafetensorsError);  // more than declared
    EXPECT_THROW(w.declare("late", DType::U8, {1}), SafetensorsError);
    w.commit();
  }
  SafetensorsFile f(p);
  EXPECT_EQ(std::memcmp(f.get("a").data, a.data(), a.size()), 0);
  EXPECT_EQ(std::memcmp(f.get("b").data, b.data(), b.size()), 0);
  EXPECT_EQ(std::memcmp(f.get("c").data, c.data(), c.size()), 0);
  EXPECT_EQ(f.get("z").nbytes, 0u);
  EXPECT_TRUE(f.metadata().empty());
}

TEST(Safetensors, WriterRejectsBadDeclarations) {
  TempDir tmp;
  SafetensorsWriter w(tmp.path / "x.safetensors");
  w.declare("a", DType::U8, {1});
  EXPECT_THROW(w.declare("a", DType::U8, {1}), SafetensorsError);
  EXPECT_THROW(w.declare("__metadata__", DType::U8, {1}), SafetensorsError);
  EXPECT_THROW(w.declare("neg", DType::U8, {2, -1}), SafetensorsError);
  EXPECT_THROW(w.declare("huge", DType::F64, {1ll << 40, 1ll << 30}), SafetensorsError);
  EXPECT_THROW(write_safetensors(tmp.path / "y.safetensors", {{"t", OwnedTensor{DType::F32, {2}, {1, 2, 3}}}}),
               SafetensorsError);
  EXPECT_FALSE(fs::exists(tmp.path / "y.safetensors"));
}

TEST(Safetensors, AtomicWriteLeavesDestinationUntouchedOnFailure) {
  TempDir tmp;
  const fs::path p = tmp.path / "model.safetensors";
  write_safetensors(p, {{"old", OwnedTensor{DType::U8, {4}, {1, 2, 3, 4}}}});
  const std::string before = read_file(p);
  const auto tmps = [&] {
    int n = 0;
    for (const auto& e : fs::directory_iterator(tmp.path)) n += e.path().filename() != "model.safetensors";
    return n;
  };
  {  // Abandoned mid-way (an exception elsewhere): destructor removes the temporary file.
    SafetensorsWriter w(p);
    w.declare("new", DType::F32, {1000});
    std::vector<float> half(500, 1.0f);
    w.write(half.data(), half.size() * 4);
    EXPECT_EQ(tmps(), 1);
  }
  EXPECT_EQ(read_file(p), before);
  EXPECT_EQ(tmps(), 0);
  {  // Commit with missing bytes fails, naming the tensor.
    SafetensorsWriter w(p);
    w.declare("new", DType::F32, {1000});
    std::vector<float> half(500, 1.0f);
    w.write(half.data(), half.size() * 4);
    try {
      w.commit();
      FAIL();
    } catch (const SafetensorsError& e) {
      EXPECT_NE(std::string(e.what()).find("'new': only 2000 of 4000 bytes"), std::string::npos) << e.what();
    }
  }
  EXPECT_EQ(read_file(p), before);
  EXPECT_EQ(tmps(), 0);
  // A destination whose directory does not exist: a clear error naming it.
  try {
    write_safetensors(tmp.path / "no" / "such" / "dir.safetensors", {{"a", OwnedTensor{DType::U8, {1}, {1}}}});
    FAIL();
  } catch (const SafetensorsError& e) {
    EXPECT_NE(std::string(e.what()).find("dir.safetensors"), std::string::npos) << e.what();
  }
  SafetensorsFile f(p);
  EXPECT_TRUE(f.contains("old"));
}

// ---------------------------------------------------------------------------
// Hostile files
// ---------------------------------------------------------------------------
struct BrokenCase {
  const char* label;
  std::string header;
  std::string data;
  std::string reason;
  std::uint64_t len_override = 0;
};

TEST(SafetensorsHostile, EachDefectIsAnErrorNamingFileAndReason) {
  const std::string d8(8, 'x');
  const std::vector<BrokenCase> cases = {
      {"header longer than file", R"({"a":{"dtype":"U8","shape":[8],"data_offsets":[0,8]}})", d8, "exceeds the file size",
       1000},
      {"header over 100 MB", "{}", "", "not a safetensors file (header length 100000001 exceeds the file size 10)",
       100'000'001},
      {"huge length", "{}", "", "not a safetensors file (header length 18446744073709551615 exceeds the file size 10)",
       ~0ull},
      {"not starting with brace", R"( {"a":1})", "", "does not start with '{'"},
      {"invalid JSON", R"({"a":{"dtype":"U8",)", "", "invalid JSON header"},
      {"invalid UTF-8", "{\"\xff\xfe\":{}}", "", "invalid JSON header"},
      {"trailing garbage in header", R"({} x)", "", "invalid JSON header"},
      {"unterminated object", "{ ", "", "invalid JSON header"},
      {"entry not an object", R"({"a":[1,2]})", "", "tensor 'a': entry is not an object"},
      {"entry missing fields", R"({"a":{"dtype":"U8","shape":[8]}})", d8, "tensor 'a': entry lacks"},
      {"dtype not a string", R"({"a":{"dtype":8,"shape":[8],"data_offsets":[0,8]}})", d8, "'dtype' is not a string"},
      {"unknown dtype", R"({"a":{"dtype":"F7","shape":[8],"data_offsets":[0,8]}})", d8, "unknown dtype 'F7'"},
      {"shape not an array", R"({"a":{"dtype":"U8","shape":8,"data_offsets":[0,8]}})", d8, "'shape' is not an array"},
      {"negative shape", R"({"a":{"dtype":"U8","shape":[-8],"data_offsets":[0,8]}})", d8, "not a non-negative integer"},
      {"float shape", R"({"a":{"dtype":"U8","shape":[8.0],"data_offsets":[0,8]}})", d8, "not a non-negative integer"},
      {"string shape", R"({"a":{"dtype":"U8","shape":["8"],"data_offsets":[0,8]}})", d8, "not a non-negative integer"},
      {"overflowing shape", R"({"a":{"dtype":"F32","shape":[4294967296,4294967296],"data_offsets":[0,8]}})", d8,
       "overflows 64-bit"},
      {"overflowing by dtype", R"({"a":{"dtype":"F64","shape":[4611686018427387904],"data_offsets":[0,8]}})", d8,
       "overflows 64-bit"},
      {"shape beyond int64", R"({"a":{"dtype":"U8","shape":[18446744073709551615],"data_offsets":[0,8]}})", d8,
       "too large"},
      {"offsets not array", R"({"a":{"dtype":"U8","shape":[8],"data_offsets":0}})", d8, "'data_offsets' is not an array"},
      {"offsets wrong length", R"({"a":{"dtype":"U8","shape":[8],"data_offsets":[0,8,9]}})", d8,
       "'data_offsets' is not an array"},
      {"negative offsets", R"({"a":{"dtype":"U8","shape":[8],"data_offsets":[-1,7]}})", d8, "not non-negative integers"},
      {"reversed offsets", R"({"a":{"dtype":"U8","shape":[0],"data_offsets":[8,0]}})", d8, "end before they begin"},
      {"offsets past the data", R"({"a":{"dtype":"U8","shape":[16],"data_offsets":[0,16]}})", d8, "out of range"},
      {"offsets far past the data",
       R"({"a":{"dtype":"U8","shape":[1],"data_offsets":[18446744073709551614,18446744073709551615]}})", d8,
       "out of range"},
      {"size not shape x dtype", R"({"a":{"dtype":"F32","shape":[4],"data_offsets":[0,8]}})", d8,
       "span 8 bytes, but shape [4] x F32 needs 16"},
      {"overlap", R"({"a":{"dtype":"U8","shape":[6],"data_offsets":[0,6]},"b":{"dtype":"U8","shape":[4],"data_offsets":[4,8]}})",
       d8, "overlap tensor 'a'"},
      {"gap", R"({"a":{"dtype":"U8","shape":[2],"data_offsets":[0,2]},"b":{"dtype":"U8","shape":[4],"data_offsets":[4,8]}})",
       d8, "leave a gap"},
      {"leading gap", R"({"a":{"dtype":"U8","shape":[4],"data_offsets":[4,8]}})", d8, "leave a gap"},
      {"trailing data", R"({"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]}})", d8, "4 bytes of trailing data"},
      {"duplicate tensor", R"({"a":{"dtype":"U8","shape":[8],"data_offsets":[0,8]},"a":{"dtype":"U8","shape":[8],"data_offsets":[0,8]}})",
       d8, "duplicate key 'a'"},
      {"duplicate field", R"({"a":{"dtype":"U8","dtype":"F32","shape":[8],"data_offsets":[0,8]}})", d8,
       "duplicate key 'dtype'"},
      {"metadata not object", R"({"__metadata__":[1]})", "", "__metadata__ is not an object"},
      {"metadata value not string", R"({"__metadata__":{"k":1}})", "", "__metadata__ entry 'k' is not a string"},
      {"too deep", R"({"a":{"dtype":"U8","shape":[[8]],"data_offsets":[0,8]}})", d8, "nested deeper"},
      {"zero length header", "", "", "too short"},
  };
  TempDir tmp;
  int i = 0;
  for (const auto& c : cases) {
    SCOPED_TRACE(c.label);
    const fs::path p = tmp.path / ("broken" + std::to_string(i++) + ".safetensors");
    write_raw(p, c.header, c.data, c.len_override);
    expect_broken(p, c.reason);
  }
  // Files shorter than the length field, and empty files.
  for (std::size_t n : {0u, 1u, 7u}) {
    const fs::path p = tmp.path / ("short" + std::to_string(n) + ".safetensors");
    std::ofstream(p, std::ios::binary) << std::string(n, '\0');
    expect_broken(p, "too small");
  }
  expect_broken(tmp.path / "does-not-exist.safetensors", "cannot open");
  expect_broken(tmp.path, "not a regular file");
  // A valid minimal file for contrast: empty header, zero-size tensors.
  write_raw(tmp.path / "ok.safetensors", R"({"z":{"dtype":"F32","shape":[0,3],"data_offsets":[0,0]}})", "");
  SafetensorsFile ok(tmp.path / "ok.safetensors");
  EXPECT_EQ(ok.get("z").nbytes, 0u);
}

TEST(SafetensorsHostile, EveryTruncationAndByteFlipIsHandled) {
  // Every prefix of a valid file and every single-byte corruption of its header must either parse
  // (then all views lie inside the buffer) or throw SafetensorsError; never crash.
  TempDir tmp;
  const fs::path p = tmp.path / "v.safetensors";
  write_safetensors(p, {{"a", OwnedTensor{DType::BF16, {2, 3}, random_bytes(12, 1)}},
                        {"b", OwnedTensor{DType::U8, {5}, random_bytes(5, 2)}}},
                    {{"format", "pt"}});
  const std::string raw = read_file(p);
  std::map<std::string, TensorView> t;
  std::vector<std::string> names;
  std::map<std::string, std::string> meta;
  const auto check = [&](const std::string& bytes) {
    const auto* d = reinterpret_cast<const std::uint8_t*>(bytes.data());
    try {
      SafetensorsFile::parse_header(d, bytes.size(), "mem", t, names, meta);
      for (const auto& [n, v] : t) {
        ASSERT_GE(v.data, d);
        ASSERT_LE(v.data + v.nbytes, d + bytes.size());
      }
    } catch (const SafetensorsError&) {
    }
  };
  for (std::size_t n = 0; n < raw.size(); ++n) check(raw.substr(0, n));
  std::uint64_t hn = 0;
  std::memcpy(&hn, raw.data(), 8);
  int parsed = 0;
  for (std::size_t i = 0; i < 8 + hn; ++i)
    for (int bit = 0; bit < 8; ++bit) {
      std::string c = raw;
      c[i] = static_cast<char>(c[i] ^ (1 << bit));
      check(c);
      parsed += !t.empty();
    }
  EXPECT_GT(parsed, 0);  // some flips (e.g. in metadata text) keep the file valid
}

// A file of `size` bytes (sparse: no disk blocks) whose 8-byte header length is `len` and whose
// header starts with '{'; every other byte is zero.
void write_sparse(const fs::path& p, std::uint64_t len, std::uint64_t size) {
  const int fd = ::open(p.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  ASSERT_GE(fd, 0) << p;
  std::uint8_t head[9];
  for (int i = 0; i < 8; ++i) head[i] = static_cast<std::uint8_t>(len >> (8 * i));
  head[8] = '{';
  ASSERT_EQ(::pwrite(fd, head, 9, 0), 9);
  ASSERT_EQ(::ftruncate(fd, static_cast<off_t>(size)), 0);
  ::close(fd);
}

// Virtual memory of this process (VmSize of /proc/self/status), bytes.
std::uint64_t vm_size() {
  std::ifstream s("/proc/self/status");
  std::string key;
  while (s >> key) {
    if (key == "VmSize:") {
      std::uint64_t kb = 0;
      s >> kb;
      return kb * 1024;
    }
    s.ignore(1 << 20, '\n');
  }
  return 0;
}

// Opens `p` in a child whose address space has room for the file's mapping plus 48 MB but not for
// the header length it claims: exit 0 when SafetensorsError names the file and `reason`, 1 for
// another message (printed), 2 when an allocation failed (the claimed size was allocated), 3 when
// the file opened.
void open_with_little_memory(const fs::path& p, std::uint64_t file_size, const std::string& reason) {
  // The default ("fast") death-test style forks without re-executing: the child uses the parent's
  // files and _Exits, and the parent's TempDir removes them ("threadsafe" re-ran the test in the
  // child, whose TempDir was then never removed).
  EXPECT_EXIT(
      {
        // Measured in the child: the death-test machinery grows the address space after the fork
        // (a limit taken in the parent left too little room on some machines).
        const std::uint64_t limit = vm_size() + file_size + (48u << 20);
        struct rlimit rl;
        rl.rlim_cur = rl.rlim_max = limit;
        if (::setrlimit(RLIMIT_AS, &rl) != 0) std::_Exit(4);
        try {
          SafetensorsFile f(p);
          std::_Exit(3);
        } catch (const SafetensorsError& e) {
          const std::string m = e.what();
          if (m.find(p.string()) != std::string::npos && m.find(reason) != std::string::npos) std::_Exit(0);
          std::fprintf(stderr, "message: %s\n", m.c_str());
          std::_Exit(1);
        } catch (const std::bad_alloc&) {
          std::_Exit(2);
        }
      },
      ::testing::ExitedWithCode(0), "");
}

// The header-length field is checked against the file size and the 100 MB limit (safetensors'
// MAX_HEADER_SIZE, 100,000,000 bytes) before the header is read or anything of its size allocated.
// The files hold that many bytes (sparse), so the limit itself is reached, not the file-size check.
TEST(SafetensorsHostile, HeaderLengthLimitIsCheckedBeforeAllocating) {
  TempDir tmp;
  constexpr std::uint64_t kLimit = 100'000'000;
  // Over the limit in a file that does hold that many bytes (sparse, 100 MB + 16).
  const fs::path over = tmp.path / "over.safetensors";
  write_sparse(over, kLimit + 1, 8 + kLimit + 1 + 8);
  expect_broken(over, "header length 100000001 exceeds the 100 MB limit");
  open_with_little_memory(over, 8 + kLimit + 1 + 8, "header length 100000001 exceeds the 100 MB limit");
  // Exactly at the limit: accepted as a length, then read (and rejected) as header text: zeros are NUL
  // bytes, which no header holds (not the JSON parser's error).
  const fs::path at = tmp.path / "at.safetensors";
  write_sparse(at, kLimit, 8 + kLimit);
  expect_broken(at, "header holds a NUL byte at offset 1 of its 100000000 bytes");
  // Past the end of the file: within the limit, and far beyond it (2^62), in a 4 KB file.
  for (const std::uint64_t len : {std::uint64_t{4096 - 8 + 1}, kLimit - 1, std::uint64_t{1} << 62}) {
    SCOPED_TRACE(len);
    const fs::path past = tmp.path / ("past" + std::to_string(len) + ".safetensors");
    write_sparse(past, len, 4096);
    const std::string reason = "not a safetensors file (header length " + std::to_string(len) + " exceeds the file size 4096)";
    expect_broken(past, reason);
    open_with_little_memory(past, 4096, reason);
  }
}

// ---------------------------------------------------------------------------
// Collections
// ---------------------------------------------------------------------------
TEST(SafetensorsCollection, ShardedCheckpoint) {
  TempDir tmp;
  write_safetensors(tmp.path / "model-00001-of-00002.safetensors",
                    {{"x.weight", OwnedTensor{DType::BF16, {2, 2}, random_bytes(8, 1)}},
                     {"y.weight", OwnedTensor{DType::F32, {3}, random_bytes(12, 2)}}});
  write_safetensors(tmp.path / "model-00002-of-00002.safetensors",
                    {{"z.weight", OwnedTensor{DType::U8, {4}, random_bytes(4, 3)}}});
  const auto write_index = [&](const std::string& body) { std::ofstream(tmp.path / "model.safetensors.index.json") << body; };
  write_index(R"({"metadata":{"total_size":24},"weight_map":{"x.weight":"model-00001-of-00002.safetensors",
      "y.weight":"model-00001-of-00002.safetensors","z.weight":"model-00002-of-00002.safetensors"}})");
  {
    const auto c = SafetensorsCollection::open_dir(tmp.path);
    EXPECT_EQ(c.files().size(), 2u);
    EXPECT_EQ(c.names(), (std::vector<std::string>{"x.weight", "y.weight", "z.weight"}));
    EXPECT_EQ(c.get("z.weight").shape, (std::vector<std::int64_t>{4}));
    EXPECT_EQ(c.file_of("z.weight").path().filename(), "model-00002-of-00002.safetensors");
    EXPECT_EQ(c.get("y.weight").dtype, DType::F32);
    EXPECT_TRUE(c.contains("x.weight"));
    EXPECT_FALSE(c.contains("w.weight"));
    try {
      c.get("w.weight");
      FAIL();
    } catch (const SafetensorsError& e) {
      EXPECT_NE(std::string(e.what()).find("'w.weight'"), std::string::npos);
      EXPECT_NE(std::string(e.what()).find("model.safetensors.index.json"), std::string::npos);
    }
  }
  const auto expect_error = [&](const std::string& what) {
    try {
      SafetensorsCollection::open_dir(tmp.path);
      ADD_FAILURE() << "no error, expected " << what;
    } catch (const SafetensorsError& e) {
      EXPECT_NE(std::string(e.what()).find(what), std::string::npos) << e.what();
    }
  };
  write_index(R"({"weight_map":{"x.weight":"model-00003-of-00002.safetensors"}})");
  expect_error("shard 'model-00003-of-00002.safetensors' (holding tensor 'x.weight') is missing");
  write_index(R"({"weight_map":{"q.weight":"model-00001-of-00002.safetensors"}})");
  expect_error("tensor 'q.weight' is listed in shard 'model-00001-of-00002.safetensors' but that file does not hold it");
  write_index(R"({"weight_map":{"x.weight":"../model-00001-of-00002.safetensors"}})");
  expect_error("not a file inside");
  write_index(R"({"weight_map":[1]})");
  expect_error("no 'weight_map' object");
  write_index(R"({"weight_map":)");
  expect_error("invalid JSON");
  // A tensor held by two shards, the index naming one, is refused: lutb quantize would write both
  // copies and the reader use one.
  write_safetensors(tmp.path / "model-00002-of-00002.safetensors",
                    {{"z.weight", OwnedTensor{DType::U8, {4}, random_bytes(4, 3)}},
                     {"x.weight", OwnedTensor{DType::BF16, {2, 2}, random_bytes(8, 4)}}});
  write_index(R"({"weight_map":{"x.weight":"model-00001-of-00002.safetensors","z.weight":"model-00002-of-00002.safetensors"}})");
  expect_error("model.safetensors.index.json: tensor 'x.weight' appears in both " +
               (tmp.path / "model-00001-of-00002.safetensors").string() + " (where the index lists it) and " +
               (tmp.path / "model-00002-of-00002.safetensors").string());
  write_safetensors(tmp.path / "model-00002-of-00002.safetensors",
                    {{"z.weight", OwnedTensor{DType::U8, {4}, random_bytes(4, 3)}}});
  // Without an index: every *.safetensors in the directory, duplicates across files rejected.
  fs::remove(tmp.path / "model.safetensors.index.json");
  {
    const auto c = SafetensorsCollection::open_dir(tmp.path);
    EXPECT_EQ(c.names().size(), 3u);
  }
  write_safetensors(tmp.path / "model-extra.safetensors", {{"x.weight", OwnedTensor{DType::U8, {1}, {1}}}});
  expect_error("tensor 'x.weight' appears in both");
  // A single model.safetensors wins over the others.
  write_safetensors(tmp.path / "model.safetensors", {{"only", OwnedTensor{DType::U8, {1}, {1}}}});
  EXPECT_EQ(SafetensorsCollection::open_dir(tmp.path).names(), std::vector<std::string>{"only"});
  TempDir empty;
  try {
    SafetensorsCollection::open_dir(empty.path);
    FAIL();
  } catch (const SafetensorsError& e) {
    EXPECT_NE(std::string(e.what()).find("no model.safetensors.index.json"), std::string::npos);
  }
}

// ---------------------------------------------------------------------------
// The real checkpoints
// ---------------------------------------------------------------------------
struct ModelExpect {
  const char* name;
  const char* expert_tensor;
  std::vector<std::int64_t> expert_shape;
};

class SafetensorsRealModels : public ::testing::TestWithParam<ModelExpect> {};

TEST_P(SafetensorsRealModels, ReadsCheckpointAndActivations) {
  const ModelExpect& m = GetParam();
  LUTB_MODEL_OR_SKIP(dir, m.name);
  const auto c = SafetensorsCollection::open_dir(dir);
  EXPECT_GT(c.names().size(), 20u);
  const TensorView& w = c.get(m.expert_tensor);
  EXPECT_EQ(w.dtype, DType::BF16);
  EXPECT_EQ(w.shape, m.expert_shape);
  const auto v = w.to_float();
  ASSERT_EQ(static_cast<std::int64_t>(v.size()), w.numel());
  double ss = 0;
  for (float x : v) {
    ASSERT_TRUE(std::isfinite(x));
    ss += static_cast<double>(x) * x;
  }
  EXPECT_GT(ss, 0.0);  // trained weights, not zeros
  EXPECT_EQ(c.file_of(m.expert_tensor).metadata().at("format"), "pt");
  SafetensorsFile acts(dir / "moe_activations.safetensors");
  EXPECT_TRUE(acts.contains("input_ids"));
  SafetensorsFile val(dir / "val_tokens.safetensors");
  EXPECT_EQ(val.get("input_ids").dtype, DType::I32);
  EXPECT_GT(val.get("input_ids").as<std::int32_t>(DType::I32).size(), 1000u);
}

INSTANTIATE_TEST_SUITE_P(
    Tiny, SafetensorsRealModels,
    ::testing::Values(ModelExpect{"tiny-qwen3-moe", "model.layers.0.mlp.experts.0.gate_proj.weight", {256, 256}},
                      ModelExpect{"tiny-mixtral", "model.layers.0.block_sparse_moe.experts.0.w2.weight", {192, 320}},
                      ModelExpect{"tiny-deepseek-v3", "model.layers.1.mlp.experts.3.down_proj.weight", {256, 128}}),
    [](const auto& info) {
      std::string s = info.param.name;
      for (auto& ch : s)
        if (ch == '-') ch = '_';
      return s;
    });

}  // namespace
}  // namespace lutb
