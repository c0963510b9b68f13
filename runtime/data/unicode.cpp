#include "runtime/data/unicode.h"

#include <algorithm>

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

}  // namespace accel
