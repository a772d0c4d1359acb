// Safetensors reading (mmap, zero-copy, hostile-input safe) and streaming writing.
//
// Format (https://github.com/huggingface/safetensors, docs "Format"): u64 little-endian header
// length N, N bytes of JSON, then the data buffer. Validation follows the reference implementation
// (safetensors/src/tensor.rs, `Metadata::validate`): header at most 100,000,000 bytes, starting
// with '{', tensors covering the data buffer contiguously (sorted by offset, each beginning where
// the previous ended, the last ending at the end of the file), byte size = numel x dtype size.
// We are stricter on what the reference leaves to serde: duplicate keys (serde keeps the last one,
// nlohmann too) are rejected, as are non-integer or negative shape/offset entries.
#include "lutb/safetensors.hpp"

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <limits>
#include <map>
#include <numeric>
#include <regex>
#include <set>
#include <sstream>
#include <system_error>

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "io/config_json.hpp"
#include "lutb/numerics.hpp"

namespace lutb {
namespace fs = std::filesystem;
using nlohmann::json;

namespace {

constexpr std::uint64_t kMaxHeaderBytes = 100'000'000;  // the reference's MAX_HEADER_SIZE

[[noreturn]] void fail(const std::string& where, const std::string& reason) {
  throw SafetensorsError(fmt::format("{}: {}", where, reason));
}
[[noreturn]] void fail_tensor(const std::string& where, const std::string& name, const std::string& reason) {
  throw SafetensorsError(fmt::format("{}: tensor '{}': {}", where, name, reason));
}

std::string shape_str(const std::vector<std::int64_t>& s) {
  return fmt::format("[{}]", fmt::join(s, ", "));
}

// Thrown from the JSON parser callback; converted to SafetensorsError with the file name.
struct HeaderShapeError {
  std::string reason;
};

// Parses the header JSON, rejecting duplicate keys at any level and nesting deeper than the format
// allows (root object > tensor object > shape/offset array: depth 3).
json parse_header_json(const char* begin, const char* end, const std::string& where) {
  std::vector<std::set<std::string>> keys;  // one set per open object
  int depth = 0;
  auto cb = [&](int, json::parse_event_t ev, json& parsed) -> bool {
    switch (ev) {
      case json::parse_event_t::object_start:
        keys.emplace_back();
        [[fallthrough]];
      case json::parse_event_t::array_start:
        if (++depth > 3) throw HeaderShapeError{"JSON nested deeper than the safetensors header allows"};
        break;
      case json::parse_event_t::object_end:
        if (!keys.empty()) keys.pop_back();
        [[fallthrough]];
      case json::parse_event_t::array_end:
        --depth;
        break;
      case json::parse_event_t::key:
        if (!keys.empty() && !keys.back().insert(parsed.get<std::string>()).second)
          throw HeaderShapeError{fmt::format("duplicate key '{}' in the header", parsed.get<std::string>())};
        break;
      case json::parse_event_t::value:
        break;
    }
    return true;
  };
  try {
    return json::parse(begin, end, cb, /*allow_exceptions=*/true, /*ignore_comments=*/false);
  } catch (const HeaderShapeError& e) {
    fail(where, "invalid header: " + e.reason);
  } catch (const json::exception& e) {
    fail(where, "invalid JSON header: " + detail::json_error_text(e.what()));
  }
}

// A non-negative integer from JSON (rejects floats, negatives, booleans).
bool json_u64(const json& j, std::uint64_t& out) {
  if (j.is_number_unsigned()) {
    out = j.get<std::uint64_t>();
    return true;
  }
  if (j.is_number_integer()) {
    const auto v = j.get<std::int64_t>();
    if (v < 0) return false;
    out = static_cast<std::uint64_t>(v);
    return true;
  }
  return false;
}

}  // namespace

// ---------------------------------------------------------------------------
// Header parsing
// ---------------------------------------------------------------------------
namespace {

// The header's length from the first 8 bytes, checked against the file, the format's limit and the
// JSON text it must hold.
std::uint64_t header_length(const std::uint8_t* data, std::size_t file_size, const std::string& where) {
  if (file_size < 8) fail(where, fmt::format("file of {} bytes is too small for a safetensors header length", file_size));
  std::uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | data[i];
  // A length beyond the file is what any other file (config.json, text) reads as: say so first.
  if (n > file_size - 8)
    fail(where, fmt::format("not a safetensors file (header length {} exceeds the file size {})", n, file_size));
  if (n > kMaxHeaderBytes) fail(where, fmt::format("header length {} exceeds the 100 MB limit", n));
  if (n < 2) fail(where, fmt::format("header length {} is too short for a JSON object", n));
  if (data[8] != '{') fail(where, "header does not start with '{'");
  const char* hb = reinterpret_cast<const char*>(data + 8);
  // nlohmann's lexer reads a NUL byte as the end of its input ("{...}\0 anything" parses as "{...}"),
  // where the reference reader's serde_json refuses the trailing characters: so do we. The header is
  // UTF-8 JSON text, padded with spaces (0x20) only.
  if (const void* nul = std::memchr(hb, '\0', n))
    fail(where, fmt::format("header holds a NUL byte at offset {} of its {} bytes: a safetensors header is UTF-8 JSON "
                            "text, padded with spaces only (a corrupt or truncated header?)",
                            static_cast<const char*>(nul) - hb, n));
  return n;
}

void read_metadata(const json& v, const std::string& where, std::map<std::string, std::string>& metadata) {
  if (!v.is_object()) fail(where, "__metadata__ is not an object of strings");
  for (auto m = v.begin(); m != v.end(); ++m) {
    if (!m.value().is_string()) fail(where, fmt::format("__metadata__ entry '{}' is not a string", m.key()));
    metadata.emplace(m.key(), m.value().get<std::string>());
  }
}

// A tensor's dtype and shape, and the bytes they need (overflow refused).
std::uint64_t read_dtype_and_shape(const json& v, const std::string& where, const std::string& name, TensorView& tv) {
  if (!v.is_object()) fail_tensor(where, name, "entry is not an object");
  const auto f_dtype = v.find("dtype"), f_shape = v.find("shape"), f_off = v.find("data_offsets");
  if (f_dtype == v.end() || f_shape == v.end() || f_off == v.end())
    fail_tensor(where, name, "entry lacks one of 'dtype', 'shape', 'data_offsets'");
  if (!f_dtype->is_string()) fail_tensor(where, name, "'dtype' is not a string");
  const auto dt = dtype_from_name(f_dtype->get<std::string>());
  if (!dt) fail_tensor(where, name, fmt::format("unknown dtype '{}'", f_dtype->get<std::string>()));
  if (!f_shape->is_array()) fail_tensor(where, name, "'shape' is not an array");
  tv.name = name;
  tv.dtype = *dt;
  std::uint64_t numel = 1;
  bool overflow = false;
  for (const json& d : *f_shape) {
    std::uint64_t dim = 0;
    if (!json_u64(d, dim)) fail_tensor(where, name, fmt::format("shape entry {} is not a non-negative integer", d.dump()));
    if (dim > static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max()))
      fail_tensor(where, name, fmt::format("shape entry {} is too large", dim));
    tv.shape.push_back(static_cast<std::int64_t>(dim));
    overflow |= __builtin_mul_overflow(numel, dim, &numel);
  }
  std::uint64_t nbytes = 0;
  overflow |= __builtin_mul_overflow(numel, static_cast<std::uint64_t>(dtype_size(*dt)), &nbytes);
  if (overflow) fail_tensor(where, name, fmt::format("shape {} overflows 64-bit byte counts", shape_str(tv.shape)));
  return nbytes;
}

// A file cut short (an interrupted download or copy): say that the file, not its header, is at
// fault, and how much data the header's tensors need.
[[noreturn]] void refuse_truncated(const json& h, const std::string& where, const std::string& name, std::uint64_t b,
                                   std::uint64_t e, std::uint64_t buffer_size, std::size_t file_size) {
  std::uint64_t end = 0;
  for (const auto& [k, x] : h.items()) {
    std::uint64_t xb = 0, xe = 0;
    if (k != "__metadata__" && x.is_object() && x.contains("data_offsets") && x["data_offsets"].is_array() &&
        x["data_offsets"].size() == 2 && json_u64(x["data_offsets"][0], xb) && json_u64(x["data_offsets"][1], xe) &&
        xb <= xe)
      end = std::max(end, xe);
  }
  fail_tensor(where, name,
              fmt::format("data_offsets [{}, {}] out of range: the data buffer has {} bytes; the header's tensors "
                          "need {} bytes of data, {} more than the file ({} bytes) holds: the file is truncated (an "
                          "interrupted download or copy?) or its header is corrupt",
                          b, e, buffer_size, end, end - buffer_size, file_size));
}

struct Span {
  std::uint64_t begin, end;
  const std::string* name;
};

// The tensors must tile the data buffer exactly: no overlap, no gap, no trailing bytes. Appends the
// names in data order.
void check_tiling(std::vector<Span>& spans, std::uint64_t buffer_size, const std::string& where,
                  std::vector<std::string>& names) {
  std::sort(spans.begin(), spans.end(), [](const Span& x, const Span& y) {
    return x.begin != y.begin ? x.begin < y.begin : (x.end != y.end ? x.end < y.end : *x.name < *y.name);
  });
  // Overlaps first, over the whole buffer: a tensor whose offsets were copied from another's leaves a
  // gap where its own bytes were; reporting the gap first would name a third tensor (the one after
  // it) instead of the two that share bytes.
  std::uint64_t reach = 0;
  const std::string* last = nullptr;
  for (const Span& s : spans) {
    if (s.begin < reach)
      fail_tensor(where, *s.name, fmt::format("data_offsets [{}, {}] overlap tensor '{}' (which ends at {})", s.begin, s.end,
                                              *last, reach));
    if (s.end > reach) {
      reach = s.end;
      last = s.name;
    }
  }
  std::uint64_t pos = 0;
  for (const Span& s : spans) {
    if (s.begin > pos)
      fail_tensor(where, *s.name, fmt::format("data_offsets [{}, {}] leave a gap: the previous tensor ends at {}", s.begin,
                                              s.end, pos));
    pos = s.end;
    names.push_back(*s.name);
  }
  if (pos != buffer_size)
    fail(where, fmt::format("{} bytes of trailing data after the last tensor (data buffer {} bytes, tensors cover {})",
                            buffer_size - pos, buffer_size, pos));
}

}  // namespace

