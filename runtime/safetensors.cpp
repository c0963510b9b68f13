#include "runtime/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>

#include "runtime/json.h"

#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "safetensors I/O assumes a little-endian host"
#endif

namespace accel {

namespace {

using json = nlohmann::json;

// The reference implementation refuses headers above 100 MB; so do we.
constexpr uint64_t kMaxHeaderBytes = 100'000'000;

// Every dtype the format defines, with its width in bits and its rank in the reference
// implementation's enum (the writer orders tensors by descending rank, i.e. by alignment).
struct KnownDType {
  const char* name;
  int bits;
  int rank;
};
constexpr KnownDType kKnownDTypes[] = {
    {"BOOL", 8, 0},  {"F4", 4, 1},      {"F6_E2M3", 6, 2}, {"F6_E3M2", 6, 3}, {"U8", 8, 4},
    {"I8", 8, 5},    {"F8_E5M2", 8, 6}, {"F8_E4M3", 8, 7}, {"F8_E8M0", 8, 8}, {"I16", 16, 9},
    {"U16", 16, 10}, {"F16", 16, 11},   {"BF16", 16, 12},  {"I32", 32, 13},   {"U32", 32, 14},
    {"F32", 32, 15}, {"C64", 64, 16},   {"F64", 64, 17},   {"I64", 64, 18},   {"U64", 64, 19},
};

const KnownDType* find_known(const std::string& name) {
  for (const auto& k : kKnownDTypes)
    if (name == k.name) return &k;
  return nullptr;
}

const char* kSupportedList = "F64 F32 BF16 F16 F8_E4M3 F8_E5M2 I64 I32 U8 BOOL";

std::string errno_text() { return std::strerror(errno); }

[[noreturn]] void fail(const std::string& path, const std::string& what) {
  throw SafetensorsError("safetensors file '" + path + "': " + what);
}

}  // namespace

const char* safetensors_dtype_name(DType t) {
  switch (t) {
    case DType::F64:
      return "F64";
    case DType::F32:
      return "F32";
    case DType::BF16:
      return "BF16";
    case DType::F16:
      return "F16";
    case DType::E4M3:
      return "F8_E4M3";
    case DType::E5M2:
      return "F8_E5M2";
    case DType::I64:
      return "I64";
    case DType::I32:
      return "I32";
    case DType::U8:
      return "U8";
    case DType::Bool:
      return "BOOL";
  }
  throw std::logic_error("safetensors_dtype_name: bad dtype");
}

DType dtype_from_safetensors_name(const std::string& name) {
  for (int i = 0; i < kNumDTypes; ++i) {
    DType t = static_cast<DType>(i);
    if (name == safetensors_dtype_name(t)) return t;
  }
  throw SafetensorsError("safetensors dtype '" + name + "' is not supported by accel-train " +
                         "(supported: " + kSupportedList + ")");
}

// ---- reader -----------------------------------------------------------------------------------

SafetensorsReader::SafetensorsReader(const std::string& path) : path_(path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) fail(path, "cannot open: " + errno_text());
  struct stat st;
  if (::fstat(fd, &st) != 0) {
    std::string e = errno_text();
    ::close(fd);
    fail(path, "cannot stat: " + e);
  }
  file_size_ = static_cast<size_t>(st.st_size);
  if (file_size_ > 0) {
    void* p = ::mmap(nullptr, file_size_, PROT_READ, MAP_PRIVATE, fd, 0);
    if (p == MAP_FAILED) {
      std::string e = errno_text();
      ::close(fd);
      fail(path, "cannot map into memory: " + e);
    }
    map_ = static_cast<const uint8_t*>(p);
    mmapped_ = true;
  }
  ::close(fd);

