#include "runtime/data/pretokenize.h"

#include <cassert>
#include <cstdint>

#include "runtime/data/unicode.h"

namespace accel {

const char* const kGpt2SplitRegex =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";
const char* const kLlama3SplitRegex =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";

namespace {

enum : uint8_t { kLetter = 1, kNumber = 2, kSpace = 4, kNewline = 8 };

// The text as code points with their classes and byte offsets.
struct Decoded {
  std::vector<uint32_t> cp;
  std::vector<uint8_t> cls;
  std::vector<size_t> offset;  // size() + 1 entries; the last is the text length

  size_t size() const { return cp.size(); }
  bool letter(size_t i) const { return cls[i] & kLetter; }
  bool number(size_t i) const { return cls[i] & kNumber; }
  bool space(size_t i) const { return cls[i] & kSpace; }
  bool newline(size_t i) const { return cls[i] & kNewline; }
  bool other(size_t i) const { return (cls[i] & (kLetter | kNumber | kSpace)) == 0; }
};

void decode(std::string_view text, Decoded* d) {
  d->cp.clear();
  d->cls.clear();
  d->offset.clear();
  size_t pos = 0;
  while (pos < text.size()) {
    uint32_t cp;
    size_t len = utf8_decode(text.data() + pos, text.size() - pos, &cp);
    uint8_t c = 0;
    if (cp == '\r' || cp == '\n') {
      c = kSpace | kNewline;
    } else if (is_whitespace(cp)) {
      c = kSpace;
    } else if (is_letter(cp)) {
      c = kLetter;
    } else if (is_number(cp)) {
      c = kNumber;
    }
    d->cp.push_back(cp);
    d->cls.push_back(c);
    d->offset.push_back(pos);
    pos += len;
  }
  d->offset.push_back(text.size());
}

template <class Pred>
size_t run_end(const Decoded& d, size_t i, Pred pred) {
  while (i < d.size() && pred(i)) ++i;
  return i;
}

uint32_t ascii_lower(uint32_t cp) {
  if (cp >= 'A' && cp <= 'Z') return cp + 32;
  if (cp == 0x17F) return 's';  // LATIN SMALL LETTER LONG S case-folds to 's'
  return cp;
}

// 's|'t|'re|'ve|'m|'ll|'d at i; returns the end or 0.
size_t match_contraction(const Decoded& d, size_t i, bool ignore_case) {
  if (d.cp[i] != '\'' || i + 1 >= d.size()) return 0;
  auto at = [&](size_t k) { return ignore_case ? ascii_lower(d.cp[k]) : d.cp[k]; };
  uint32_t a = at(i + 1);
  if (a == 's' || a == 't' || a == 'm' || a == 'd') return i + 2;
  if (i + 2 < d.size()) {
    uint32_t b = at(i + 2);
    if ((a == 'r' && b == 'e') || (a == 'v' && b == 'e') || (a == 'l' && b == 'l')) return i + 3;
  }
  return 0;
}

// \s+(?!\S) then \s+ : the whitespace run, leaving its last character to the next piece when
// that piece starts with a non-space.
size_t match_space_run(const Decoded& d, size_t i) {
  size_t end = run_end(d, i, [&](size_t k) { return d.space(k); });
  if (end == i) return 0;
  if (end == d.size() || end - i == 1) return end;
  return end - 1;
}

size_t match_gpt2(const Decoded& d, size_t i) {
  if (size_t e = match_contraction(d, i, false)) return e;
  const bool lead_space = d.cp[i] == ' ' && i + 1 < d.size();
  // ` ?\p{L}+`, ` ?\p{N}+`, ` ?[^\s\p{L}\p{N}]+`
  if (d.letter(i)) return run_end(d, i, [&](size_t k) { return d.letter(k); });
  if (lead_space && d.letter(i + 1))
    return run_end(d, i + 1, [&](size_t k) { return d.letter(k); });
  if (d.number(i)) return run_end(d, i, [&](size_t k) { return d.number(k); });
  if (lead_space && d.number(i + 1))
    return run_end(d, i + 1, [&](size_t k) { return d.number(k); });
  if (d.other(i)) return run_end(d, i, [&](size_t k) { return d.other(k); });
  if (lead_space && d.other(i + 1)) return run_end(d, i + 1, [&](size_t k) { return d.other(k); });
  return match_space_run(d, i);
}

size_t match_llama3(const Decoded& d, size_t i) {
  if (size_t e = match_contraction(d, i, true)) return e;
  // [^\r\n\p{L}\p{N}]?\p{L}+
  if (!d.newline(i) && !d.letter(i) && !d.number(i) && i + 1 < d.size() && d.letter(i + 1)) {
    return run_end(d, i + 1, [&](size_t k) { return d.letter(k); });
  }
  if (d.letter(i)) return run_end(d, i, [&](size_t k) { return d.letter(k); });
  // \p{N}{1,3}
  if (d.number(i)) {
    size_t e = i;
    while (e < d.size() && e < i + 3 && d.number(e)) ++e;
    return e;
  }
  // ` ?[^\s\p{L}\p{N}]+[\r\n]*`
  size_t j = i;
  if (d.cp[i] == ' ' && i + 1 < d.size() && d.other(i + 1)) j = i + 1;
  if (d.other(j)) {
    size_t e = run_end(d, j, [&](size_t k) { return d.other(k); });
    return run_end(d, e, [&](size_t k) { return d.cp[k] == '\r' || d.cp[k] == '\n'; });
  }
  // \s*[\r\n]+ : up to and including the last newline of the whitespace run.
  size_t end = run_end(d, i, [&](size_t k) { return d.space(k); });
  for (size_t k = end; k > i; --k) {
    if (d.newline(k - 1)) return k;
  }
  return match_space_run(d, i);
}

}  // namespace

void split_pretokens(std::string_view text, SplitPattern pattern,
                     std::vector<std::string_view>* out) {
  thread_local Decoded d;
  decode(text, &d);
  size_t i = 0;
  while (i < d.size()) {
    size_t end = pattern == SplitPattern::Gpt2 ? match_gpt2(d, i) : match_llama3(d, i);
    assert(end > i && "the split patterns match every character");
    out->push_back(text.substr(d.offset[i], d.offset[end] - d.offset[i]));
    i = end;
  }
}

}  // namespace accel