void SafetensorsFile::parse_header(const std::uint8_t* data, std::size_t file_size, const std::string& where,
                                   std::map<std::string, TensorView>& tensors, std::vector<std::string>& names,
                                   std::map<std::string, std::string>& metadata) {
  tensors.clear();
  names.clear();
  metadata.clear();
  const std::uint64_t n = header_length(data, file_size, where);
  const char* hb = reinterpret_cast<const char*>(data + 8);
  const json h = parse_header_json(hb, hb + n, where);
  if (!h.is_object()) fail(where, "header is not a JSON object");

  const std::uint8_t* buffer = data + 8 + n;
  const std::uint64_t buffer_size = file_size - 8 - n;
  std::vector<Span> spans;
  spans.reserve(h.size());
  for (auto it = h.begin(); it != h.end(); ++it) {
    const std::string& name = it.key();
    const json& v = it.value();
    if (name == "__metadata__") {
      read_metadata(v, where, metadata);
      continue;
    }
    TensorView tv;
    const std::uint64_t nbytes = read_dtype_and_shape(v, where, name, tv);
    const json& off = v["data_offsets"];
    if (!off.is_array() || off.size() != 2) fail_tensor(where, name, "'data_offsets' is not an array of 2 integers");
    std::uint64_t b = 0, e = 0;
    if (!json_u64(off[0], b) || !json_u64(off[1], e))
      fail_tensor(where, name, "'data_offsets' entries are not non-negative integers");
    if (b > e) fail_tensor(where, name, fmt::format("data_offsets [{}, {}] end before they begin", b, e));
    if (e > buffer_size) refuse_truncated(h, where, name, b, e, buffer_size, file_size);
    if (e - b != nbytes)
      fail_tensor(where, name, fmt::format("data_offsets [{}, {}] span {} bytes, but shape {} x {} needs {}", b, e, e - b,
                                           shape_str(tv.shape), dtype_name(tv.dtype), nbytes));
    tv.data = buffer + b;
    tv.nbytes = static_cast<std::size_t>(nbytes);
    auto [pos, inserted] = tensors.emplace(name, std::move(tv));
    if (!inserted) fail_tensor(where, name, "duplicate tensor name");  // the JSON check catches this first
    spans.push_back({b, e, &pos->first});
  }
  check_tiling(spans, buffer_size, where, names);
}

