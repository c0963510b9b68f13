#include "runtime/data/unicode.h"

#include <algorithm>
#include <vector>

namespace accel {

size_t utf8_decode(const char* s, size_t n, uint32_t* cp) {
  const auto* u = reinterpret_cast<const unsigned char*>(s);
  const uint32_t b0 = u[0];
  if (b0 < 0x80) {
    *cp = b0;
    return 1;
  }
  size_t len;
  uint32_t value, min_value;
  if ((b0 & 0xE0) == 0xC0) {
    len = 2, value = b0 & 0x1F, min_value = 0x80;
  } else if ((b0 & 0xF0) == 0xE0) {
    len = 3, value = b0 & 0x0F, min_value = 0x800;
  } else if ((b0 & 0xF8) == 0xF0) {
    len = 4, value = b0 & 0x07, min_value = 0x10000;
  } else {
    *cp = kInvalidCodePointBase + b0;
    return 1;
  }
  if (n < len) {
    *cp = kInvalidCodePointBase + b0;
    return 1;
  }
  for (size_t k = 1; k < len; ++k) {
    if ((u[k] & 0xC0) != 0x80) {
      *cp = kInvalidCodePointBase + b0;
      return 1;
    }
    value = (value << 6) | (u[k] & 0x3F);
  }
  if (value < min_value || value > 0x10FFFF || (value >= 0xD800 && value <= 0xDFFF)) {
    *cp = kInvalidCodePointBase + b0;
    return 1;
  }
  *cp = value;
  return len;
}

namespace {
bool in_ranges(const CodeRange* ranges, size_t count, uint32_t cp) {
  const CodeRange* end = ranges + count;
  // First range whose last >= cp.
  const CodeRange* it =
      std::lower_bound(ranges, end, cp, [](const CodeRange& r, uint32_t v) { return r.last < v; });
  return it != end && it->first <= cp;
}
}  // namespace

bool is_letter(uint32_t cp) {
  if (cp < 0x80) return (cp | 0x20) >= 'a' && (cp | 0x20) <= 'z';
  return in_ranges(unicode_tables::kLetters, unicode_tables::kLetters_count, cp);
}

bool is_number(uint32_t cp) {
  if (cp < 0x80) return cp >= '0' && cp <= '9';
  return in_ranges(unicode_tables::kNumbers, unicode_tables::kNumbers_count, cp);
}

bool is_whitespace(uint32_t cp) {
  if (cp < 0x80) return cp == ' ' || (cp >= 0x09 && cp <= 0x0D);
  return in_ranges(unicode_tables::kWhiteSpace, unicode_tables::kWhiteSpace_count, cp);
}

namespace {

// Hangul syllables are composed and decomposed by formula (Unicode chapter 3.12).
constexpr uint32_t kHangulBase = 0xAC00, kLeadBase = 0x1100, kVowelBase = 0x1161,
                   kTrailBase = 0x11A7;
constexpr uint32_t kLeadCount = 19, kVowelCount = 21, kTrailCount = 28;
constexpr uint32_t kSyllableCount = kLeadCount * kVowelCount * kTrailCount;

uint32_t combining_class(uint32_t cp) {
  using unicode_tables::kCombiningClasses;
  if (cp < 0x300) return 0;
  const auto* end = kCombiningClasses + unicode_tables::kCombiningClasses_count;
  const auto* it =
      std::lower_bound(kCombiningClasses, end, cp,
                       [](const CombiningClassRange& r, uint32_t v) { return r.last < v; });
  return it != end && it->first <= cp ? it->combining_class : 0;
}

const Decomposition* find_decomposition(const Decomposition* table, size_t count, uint32_t cp) {
  const Decomposition* end = table + count;
  const Decomposition* it =
      std::lower_bound(table, end, cp, [](const Decomposition& d, uint32_t v) { return d.cp < v; });
  return it != end && it->cp == cp ? it : nullptr;
}

void decompose(uint32_t cp, bool compatibility, std::vector<uint32_t>* out) {
  using namespace unicode_tables;
  if (cp >= kHangulBase && cp < kHangulBase + kSyllableCount) {
    const uint32_t s = cp - kHangulBase;
    out->push_back(kLeadBase + s / (kVowelCount * kTrailCount));
    out->push_back(kVowelBase + (s % (kVowelCount * kTrailCount)) / kTrailCount);
    if (s % kTrailCount) out->push_back(kTrailBase + s % kTrailCount);
    return;
  }
  if (cp < 0xA0) {  // nothing below U+00A0 decomposes
    out->push_back(cp);
    return;
  }
  const Decomposition* d = nullptr;
  const uint32_t* pool = nullptr;
  if (compatibility) {
    d = find_decomposition(kCompatibilityDecompositions, kCompatibilityDecompositions_count, cp);
    pool = kCompatibilityDecompositions_pool;
  }
  if (!d) {
    d = find_decomposition(kCanonicalDecompositions, kCanonicalDecompositions_count, cp);
    pool = kCanonicalDecompositions_pool;
  }
  if (!d) {
    out->push_back(cp);
    return;
  }
  out->insert(out->end(), pool + d->offset, pool + d->offset + d->length);
}

// 0 when the pair has no primary composite.
uint32_t compose_pair(uint32_t a, uint32_t b) {
  using unicode_tables::kCompositions;
  if (a >= kLeadBase && a < kLeadBase + kLeadCount && b >= kVowelBase &&
      b < kVowelBase + kVowelCount) {
    return kHangulBase + ((a - kLeadBase) * kVowelCount + (b - kVowelBase)) * kTrailCount;
  }
  if (a >= kHangulBase && a < kHangulBase + kSyllableCount &&
      (a - kHangulBase) % kTrailCount == 0 && b > kTrailBase && b < kTrailBase + kTrailCount) {
    return a + (b - kTrailBase);
  }
  const Composition* end = kCompositions + unicode_tables::kCompositions_count;
  const Composition* it =
      std::lower_bound(kCompositions, end, std::make_pair(a, b),
                       [](const Composition& c, const std::pair<uint32_t, uint32_t>& v) {
                         return c.first != v.first ? c.first < v.first : c.second < v.second;
                       });
  return it != end && it->first == a && it->second == b ? it->composite : 0;
}

// Normalizes one run of valid code points.
void normalize_run(const std::vector<uint32_t>& run, NormalForm form, std::string* out) {
  const bool compatibility = form == NormalForm::NFKC || form == NormalForm::NFKD;
  std::vector<uint32_t> d;
  d.reserve(run.size() + 8);
  for (uint32_t cp : run) decompose(cp, compatibility, &d);
  // Canonical ordering: a stable sort of each run of non-starters by combining class.
  for (size_t i = 1; i < d.size(); ++i) {
    const uint32_t cc = combining_class(d[i]);
    if (cc == 0) continue;
    size_t j = i;
    while (j > 0 && combining_class(d[j - 1]) > cc) {
      std::swap(d[j], d[j - 1]);
      --j;
    }
  }
  if (form == NormalForm::NFC || form == NormalForm::NFKC) {
    // Canonical composition: each character joins the last starter unless a character between
    // them blocks it (a starter, or one of the same or higher combining class).
    std::vector<uint32_t> c;
    c.reserve(d.size());
    ptrdiff_t starter = -1;
    uint32_t last_cc = 0;
    for (uint32_t cp : d) {
      const uint32_t cc = combining_class(cp);
      if (starter >= 0) {
        const bool adjacent = static_cast<size_t>(starter) + 1 == c.size();
        if (adjacent || (last_cc != 0 && last_cc < cc)) {
          if (uint32_t composite = compose_pair(c[starter], cp)) {
            c[starter] = composite;
            continue;
          }
        }
      }
      if (cc == 0) starter = static_cast<ptrdiff_t>(c.size());
      last_cc = cc;
      c.push_back(cp);
    }
    d.swap(c);
  }
  for (uint32_t cp : d) utf8_append(out, cp);
}

}  // namespace

std::string unicode_normalize(std::string_view text, NormalForm form) {
  // Fast path: ASCII never changes; below U+0300 nothing changes under NFC.
  const uint32_t unchanged_below = form == NormalForm::NFC ? 0x300 : 0x80;
  size_t pos = 0, last = 0;  // `last`: where the code point before `pos` starts
  while (pos < text.size()) {
    uint32_t cp;
    const size_t len = utf8_decode(text.data() + pos, text.size() - pos, &cp);
    if (cp >= unchanged_below) break;
    last = pos;
    pos += len;
  }
  if (pos == text.size()) return std::string(text);
  pos = last;  // the character before may compose with what follows
  std::string out(text.substr(0, pos));
  std::vector<uint32_t> run;
  while (pos < text.size()) {
    uint32_t cp;
    const size_t len = utf8_decode(text.data() + pos, text.size() - pos, &cp);
    if (cp >= kInvalidCodePointBase) {
      normalize_run(run, form, &out);
      run.clear();
      out.push_back(text[pos]);
    } else {
      run.push_back(cp);
    }
    pos += len;
  }
  normalize_run(run, form, &out);
  return out;
}

}  // namespace accel
