#include "runtime/data/shard.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <stdexcept>

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "token shards are read in place");

namespace accel {

namespace {

[[noreturn]] void shard_error(const std::string& path, const std::string& what) {
  throw std::runtime_error("token shard '" + path + "': " + what);
}

void put_u32(char* p, uint32_t v) { memcpy(p, &v, 4); }
void put_u64(char* p, uint64_t v) { memcpy(p, &v, 8); }
uint32_t get_u32(const unsigned char* p) {
  uint32_t v;
  memcpy(&v, p, 4);
  return v;
}
uint64_t get_u64(const unsigned char* p) {
  uint64_t v;
  memcpy(&v, p, 8);
  return v;
}

template <class T>
T max_of(const T* p, int64_t n) {
  // Plain loop over a local accumulator: the compiler turns it into packed max instructions.
  T m = 0;
  for (int64_t i = 0; i < n; ++i) m = p[i] > m ? p[i] : m;
  return m;
}

}  // namespace

int shard_token_bytes(int64_t vocab_size) { return vocab_size <= 65536 ? 2 : 4; }

ShardWriter::ShardWriter(std::string path, int64_t vocab_size, bool documents)
    : path_(std::move(path)),
      tmp_path_(path_ + ".tmp"),
      vocab_size_(vocab_size),
      documents_(documents) {
  if (vocab_size <= 0 || vocab_size > (int64_t{1} << 32)) {
    throw std::invalid_argument("ShardWriter '" + path_ + "': vocab_size " +
                                std::to_string(vocab_size) + " is not in [1, 2^32]");
  }
  width_ = shard_token_bytes(vocab_size);
  FILE* f = fopen(tmp_path_.c_str(), "wb");
  if (!f) shard_error(tmp_path_, std::string("cannot create: ") + strerror(errno));
  file_ = f;
  char header[kShardHeaderBytes] = {};
  if (fwrite(header, 1, sizeof(header), f) != sizeof(header)) {
    shard_error(tmp_path_, std::string("write failed: ") + strerror(errno));
  }
  buffer_.reserve(1 << 20);
}

ShardWriter::~ShardWriter() {
  if (file_) {
    fclose(static_cast<FILE*>(file_));
    std::remove(tmp_path_.c_str());
  }
}

void ShardWriter::append_document(const uint32_t* ids, const uint8_t* trained, size_t n) {
  if (!documents_) throw std::logic_error("ShardWriter::append_document on a token-stream shard");
  if (n == 0) throw std::invalid_argument("ShardWriter '" + path_ + "': an empty document");
  for (size_t i = 0; i < n; ++i) {
    if (trained[i] > 1) throw std::invalid_argument("ShardWriter: trained flags are 0 or 1");
  }
  write_tokens(ids, n);
  trained_.insert(trained_.end(), trained, trained + n);
  starts_.push_back(static_cast<uint64_t>(count_));
}

void ShardWriter::append(const uint32_t* ids, size_t n) {
  if (documents_) throw std::logic_error("ShardWriter::append on a document shard");
  write_tokens(ids, n);
}

void ShardWriter::write_tokens(const uint32_t* ids, size_t n) {
  if (!file_) throw std::logic_error("ShardWriter: append after close()");
  constexpr size_t kChunk = 1 << 18;
  for (size_t start = 0; start < n; start += kChunk) {
    const size_t m = std::min(kChunk, n - start);
    const uint32_t* p = ids + start;
    uint32_t max_id = max_of(p, static_cast<int64_t>(m));
    if (max_id >= static_cast<uint64_t>(vocab_size_)) {
      throw std::invalid_argument("ShardWriter '" + path_ + "': token " + std::to_string(max_id) +
                                  " is >= vocab_size " + std::to_string(vocab_size_));
    }
    const size_t old = buffer_.size();
    buffer_.resize(old + m * width_);
    if (width_ == 2) {
      auto* out = reinterpret_cast<uint16_t*>(buffer_.data() + old);
      for (size_t i = 0; i < m; ++i) out[i] = static_cast<uint16_t>(p[i]);
    } else {
      memcpy(buffer_.data() + old, p, m * 4);
    }
    if (buffer_.size() >= (1u << 20)) flush();
  }
  count_ += static_cast<int64_t>(n);
}

void ShardWriter::flush() {
  FILE* f = static_cast<FILE*>(file_);
  if (!buffer_.empty() && fwrite(buffer_.data(), 1, buffer_.size(), f) != buffer_.size()) {
    shard_error(tmp_path_, std::string("write failed: ") + strerror(errno));
  }
  buffer_.clear();
}

void ShardWriter::close() {
  if (!file_) return;
  if (documents_) {
    buffer_.insert(buffer_.end(), trained_.begin(), trained_.end());
    const size_t old = buffer_.size();
    buffer_.resize(old + starts_.size() * 8);
    memcpy(buffer_.data() + old, starts_.data(), starts_.size() * 8);
  }
  flush();
  FILE* f = static_cast<FILE*>(file_);
  char header[kShardHeaderBytes] = {};
  memcpy(header, kShardMagic, 8);
  put_u32(header + 8, documents_ ? kDocumentShardVersion : kShardVersion);
  put_u32(header + 12, static_cast<uint32_t>(width_));
  put_u64(header + 16, static_cast<uint64_t>(count_));
  put_u64(header + 24, static_cast<uint64_t>(vocab_size_));
  if (documents_) put_u64(header + 32, starts_.size() - 1);
  bool ok = fseek(f, 0, SEEK_SET) == 0 && fwrite(header, 1, sizeof(header), f) == sizeof(header) &&
            fflush(f) == 0;
  int err = errno;
  ok = (fclose(f) == 0) && ok;
  file_ = nullptr;
  if (!ok) {
    std::remove(tmp_path_.c_str());
    shard_error(tmp_path_, std::string("write failed: ") + strerror(err));
  }
  if (std::rename(tmp_path_.c_str(), path_.c_str()) != 0) {
    err = errno;
    std::remove(tmp_path_.c_str());
    shard_error(path_,
                std::string("cannot rename the finished shard into place: ") + strerror(err));
  }
}

void write_token_shard(const std::string& path, const std::vector<uint32_t>& tokens,
                       int64_t vocab_size) {
  ShardWriter w(path, vocab_size);
  w.append(tokens);
  w.close();
}

std::shared_ptr<const TokenShard> TokenShard::open(const std::string& path, bool validate_tokens) {
  std::shared_ptr<TokenShard> s(new TokenShard());
  s->path_ = path;
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) shard_error(path, std::string("cannot open: ") + strerror(errno));
  struct stat st;
  if (fstat(fd, &st) != 0) {
    int err = errno;
    ::close(fd);
    shard_error(path, std::string("cannot stat: ") + strerror(err));
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    shard_error(path, "is not a regular file");
  }
  const size_t file_bytes = static_cast<size_t>(st.st_size);
  if (file_bytes < kShardHeaderBytes) {
    ::close(fd);
    shard_error(path, "is truncated: " + std::to_string(file_bytes) +
                          " bytes, smaller than the 64-byte header (re-create it with accel-data)");
  }
  void* map = mmap(nullptr, file_bytes, PROT_READ, MAP_PRIVATE, fd, 0);
  int map_err = errno;
  ::close(fd);
  if (map == MAP_FAILED) shard_error(path, std::string("mmap failed: ") + strerror(map_err));
  s->map_ = map;
  s->map_bytes_ = file_bytes;
  const auto* h = static_cast<const unsigned char*>(map);