// ---------------------------------------------------------------------------
// SafetensorsFile
// ---------------------------------------------------------------------------
SafetensorsFile::SafetensorsFile(const fs::path& path) : path_(path) {
  const std::string where = path.string();
  // O_NONBLOCK: open() of a named pipe blocks until a writer appears, deaf to a first Ctrl-C. It is refused
  // below as not a regular file; on a regular file the flag does nothing.
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) fail(where, fmt::format("cannot open: {}", std::strerror(errno)));
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    const int err = errno;
    ::close(fd);
    fail(where, fmt::format("cannot stat: {}", std::strerror(err)));
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    fail(where, S_ISFIFO(st.st_mode)  ? "is a named pipe (FIFO), not a regular file"
                : S_ISDIR(st.st_mode) ? "is a directory, not a regular file"
                                      : "not a regular file");
  }
  size_ = static_cast<std::size_t>(st.st_size);
  if (size_ < 8) {
    ::close(fd);
    fail(where, fmt::format("file of {} bytes is too small for a safetensors header length", size_));
  }
  void* m = ::mmap(nullptr, size_, PROT_READ, MAP_PRIVATE, fd, 0);
  const int err = errno;
  ::close(fd);
  if (m == MAP_FAILED) fail(where, fmt::format("cannot mmap {} bytes: {}", size_, std::strerror(err)));
  map_ = m;
  try {
    parse_header(static_cast<const std::uint8_t*>(map_), size_, where, tensors_, names_, metadata_);
  } catch (...) {
    ::munmap(map_, size_);
    map_ = nullptr;
    throw;
  }
}

