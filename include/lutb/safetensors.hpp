// lutb/safetensors.hpp: reading and writing the safetensors format
// (https://github.com/huggingface/safetensors: 8-byte little-endian header length N, N bytes of
// UTF-8 JSON {name: {dtype, shape, data_offsets: [begin, end]}, "__metadata__": {str: str}},
// then the data; offsets are relative to the end of the header).
//
// Reading memory-maps the file and hands out zero-copy views. Every structural defect is a
// SafetensorsError naming the file, the tensor where there is one, and the reason: header length
// above the file size or above 100 MB, invalid JSON, unknown dtype, offsets out of range,
// overlapping or not covering the data, size not matching shape x dtype, duplicate names.
// Writing streams one tensor at a time to "<path>.tmp.<pid>" and renames it over `path` only when
// complete; a failure leaves `path` as it was.
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

  std::int64_t numel() const;
  /// Elements as FP32 (F32, F16, BF16, F64 sources); throws SafetensorsError for other dtypes.
  std::vector<float> to_float() const;
  /// Typed access; throws SafetensorsError naming the tensor when the dtype differs.
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
  /// Opens `dir/model.safetensors.index.json` when present, else `dir/model.safetensors`, else
  /// every *.safetensors in dir. Throws SafetensorsError naming what is missing.
  static SafetensorsCollection open_dir(const std::filesystem::path& dir);
  /// Opens one file.
  static SafetensorsCollection open_file(const std::filesystem::path& file);

  std::vector<std::string> names() const;
  bool contains(const std::string& name) const;
  const TensorView& get(const std::string& name) const;
  /// The file that holds `name`.
  const SafetensorsFile& file_of(const std::string& name) const;
  const std::vector<std::unique_ptr<SafetensorsFile>>& files() const { return files_; }

 private:
  std::vector<std::unique_ptr<SafetensorsFile>> files_;
  std::map<std::string, std::size_t> where_;
};

/// Streaming writer. Declare every tensor first (name, dtype, shape), then write their bytes in
/// declaration order with write() (possibly in several chunks per tensor), then commit().
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

/// One-shot helper: writes tensors held in memory (name -> (dtype, shape, bytes)).
struct OwnedTensor {
  DType dtype;
  std::vector<std::int64_t> shape;
  std::vector<std::uint8_t> bytes;
};
void write_safetensors(const std::filesystem::path& path, const std::vector<std::pair<std::string, OwnedTensor>>& tensors,
                       const std::map<std::string, std::string>& metadata = {});

}  // namespace lutb
