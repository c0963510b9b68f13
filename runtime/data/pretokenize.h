// The pre-tokenization regexes of byte-level BPE tokenizers, matched by hand over UTF-8 (std::regex
// has no \p{L} / \p{N}). Each pattern splits text into pieces exactly as the regex's successive
// leftmost matches would (Hugging Face `Split(..., behavior="isolated")` / `ByteLevel(use_regex)`);
// the pieces cover the whole text.
#pragma once

#include <string_view>
#include <vector>

namespace accel {

enum class SplitPattern {
  // 's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
  Gpt2,
  // (?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|
  // \s*[\r\n]+|\s+(?!\S)|\s+
  Llama3,
};

// The regex source strings as they appear in tokenizer.json files.
extern const char* const kGpt2SplitRegex;
extern const char* const kLlama3SplitRegex;

// Appends the pieces of `text` to `out` (views into `text`).
void split_pretokens(std::string_view text, SplitPattern pattern,
                     std::vector<std::string_view>* out);

}  // namespace accel