SafetensorsFile::~SafetensorsFile() {
  if (map_) ::munmap(map_, size_);
}

const TensorView& SafetensorsFile::get(const std::string& name) const {
  const auto it = tensors_.find(name);
  if (it == tensors_.end()) fail(path_.string(), fmt::format("no tensor named '{}'", name));
  return it->second;
}

// ---------------------------------------------------------------------------
// TensorView
// ---------------------------------------------------------------------------
std::int64_t TensorView::numel() const {
  std::int64_t n = 1;
  for (auto d : shape) n *= d;
  return n;
}

std::vector<float> TensorView::to_float() const {
  const std::size_t n = nbytes / dtype_size(dtype);
  std::vector<float> out(n);
  if (n == 0 && dtype_is_float_source(dtype)) return out;
  // The data may sit at any byte offset in the file: copy through aligned chunks, never cast.
  constexpr std::size_t kChunk = 4096;
  switch (dtype) {
    case DType::F32:
      std::memcpy(out.data(), data, n * sizeof(float));
      break;
    case DType::F64:
      for (std::size_t i = 0; i < n; ++i) {
        double d;
        std::memcpy(&d, data + 8 * i, 8);
        out[i] = static_cast<float>(d);
      }
      break;
    case DType::F16:
    case DType::BF16: {
      std::uint16_t buf[kChunk];
      for (std::size_t i = 0; i < n; i += kChunk) {
        const std::size_t m = std::min(kChunk, n - i);
        std::memcpy(buf, data + 2 * i, 2 * m);
        if (dtype == DType::BF16)
          bf16_to_float_n(buf, out.data() + i, m);
        else
          fp16_to_float_n(buf, out.data() + i, m);
      }
      break;
    }
    case DType::F8_E4M3:
      e4m3_to_float_n(data, out.data(), n);
      break;
    default:
      throw SafetensorsError(
          fmt::format("tensor '{}': dtype {} cannot be read as floating point", name, dtype_name(dtype)));
  }
  return out;
}

template <class T>
std::span<const T> TensorView::as(DType expected) const {
  if (dtype != expected)
    throw SafetensorsError(
        fmt::format("tensor '{}': dtype is {}, expected {}", name, dtype_name(dtype), dtype_name(expected)));
  if (sizeof(T) != dtype_size(expected))
    throw SafetensorsError(fmt::format("tensor '{}': element type of {} bytes cannot view {}", name, sizeof(T),
                                       dtype_name(expected)));
  if (reinterpret_cast<std::uintptr_t>(data) % alignof(T) != 0)
    throw SafetensorsError(fmt::format("tensor '{}': data is not {}-byte aligned in the file; use to_float() or copy it",
                                       name, alignof(T)));
  return {reinterpret_cast<const T*>(data), nbytes / sizeof(T)};
}

template std::span<const std::uint8_t> TensorView::as<std::uint8_t>(DType) const;
template std::span<const std::int8_t> TensorView::as<std::int8_t>(DType) const;
template std::span<const std::uint16_t> TensorView::as<std::uint16_t>(DType) const;
template std::span<const std::int16_t> TensorView::as<std::int16_t>(DType) const;
template std::span<const std::uint32_t> TensorView::as<std::uint32_t>(DType) const;
template std::span<const std::int32_t> TensorView::as<std::int32_t>(DType) const;
template std::span<const std::uint64_t> TensorView::as<std::uint64_t>(DType) const;
template std::span<const std::int64_t> TensorView::as<std::int64_t>(DType) const;
template std::span<const float> TensorView::as<float>(DType) const;
template std::span<const double> TensorView::as<double>(DType) const;

// ---------------------------------------------------------------------------
// SafetensorsCollection
// ---------------------------------------------------------------------------
SafetensorsCollection SafetensorsCollection::open_file(const fs::path& file) {
  SafetensorsCollection c;
  c.source_ = file;
  c.files_.push_back(std::make_unique<SafetensorsFile>(file));
  for (const auto& n : c.files_[0]->names()) c.where_.emplace(n, 0);
  return c;
}

