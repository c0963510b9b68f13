#include "runtime/data/pretokenize.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include <algorithm>
#include <cctype>
#include <stdexcept>

#include "runtime/data/unicode.h"

namespace accel {

const char* const kGpt2SplitRegex =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";
const char* const kLlama3SplitRegex =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";

namespace {

bool is_hex(char c) {
  return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f') || (c >= 'A' && c <= 'F');
}

// Oniguruma's \w, measured code point by code point against libonig 6.9.8: Alphabetic, marks,
// decimal digits and connector punctuation, plus (outside a character class only) the Latin-1
// digits ² ³ ¹ ¼ ½ ¾. PCRE2's own \w is letters, all numbers and '_'.
const char* const kWordInClass = R"(\p{Alphabetic}\p{M}\p{Nd}\p{Pc})";
const char* const kWordLatin1 = R"(\x{B2}\x{B3}\x{B9}\x{BC}-\x{BE})";

}  // namespace

std::string oniguruma_to_pcre2(std::string_view p) {
  const std::string word = std::string(kWordInClass) + kWordLatin1;  // outside a class
  std::string out;
  out.reserve(p.size() + 16);
  bool in_class = false;
  size_t class_start = 0;  // offset just after '[' or "[^"
  size_t i = 0;
  auto fail = [&](const std::string& what) {
    throw std::invalid_argument(what + " (at offset " + std::to_string(i) +
                                ") has no PCRE2 equivalent");
  };
  // Copies from i through the first `close` (an escape's {...} or <...> argument).
  auto copy_through = [&](char close) {
    size_t end = p.find(close, i);
    if (end == std::string_view::npos) end = p.size() - 1;
    out.append(p.substr(i, end + 1 - i));
    i = end + 1;
  };
  while (i < p.size()) {
    const char c = p[i];
    if (c == '\\' && i + 1 < p.size()) {
      const char e = p[i + 1];
      switch (e) {
        case 's':  // White_Space; PCRE2's \s also takes U+180E
          out += "\\p{White_Space}";
          i += 2;
          continue;
        case 'S':
          out += "\\P{White_Space}";
          i += 2;
          continue;
        case 'w':
          out += in_class ? std::string(kWordInClass) : "[" + word + "]";
          i += 2;
          continue;
        case 'W':
          if (in_class) fail("\\W inside a character class");
          out += "[^" + word + "]";
          i += 2;
          continue;
        case 'h':  // a hexadecimal digit in Oniguruma, horizontal space in PCRE2
          out += in_class ? "0-9a-fA-F" : "[0-9a-fA-F]";
          i += 2;
          continue;
        case 'H':
          if (in_class) fail("\\H inside a character class");
          out += "[^0-9a-fA-F]";
          i += 2;
          continue;
        case 'b':
        case 'B':
          if (in_class) break;  // backspace in both
          out += e == 'b' ? "(?:(?<=[" + word + "])(?![" + word + "])|(?<![" + word + "])(?=[" +
                                word + "]))"
                          : "(?:(?<=[" + word + "])(?=[" + word + "])|(?<![" + word + "])(?![" +
                                word + "]))";
          i += 2;
          continue;
        case 'u':  // \uHHHH
          if (i + 6 > p.size() || !is_hex(p[i + 2]) || !is_hex(p[i + 3]) || !is_hex(p[i + 4]) ||
              !is_hex(p[i + 5])) {
            fail("\\u without four hexadecimal digits");
          }
          out += "\\x{" + std::string(p.substr(i + 2, 4)) + "}";
          i += 6;
          continue;
        case 'p':
        case 'P':
        case 'x':
        case 'o':
        case 'N':
          if (i + 2 < p.size() && p[i + 2] == '{') {
            copy_through('}');
            continue;
          }
          break;
        case 'k':
        case 'g':
          if (i + 2 < p.size() && p[i + 2] == '<') {
            copy_through('>');
            continue;
          }
          break;
        default:
          break;
      }
      out.append(p.substr(i, 2));
      i += 2;
      continue;
    }
    if (in_class) {
      if (c == '[') {
        if (p.substr(i, 2) == "[:") {  // a POSIX bracket such as [:alpha:]
          size_t end = p.find(":]", i + 2);
          if (end != std::string_view::npos) {
            out.append(p.substr(i, end + 2 - i));
            i = end + 2;
            continue;
          }
        }
        fail("a character class inside a character class");
      }
      if (c == '&' && i + 1 < p.size() && p[i + 1] == '&') fail("character class intersection &&");
      if (c == ']' && i > class_start) in_class = false;
      out.push_back(c);
      ++i;
      continue;
    }
    if (c == '[') {
      in_class = true;
      out.push_back(c);
      ++i;
      if (i < p.size() && p[i] == '^') out.push_back(p[i++]);
      class_start = i;  // a ']' right here is a literal
      continue;
    }
    if (c == '(' && p.substr(i, 2) == "(?") {
      // Inline options (?imx-imx) / (?imx-imx:...): Oniguruma's m is PCRE2's s (dot matches
      // newline); ^ and $ always match at line breaks (PCRE2_MULTILINE).
      size_t j = i + 2;
      while (j < p.size() && (std::isalpha(static_cast<unsigned char>(p[j])) || p[j] == '-')) ++j;
      if (j > i + 2 && j < p.size() && (p[j] == ':' || p[j] == ')')) {
        out += "(?";
        for (size_t k = i + 2; k < j; ++k) {
          const char o = p[k];
          if (o == 'm') {
            out.push_back('s');
          } else if (o == 'i' || o == 'x' || o == '-') {
            out.push_back(o);
          } else {
            i = k;
            fail(std::string("the inline option '") + o + "'");
          }
        }
        i = j;
        continue;
      }
      out += "(?";
      i += 2;
      continue;
    }
    if (c == '{' && i + 1 < p.size() && p[i + 1] == ',') {  // {,n} is {0,n} in Oniguruma
      size_t j = i + 2;
      while (j < p.size() && std::isdigit(static_cast<unsigned char>(p[j]))) ++j;
      if (j > i + 2 && j < p.size() && p[j] == '}') {
        out += "{0";
        ++i;
        continue;
      }
    }
    out.push_back(c);
    ++i;
  }
  return out;
}

TextPattern TextPattern::literal(std::string text) {
  if (text.empty()) throw std::invalid_argument("the pattern is an empty string");
  TextPattern t;
  t.literal_ = std::move(text);
  return t;
}

TextPattern TextPattern::regex(const std::string& pattern) {
  const std::string translated = oniguruma_to_pcre2(pattern);
  int error = 0;
  PCRE2_SIZE offset = 0;
  pcre2_compile_context* context = pcre2_compile_context_create(nullptr);
  pcre2_set_newline(context, PCRE2_NEWLINE_LF);
  pcre2_code* code = pcre2_compile(
      reinterpret_cast<PCRE2_SPTR>(translated.data()), translated.size(),
      PCRE2_UTF | PCRE2_UCP | PCRE2_MULTILINE | PCRE2_MATCH_INVALID_UTF, &error, &offset, context);
  pcre2_compile_context_free(context);
  if (!code) {
    PCRE2_UCHAR message[256];
    pcre2_get_error_message(error, message, sizeof(message));
    std::string where = translated == pattern ? "at offset " + std::to_string(offset)
                                              : "at offset " + std::to_string(offset) +
                                                    " of its PCRE2 form '" + translated + "'";
    throw std::invalid_argument(std::string(reinterpret_cast<const char*>(message)) + " (" + where +
                                ")");
  }
  pcre2_jit_compile(code, PCRE2_JIT_COMPLETE);  // without JIT (unsupported CPU) it interprets
  TextPattern t;
  t.code_.reset(code, pcre2_code_free);
  return t;
}

namespace {

// Per-thread match state: one match_data (only the whole match is read) and a JIT stack.
struct MatchState {
  pcre2_match_data* data = pcre2_match_data_create(1, nullptr);
  pcre2_match_context* context = pcre2_match_context_create(nullptr);
  pcre2_jit_stack* stack = pcre2_jit_stack_create(32 << 10, 8 << 20, nullptr);
  MatchState() {
    pcre2_jit_stack_assign(context, nullptr, stack);
    pcre2_set_match_limit(context, 10'000'000);
  }
  ~MatchState() {
    pcre2_jit_stack_free(stack);
    pcre2_match_context_free(context);
    pcre2_match_data_free(data);
  }
};

size_t utf8_length_at(std::string_view text, size_t pos) {
  uint32_t cp;
  return utf8_decode(text.data() + pos, text.size() - pos, &cp);
}

}  // namespace

void TextPattern::find_matches(std::string_view text, std::vector<MatchSpan>* out) const {
  if (text.empty()) {
    out->push_back({0, 0, false});
    return;
  }
  size_t prev = 0;
  auto add = [&](size_t begin, size_t end) {
    if (prev != begin) out->push_back({prev, begin, false});
    out->push_back({begin, end, true});
    prev = end;
  };
  if (!code_) {
    if (literal_.empty()) {
      out->push_back({0, text.size(), false});
      return;
    }
    for (size_t at = text.find(literal_); at != std::string_view::npos;
         at = text.find(literal_, at + literal_.size())) {
      add(at, at + literal_.size());
    }
  } else {
    thread_local MatchState state;
    const auto* subject = reinterpret_cast<PCRE2_SPTR>(text.data());
    // As the onig crate's find_iter: search from the last match's end; an empty match right
    // where the last match ended is skipped by moving one character on.
    size_t start = 0;
    bool have_last = false;
    size_t last_end = 0;
    while (start <= text.size()) {
      const int rc =
          pcre2_match(code_.get(), subject, text.size(), start, 0, state.data, state.context);
      if (rc == PCRE2_ERROR_NOMATCH) break;
      if (rc < 0) {
        PCRE2_UCHAR message[256];
        pcre2_get_error_message(rc, message, sizeof(message));
        throw std::runtime_error(std::string("regex matching failed: ") +
                                 reinterpret_cast<const char*>(message));
      }
      const PCRE2_SIZE* ov = pcre2_get_ovector_pointer(state.data);
      const size_t begin = ov[0], end = ov[1];
      if (begin == end && have_last && last_end == end) {
        if (start >= text.size()) break;
        start += utf8_length_at(text, start);
        continue;
      }
      add(begin, end);
      start = end;
      have_last = true;
      last_end = end;
    }
  }
  if (prev != text.size()) out->push_back({prev, text.size(), false});
}

void split_spans(const std::vector<MatchSpan>& spans, SplitBehavior behavior, bool invert,
                 std::vector<std::pair<size_t, size_t>>* pieces) {
  // (begin, end, removed) as tokenizers computes them, then the kept non-empty ones.
  struct Piece {
    size_t begin, end;
    bool removed;
  };
  std::vector<Piece> acc;
  acc.reserve(spans.size());
  bool previous_match = false;
  switch (behavior) {
    case SplitBehavior::Isolated:
      for (const MatchSpan& s : spans) acc.push_back({s.begin, s.end, false});
      break;
    case SplitBehavior::Removed:
      for (const MatchSpan& s : spans) acc.push_back({s.begin, s.end, s.is_match != invert});
      break;
    case SplitBehavior::Contiguous:
      for (const MatchSpan& s : spans) {
        const bool m = s.is_match != invert;
        if (m == previous_match && !acc.empty()) {
          acc.back().end = s.end;
        } else {
          acc.push_back({s.begin, s.end, false});
        }
        previous_match = m;
      }
      break;
    case SplitBehavior::MergedWithPrevious:
      for (const MatchSpan& s : spans) {
        const bool m = s.is_match != invert;
        if (m && !previous_match && !acc.empty()) {
          acc.back().end = s.end;
        } else {
          acc.push_back({s.begin, s.end, false});
        }
        previous_match = m;
      }
      break;
    case SplitBehavior::MergedWithNext:
      for (auto it = spans.rbegin(); it != spans.rend(); ++it) {
        const bool m = it->is_match != invert;
        if (m && !previous_match && !acc.empty()) {
          acc.back().begin = it->begin;
        } else {
          acc.push_back({it->begin, it->end, false});
        }
        previous_match = m;
      }
      std::reverse(acc.begin(), acc.end());
      break;
  }
  for (const Piece& p : acc) {
    if (!p.removed && p.end > p.begin) pieces->emplace_back(p.begin, p.end);
  }
}

}  // namespace accel