  try {
    if (file_size_ < 8)
      fail(path, "truncated: " + std::to_string(file_size_) +
                     " bytes, too short to hold the 8-byte header length");
    uint64_t n = 0;
    std::memcpy(&n, map_, 8);
    if (n > kMaxHeaderBytes)
      fail(path, "header length " + std::to_string(n) + " exceeds the " +
                     std::to_string(kMaxHeaderBytes) + "-byte limit (corrupt or not a " +
                     "safetensors file)");
    if (n > file_size_ - 8)
      fail(path, "header length " + std::to_string(n) + " runs past the end of the file (" +
                     std::to_string(file_size_) + " bytes): the file is truncated or corrupt");
    data_start_ = 8 + n;
    const char* hb = reinterpret_cast<const char*>(map_ + 8);
    if (n == 0 || hb[0] != '{') fail(path, "header is not a JSON object (it must start with '{')");

    json header;
    try {
      header = parse_json(std::string_view(hb, n), "header");
    } catch (const JsonError& e) {
      fail(path, e.what());
    }
    if (!header.is_object()) fail(path, "header is not a JSON object");

    const uint64_t data_size = file_size_ - data_start_;
    for (auto it = header.begin(); it != header.end(); ++it) {
      const std::string& name = it.key();
      const json& v = it.value();
      if (name == "__metadata__") {
        if (!v.is_object()) fail(path, "__metadata__ must be an object of strings");
        for (auto m = v.begin(); m != v.end(); ++m) {
          if (!m.value().is_string())
            fail(path, "__metadata__ entry '" + text_excerpt(m.key()) + "' must be a string, got " +
                           json_excerpt(m.value()));
          metadata_[m.key()] = m.value().get<std::string>();
        }
        continue;
      }
      const std::string where = "tensor '" + text_excerpt(name) + "'";
      if (!v.is_object()) fail(path, where + ": entry must be an object, got " + json_excerpt(v));
      for (const char* field : {"dtype", "shape", "data_offsets"})
        if (!v.contains(field)) fail(path, where + ": missing field '" + field + "'");
      SafetensorsTensorInfo info;
      info.name = name;
      if (!v["dtype"].is_string()) fail(path, where + ": 'dtype' must be a string");
      info.dtype_name = v["dtype"].get<std::string>();
      const KnownDType* known = find_known(info.dtype_name);
      if (!known)
        fail(path, where + ": unknown dtype '" + text_excerpt(info.dtype_name) +
                       "' (accel-train reads " + kSupportedList + ")");
      for (int i = 0; i < kNumDTypes; ++i) {
        if (info.dtype_name == safetensors_dtype_name(static_cast<DType>(i))) {
          info.supported = true;
          info.dtype = static_cast<DType>(i);
        }
      }
      const json& shape = v["shape"];
      if (!shape.is_array()) fail(path, where + ": 'shape' must be an array of integers");
      uint64_t numel = 1;
      int64_t extent = 1;  // product of the non-zero dims: the strides must fit in int64 too
      for (const json& d : shape) {
        if (!d.is_number_unsigned())
          fail(path,
               where + ": 'shape' entries must be non-negative integers, got " + json_excerpt(d));
        uint64_t dim = d.get<uint64_t>();
        if (dim > static_cast<uint64_t>(INT64_MAX) || __builtin_mul_overflow(numel, dim, &numel) ||
            (dim && __builtin_mul_overflow(extent, static_cast<int64_t>(dim), &extent)))
          fail(path, where + ": shape " + json_excerpt(shape) + " overflows");
        info.shape.push_back(static_cast<int64_t>(dim));
      }
      const json& off = v["data_offsets"];
      if (!off.is_array() || off.size() != 2 || !off[0].is_number_unsigned() ||
          !off[1].is_number_unsigned())
        fail(path, where +
                       ": 'data_offsets' must be [begin, end] with non-negative integers, got " +
                       json_excerpt(off));
      info.data_begin = off[0].get<uint64_t>();
      info.data_end = off[1].get<uint64_t>();
      if (info.data_end < info.data_begin)
        fail(path, where + ": data_offsets " + json_excerpt(off) + " end before they begin");
      if (info.data_end > data_size)
        fail(path, where + ": data_offsets " + json_excerpt(off) + " lie outside the data area (" +
                       std::to_string(data_size) + " bytes after the header): the file is " +
                       "truncated or the header is corrupt");
      uint64_t bits = 0;
      if (__builtin_mul_overflow(numel, static_cast<uint64_t>(known->bits), &bits))
        fail(path, where + ": shape " + json_excerpt(shape) + " overflows");
      if (bits % 8 != 0)
        fail(path, where + ": " + std::to_string(numel) + " elements of " + info.dtype_name +
                       " do not fill whole bytes");
      if (info.nbytes() != bits / 8)
        fail(path, where + ": data_offsets " + json_excerpt(off) + " span " +
                       std::to_string(info.nbytes()) + " bytes but shape " + json_excerpt(shape) +
                       " of " + info.dtype_name + " needs " + std::to_string(bits / 8) + " bytes");
      index_[name] = tensors_.size();
      tensors_.push_back(std::move(info));
    }

    // The byte ranges must tile the data area exactly: no overlap, no gap, nothing after.
    std::sort(tensors_.begin(), tensors_.end(), [](const auto& a, const auto& b) {
      return a.data_begin != b.data_begin ? a.data_begin < b.data_begin : a.data_end < b.data_end;
    });
    uint64_t pos = 0;
    const SafetensorsTensorInfo* prev = nullptr;
    for (const auto& t : tensors_) {
      if (t.data_begin < pos)
        fail(path, "tensor '" + t.name + "' data [" + std::to_string(t.data_begin) + ", " +
                       std::to_string(t.data_end) + ") overlaps tensor '" + prev->name + "' [" +
                       std::to_string(prev->data_begin) + ", " + std::to_string(prev->data_end) +
                       ")");
      if (t.data_begin > pos)
        fail(path, "tensor '" + t.name + "' data begins at " + std::to_string(t.data_begin) +
                       " but the previous tensor ends at " + std::to_string(pos) +
                       " (a gap: the header is corrupt)");
      pos = t.data_end;
      prev = &t;
    }
    if (pos != data_size)
      fail(path, "the tensors cover " + std::to_string(pos) + " bytes of data but the file holds " +
                     std::to_string(data_size) + " bytes after the header");
    index_.clear();
    for (size_t i = 0; i < tensors_.size(); ++i) index_[tensors_[i].name] = i;
  } catch (...) {
    if (mmapped_) ::munmap(const_cast<uint8_t*>(map_), file_size_);
    map_ = nullptr;
    throw;
  }
}