namespace {

using ShardFiles = std::vector<std::unique_ptr<SafetensorsFile>>;
using TensorShards = std::map<std::string, std::size_t>;  // tensor -> index into ShardFiles

// model.safetensors.index.json, parsed, with a non-empty weight_map object.
json read_index(const fs::path& index) {
  if (const std::string kind = detail::non_regular_kind(index); !kind.empty())  // a FIFO would block open() for ever
    fail(index.string(), fmt::format("is {}; the index must be a regular file", kind));
  json j;
  {
    std::ifstream in(index);
    if (!in) fail(index.string(), "cannot open");
    try {
      j = json::parse(in);
    } catch (const json::exception& e) {
      fail(index.string(), "invalid JSON: " + detail::json_error_text(e.what()));
    }
  }
  if (!j.is_object() || !j.contains("weight_map") || !j["weight_map"].is_object())
    fail(index.string(), "no 'weight_map' object");
  // An empty map would make every tensor "missing", naming neither the index nor the shards that
  // hold them.
  if (j["weight_map"].empty())
    fail(index.string(), "'weight_map' is empty: it lists no tensor (an index must name the shard of every tensor)");
  return j;
}

// One weight_map entry's shard: a file name inside the checkpoint folder.
fs::path index_entry_shard(const fs::path& index, const fs::path& dir, const std::string& tensor, const json& value) {
  if (!value.is_string()) fail(index.string(), fmt::format("weight_map entry '{}' is not a file name", tensor));
  const std::string shard = value.get<std::string>();
  const fs::path rel(shard);
  if (shard.empty() || rel.is_absolute() || std::any_of(rel.begin(), rel.end(), [](const fs::path& p) { return p == ".."; }))
    fail(index.string(), fmt::format("weight_map entry '{}' names '{}', which is not a file inside {}", tensor, shard,
                                     dir.string()));
  return rel;
}

// Opens the shard an index entry names, reporting the index's entry beside the shard's own error
// ("s/.: is a directory" or "s/config.json: not a safetensors file" alone would not say that the
// index named them).
std::unique_ptr<SafetensorsFile> open_index_shard(const fs::path& index, const fs::path& dir, const std::string& tensor,
                                                  const std::string& shard, const fs::path& rel) {
  const fs::path p = dir / rel;
  if (!fs::exists(p))
    fail(index.string(), fmt::format("shard '{}' (holding tensor '{}') is missing: {} does not exist", shard, tensor,
                                     p.string()));
  try {
    return std::make_unique<SafetensorsFile>(p);
  } catch (const SafetensorsError& e) {
    fail(index.string(), fmt::format("weight_map entry '{}' names shard '{}', which cannot be read: {}", tensor,
                                     shard, e.what()));
  }
}

// A tensor held by two shards is ambiguous (a reader would take the index's, a writer of every shard
// both), as it is without an index.
void check_held_once(const fs::path& index, const std::map<std::string, std::size_t>& shard_ix, const ShardFiles& files,
                     const TensorShards& where) {
  for (const auto& [shard, ix] : shard_ix)
    for (const auto& n : files[ix]->names()) {
      const auto w = where.find(n);
      if (w != where.end() && w->second != ix)
        fail(index.string(), fmt::format("tensor '{}' appears in both {} (where the index lists it) and {}", n,
                                         files[w->second]->path().string(), files[ix]->path().string()));
    }
}

// The *.safetensors files of a folder without an index or model.safetensors: the weights, the data
// files lutb reads beside a model, and the folder's other entries (named in errors).
struct FolderFiles {
  std::vector<fs::path> weights, data;
  std::vector<std::string> others;
};

FolderFiles list_folder(const fs::path& dir) {
  FolderFiles f;
  for (const auto& e : fs::directory_iterator(dir)) {
    const std::string fname = e.path().filename().string();
    if (!(e.is_regular_file() && e.path().extension() == ".safetensors")) {
      f.others.push_back(fname);
      continue;
    }
    if (fname == "val_tokens.safetensors" || fname == "moe_activations.safetensors" || fname.rfind("consolidated", 0) == 0)
      f.data.push_back(e.path());
    else
      f.weights.push_back(e.path());
  }
  std::sort(f.weights.begin(), f.weights.end());
  std::sort(f.data.begin(), f.data.end());
  std::sort(f.others.begin(), f.others.end());
  return f;
}

void check_has_weights(const fs::path& dir, const FolderFiles& f) {
  if (!f.weights.empty()) return;
  std::string found;
  for (const auto& p : f.data) found += (found.empty() ? "" : ", ") + p.filename().string();
  for (const auto& o : f.others) found += (found.empty() ? "" : ", ") + o;
  fail(dir.string(),
       fmt::format("no model weights: the folder has no model.safetensors.index.json (sharded checkpoint), no "
                   "model.safetensors and no other *.safetensors weight file{}{}",
                   f.data.empty() ? "" : " (val_tokens.safetensors, moe_activations.safetensors and consolidated*.safetensors are not read as weights)",
                   found.empty() ? "; it is empty" : "; it holds only: " + found));
}

// Hugging Face shards without their index: all N of model-XXXXX-of-NNNNN must be there.
void check_shard_sets_complete(const fs::path& dir, const std::vector<fs::path>& files) {
  static const std::regex shard_re(R"(^(.*)-(\d{5})-of-(\d{5})\.safetensors$)");
  std::map<std::pair<std::string, std::string>, std::set<std::string>> sets;  // (stem, N) -> indices present
  for (const auto& p : files) {
    std::smatch m;
    const std::string fname = p.filename().string();
    if (std::regex_match(fname, m, shard_re)) sets[{m[1].str(), m[3].str()}].insert(m[2].str());
  }
  for (const auto& [key, have] : sets) {
    const int n = std::stoi(key.second);
    for (int i = 1; i <= n; ++i) {
      const std::string want = fmt::format("{}-{:05d}-of-{}.safetensors", key.first, i, key.second);
      if (!have.count(fmt::format("{:05d}", i)))
        fail(dir.string(), fmt::format("shard {} is missing (the folder has {} of the {} shards {}-NNNNN-of-{}"
                                       ".safetensors and no model.safetensors.index.json that lists them)",
                                       want, have.size(), n, key.first, key.second));
    }
  }
}

}  // namespace

