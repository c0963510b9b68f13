// Token shards: pre-tokenized data on disk, read through mmap. The format (docs/data.md):
//
//   offset  size  field
//   0       8     magic "ACCELTOK"
//   8       4     version (uint32, 1)
//   12      4     token width in bytes (uint32: 2 = uint16 tokens, 4 = uint32 tokens)
//   16      8     token count (uint64)
//   24      8     vocab size (uint64): every token is < this
//   32      32    reserved, zero
//   64      ...   the tokens, little-endian, token count x width bytes, nothing after them
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace accel {

constexpr char kShardMagic[9] = "ACCELTOK";
constexpr uint32_t kShardVersion = 1;
constexpr size_t kShardHeaderBytes = 64;
constexpr const char* kShardExtension = ".tok";

// 2 (uint16 tokens) when every id fits, i.e. vocab_size <= 65536, else 4.
int shard_token_bytes(int64_t vocab_size);

// Streams tokens into one shard. Data goes to `path`.tmp and is renamed to `path` by close(), so a
// crash never leaves a half-written shard under the final name.
class ShardWriter {
 public:
  ShardWriter(std::string path, int64_t vocab_size);
  ~ShardWriter();  // without close(): removes the temporary file
  ShardWriter(const ShardWriter&) = delete;
  ShardWriter& operator=(const ShardWriter&) = delete;

  // Throws std::invalid_argument for an id >= vocab_size.
  void append(const uint32_t* ids, size_t n);
  void append(const std::vector<uint32_t>& ids) { append(ids.data(), ids.size()); }
  int64_t count() const { return count_; }
  const std::string& path() const { return path_; }
  void close();

 private:
  void flush();
  std::string path_, tmp_path_;
  int64_t vocab_size_;
  int width_;
  int64_t count_ = 0;
  std::vector<char> buffer_;
  void* file_ = nullptr;  // FILE*
};

void write_token_shard(const std::string& path, const std::vector<uint32_t>& tokens,
                       int64_t vocab_size);

// A read-only, memory-mapped shard. open() validates the header and the size, and (unless told
// not to) that every token is < vocab_size; each problem is a std::runtime_error naming the file.
class TokenShard {
 public:
  static std::shared_ptr<const TokenShard> open(const std::string& path,
                                                bool validate_tokens = true);
  ~TokenShard();
  TokenShard(const TokenShard&) = delete;
  TokenShard& operator=(const TokenShard&) = delete;

  const std::string& path() const { return path_; }
  int64_t size() const { return count_; }  // tokens
  int64_t vocab_size() const { return vocab_size_; }
  int token_bytes() const { return width_; }
  uint32_t at(int64_t i) const;
  // Copies tokens [start, start + n), widened.
  void read(int64_t start, int64_t n, int64_t* out) const;
  void read(int64_t start, int64_t n, uint32_t* out) const;
  // The largest token id in [start, start + n) (0 for an empty range); vectorized.
  uint32_t max_token(int64_t start, int64_t n) const;

 private:
  TokenShard() = default;
  std::string path_;
  void* map_ = nullptr;
  size_t map_bytes_ = 0;
  const unsigned char* tokens_ = nullptr;
  int64_t count_ = 0;
  int64_t vocab_size_ = 0;
  int width_ = 0;
};

}  // namespace accel
