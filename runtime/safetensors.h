// safetensors files: the Hugging Face weight format (an 8-byte little-endian header length, a JSON
// header naming each tensor's dtype, shape and byte range, then the raw little-endian data).
//
// The reader maps the file and validates the whole header when opened, so a corrupt file fails
// early with a message naming the file and the tensor or field at fault. The writer produces the
// same bytes as the reference implementation (huggingface/safetensors) for the same tensors and
// metadata, and replaces the destination atomically (write to PATH.tmp, fsync, rename).
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "runtime/tensor.h"

namespace accel {

// A bad or unreadable safetensors file, or tensors that cannot be saved.
class SafetensorsError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// safetensors dtype names ("F32", "BF16", "F8_E4M3", "BOOL", ...) <-> DType.
const char* safetensors_dtype_name(DType t);
// Throws SafetensorsError for names accel does not support (message lists the supported ones).
DType dtype_from_safetensors_name(const std::string& name);

struct SafetensorsTensorInfo {
  std::string name;
  std::string dtype_name;    // as written in the file ("F32", "I16", ...)
  bool supported = false;    // dtype maps to an accel DType; load() throws otherwise
  DType dtype = DType::F32;  // meaningful only when supported
  Shape shape;
  uint64_t data_begin = 0, data_end = 0;  // byte range, relative to the start of the data area
  uint64_t nbytes() const { return data_end - data_begin; }
};

class SafetensorsReader {
 public:
  // Opens and validates `path`; throws SafetensorsError naming the file and what is wrong.
  explicit SafetensorsReader(const std::string& path);
  ~SafetensorsReader();
  SafetensorsReader(const SafetensorsReader&) = delete;
  SafetensorsReader& operator=(const SafetensorsReader&) = delete;

  const std::string& path() const { return path_; }
  // Tensor names in file (data offset) order.
  std::vector<std::string> names() const;
  bool contains(const std::string& name) const;
  // Throws SafetensorsError when `name` is not in the file.
  const SafetensorsTensorInfo& info(const std::string& name) const;
  // A new contiguous CPU tensor holding a copy of the data.
  Tensor load(const std::string& name, MemCategory category = MemCategory::Params) const;
  // The raw little-endian bytes of one tensor inside the mapping (valid while the reader lives).
  const uint8_t* raw_data(const std::string& name) const;
  // The "__metadata__" string map (empty when the file has none).
  const std::map<std::string, std::string>& metadata() const { return metadata_; }

 private:
  std::string path_;
  const uint8_t* map_ = nullptr;  // whole file (mmap, or a heap copy for empty files)
  size_t file_size_ = 0;
  bool mmapped_ = false;
  uint64_t data_start_ = 0;                     // 8 + header length
  std::vector<SafetensorsTensorInfo> tensors_;  // sorted by data_begin
  std::map<std::string, size_t> index_;
  std::map<std::string, std::string> metadata_;
};

// Writes `tensors` (any device, any layout: they are copied to contiguous CPU memory first) to
// `path`. Tensors are laid out like the reference writer: by descending dtype alignment, then by
// name, so every tensor's data is aligned to its element size; the header is padded with spaces
// to a multiple of 8 bytes. Names must be unique, non-empty and not "__metadata__".
void save_safetensors(const std::string& path,
                      const std::vector<std::pair<std::string, Tensor>>& tensors,
                      const std::map<std::string, std::string>& metadata = {});

}  // namespace accel