SafetensorsCollection SafetensorsCollection::open_dir(const fs::path& dir) {
  if (!fs::is_directory(dir)) fail(dir.string(), "not a directory");
  const fs::path index = dir / "model.safetensors.index.json";
  if (fs::exists(index)) {
    SafetensorsCollection c;
    c.source_ = index;
    const json j = read_index(index);
    std::map<std::string, std::size_t> shard_ix;
    for (auto it = j["weight_map"].begin(); it != j["weight_map"].end(); ++it) {
      const fs::path rel = index_entry_shard(index, dir, it.key(), it.value());
      const std::string shard = it.value().get<std::string>();
      // One file named two ways ("model-00001-of-00002.safetensors" and "./model-00001-of-00002.safetensors",
      // which transformers reads alike) is one shard: shards are told apart by their normalised path.
      const std::string key = rel.lexically_normal().string();
      auto s = shard_ix.find(key);
      if (s == shard_ix.end()) {
        c.files_.push_back(open_index_shard(index, dir, it.key(), shard, rel));
        s = shard_ix.emplace(key, c.files_.size() - 1).first;
      }
      if (!c.files_[s->second]->contains(it.key()))
        fail(index.string(), fmt::format("tensor '{}' is listed in shard '{}' but that file does not hold it", it.key(), shard));
      c.where_.emplace(it.key(), s->second);
    }
    check_held_once(index, shard_ix, c.files_, c.where_);
    return c;
  }
  if (fs::exists(dir / "model.safetensors")) {
    SafetensorsCollection c = open_file(dir / "model.safetensors");
    c.source_ = dir;
    return c;
  }
  // Neither an index nor model.safetensors: every *.safetensors file of the folder is read as the
  // weights, except the data files lutb reads beside a model (val_tokens.safetensors,
  // moe_activations.safetensors) and Mistral's consolidated*.safetensors (the same weights under
  // other names). Those share tensor names ("input_ids") and are never weights.
  const FolderFiles folder = list_folder(dir);
  check_has_weights(dir, folder);
  check_shard_sets_complete(dir, folder.weights);
  SafetensorsCollection c;
  c.source_ = dir;
  for (const auto& p : folder.weights) {
    c.files_.push_back(std::make_unique<SafetensorsFile>(p));
    for (const auto& n : c.files_.back()->names()) {
      const auto [it, inserted] = c.where_.emplace(n, c.files_.size() - 1);
      if (!inserted)
        fail(dir.string(),
             fmt::format("tensor '{}' appears in both {} and {}: the folder has no model.safetensors and no "
                         "model.safetensors.index.json, so every *.safetensors file in it is read as part of the "
                         "weights; add the index that says which file holds each tensor, or move the file that is "
                         "not part of the checkpoint out of the folder",
                         n, c.files_[it->second]->path().string(), p.string()));
    }
  }
  return c;
}

std::vector<std::string> SafetensorsCollection::names() const {
  std::vector<std::string> out;
  out.reserve(where_.size());
  for (const auto& [n, _] : where_) out.push_back(n);
  return out;
}

bool SafetensorsCollection::contains(const std::string& name) const { return where_.count(name) != 0; }

const SafetensorsFile& SafetensorsCollection::file_of(const std::string& name) const {
  const auto it = where_.find(name);
  if (it == where_.end()) fail(source_.string(), fmt::format("no tensor named '{}'{}", name, absent_note(name)));
  return *files_[it->second];
}

const TensorView& SafetensorsCollection::get(const std::string& name) const { return file_of(name).get(name); }