SafetensorsReader::~SafetensorsReader() {
  if (mmapped_ && map_) ::munmap(const_cast<uint8_t*>(map_), file_size_);
}

std::vector<std::string> SafetensorsReader::names() const {
  std::vector<std::string> out;
  out.reserve(tensors_.size());
  for (const auto& t : tensors_) out.push_back(t.name);
  return out;
}

bool SafetensorsReader::contains(const std::string& name) const { return index_.count(name) > 0; }

const SafetensorsTensorInfo& SafetensorsReader::info(const std::string& name) const {
  auto it = index_.find(name);
  if (it == index_.end()) fail(path_, "has no tensor named '" + name + "'");
  return tensors_[it->second];
}

const uint8_t* SafetensorsReader::raw_data(const std::string& name) const {
  const auto& i = info(name);
  return map_ + data_start_ + i.data_begin;
}

Tensor SafetensorsReader::load(const std::string& name, MemCategory category) const {
  const auto& i = info(name);
  if (!i.supported)
    fail(path_, "tensor '" + name + "' has dtype " + i.dtype_name +
                    ", which accel-train does not support (supported: " + kSupportedList + ")");
  Tensor t = Tensor::empty(i.shape, i.dtype, Device::cpu(), category);
  if (i.nbytes() > 0) std::memcpy(t.data_ptr(), map_ + data_start_ + i.data_begin, i.nbytes());
  return t;
}

// ---- writer -----------------------------------------------------------------------------------

namespace {

int dtype_rank(DType t) { return find_known(safetensors_dtype_name(t))->rank; }

void write_all(int fd, const void* p, size_t n, const std::string& tmp) {
  const char* c = static_cast<const char*>(p);
  while (n > 0) {
    ssize_t w = ::write(fd, c, n);
    if (w < 0) {
      if (errno == EINTR) continue;
      throw SafetensorsError("safetensors file '" + tmp + "': write failed: " + errno_text());
    }
    c += w;
    n -= static_cast<size_t>(w);
  }
}

std::string parent_dir(const std::string& path) {
  auto slash = path.find_last_of('/');
  if (slash == std::string::npos) return ".";
  if (slash == 0) return "/";
  return path.substr(0, slash);
}

}  // namespace