  if (memcmp(h, kShardMagic, 8) != 0) {
    std::string got;
    for (int i = 0; i < 8; ++i) got += (h[i] >= 32 && h[i] < 127) ? static_cast<char>(h[i]) : '?';
    shard_error(path, "is not a token shard: magic '" + got + "', expected '" + kShardMagic +
                          "' (make shards with accel-data)");
  }
  const uint32_t version = get_u32(h + 8);
  if (version != kShardVersion && version != kDocumentShardVersion) {
    shard_error(path, "has format version " + std::to_string(version) +
                          "; this build reads versions " + std::to_string(kShardVersion) + " and " +
                          std::to_string(kDocumentShardVersion) +
                          " (re-create it with this accel-data)");
  }
  const uint32_t width = get_u32(h + 12);
  if (width != 2 && width != 4) {
    shard_error(path, "has a token width of " + std::to_string(width) +
                          " bytes; expected 2 (uint16) or 4 (uint32)");
  }
  const uint64_t count = get_u64(h + 16);
  const uint64_t vocab = get_u64(h + 24);
  if (vocab == 0 || vocab > (uint64_t{1} << 32) || (width == 2 && vocab > 65536)) {
    shard_error(path, "has an invalid vocab_size " + std::to_string(vocab) + " for " +
                          std::to_string(width) + "-byte tokens");
  }
  const uint64_t payload = file_bytes - kShardHeaderBytes;
  const uint64_t docs = version == kDocumentShardVersion ? get_u64(h + 32) : 0;
  // Per token: its bytes, plus a trained flag in version 2; then the document starts.
  const uint64_t per_token = width + (version == kDocumentShardVersion ? 1 : 0);
  const uint64_t starts_bytes = version == kDocumentShardVersion ? 8 * (docs + 1) : 0;
  if (docs > payload / 8 || starts_bytes > payload ||
      count > (payload - starts_bytes) / per_token || count * per_token + starts_bytes != payload) {
    shard_error(path,
                "is truncated or corrupt: the header says " + std::to_string(count) + " tokens" +
                    (version == kDocumentShardVersion ? " in " + std::to_string(docs) + " documents"
                                                      : std::string()) +
                    " (" + std::to_string(count * per_token + starts_bytes) +
                    " bytes) but the file holds " + std::to_string(payload) +
                    " bytes after the header (re-create it with accel-data)");
  }
  s->version_ = version;
  s->tokens_ = h + kShardHeaderBytes;
  if (version == kDocumentShardVersion) {
    s->documents_ = static_cast<int64_t>(docs);
    s->trained_ = s->tokens_ + count * width;
    s->starts_ = s->trained_ + count;
    uint64_t prev = get_u64(s->starts_);
    if (prev != 0) shard_error(path, "is corrupt: its first document does not start at token 0");
    for (uint64_t d = 1; d <= docs; ++d) {
      const uint64_t start = get_u64(s->starts_ + 8 * d);
      if (start <= prev || start > count) {
        shard_error(path, "is corrupt: document " + std::to_string(d - 1) + " ends at token " +
                              std::to_string(start) + " (after " + std::to_string(prev) +
                              ", within " + std::to_string(count) + " tokens expected)");
      }
      prev = start;
    }
    if (prev != count) {
      shard_error(path, "is corrupt: its documents end at token " + std::to_string(prev) + " of " +
                            std::to_string(count));
    }
    for (uint64_t i = 0; i < count; ++i) {
      if (s->trained_[i] > 1) {
        shard_error(path, "is corrupt: the trained flag of token " + std::to_string(i) + " is " +
                              std::to_string(s->trained_[i]) + " (0 or 1 expected)");
      }
    }
  }
  s->count_ = static_cast<int64_t>(count);
  s->vocab_size_ = static_cast<int64_t>(vocab);
  s->width_ = static_cast<int>(width);

