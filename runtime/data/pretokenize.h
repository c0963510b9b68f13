// Splitting text as Hugging Face `tokenizers` does for tokenizer.json's normalizers, pre-tokenizers
// and decoders: patterns ({"String": ...} or {"Regex": ...}) and the Split behaviors. Regexes are
// written in Oniguruma's syntax (the engine `tokenizers` uses); they run on PCRE2 after
// oniguruma_to_pcre2() rewrote the few constructs whose meaning differs (\s, \w, \h, \b, (?m),
// ...).
#pragma once

#include <cstddef>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

struct pcre2_real_code_8;  // PCRE2's compiled pattern (pcre2_code)

namespace accel {

// The regex source strings of GPT-2's and Llama 3's pre-tokenizers as tokenizer.json has them.
extern const char* const kGpt2SplitRegex;
extern const char* const kLlama3SplitRegex;

// A piece of the text and whether the pattern matched it.
struct MatchSpan {
  size_t begin, end;
  bool is_match;
};

// Translates an Oniguruma pattern into PCRE2 syntax with the same meaning under
// PCRE2_UTF | PCRE2_UCP | PCRE2_MULTILINE. Throws std::invalid_argument (saying what and where)
// for Oniguruma constructs PCRE2 cannot express (class intersection &&, nested classes, \W or \H
// inside a class, inline options other than i, m, x).
std::string oniguruma_to_pcre2(std::string_view pattern);

class TextPattern {
 public:
  TextPattern() = default;  // matches nothing; assign literal() or regex()
  // A literal string (tokenizers escapes it into a regex; the same thing). Throws
  // std::invalid_argument when empty.
  static TextPattern literal(std::string text);
  // An Oniguruma regex; throws std::invalid_argument naming the problem and its offset.
  static TextPattern regex(const std::string& pattern);

  // The matches in order with the gaps between them, covering `text` (tokenizers' find_matches:
  // successive leftmost matches; an empty match right where the previous one ended is skipped).
  // Empty text gives one empty gap. Bytes that are not valid UTF-8 match no pattern item.
  // Throws std::runtime_error when a regex exceeds PCRE2's match limit (catastrophic
  // backtracking).
  void find_matches(std::string_view text, std::vector<MatchSpan>* out) const;

 private:
  std::string literal_;
  std::shared_ptr<pcre2_real_code_8> code_;  // null for a literal
};

// tokenizers' SplitDelimiterBehavior: what becomes of the matches when splitting.
enum class SplitBehavior { Removed, Isolated, MergedWithPrevious, MergedWithNext, Contiguous };

// tokenizers' NormalizedString::split: the pieces [begin, end) of `spans` (from find_matches) for
// `behavior`, the matches and gaps swapped first when `invert`. Empty pieces are left out.
void split_spans(const std::vector<MatchSpan>& spans, SplitBehavior behavior, bool invert,
                 std::vector<std::pair<size_t, size_t>>* pieces);

}  // namespace accel
