// UTF-8 decoding, the few Unicode classes the tokenizers need (letters, numbers, White_Space) and
// the Unicode normalization forms (NFC, NFD, NFKC, NFKD) of tokenizer.json normalizers.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace accel {

struct CodeRange {
  uint32_t first, last;
};
struct CombiningClassRange {
  uint32_t first, last, combining_class;
};
// A code point's full decomposition: `length` code points at `offset` of the table's pool.
struct Decomposition {
  uint32_t cp, offset, length;
};
// first + second -> composite (the primary composites, Hangul aside).
struct Composition {
  uint32_t first, second, composite;
};

namespace unicode_tables {
extern const CodeRange kLetters[];
extern const size_t kLetters_count;
extern const CodeRange kNumbers[];
extern const size_t kNumbers_count;
extern const CodeRange kWhiteSpace[];
extern const size_t kWhiteSpace_count;
extern const CombiningClassRange kCombiningClasses[];
extern const size_t kCombiningClasses_count;
extern const Decomposition kCanonicalDecompositions[];
extern const size_t kCanonicalDecompositions_count;
extern const uint32_t kCanonicalDecompositions_pool[];
extern const Decomposition kCompatibilityDecompositions[];  // only where NFKD differs from NFD
extern const size_t kCompatibilityDecompositions_count;
extern const uint32_t kCompatibilityDecompositions_pool[];
extern const Composition kCompositions[];  // sorted by (first, second)
extern const size_t kCompositions_count;
}  // namespace unicode_tables

// A byte that does not start a valid UTF-8 sequence decodes to kInvalidCodePointBase + byte, a
// value outside Unicode that belongs to no class, so malformed text still tokenizes (byte by byte).
constexpr uint32_t kInvalidCodePointBase = 0x110000;

// Decodes the code point starting at s[0] (n > 0 bytes available) and returns its length in bytes
// (1 for an invalid byte). Overlong forms, surrogates and values above U+10FFFF are invalid.
size_t utf8_decode(const char* s, size_t n, uint32_t* cp);

bool is_letter(uint32_t cp);      // general category L*
bool is_number(uint32_t cp);      // general category N*
bool is_whitespace(uint32_t cp);  // White_Space property (what Oniguruma's \s matches)

enum class NormalForm { NFC, NFD, NFKC, NFKD };

// `text` in the normal form (Unicode's algorithm, tables from gen_unicode_tables.py). Bytes that
// are not valid UTF-8 are kept as they are and block composition across them.
std::string unicode_normalize(std::string_view text, NormalForm form);

// Appends the UTF-8 encoding of a valid code point.
template <class String>
void utf8_append(String* out, uint32_t cp) {
  if (cp < 0x80) {
    out->push_back(static_cast<char>(cp));
  } else if (cp < 0x800) {
    out->push_back(static_cast<char>(0xC0 | (cp >> 6)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else if (cp < 0x10000) {
    out->push_back(static_cast<char>(0xE0 | (cp >> 12)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else {
    out->push_back(static_cast<char>(0xF0 | (cp >> 18)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  }
}

}  // namespace accel
