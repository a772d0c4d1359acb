// lutb/safetensors.hpp: reading and writing the safetensors format
// (https://github.com/huggingface/safetensors: 8-byte little-endian header length N, N bytes of
// UTF-8 JSON {name: {dtype, shape, data_offsets: [begin, end]}, "__metadata__": {str: str}},
// then the data; offsets are relative to the end of the header).
//
// Reading memory-maps the file and hands out zero-copy views. Every structural defect is a
// SafetensorsError naming the file, the tensor where there is one, and the reason: file shorter
// than 8 bytes, header length above the file size or above 100,000,000 bytes (the reference's
// MAX_HEADER_SIZE), header not starting with '{', invalid JSON or UTF-8, duplicate keys at any level
// (tensor names or fields), non-object entries, missing fields, wrong field types (dtype not a
// string, shape/offsets not arrays of non-negative integers), unknown dtype, shape products that
// overflow 64 bits, offsets reversed or past the data, size not matching shape x dtype, tensors that
// overlap, leave gaps, or leave trailing bytes (the data buffer must be covered exactly, as the
// reference implementation's Metadata::validate requires). Unknown extra fields in an entry are
// ignored, as the reference does. No input crashes or reads out of bounds (fuzzed: fuzz/).
//
// Writing streams one tensor at a time to "<path>.tmp.<pid>" and renames it over `path` only when
// complete (after fsync); a failure or an abandoned writer leaves `path` as it was and removes the
// temporary file. The header is compact JSON padded with spaces to a multiple of 8 bytes, like the
// reference writer; tensors are laid out largest element size first (stable in declaration order),
// so every tensor's data is aligned to its element size in the file, as the reference writer
// does by sorting on dtype.
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <span>
#include <stdexcept>
#include <string>
#include <vector>

#include "lutb/dtype.hpp"

namespace lutb {

struct SafetensorsError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

/// Zero-copy view of one tensor inside a mapped file.
struct TensorView {
  std::string name;
  DType dtype = DType::U8;
  std::vector<std::int64_t> shape;
  const std::uint8_t* data = nullptr;  // valid while the owning SafetensorsFile lives
  std::size_t nbytes = 0;

  /// Product of the shape (1 for a scalar, shape []).
  std::int64_t numel() const;
  /// Elements as FP32, row-major, numel() values: exact for F32, F16, BF16 and F8_E4M3 (NaN bytes
  /// give NaN), rounded to nearest for F64. Works at any alignment. Throws SafetensorsError naming
  /// the tensor for other dtypes.
  std::vector<float> to_float() const;
  /// Typed zero-copy access: nbytes / sizeof(T) elements. Throws SafetensorsError naming the tensor
  /// when the dtype differs from `expected`, when sizeof(T) != dtype_size(expected), or when the
  /// data is not aligned for T (files written by the reference implementation or by
  /// SafetensorsWriter are aligned). Instantiated for u8, i8, u16, i16, u32, i32, u64, i64, float,
  /// double (BF16/F16 as std::uint16_t, F8_* and BOOL as std::uint8_t).
  template <class T> std::span<const T> as(DType expected) const;
};

/// A memory-mapped safetensors file.
class SafetensorsFile {
 public:
  /// Maps and validates `path`. Throws SafetensorsError.
  explicit SafetensorsFile(const std::filesystem::path& path);
  ~SafetensorsFile();
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;

  const std::filesystem::path& path() const { return path_; }
  /// Tensor names in file order (by data offset).
  const std::vector<std::string>& names() const { return names_; }
  bool contains(const std::string& name) const { return tensors_.count(name) != 0; }
  /// Throws SafetensorsError naming the file and tensor when absent.
  const TensorView& get(const std::string& name) const;
  const std::map<std::string, std::string>& metadata() const { return metadata_; }

  /// Parses and validates a header alone (the fuzz target's entry point). `file_size` is the
  /// whole file's size. Throws SafetensorsError.
  static void parse_header(const std::uint8_t* data, std::size_t file_size, const std::string& where,
                           std::map<std::string, TensorView>& tensors, std::vector<std::string>& names,
                           std::map<std::string, std::string>& metadata);