  if (validate_tokens) {
    constexpr int64_t kChunk = 1 << 16;
    for (int64_t start = 0; start < s->count_; start += kChunk) {
      const int64_t n = std::min(kChunk, s->count_ - start);
      if (s->max_token(start, n) < vocab) continue;
      for (int64_t i = start; i < start + n; ++i) {
        if (s->at(i) >= vocab) {
          shard_error(path, "token " + std::to_string(s->at(i)) + " at index " + std::to_string(i) +
                                " is >= the shard's vocab_size " + std::to_string(vocab) +
                                " (the file is corrupt or was written with another tokenizer)");
        }
      }
    }
  }
  return s;
}

TokenShard::~TokenShard() {
  if (map_) munmap(map_, map_bytes_);
}

int64_t TokenShard::document_start(int64_t d) const {
  if (d < 0 || d > documents_) {
    throw std::out_of_range("TokenShard::document_start: no document " + std::to_string(d) +
                            " in '" + path_ + "'");
  }
  return static_cast<int64_t>(get_u64(starts_ + 8 * d));
}

uint32_t TokenShard::at(int64_t i) const {
  if (width_ == 2) {
    uint16_t v;
    memcpy(&v, tokens_ + 2 * i, 2);
    return v;
  }
  uint32_t v;
  memcpy(&v, tokens_ + 4 * i, 4);
  return v;
}

template <class Out>
static void read_tokens(const unsigned char* tokens, int width, int64_t start, int64_t n,
                        Out* out) {
  if (width == 2) {
    const auto* p = reinterpret_cast<const uint16_t*>(tokens) + start;
    for (int64_t i = 0; i < n; ++i) out[i] = static_cast<Out>(p[i]);
  } else {
    const auto* p = reinterpret_cast<const uint32_t*>(tokens) + start;
    for (int64_t i = 0; i < n; ++i) out[i] = static_cast<Out>(p[i]);
  }
}

void TokenShard::read(int64_t start, int64_t n, int64_t* out) const {
  if (start < 0 || n < 0 || start + n > count_) {
    throw std::out_of_range("TokenShard::read past the end of '" + path_ + "'");
  }
  read_tokens(tokens_, width_, start, n, out);
}

void TokenShard::read(int64_t start, int64_t n, uint32_t* out) const {
  if (start < 0 || n < 0 || start + n > count_) {
    throw std::out_of_range("TokenShard::read past the end of '" + path_ + "'");
  }
  read_tokens(tokens_, width_, start, n, out);
}

uint32_t TokenShard::max_token(int64_t start, int64_t n) const {
  if (width_ == 2) return max_of(reinterpret_cast<const uint16_t*>(tokens_) + start, n);
  return max_of(reinterpret_cast<const uint32_t*>(tokens_) + start, n);
}

}  // namespace accel