std::string SafetensorsCollection::absent_note(const std::string& name) const {
  if (where_.count(name)) return {};
  if (source_.filename() == "model.safetensors.index.json") {
    for (const auto& f : files_)
      if (f->contains(name))
        return fmt::format("; {} holds it, but {}'s weight_map does not list it (add it there)", f->path().string(),
                           source_.string());
    return fmt::format("; {}'s weight_map does not list it (nor does any of its {} shard{} hold it)", source_.string(),
                       files_.size(), files_.size() == 1 ? "" : "s");
  }
  // The files searched, so that "checkpoint DIR: tensor X not found" says which file should hold it.
  if (files_.size() == 1) return fmt::format("; {} has no such tensor", files_.front()->path().string());
  std::string list;
  for (std::size_t i = 0; i < files_.size() && i < 4; ++i) list += (i ? ", " : "") + files_[i]->path().filename().string();
  if (files_.size() > 4) list += ", ...";
  return fmt::format("; none of the {} weight files of {} ({}) holds it", files_.size(), source_.string(), list);
}

// ---------------------------------------------------------------------------
// Writer
// ---------------------------------------------------------------------------
struct SafetensorsWriter::Impl {
  struct Entry {
    std::string name;
    DType dtype;
    std::vector<std::int64_t> shape;
    std::uint64_t nbytes = 0;
    std::uint64_t offset = 0;   // in the data buffer
    std::uint64_t written = 0;
  };
  fs::path path, tmp;
  std::map<std::string, std::string> metadata;
  std::vector<Entry> entries;
  std::set<std::string> names;
  int fd = -1;
  bool created = false, header_written = false, committed = false, failed = false;
  std::uint64_t data_start = 0;
  std::size_t current = 0;  // entry being written
  std::vector<std::uint8_t> buf;
  std::uint64_t buf_pos = 0;  // file position of buf[0]

  [[noreturn]] void io_fail(const std::string& what) {
    failed = true;
    fail(tmp.string(), fmt::format("{}: {}", what, std::strerror(errno)));
  }

  void pwrite_all(const std::uint8_t* p, std::size_t n, std::uint64_t off) {
    while (n > 0) {
      const ssize_t w = ::pwrite(fd, p, n, static_cast<off_t>(off));
      if (w < 0) {
        if (errno == EINTR) continue;
        io_fail("write failed");
      }
      p += w;
      n -= static_cast<std::size_t>(w);
      off += static_cast<std::uint64_t>(w);
    }
  }
  void flush() {
    if (!buf.empty()) pwrite_all(buf.data(), buf.size(), buf_pos);
    buf.clear();
  }

  void start() {
    // Offsets: largest element size first (stable in declaration order), so that every tensor is
    // aligned to its element size when the data buffer starts 8-byte aligned, as the reference
    // writer does (it sorts by dtype, descending).
    std::vector<std::size_t> order(entries.size());
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [&](std::size_t a, std::size_t b) {
      return dtype_size(entries[a].dtype) > dtype_size(entries[b].dtype);
    });
    std::uint64_t off = 0;
    for (std::size_t i : order) {
      entries[i].offset = off;
      off += entries[i].nbytes;
    }
    // Header JSON in data order, compact, like the reference serialiser.
    std::string h = "{";
    if (!metadata.empty()) h += "\"__metadata__\":" + json(metadata).dump() + (order.empty() ? "" : ",");
    for (std::size_t k = 0; k < order.size(); ++k) {
      const Entry& e = entries[order[k]];
      h += json(e.name).dump() + ":{\"dtype\":\"" + std::string(dtype_name(e.dtype)) + "\",\"shape\":" + json(e.shape).dump() +
           ",\"data_offsets\":[" + std::to_string(e.offset) + "," + std::to_string(e.offset + e.nbytes) + "]}";
      if (k + 1 < order.size()) h += ",";
    }
    h += "}";
    h.append((8 - h.size() % 8) % 8, ' ');  // pad with spaces so the data buffer starts 8-byte aligned
    if (h.size() > kMaxHeaderBytes) fail(path.string(), fmt::format("header of {} bytes exceeds the 100 MB limit", h.size()));
    tmp = path;
    tmp += ".tmp." + std::to_string(::getpid());
    fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd < 0) io_fail("cannot create");
    created = true;
    std::uint8_t len[8];
    for (int i = 0; i < 8; ++i) len[i] = static_cast<std::uint8_t>(static_cast<std::uint64_t>(h.size()) >> (8 * i));
    pwrite_all(len, 8, 0);
    pwrite_all(reinterpret_cast<const std::uint8_t*>(h.data()), h.size(), 8);
    data_start = 8 + h.size();
    header_written = true;
    current = 0;
    skip_complete();
    buf.reserve(1 << 20);
    if (current < entries.size()) buf_pos = data_start + entries[current].offset;
  }

  void skip_complete() {
    while (current < entries.size() && entries[current].written == entries[current].nbytes) ++current;
  }

  void append(const std::uint8_t* p, std::size_t n) {
    while (n > 0) {
      if (current >= entries.size())
        fail(path.string(), fmt::format("{} more bytes written than the declared tensors hold", n));
      Entry& e = entries[current];
      const std::uint64_t pos = data_start + e.offset + e.written;
      if (buf.empty()) buf_pos = pos;
      if (buf_pos + buf.size() != pos) {
        flush();
        buf_pos = pos;
      }
      const std::size_t take = static_cast<std::size_t>(std::min<std::uint64_t>(n, e.nbytes - e.written));
      const std::size_t room = (1u << 20) - buf.size();
      const std::size_t now = std::min(take, room);
      buf.insert(buf.end(), p, p + now);
      if (buf.size() >= (1u << 20)) flush();
      e.written += now;
      p += now;
      n -= now;
      skip_complete();
    }
  }

  void close_fd() {
    if (fd >= 0) ::close(fd);
    fd = -1;
  }
};