 private:
  std::filesystem::path path_;
  void* map_ = nullptr;
  std::size_t size_ = 0;
  std::map<std::string, TensorView> tensors_;
  std::vector<std::string> names_;
  std::map<std::string, std::string> metadata_;
};

/// A checkpoint's tensors across one file or shards (model.safetensors.index.json "weight_map").
class SafetensorsCollection {
 public:
  /// Opens `dir/model.safetensors.index.json` when present (its "weight_map" name -> shard file,
  /// relative to dir; each shard opened once; only the mapped names are exposed), else
  /// `dir/model.safetensors`, else every *.safetensors in dir except the data files
  /// val_tokens.safetensors, moe_activations.safetensors and consolidated*.safetensors (a name in
  /// two files is an error; Hugging Face shards "S-NNNNN-of-MMMMM.safetensors" must all be there).
  /// Throws SafetensorsError naming `dir` (or the index) and what is missing or wrong: the shard
  /// file and a tensor it should hold, a tensor absent from its shard, a weight_map entry outside
  /// dir, a shard missing from an index-less set, a tensor in two files, or no weight file at all
  /// (listing what the folder holds).
  static SafetensorsCollection open_dir(const std::filesystem::path& dir);
  /// Opens one file.
  static SafetensorsCollection open_file(const std::filesystem::path& file);

  /// All tensor names, sorted.
  std::vector<std::string> names() const;
  bool contains(const std::string& name) const;
  /// Throws SafetensorsError naming the collection (file, dir or index) and the tensor when absent.
  const TensorView& get(const std::string& name) const;
  /// The file that holds `name` (same error when absent).
  const SafetensorsFile& file_of(const std::string& name) const;
  const std::vector<std::unique_ptr<SafetensorsFile>>& files() const { return files_; }
  /// For a name the collection does not expose, where it was looked for, for "not found" messages: ";
  /// FILE has no such tensor" (one file), "; none of the N weight files of DIR (a, b, ...) holds it", ";
  /// INDEX's weight_map does not list it (nor does any of its N shards hold it)", or, when an index
  /// leaves out a tensor one of its shards holds, "; SHARD holds it, but INDEX's weight_map does not
  /// list it (add it there)" (the tensor is invisible through the index). "" for a name it exposes.
  std::string absent_note(const std::string& name) const;

 private:
  std::filesystem::path source_;  // the file, directory or index named in errors
  std::vector<std::unique_ptr<SafetensorsFile>> files_;
  std::map<std::string, std::size_t> where_;
};

/// Streaming writer. Declare every tensor first (name, dtype, shape), then write their bytes in
/// declaration order with write() (any chunking: a chunk may end inside a tensor or span several),
/// then commit(). Memory stays bounded (a 1 MiB write buffer). Errors (SafetensorsError naming the
/// path and tensor): a name declared twice or "__metadata__", a negative or overflowing shape, a
/// declaration after the first write, more bytes than declared, commit with bytes missing, I/O
/// errors (with strerror). The temporary file is created at the first write() or commit().
class SafetensorsWriter {
 public:
  explicit SafetensorsWriter(std::filesystem::path path, std::map<std::string, std::string> metadata = {});
  ~SafetensorsWriter();  // removes the temporary file unless committed
  void declare(const std::string& name, DType dtype, std::vector<std::int64_t> shape);
  /// Appends bytes of the current tensor. Throws when more bytes than declared arrive.
  void write(const void* data, std::size_t nbytes);
  /// Checks every declared byte was written, flushes, fsyncs and renames over the target.
  void commit();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

/// One-shot helper: writes tensors held in memory (name -> (dtype, shape, bytes)), atomically as
/// SafetensorsWriter. Throws SafetensorsError when a tensor's byte count is not shape x dtype.
struct OwnedTensor {
  DType dtype;
  std::vector<std::int64_t> shape;
  std::vector<std::uint8_t> bytes;
};
void write_safetensors(const std::filesystem::path& path, const std::vector<std::pair<std::string, OwnedTensor>>& tensors,
                       const std::map<std::string, std::string>& metadata = {});

}  // namespace lutb
