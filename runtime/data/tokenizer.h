// Tokenizers that turn text into token ids for the shards: a byte-level one (vocab 256, id = byte)
// and Hugging Face `tokenizer.json` BPE: byte-level as GPT-2, Llama 3 and Qwen2/Qwen3 use it, and
// SentencePiece-style (byte_fallback) as Llama 2 and Mistral use it.
//
// The BPE encoder reproduces `tokenizers`' `Tokenizer.encode(text, add_special_tokens=False)`:
// added tokens that are not `normalized` are split out first (leftmost-longest, with lstrip /
// rstrip / single_word), the rest is normalized, the normalized added tokens are split out of it,
// then the pre-tokenizers split it into words and BPE merges each word by merge rank. decode()
// runs the decoders as `decode(ids, skip_special_tokens=False)` does. The post-processor
// (templates that add <|begin_of_text|> etc.) is not applied: the corpus builder puts an
// end-of-text token between documents itself. Supported (docs/data.md has the list):
//   normalizer     null, NFC, NFD, NFKC, NFKD, Prepend, Replace, Sequence
//   pre_tokenizer  null, ByteLevel, Split (any Oniguruma regex or string, every behavior, invert),
//                  Metaspace, Sequence (ByteLevel last)
//   model          BPE with ignore_merges, byte_fallback, fuse_unk, unk_token
//   decoder        null, ByteLevel, Replace, ByteFallback, Fuse, Strip, Metaspace, Sequence
// Anything else is rejected with an error naming the file and the JSON path.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace accel {

class Tokenizer {
 public:
  virtual ~Tokenizer() = default;
  // Appends the ids of `text` to `out`. Thread-safe (no shared mutable state).
  virtual void encode(std::string_view text, std::vector<uint32_t>* out) const = 0;
  std::vector<uint32_t> encode(std::string_view text) const {
    std::vector<uint32_t> ids;
    encode(text, &ids);
    return ids;
  }
  // The text of `ids` (invalid UTF-8 from partial byte sequences is replaced by U+FFFD for BPE,
  // as `tokenizers` does; the byte tokenizer returns the bytes as they are). Throws
  // std::out_of_range for an id outside the vocabulary.
  virtual std::string decode(const std::vector<uint32_t>& ids) const = 0;
  // One more than the largest id (the embedding rows a model needs).
  virtual int64_t vocab_size() const = 0;
  virtual std::optional<uint32_t> token_to_id(const std::string& token) const = 0;
  // The token that ends a document (<|endoftext|>, <|end_of_text|>, </s> or <eos>), if any.
  virtual std::optional<uint32_t> end_of_text_id() const = 0;
  // For messages: "byte-level (vocab 256)", "BPE 'path/tokenizer.json' (vocab 1000)".
  virtual std::string description() const = 0;
  // Changes whenever the ids of some text could change (for caches of tokenized data).
  virtual std::string fingerprint() const = 0;
};

std::unique_ptr<Tokenizer> make_byte_tokenizer();
// `name` is used in error messages (normally the file path).
std::unique_ptr<Tokenizer> load_bpe_tokenizer_from_json(const std::string& json_text,
                                                        const std::string& name);
std::unique_ptr<Tokenizer> load_bpe_tokenizer(const std::string& path);
// "byte" -> byte-level; anything else is a path to a tokenizer.json (or a folder holding one).
std::unique_ptr<Tokenizer> make_tokenizer(const std::string& spec);

// GPT-2's byte -> printable code point map used by byte-level BPE (e.g. ' ' -> U+0120 'Ġ').
uint32_t byte_to_unicode(uint8_t b);

}  // namespace accel
