// Token shards: pre-tokenized data on disk, read through mmap. The format (docs/data.md):
//
//   offset  size  field
//   0       8     magic "ACCELTOK"
//   8       4     version (uint32, 1)
//   12      4     token width in bytes (uint32: 2 = uint16 tokens, 4 = uint32 tokens)
//   16      8     token count (uint64)
//   24      8     vocab size (uint64): every token is < this
//   32      8     version 2: document count D (uint64); version 1: zero
//   40      24    reserved, zero
//   64      ...   the tokens, little-endian, token count x width bytes
// Version 1 ends there. Version 2 (documents: JSONL samples for fine-tuning) goes on with
//   ...     N     one byte per token: 1 when the token is a trained target, 0 when not (prompt,
//                 system and user tokens: their loss is masked)
//   ...     8(D+1) the document starts (uint64): 0, ..., N; each document holds >= 1 token
// Readers take both versions; a version-1 shard has no documents and trains every token.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace accel {

constexpr char kShardMagic[9] = "ACCELTOK";
constexpr uint32_t kShardVersion = 1;          // token streams
constexpr uint32_t kDocumentShardVersion = 2;  // documents with trained flags
constexpr size_t kShardHeaderBytes = 64;
constexpr const char* kShardExtension = ".tok";

// 2 (uint16 tokens) when every id fits, i.e. vocab_size <= 65536, else 4.
int shard_token_bytes(int64_t vocab_size);

// Streams tokens into one shard. Data goes to `path`.tmp and is renamed to `path` by close(), so a
// crash never leaves a half-written shard under the final name. With `documents`, the shard is
// version 2 and takes whole documents (append_document) instead of a token stream; their flags
// and starts are kept in memory until close() (one byte per token).
class ShardWriter {
 public:
  ShardWriter(std::string path, int64_t vocab_size, bool documents = false);
  ~ShardWriter();  // without close(): removes the temporary file
  ShardWriter(const ShardWriter&) = delete;
  ShardWriter& operator=(const ShardWriter&) = delete;

  // Throws std::invalid_argument for an id >= vocab_size.
  void append(const uint32_t* ids, size_t n);
  void append(const std::vector<uint32_t>& ids) { append(ids.data(), ids.size()); }
  // Documents only: one document of n >= 1 tokens and its trained flags (0 or 1 each).
  void append_document(const uint32_t* ids, const uint8_t* trained, size_t n);
  int64_t count() const { return count_; }
  int64_t documents() const { return static_cast<int64_t>(starts_.size()) - 1; }
  const std::string& path() const { return path_; }
  void close();

 private:
  void write_tokens(const uint32_t* ids, size_t n);
  void flush();
  std::string path_, tmp_path_;
  int64_t vocab_size_;
  int width_;
  int64_t count_ = 0;
  bool documents_;
  std::vector<uint8_t> trained_;
  std::vector<uint64_t> starts_{0};
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
  // Version 2: the documents, [document_start(d), document_start(d + 1)), and whether token i is
  // a trained target. A version-1 shard has no documents and every token is trained.
  bool has_documents() const { return version_ == kDocumentShardVersion; }
  int64_t documents() const { return documents_; }
  int64_t document_start(int64_t d) const;  // d in [0, documents()]
  bool trained(int64_t i) const { return !trained_ || trained_[i] != 0; }

 private:
  TokenShard() = default;
  std::string path_;
  void* map_ = nullptr;
  size_t map_bytes_ = 0;
  const unsigned char* tokens_ = nullptr;
  int64_t count_ = 0;
  int64_t vocab_size_ = 0;
  int width_ = 0;
  uint32_t version_ = 0;
  int64_t documents_ = 0;
  const unsigned char* trained_ = nullptr;  // version 2
  const unsigned char* starts_ = nullptr;   // version 2: documents_ + 1 uint64, unaligned
};

}  // namespace accel