SafetensorsWriter::SafetensorsWriter(fs::path path, std::map<std::string, std::string> metadata)
    : impl_(std::make_unique<Impl>()) {
  impl_->path = std::move(path);
  impl_->metadata = std::move(metadata);
}

SafetensorsWriter::~SafetensorsWriter() {
  if (!impl_) return;
  impl_->close_fd();
  if (impl_->created && !impl_->committed) {
    std::error_code ec;
    fs::remove(impl_->tmp, ec);
  }
}

void SafetensorsWriter::declare(const std::string& name, DType dtype, std::vector<std::int64_t> shape) {
  Impl& m = *impl_;
  const std::string where = m.path.string();
  if (m.header_written) fail_tensor(where, name, "declared after data was written");
  if (name == "__metadata__") fail_tensor(where, name, "reserved name");
  if (!m.names.insert(name).second) fail_tensor(where, name, "declared twice");
  std::uint64_t numel = 1;
  bool overflow = false;
  for (auto d : shape) {
    if (d < 0) fail_tensor(where, name, fmt::format("negative dimension in shape {}", shape_str(shape)));
    overflow |= __builtin_mul_overflow(numel, static_cast<std::uint64_t>(d), &numel);
  }
  std::uint64_t nbytes = 0;
  overflow |= __builtin_mul_overflow(numel, static_cast<std::uint64_t>(dtype_size(dtype)), &nbytes);
  if (overflow) fail_tensor(where, name, fmt::format("shape {} overflows", shape_str(shape)));
  m.entries.push_back({name, dtype, std::move(shape), nbytes, 0, 0});
}

void SafetensorsWriter::write(const void* data, std::size_t nbytes) {
  Impl& m = *impl_;
  if (m.committed) fail(m.path.string(), "write after commit");
  if (m.failed) fail(m.path.string(), "write after an earlier failure");
  if (!m.header_written) m.start();
  m.append(static_cast<const std::uint8_t*>(data), nbytes);
}

void SafetensorsWriter::commit() {
  Impl& m = *impl_;
  const std::string where = m.path.string();
  if (m.committed) fail(where, "committed twice");
  if (m.failed) fail(where, "commit after an earlier failure");
  if (!m.header_written) m.start();  // only zero-byte tensors, or none
  m.skip_complete();
  if (m.current < m.entries.size()) {
    const auto& e = m.entries[m.current];
    fail_tensor(where, e.name, fmt::format("only {} of {} bytes were written", e.written, e.nbytes));
  }
  m.flush();
  if (::fsync(m.fd) != 0) m.io_fail("fsync failed");
  if (::close(m.fd) != 0) {
    m.fd = -1;
    m.io_fail("close failed");
  }
  m.fd = -1;
  std::error_code ec;
  fs::rename(m.tmp, m.path, ec);
  if (ec) {
    m.failed = true;
    fail(where, fmt::format("cannot rename {} over it: {}", m.tmp.string(), ec.message()));
  }
  m.committed = true;
  // Make the rename durable.
  const fs::path parent = m.path.has_parent_path() ? m.path.parent_path() : fs::path(".");
  const int dfd = ::open(parent.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dfd >= 0) {
    ::fsync(dfd);
    ::close(dfd);
  }
}

void write_safetensors(const fs::path& path, const std::vector<std::pair<std::string, OwnedTensor>>& tensors,
                       const std::map<std::string, std::string>& metadata) {
  SafetensorsWriter w(path, metadata);
  for (const auto& [name, t] : tensors) {
    w.declare(name, t.dtype, t.shape);
    std::uint64_t numel = 1;
    for (auto d : t.shape) numel *= static_cast<std::uint64_t>(d);
    if (t.bytes.size() != numel * dtype_size(t.dtype))
      fail_tensor(path.string(), name, fmt::format("holds {} bytes but shape {} x {} needs {}", t.bytes.size(),
                                                   shape_str(t.shape), dtype_name(t.dtype), numel * dtype_size(t.dtype)));
  }
  for (const auto& [name, t] : tensors) w.write(t.bytes.data(), t.bytes.size());
  w.commit();
}

}  // namespace lutb