void save_safetensors(const std::string& path,
                      const std::vector<std::pair<std::string, Tensor>>& tensors,
                      const std::map<std::string, std::string>& metadata) {
  struct Entry {
    std::string name;
    Tensor t;  // contiguous, on the CPU
  };
  std::vector<Entry> entries;
  entries.reserve(tensors.size());
  std::map<std::string, int> seen;
  for (const auto& [name, t] : tensors) {
    if (name.empty()) fail(path, "cannot save a tensor with an empty name");
    if (name == "__metadata__") fail(path, "'__metadata__' is reserved and cannot name a tensor");
    if (!t.defined()) fail(path, "tensor '" + name + "' is undefined");
    if (seen[name]++) fail(path, "tensor name '" + name + "' appears more than once");
    Tensor c = t.device().is_cpu() ? t : t.to(Device::cpu());
    if (!c.is_contiguous()) c = c.clone(MemCategory::Other);
    entries.push_back({name, c});
  }
  std::stable_sort(entries.begin(), entries.end(), [](const Entry& a, const Entry& b) {
    int ra = dtype_rank(a.t.dtype()), rb = dtype_rank(b.t.dtype());
    return ra != rb ? ra > rb : a.name < b.name;
  });

  // Header JSON written by hand so the key order matches the reference writer:
  // __metadata__ first, then the tensors in data order, fields dtype, shape, data_offsets.
  std::string header = "{";
  bool first = true;
  if (!metadata.empty()) {
    header += "\"__metadata__\":{";
    bool f2 = true;
    for (const auto& [k, v] : metadata) {  // std::map: sorted keys, deterministic output
      if (!f2) header += ",";
      f2 = false;
      header += json(k).dump() + ":" + json(v).dump();
    }
    header += "}";
    first = false;
  }
  uint64_t offset = 0;
  for (const auto& e : entries) {
    if (!first) header += ",";
    first = false;
    header += json(e.name).dump() + ":{\"dtype\":\"" + safetensors_dtype_name(e.t.dtype()) +
              "\",\"shape\":[";
    for (size_t d = 0; d < e.t.shape().size(); ++d) {
      if (d) header += ",";
      header += std::to_string(e.t.shape()[d]);
    }
    uint64_t n = e.t.nbytes();
    header +=
        "],\"data_offsets\":[" + std::to_string(offset) + "," + std::to_string(offset + n) + "]}";
    offset += n;
  }
  header += "}";
  header.append((8 - header.size() % 8) % 8, ' ');
  if (header.size() > kMaxHeaderBytes)
    fail(path, "header would be " + std::to_string(header.size()) + " bytes, above the " +
                   std::to_string(kMaxHeaderBytes) + "-byte limit readers accept");

  const std::string tmp = path + ".tmp";
  int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) fail(tmp, "cannot create: " + errno_text());
  try {
    uint64_t n = header.size();
    write_all(fd, &n, 8, tmp);
    write_all(fd, header.data(), header.size(), tmp);
    for (const auto& e : entries)
      if (e.t.nbytes() > 0) write_all(fd, e.t.data_ptr(), e.t.nbytes(), tmp);
    if (::fsync(fd) != 0) fail(tmp, "fsync failed: " + errno_text());
  } catch (...) {
    ::close(fd);
    ::unlink(tmp.c_str());
    throw;
  }
  if (::close(fd) != 0) {
    std::string e = errno_text();
    ::unlink(tmp.c_str());
    fail(tmp, "close failed: " + e);
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    std::string e = errno_text();
    ::unlink(tmp.c_str());
    fail(path, "cannot rename " + tmp + " into place: " + e);
  }
  // Make the rename itself durable.
  int dfd = ::open(parent_dir(path).c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dfd >= 0) {
    ::fsync(dfd);
    ::close(dfd);
  }
}

}  // namespace accel
