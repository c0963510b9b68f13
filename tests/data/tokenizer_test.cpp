#include "runtime/data/tokenizer.h"

#include <dlfcn.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <optional>
#include <random>

#include "runtime/data/pretokenize.h"
#include "runtime/data/unicode.h"
#include "tests/data/test_util.h"

namespace accel {
namespace {

using testing::error_of;
using testing::TempDir;
using testing::write_bytes;

using Pieces = std::vector<std::string>;

Pieces split(const std::string& text, const TextPattern& pattern,
             SplitBehavior behavior = SplitBehavior::Isolated, bool invert = false) {
  std::vector<MatchSpan> spans;
  pattern.find_matches(text, &spans);
  std::vector<std::pair<size_t, size_t>> cuts;
  split_spans(spans, behavior, invert, &cuts);
  Pieces out;
  for (const auto& [begin, end] : cuts) out.push_back(text.substr(begin, end - begin));
  return out;
}

Pieces split(const std::string& text, const char* regex) {
  return split(text, TextPattern::regex(regex));
}

const char* const kQwen2SplitRegex =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";

TEST(Unicode, Classes) {
  uint32_t cp;
  EXPECT_EQ(utf8_decode("\xC3\xA9", 2, &cp), 2u);  // é
  EXPECT_EQ(cp, 0xE9u);
  EXPECT_TRUE(is_letter(cp));
  EXPECT_EQ(utf8_decode("\xF0\x9F\x99\x82", 4, &cp), 4u);  // 🙂
  EXPECT_EQ(cp, 0x1F642u);
  EXPECT_FALSE(is_letter(cp) || is_number(cp) || is_whitespace(cp));
  EXPECT_TRUE(is_letter(0x65E5));  // 日
  EXPECT_TRUE(is_letter(0x3B1));   // α
  EXPECT_TRUE(is_number(0xBD));    // ½ (No)
  EXPECT_TRUE(is_number(0x2160));  // Ⅰ (Nl)
  EXPECT_TRUE(is_number(0x0663));  // Arabic-Indic 3 (Nd)
  EXPECT_FALSE(is_letter('_'));
  EXPECT_TRUE(is_whitespace(0x3000));  // ideographic space
  EXPECT_TRUE(is_whitespace(0xA0));
  EXPECT_FALSE(is_whitespace(0x200B));  // zero width space is not White_Space
  // Invalid sequences decode one byte at a time to values outside Unicode.
  EXPECT_EQ(utf8_decode("\xC3(", 2, &cp), 1u);
  EXPECT_EQ(cp, kInvalidCodePointBase + 0xC3);
  EXPECT_EQ(utf8_decode("\xE6\x97", 2, &cp), 1u);      // truncated
  EXPECT_EQ(utf8_decode("\xC0\xAF", 2, &cp), 1u);      // overlong
  EXPECT_EQ(utf8_decode("\xED\xA0\x80", 3, &cp), 1u);  // surrogate
}

TEST(PreTokenize, Gpt2Pattern) {
  const auto g = kGpt2SplitRegex;
  EXPECT_EQ(split("Hello world's 123 foo!!  bar\n\n baz", g),
            (Pieces{"Hello", " world", "'s", " 123", " foo", "!!", " ", " bar", "\n\n", " baz"}));
  EXPECT_EQ(split("I'M you're we'VE", g), (Pieces{"I", "'", "M", " you", "'re", " we", "'", "VE"}));
  EXPECT_EQ(split("naïve café 日本語 🙂", g),
            (Pieces{"naïve", " café", " 日本語", " 🙂"}));
  EXPECT_EQ(split("abc123def 4.5", g), (Pieces{"abc", "123", "def", " 4", ".", "5"}));
  EXPECT_EQ(split("trailing   ", g), (Pieces{"trailing", "   "}));
  EXPECT_EQ(split("   lead", g), (Pieces{"  ", " lead"}));
  EXPECT_EQ(split("a\tb", g), (Pieces{"a", "\t", "b"}));
  EXPECT_EQ(split("x\u3000y", g), (Pieces{"x", "\u3000", "y"}));
  EXPECT_EQ(split("", g), (Pieces{}));
  // Bytes that are not UTF-8 match nothing: they are the gaps between matches.
  EXPECT_EQ(split("ab\xFF\xFEz", g), (Pieces{"ab", "\xFF\xFE", "z"}));
  EXPECT_EQ(split("a \xFF b", g), (Pieces{"a", " ", "\xFF", " b"}));
}

TEST(PreTokenize, Llama3Pattern) {
  const auto l = kLlama3SplitRegex;
  EXPECT_EQ(split("Hello world's 12345 (ok)\n\n  x", l),
            (Pieces{"Hello", " world", "'s", " ", "123", "45", " (", "ok", ")\n\n", " ", " x"}));
  EXPECT_EQ(split("I'M YOU'RE", l), (Pieces{"I", "'M", " YOU", "'RE"}));
  EXPECT_EQ(split("def f(x):\n    return x", l),
            (Pieces{"def", " f", "(x", "):\n", "   ", " return", " x"}));
  EXPECT_EQ(split("a  \n \n  b", l), (Pieces{"a", "  \n \n", " ", " b"}));
  EXPECT_EQ(split("trailing \n", l), (Pieces{"trailing", " \n"}));
  EXPECT_EQ(split("1234567", l), (Pieces{"123", "456", "7"}));
  EXPECT_EQ(split("naïve café 日本語", l), (Pieces{"naïve", " café", " 日本語"}));
  EXPECT_EQ(split("...hello", l), (Pieces{"...", "hello"}));
  EXPECT_EQ(split("(hello", l), (Pieces{"(hello"}));
}

TEST(PreTokenize, Qwen2PatternSplitsDigitsOneByOne) {
  const auto q = kQwen2SplitRegex;
  EXPECT_EQ(split("1234567 3.14", q),
            (Pieces{"1", "2", "3", "4", "5", "6", "7", " ", "3", ".", "1", "4"}));
  EXPECT_EQ(split("I'M x\n\n  y", q), (Pieces{"I", "'M", " x", "\n\n", " ", " y"}));
  // A punctuation mark joins the letters after it ([^\r\n\p{L}\p{N}]?\p{L}+).
  EXPECT_EQ(split("中文，日本語。", q), (Pieces{"中文", "，日本語", "。"}));
}

// Where Oniguruma (what `tokenizers` runs) and PCRE2 read the same text differently, the pattern
// is rewritten; each case checks the Oniguruma meaning.
TEST(PreTokenize, OnigurumaMeaningsOnPcre2) {
  // \s is White_Space: PCRE2's own \s would also take U+180E MONGOLIAN VOWEL SEPARATOR.
  EXPECT_EQ(split("a\u180Eb c", "\\s"), (Pieces{"a\u180Eb", " ", "c"}));
  EXPECT_EQ(split("a\u180Eb c", "[^\\s]+"), (Pieces{"a\u180Eb", " ", "c"}));
  // \w takes marks and every connector punctuation.
  EXPECT_EQ(split("e\u0301_\u203F|x", "\\w+"), (Pieces{"e\u0301_\u203F", "|", "x"}));
  EXPECT_EQ(split("ab|c", "\\W"), (Pieces{"ab", "|", "c"}));
  EXPECT_EQ(split("e\u0301 x", "\\b"), (Pieces{"e\u0301", " ", "x"}));
  // \h is a hexadecimal digit.
  EXPECT_EQ(split("12af zz", "\\h+"), (Pieces{"12af", " zz"}));
  // (?m) lets the dot match a newline; ^ and $ match at every line.
  EXPECT_EQ(split("a\nb", "(?m).+"), (Pieces{"a\nb"}));
  EXPECT_EQ(split("a\nb", ".+"), (Pieces{"a", "\n", "b"}));
  EXPECT_EQ(split("ab\ncd", "^."), (Pieces{"a", "b\n", "c", "d"}));
  // {,n} is {0,n}; \uHHHH is a code point.
  EXPECT_EQ(split("aaa", "a{,2}"), (Pieces{"aa", "a"}));
  EXPECT_EQ(split("xＡy", "\\uFF21"), (Pieces{"x", "Ａ", "y"}));
  // Case-insensitive contractions include the long s (U+017F folds to s).
  EXPECT_EQ(split("x'ſ", kLlama3SplitRegex), (Pieces{"x", "'ſ"}));
  EXPECT_EQ(oniguruma_to_pcre2("[^\\s\\p{L}]"), "[^\\p{White_Space}\\p{L}]");
  EXPECT_EQ(oniguruma_to_pcre2("(?i:a)(?mi)b"), "(?i:a)(?si)b");
  EXPECT_EQ(oniguruma_to_pcre2("\\p{L}\\x{41}\\\\s"), "\\p{L}\\x{41}\\\\s");
  EXPECT_EQ(oniguruma_to_pcre2("[]s]"), "[]s]");
  // What PCRE2 cannot express is refused, saying what.
  auto refused = [](const char* pattern) {
    try {
      TextPattern::regex(pattern);
    } catch (const std::invalid_argument& e) {
      return std::string(e.what());
    }
    return std::string("accepted");
  };
  EXPECT_NE(refused("[a-z&&[^b]]").find("intersection"), std::string::npos);
  EXPECT_NE(refused("[a[b]]").find("a character class inside a character class"),
            std::string::npos);
  EXPECT_NE(refused("[\\W]").find("\\W inside a character class"), std::string::npos);
  EXPECT_NE(refused("(?y)a").find("inline option 'y'"), std::string::npos);
  EXPECT_NE(refused("\\u12").find("\\u without four"), std::string::npos);
  EXPECT_NE(refused("(a").find("offset"), std::string::npos);  // PCRE2's own message
  EXPECT_NE(refused("\\s\\p{Letter}").find("PCRE2 form"), std::string::npos)
      << "the translated form is quoted when it differs";
}

// libonig (Debian's libonig5, the Oniguruma that `tokenizers` runs, found with dlopen so the build
// needs no headers): what it matches, as the onig crate's find_iter reports it. Null when the
// library is not installed.
class Oniguruma {
 public:
  static const Oniguruma* get() {
    static const Oniguruma* instance = [] {
      void* lib = dlopen("libonig.so.5", RTLD_NOW);
      return lib ? new Oniguruma(lib) : nullptr;
    }();
    return instance;
  }

  // The [begin, end) of each match of `pattern` in `text`; nullopt when onig refuses the pattern.
  std::optional<std::vector<std::pair<size_t, size_t>>> matches(const std::string& pattern,
                                                                const std::string& text) const {
    using UChar = unsigned char;
    if (pattern != compiled_pattern_) {  // compiling is most of the cost: once per pattern
      if (compiled_) free_(compiled_);
      compiled_ = nullptr;
      compiled_pattern_ = pattern;
      const auto* p = reinterpret_cast<const UChar*>(pattern.data());
      void* error_info[3] = {};
      if (new_(&compiled_, p, p + pattern.size(), 0, utf8_, *default_syntax_, error_info) != 0) {
        compiled_ = nullptr;
      }
    }
    void* regex = compiled_;
    if (!regex) return std::nullopt;
    Region* region = region_new_();
    std::vector<std::pair<size_t, size_t>> out;
    const auto* s = reinterpret_cast<const UChar*>(text.data());
    const size_t n = text.size();
    size_t start = 0;
    std::optional<size_t> last_end;
    while (start <= n) {
      if (search_(regex, s, s + n, s + start, s + n, region, 0) < 0) break;
      const size_t b = region->beg[0], e = region->end[0];
      if (b == e && last_end == e) {  // the onig crate's rule for empty matches
        if (start >= n) break;
        uint32_t cp;
        start += utf8_decode(text.data() + start, n - start, &cp);
        continue;
      }
      out.emplace_back(b, e);
      start = e;
      last_end = e;
    }
    region_free_(region, 1);
    return out;
  }

 private:
  struct Region {  // OnigRegion
    int allocated, num_regs;
    int *beg, *end;
    void* history_root;
  };
  explicit Oniguruma(void* lib) {
    auto sym = [&](const char* name) {
      void* f = dlsym(lib, name);
      if (!f) throw std::runtime_error(std::string("libonig.so.5 lacks ") + name);
      return f;
    };
    utf8_ = sym("OnigEncodingUTF8");
    default_syntax_ = static_cast<void**>(sym("OnigDefaultSyntax"));
    new_ = reinterpret_cast<decltype(new_)>(sym("onig_new"));
    search_ = reinterpret_cast<decltype(search_)>(sym("onig_search"));
    free_ = reinterpret_cast<decltype(free_)>(sym("onig_free"));
    region_new_ = reinterpret_cast<decltype(region_new_)>(sym("onig_region_new"));
    region_free_ = reinterpret_cast<decltype(region_free_)>(sym("onig_region_free"));
    void* encodings[1] = {utf8_};
    reinterpret_cast<int (*)(void**, int)>(sym("onig_initialize"))(encodings, 1);
  }
  void* utf8_;
  void** default_syntax_;
  mutable std::string compiled_pattern_;
  mutable void* compiled_ = nullptr;
  int (*new_)(void**, const unsigned char*, const unsigned char*, unsigned, void*, void*, void*);
  int (*search_)(void*, const unsigned char*, const unsigned char*, const unsigned char*,
                 const unsigned char*, Region*, unsigned);
  void (*free_)(void*);
  Region* (*region_new_)();
  void (*region_free_)(Region*, int);
};

// Random text from characters where Oniguruma and PCRE2 could disagree: every kind of space,
// marks, connector punctuation, Latin-1 digits, numbers of other scripts, letters of many scripts,
// emoji sequences, contractions in both cases with the long s, line breaks.
std::vector<std::string> mixed_corpus(size_t count, uint64_t seed) {
  const std::vector<std::string> units = {"a",
                                          "Z",
                                          "k",
                                          "s",
                                          "0",
                                          "7",
                                          " ",
                                          " ",
                                          "  ",
                                          "\t",
                                          "\n",
                                          "\r\n",
                                          "\n\n",
                                          "!",
                                          "?",
                                          ".",
                                          ",",
                                          "'",
                                          "\"",
                                          "(",
                                          "]",
                                          "{",
                                          "-",
                                          "_",
                                          "/",
                                          "\\",
                                          "#",
                                          "$",
                                          "'s",
                                          "'S",
                                          "'ll",
                                          "'LL",
                                          "'re",
                                          "'Ve",
                                          "'d",
                                          "'M",
                                          "'t",
                                          "'\u017F",
                                          "\u017F",
                                          "\u212A",
                                          "\u00DF",
                                          "\u00A0",
                                          "\u3000",
                                          "\u180E",
                                          "\u2028",
                                          "\u0085",
                                          "\u200B",
                                          "\u200D",
                                          "\uFEFF",
                                          "\u2003",
                                          "\u1680",
                                          "\v",
                                          "\f",
                                          "\u0301",
                                          "\u0308",
                                          "\u093C",
                                          "\u094D",
                                          "\u0651",
                                          "\u20DD",
                                          "\u203F",
                                          "\uFE33",
                                          "\u00E9",
                                          "\u00C6",
                                          "\u65E5",
                                          "\u672C",
                                          "\uD55C",
                                          "\u0645",
                                          "\u0440",
                                          "\u03BB",
                                          "\u0939",
                                          "\u0E44",
                                          "\u05E9",
                                          "\u0661",
                                          "\uFF14",
                                          "\u00B2",
                                          "\u00B3",
                                          "\u00B9",
                                          "\u00BD",
                                          "\u00BE",
                                          "\u216B",
                                          "\u2460",
                                          "\u3007",
                                          "\U0001F469\U0001F3FD\u200D\U0001F4BB",
                                          "\U0001F44D\U0001F3FF",
                                          "\U0001F1EF\U0001F1F5",
                                          "\u2764\uFE0F",
                                          "\U0001D518",
                                          "\U00020000"};
  std::mt19937_64 rng(seed);
  std::vector<std::string> out;
  for (size_t i = 0; i < count; ++i) {
    std::string s;
    const size_t n = rng() % 48;
    for (size_t k = 0; k < n; ++k) s += units[rng() % units.size()];
    out.push_back(s);
  }
  return out;
}

// Issue 20: Split regexes run on PCRE2, `tokenizers` runs them on Oniguruma. Every match of the
// pre-tokenizer regexes of GPT-2, Llama 3, Qwen2, GPT-4o and DeepSeek-V3, and of patterns using
// each rewritten construct, must be the same on a mixed corpus and the fixtures' test strings.
TEST(PreTokenize, SameMatchesAsOniguruma) {
  const Oniguruma* onig = Oniguruma::get();
  if (!onig) GTEST_SKIP() << "libonig.so.5 not installed (apt-get install libonig5)";
  const std::vector<std::string> patterns = {
      kGpt2SplitRegex,
      kLlama3SplitRegex,
      kQwen2SplitRegex,
      R"([^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+)",
      R"([!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)",
      R"([一-龥぀-ゟ゠-ヿ]+)",
      R"(\w+|[^\w\s]+)",
      R"(\b\w+\b|\W)",
      R"(\h+|\H)",
      R"((?m).{1,5})",
      R"(^.+$|\d{,2})",
      R"(\S+|\s)",
      R"((?i)stra(ß|ss)e|kelvin|\u017F+)",
  };
  std::vector<std::string> texts = mixed_corpus(3000, 20);
  for (const char* variant : {"gpt2", "llama3", "qwen2", "spm_bpe"}) {
    std::ifstream in(std::string(ACCEL_TEST_DATA_DIR) + "/fixtures/bpe/" + variant +
                     "/expected.json");
    if (!in) continue;
    const nlohmann::json fixture = nlohmann::json::parse(in);  // outlives the loop below
    for (const auto& c : fixture["cases"]) texts.push_back(c["text"]);
  }
  size_t compared = 0;
  for (const std::string& pattern : patterns) {
    const TextPattern ours = TextPattern::regex(pattern);
    size_t differ = 0;
    for (const std::string& text : texts) {
      if (text.empty()) continue;  // tokenizers never searches empty text
      const auto expected = onig->matches(pattern, text);
      ASSERT_TRUE(expected) << "libonig refused " << pattern;
      std::vector<MatchSpan> spans;
      ours.find_matches(text, &spans);
      std::vector<std::pair<size_t, size_t>> got;
      for (const MatchSpan& m : spans) {
        if (m.is_match) got.emplace_back(m.begin, m.end);
      }
      if (got != *expected && differ++ < 3) {
        ADD_FAILURE() << "pattern " << pattern << "\ntext " << nlohmann::json(text).dump();
      }
      ++compared;
    }
    EXPECT_EQ(differ, 0u) << pattern;
  }
  EXPECT_GT(compared, 30000u);
}

TEST(PreTokenize, SplitBehaviorsAndInvert) {
  const TextPattern dash = TextPattern::literal("-");
  using B = SplitBehavior;
  EXPECT_EQ(split("a-b--c-", dash, B::Isolated), (Pieces{"a", "-", "b", "-", "-", "c", "-"}));
  EXPECT_EQ(split("a-b--c-", dash, B::Removed), (Pieces{"a", "b", "c"}));
  EXPECT_EQ(split("a-b--c-", dash, B::MergedWithPrevious), (Pieces{"a-", "b-", "-", "c-"}));
  EXPECT_EQ(split("-a-b--c", dash, B::MergedWithNext), (Pieces{"-a", "-b", "-", "-c"}));
  EXPECT_EQ(split("a-b--c-", dash, B::Contiguous), (Pieces{"a", "-", "b", "--", "c", "-"}));
  // invert: the gaps are the matches.
  EXPECT_EQ(split("a-b--c", dash, B::Removed, true), (Pieces{"-", "-", "-"}));
  EXPECT_EQ(split("ab-c", dash, B::MergedWithPrevious, true), (Pieces{"ab", "-c"}));
  const TextPattern digits = TextPattern::regex("\\d+");
  EXPECT_EQ(split("ab12cd345", digits, B::MergedWithNext), (Pieces{"ab", "12cd", "345"}));
  EXPECT_EQ(split("ab12cd345", digits, B::Removed, true), (Pieces{"12", "345"}));
  // Empty matches: one right after a match is skipped (the onig crate's find_iter).
  EXPECT_EQ(split("ab", TextPattern::regex("x*")), (Pieces{"a", "b"}));
  EXPECT_EQ(split("", dash), (Pieces{}));
  EXPECT_THROW(TextPattern::literal(""), std::invalid_argument);
}

TEST(PreTokenize, CatastrophicBacktrackingIsAnError) {
  const TextPattern p = TextPattern::regex("(a+)+\\d");
  std::vector<MatchSpan> spans;
  const std::string err = error_of([&] { p.find_matches(std::string(40, 'a'), &spans); });
  EXPECT_NE(err.find("regex matching failed: match limit exceeded"), std::string::npos) << err;
}

TEST(Unicode, NormalForms) {
  const auto nfc = [](const std::string& s) { return unicode_normalize(s, NormalForm::NFC); };
  const auto nfd = [](const std::string& s) { return unicode_normalize(s, NormalForm::NFD); };
  const auto nfkc = [](const std::string& s) { return unicode_normalize(s, NormalForm::NFKC); };
  const auto nfkd = [](const std::string& s) { return unicode_normalize(s, NormalForm::NFKD); };
  // Expected values from Python's unicodedata.normalize.
  EXPECT_EQ(nfc("e\u0301"), "\u00e9");
  EXPECT_EQ(nfd("\u00e9"), "e\u0301");
  EXPECT_EQ(nfc("cafe\u0301 A\u030a \u212b \u2126"), "caf\u00e9 \u00c5 \u00c5 \u03a9");
  EXPECT_EQ(nfc("\u1112\u1161\u11ab"), "\ud55c");  // Hangul jamo -> syllable
  EXPECT_EQ(nfd("\ud55c"), "\u1112\u1161\u11ab");
  // Canonical order: dot below (220) before acute (230); composition skips the blocked one.
  EXPECT_EQ(nfc("a\u0301\u0323"), "\u1ea1\u0301");
  EXPECT_EQ(nfd("\u1e69"), "s\u0323\u0307");
  EXPECT_EQ(nfc("s\u0307\u0323"), "\u1e69");
  // Composition exclusions stay decomposed; singletons map away.
  EXPECT_EQ(nfc("\u0958"), "\u0915\u093c");
  EXPECT_EQ(nfc("\u0344"), "\u0308\u0301");
  // Compatibility forms.
  EXPECT_EQ(nfkc("\ufb01 \uff76 \u00b2 \u2460 \u00a0"), "fi \u30ab 2 1  ");
  EXPECT_EQ(nfkd("\u01c4"), "DZ\u030c");
  EXPECT_EQ(nfc("\u01c4"), "\u01c4");
  EXPECT_EQ(nfkc("\u1e9b\u0323"), "\u1e69");
  // A mark after ASCII composes with it (the ASCII fast path must not cut them apart).
  EXPECT_EQ(nfc("abcde\u0301"), "abcd\u00e9");
  EXPECT_EQ(nfc("plain ascii"), "plain ascii");
  // Invalid UTF-8 stays as it is and blocks composition.
  EXPECT_EQ(nfc("e\xFF\u0301"), "e\xFF\u0301");
  EXPECT_EQ(nfc("\xC3"), "\xC3");
}

TEST(ByteTokenizer, RoundTrip) {
  auto t = make_tokenizer("byte");
  const std::string text("h\xC3\xA9llo\n\x00\xff!", 10);
  auto ids = t->encode(text);
  ASSERT_EQ(ids.size(), text.size());
  EXPECT_EQ(ids[1], 0xC3u);
  EXPECT_EQ(ids[7], 0u);
  EXPECT_EQ(ids[8], 0xFFu);
  EXPECT_EQ(t->decode(ids), text);
  EXPECT_EQ(t->vocab_size(), 256);
  EXPECT_FALSE(t->end_of_text_id());
  EXPECT_THROW(t->decode({256}), std::out_of_range);
}

TEST(ByteToUnicode, Gpt2Map) {
  EXPECT_EQ(byte_to_unicode(' '), 0x120u);   // Ġ
  EXPECT_EQ(byte_to_unicode('\n'), 0x10Au);  // Ċ
  EXPECT_EQ(byte_to_unicode('A'), static_cast<uint32_t>('A'));
  EXPECT_EQ(byte_to_unicode(0), 0x100u);
  EXPECT_EQ(byte_to_unicode(0xAD), 0x143u);
  EXPECT_EQ(byte_to_unicode(0xFF), 0xFFu);
}

// A tiny hand-written byte-level BPE: the 256 byte symbols get ids 0..255 in byte order, then
// merges build "he", "Ġt", "Ġthe", "in", "ing", ...
std::string symbol(uint8_t b) {
  std::string s;
  utf8_append(&s, byte_to_unicode(b));
  return s;
}

nlohmann::json tiny_tokenizer(const std::vector<std::pair<std::string, std::string>>& merges,
                              bool pair_form = false) {
  nlohmann::json vocab = nlohmann::json::object();
  for (int b = 0; b < 256; ++b) vocab[symbol(static_cast<uint8_t>(b))] = b;
  nlohmann::json m = nlohmann::json::array();
  int next = 256;
  for (const auto& [a, b] : merges) {
    if (!vocab.contains(a + b)) vocab[a + b] = next++;
    if (pair_form) {
      m.push_back({a, b});
    } else {
      m.push_back(a + " " + b);
    }
  }
  nlohmann::json j;
  j["version"] = "1.0";
  j["added_tokens"] = nlohmann::json::array(
      {{{"id", 300},
        {"content", "<|endoftext|>"},
        {"special", true},
        {"lstrip", false},
        {"rstrip", false},
        {"normalized", false},
        {"single_word", false}},
       {{"id", 301},
        {"content", "<mask>"},
        {"special", true},
        {"lstrip", true},
        {"rstrip", false},
        {"normalized", false},
        {"single_word", false}},
       {{"id", 302}, {"content", "<|endoftext|>!"}, {"special", true}, {"normalized", false}}});
  j["normalizer"] = nullptr;
  j["pre_tokenizer"] = {{"type", "ByteLevel"},
                        {"add_prefix_space", false},
                        {"trim_offsets", true},
                        {"use_regex", true}};
  j["post_processor"] = nullptr;
  j["decoder"] = {{"type", "ByteLevel"}};
  j["model"] = {{"type", "BPE"},
                {"dropout", nullptr},
                {"unk_token", nullptr},
                {"continuing_subword_prefix", nullptr},
                {"end_of_word_suffix", nullptr},
                {"fuse_unk", false},
                {"byte_fallback", false},
                {"vocab", vocab},
                {"merges", m}};
  return j;
}

const std::vector<std::pair<std::string, std::string>> kMerges = {
    {"Ġ", "t"}, {"h", "e"}, {"Ġt", "he"}, {"i", "n"}, {"in", "g"}, {"Ġ", "s"}, {"Ġs", "ing"}};

uint32_t id_of(const Tokenizer& t, const std::string& token) {
  auto id = t.token_to_id(token);
  EXPECT_TRUE(id) << token;
  return id.value_or(0);
}

TEST(BpeTokenizer, HandWrittenMergesApplyByRank) {
  for (bool pair_form : {false, true}) {
    auto t = load_bpe_tokenizer_from_json(tiny_tokenizer(kMerges, pair_form).dump(), "tiny");
    EXPECT_EQ(t->vocab_size(), 303);
    // "the": t h e -> (h e) -> [t, he]; " the": Ġ t h e -> Ġt, he -> Ġthe.
    EXPECT_EQ(t->encode("the the"),
              (std::vector<uint32_t>{'t', id_of(*t, "he"), id_of(*t, "Ġthe")}));
    EXPECT_EQ(t->encode(" sing"), (std::vector<uint32_t>{id_of(*t, "Ġsing")}));
    EXPECT_EQ(t->encode("singing"),
              (std::vector<uint32_t>{'s', id_of(*t, "ing"), id_of(*t, "ing")}));
    EXPECT_EQ(t->encode("a\n"), (std::vector<uint32_t>{'a', id_of(*t, "Ċ")}));
    EXPECT_EQ(id_of(*t, "Ċ"), 10u);
    for (const char* s :
         {"the the", " sing singing", "naïve café 日本語 🙂", "x\n\n  y", ""}) {
      EXPECT_EQ(t->decode(t->encode(s)), s);
    }
  }
}

TEST(BpeTokenizer, MergeOrderMatters) {
  // "abc" with (b c) ranked before (a b) -> [a, bc]; the other way round -> [ab, c].
  auto bc_first =
      load_bpe_tokenizer_from_json(tiny_tokenizer({{"b", "c"}, {"a", "b"}}).dump(), "x");
  EXPECT_EQ(bc_first->encode("abc"), (std::vector<uint32_t>{'a', id_of(*bc_first, "bc")}));
  auto ab_first =
      load_bpe_tokenizer_from_json(tiny_tokenizer({{"a", "b"}, {"b", "c"}}).dump(), "x");
  EXPECT_EQ(ab_first->encode("abc"), (std::vector<uint32_t>{id_of(*ab_first, "ab"), 'c'}));
  // Repeats merge left to right: "aaa" with (a a) -> [aa, a].
  auto aa = load_bpe_tokenizer_from_json(tiny_tokenizer({{"a", "a"}}).dump(), "x");
  EXPECT_EQ(aa->encode("aaaaa"), (std::vector<uint32_t>{id_of(*aa, "aa"), id_of(*aa, "aa"), 'a'}));
}

TEST(BpeTokenizer, IgnoreMergesTakesWholeWordsFromTheVocab) {
  auto j = tiny_tokenizer(kMerges);
  j["model"]["vocab"]["xyz"] = 299;  // no merges lead to it
  auto plain = load_bpe_tokenizer_from_json(j.dump(), "x");
  EXPECT_EQ(plain->encode("xyz"), (std::vector<uint32_t>{'x', 'y', 'z'}));
  j["model"]["ignore_merges"] = true;
  auto ignoring = load_bpe_tokenizer_from_json(j.dump(), "x");
  EXPECT_EQ(ignoring->encode("xyz"), (std::vector<uint32_t>{299}));
  EXPECT_EQ(ignoring->encode("the"), (std::vector<uint32_t>{'t', id_of(*ignoring, "he")}));
}

TEST(BpeTokenizer, AddedTokensAreSplitOutFirst) {
  auto t = load_bpe_tokenizer_from_json(tiny_tokenizer(kMerges).dump(), "tiny");
  EXPECT_EQ(t->end_of_text_id(), 300u);
  EXPECT_EQ(t->encode("the<|endoftext|>the"),
            (std::vector<uint32_t>{'t', id_of(*t, "he"), 300, 't', id_of(*t, "he")}));
  // Leftmost-longest: "<|endoftext|>!" beats "<|endoftext|>".
  EXPECT_EQ(t->encode("a<|endoftext|>!"), (std::vector<uint32_t>{'a', 302}));
  // lstrip: "<mask>" takes the spaces on its left.
  EXPECT_EQ(t->encode("a  <mask> b"), (std::vector<uint32_t>{'a', 301, id_of(*t, "Ġ"), 'b'}));
  EXPECT_EQ(t->decode({'a', 301, 300}), "a<mask><|endoftext|>");
  EXPECT_EQ(t->encode("<|endoftext|>"), (std::vector<uint32_t>{300}));
}

TEST(BpeTokenizer, SingleWordAndRstripAndNonSpecialAddedTokens) {
  auto j = tiny_tokenizer(kMerges);
  j["added_tokens"].push_back({{"id", 303},
                               {"content", "cat"},
                               {"special", false},
                               {"single_word", true},
                               {"normalized", true}});
  j["added_tokens"].push_back({{"id", 304},
                               {"content", "[R]"},
                               {"special", false},
                               {"rstrip", true},
                               {"normalized", true}});
  auto t = load_bpe_tokenizer_from_json(j.dump(), "x");
  EXPECT_EQ(t->encode("a cat"), (std::vector<uint32_t>{'a', id_of(*t, "Ġ"), 303}));
  EXPECT_EQ(t->encode("cats"), (std::vector<uint32_t>{'c', 'a', 't', 's'}));  // not a single word
  EXPECT_EQ(t->encode("[R]  x"), (std::vector<uint32_t>{304, 'x'}));
}

TEST(BpeTokenizer, DecodeReplacesBrokenUtf8) {
  auto t = load_bpe_tokenizer_from_json(tiny_tokenizer(kMerges).dump(), "x");
  // The first two bytes of "日" (E6 97 A5) then 'a': one U+FFFD for the incomplete sequence.
  EXPECT_EQ(t->decode({0xE6, 0x97, 'a'}),
            "\xEF\xBF\xBD"
            "a");
  EXPECT_EQ(t->decode({0xFF}), "\xEF\xBF\xBD");
  EXPECT_THROW(t->decode({299}), std::out_of_range);  // an unused id
}

TEST(BpeTokenizer, Llama3StyleSequence) {
  auto j = tiny_tokenizer(kMerges);
  j["pre_tokenizer"] = {
      {"type", "Sequence"},
      {"pretokenizers",
       {{{"type", "Split"},
         {"pattern", {{"Regex", kLlama3SplitRegex}}},
         {"behavior", "Isolated"},
         {"invert", false}},
        {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"use_regex", false}}}}};
  auto t = load_bpe_tokenizer_from_json(j.dump(), "x");
  // Llama 3 splits digits in threes: "12345" -> "123", "45"; bytes are unmerged digits.
  EXPECT_EQ(t->encode("12345"), (std::vector<uint32_t>{'1', '2', '3', '4', '5'}));
  EXPECT_EQ(t->encode("I'M the"), (std::vector<uint32_t>{'I', '\'', 'M', id_of(*t, "Ġthe")}));
}

TEST(BpeTokenizer, AddPrefixSpace) {
  auto j = tiny_tokenizer(kMerges);
  j["pre_tokenizer"]["add_prefix_space"] = true;
  auto t = load_bpe_tokenizer_from_json(j.dump(), "x");
  EXPECT_EQ(t->encode("the"), (std::vector<uint32_t>{id_of(*t, "Ġthe")}));
  EXPECT_EQ(t->encode(" the"), (std::vector<uint32_t>{id_of(*t, "Ġthe")}));
}

TEST(BpeTokenizer, MissingByteSymbolIsAnError) {
  auto j = tiny_tokenizer({});
  j["model"]["vocab"].erase(symbol('q'));
  auto t = load_bpe_tokenizer_from_json(j.dump(), "tok.json");
  EXPECT_EQ(t->encode("abc").size(), 3u);
  std::string err = error_of([&] { t->encode("quit"); });
  EXPECT_NE(err.find("tok.json"), std::string::npos) << err;
  EXPECT_NE(
      err.find("model.vocab has no token for 'q' (bytes 0x71) and model.unk_token is not set"),
      std::string::npos)
      << err;
}

TEST(BpeTokenizer, MalformedFilesNameTheFileAndField) {
  TempDir dir;
  auto check = [&](const std::string& text, const std::string& expected) {
    const std::string path = dir.file("tokenizer.json");
    write_bytes(path, text);
    std::string err;
    try {
      make_tokenizer(path);
    } catch (const std::runtime_error& e) {
      err = e.what();
    }
    EXPECT_NE(err.find(path), std::string::npos) << err;
    EXPECT_NE(err.find(expected), std::string::npos) << "expected '" << expected << "' in: " << err;
  };
  check("{\"model\": {", "not valid JSON");
  check("[1, 2]", "not a JSON object");
  check("{}", "missing 'model'");
  auto j = tiny_tokenizer(kMerges);
  auto no_vocab = j;
  no_vocab["model"].erase("vocab");
  check(no_vocab.dump(), "missing model.vocab");
  auto no_merges = j;
  no_merges["model"].erase("merges");
  check(no_merges.dump(), "missing model.merges");
  auto bad_merge = j;
  bad_merge["model"]["merges"].push_back("Ġthe zzz");
  check(bad_merge.dump(),
        "model.merges[7] (\"Ġthe zzz\") references 'zzz', which is not in model.vocab");
  auto bad_merge_form = j;
  bad_merge_form["model"]["merges"].push_back("a b c");
  check(bad_merge_form.dump(), "model.merges[7]");
  auto unmerged = j;
  unmerged["model"]["merges"].push_back("a b");  // "ab" is not in the vocab
  check(unmerged.dump(), "the merged token 'ab' is not in model.vocab");
  auto wordpiece = j;
  wordpiece["model"]["type"] = "WordPiece";
  check(wordpiece.dump(), "model.type is \"WordPiece\"");
  auto bad_id = j;
  bad_id["model"]["vocab"]["Ġthe"] = "x";
  check(bad_id.dump(), "model.vocab['Ġthe']");
  auto fallback = j;
  fallback["model"]["byte_fallback"] = "yes";
  check(fallback.dump(), "model.byte_fallback is \"yes\", not true or false");
  auto metaspace = j;
  metaspace["pre_tokenizer"] = {{"type", "Metaspace"}};
  check(metaspace.dump(), "pre_tokenizer.replacement is missing");
  auto other_regex = j;
  other_regex["pre_tokenizer"] = {
      {"type", "Sequence"},
      {"pretokenizers",
       {{{"type", "Split"}, {"pattern", {{"Regex", "[a-z&&[^b]]"}}}, {"behavior", "Isolated"}},
        {{"type", "ByteLevel"}, {"use_regex", false}}}}};
  check(other_regex.dump(),
        "pre_tokenizer.pretokenizers[0].pattern.Regex \"[a-z&&[^b]]\" is not supported: character "
        "class intersection && (at offset 4) has no PCRE2 equivalent");
  auto lowercase = j;
  lowercase["normalizer"] = {{"type", "Sequence"},
                             {"normalizers", {{{"type", "NFC"}}, {{"type", "Lowercase"}}}}};
  check(lowercase.dump(), "normalizer.normalizers[1].type 'Lowercase' is not supported");
  auto bad_added = j;
  bad_added["added_tokens"].push_back({{"content", "<x>"}});
  check(bad_added.dump(), "added_tokens[3] lacks a numeric 'id'");

  EXPECT_NE(error_of([&] { make_tokenizer(dir.file("nope.json")); }).find("no such file"),
            std::string::npos);
  // A folder holding a tokenizer.json works as the path.
  write_bytes(dir.file("tokenizer.json"), j.dump());
  EXPECT_EQ(make_tokenizer(dir.path().string())->vocab_size(), 303);
}

// Issue 26: two tokens with one id were accepted (the later silently replaced the earlier).
TEST(BpeTokenizer, TwoTokensWithOneIdAreRefused) {
  auto j = tiny_tokenizer(kMerges);
  auto twice = j;
  twice["model"]["vocab"]["zz"] = j["model"]["vocab"]["Ġthe"];
  const std::string id = std::to_string(j["model"]["vocab"]["Ġthe"].get<int>());
  std::string err = error_of([&] { load_bpe_tokenizer_from_json(twice.dump(), "t.json"); });
  EXPECT_NE(err.find("tokenizer 't.json': model.vocab gives id " + id + " to both 'zz' and 'Ġthe'"),
            std::string::npos)
      << err;
  auto added = j;
  added["added_tokens"].push_back({{"id", 301}, {"content", "<other>"}, {"special", true}});
  err = error_of([&] { load_bpe_tokenizer_from_json(added.dump(), "t.json"); });
  EXPECT_NE(
      err.find("added_tokens[3] gives id 301 to '<other>', which already belongs to '<mask>'"),
      std::string::npos)
      << err;
  // An added token that repeats its own vocab entry (as GPT-2's <|endoftext|> does) is fine.
  auto repeated = j;
  repeated["model"]["vocab"]["<|endoftext|>"] = 300;
  EXPECT_NO_THROW(load_bpe_tokenizer_from_json(repeated.dump(), "t.json"));
}

// Issue 26 #2: a normalizer nested 100,000 levels deep overflowed the stack when its text went
// into the error message.
TEST(BpeTokenizer, DeeplyNestedJsonIsAnError) {
  auto j = tiny_tokenizer(kMerges);
  std::string text = j.dump();
  const std::string deep = std::string(100000, '[') + std::string(100000, ']');
  text.replace(text.find("\"normalizer\":null"), 17, "\"normalizer\":" + deep);
  std::string err = error_of([&] { load_bpe_tokenizer_from_json(text, "t.json"); });
  EXPECT_NE(err.find("tokenizer 't.json': JSON nests arrays/objects deeper than"),
            std::string::npos)
      << err.substr(0, 300);
  // Shallow but huge: the message quotes an excerpt.
  j["normalizer"] = std::vector<int>(100000, 7);
  err = error_of([&] { load_bpe_tokenizer_from_json(j.dump(), "t.json"); });
  EXPECT_NE(err.find("normalizer has no 'type' ([7,7,7"), std::string::npos) << err.substr(0, 300);
  EXPECT_LT(err.size(), 300u);
}

TEST(BpeTokenizer, FingerprintFollowsContent) {
  auto a = load_bpe_tokenizer_from_json(tiny_tokenizer(kMerges).dump(), "a");
  auto b = load_bpe_tokenizer_from_json(tiny_tokenizer(kMerges).dump(), "b");
  auto c = load_bpe_tokenizer_from_json(tiny_tokenizer({{"a", "b"}}).dump(), "a");
  EXPECT_EQ(a->fingerprint(), b->fingerprint());
  EXPECT_NE(a->fingerprint(), c->fingerprint());
  EXPECT_NE(a->fingerprint(), make_byte_tokenizer()->fingerprint());
}

// A hand-written SentencePiece-style BPE as Llama 2 / Mistral ship it: <unk> <s> </s>, the byte
// tokens <0x00>..<0xFF> at ids 3..258, then "▁", "a", "b", "▁a", "ab", "▁ab".
constexpr uint32_t kByte0 = 3, kSpace = 259, kA = 260, kB = 261, kSpaceA = 262, kAB = 263,
                   kSpaceAB = 264;

nlohmann::json spm_tokenizer() {
  nlohmann::json vocab = {{"<unk>", 0}, {"<s>", 1}, {"</s>", 2}};
  for (int b = 0; b < 256; ++b) {
    char name[8];
    snprintf(name, sizeof(name), "<0x%02X>", b);
    vocab[name] = kByte0 + b;
  }
  vocab["▁"] = kSpace;
  vocab["a"] = kA;
  vocab["b"] = kB;
  vocab["▁a"] = kSpaceA;
  vocab["ab"] = kAB;
  vocab["▁ab"] = kSpaceAB;
  nlohmann::json j;
  j["added_tokens"] = nlohmann::json::array();
  for (int id = 0; id < 3; ++id) {
    const char* names[] = {"<unk>", "<s>", "</s>"};
    j["added_tokens"].push_back(
        {{"id", id}, {"content", names[id]}, {"special", true}, {"normalized", false}});
  }
  j["normalizer"] = {{"type", "Sequence"},
                     {"normalizers",
                      {{{"type", "Prepend"}, {"prepend", "▁"}},
                       {{"type", "Replace"}, {"pattern", {{"String", " "}}}, {"content", "▁"}}}}};
  j["pre_tokenizer"] = nullptr;
  j["decoder"] = {{"type", "Sequence"},
                  {"decoders",
                   {{{"type", "Replace"}, {"pattern", {{"String", "▁"}}}, {"content", " "}},
                    {{"type", "ByteFallback"}},
                    {{"type", "Fuse"}},
                    {{"type", "Strip"}, {"content", " "}, {"start", 1}, {"stop", 0}}}}};
  j["model"] = {{"type", "BPE"},    {"unk_token", "<unk>"},
                {"fuse_unk", true}, {"byte_fallback", true},
                {"vocab", vocab},   {"merges", {"▁ a", "a b", "▁a b"}}};
  return j;
}

using Ids = std::vector<uint32_t>;

TEST(SentencePieceBpe, PrependReplaceAndByteFallback) {
  auto t = load_bpe_tokenizer_from_json(spm_tokenizer().dump(), "spm");
  EXPECT_EQ(t->vocab_size(), 265);
  EXPECT_EQ(t->end_of_text_id(), 2u);
  EXPECT_EQ(t->encode("ab"), (Ids{kSpaceAB}));
  EXPECT_EQ(t->encode("a ab"), (Ids{kSpaceA, kSpaceAB}));
  EXPECT_EQ(t->encode(" a"), (Ids{kSpace, kSpaceA}));
  EXPECT_EQ(t->encode(""), (Ids{}));
  // 日 (E6 97 A5) is not in the vocab: its bytes.
  const Ids a_ri{kSpaceA, kSpace, kByte0 + 0xE6, kByte0 + 0x97, kByte0 + 0xA5};
  EXPECT_EQ(t->encode("a 日"), a_ri);
  EXPECT_EQ(t->decode(a_ri), "a 日");
  EXPECT_EQ(t->decode({kSpaceAB, kSpaceA}), "ab a");  // Strip takes the first space only
  // Byte tokens that are not UTF-8: one U+FFFD per byte token (ByteFallback), not per run.
  EXPECT_EQ(t->decode({kA, kByte0 + 0xE6, kByte0 + 0x97}), "a\uFFFD\uFFFD");
  EXPECT_EQ(t->decode({kByte0 + 'x'}), "x");
  // Special tokens are split out before normalization; each piece is normalized on its own.
  EXPECT_EQ(t->encode("<s>ab</s> a"), (Ids{1, kSpaceAB, 2, kSpace, kSpaceA}));
  EXPECT_EQ(t->decode({1, kSpaceAB, 2}), "<s> ab</s>");
}

TEST(SentencePieceBpe, UnknownCharactersWithoutByteTokens) {
  auto j = spm_tokenizer();
  j["model"]["byte_fallback"] = false;
  auto fused = load_bpe_tokenizer_from_json(j.dump(), "spm");
  EXPECT_EQ(fused->encode("日本a"), (Ids{kSpace, 0, kA}));  // one <unk> for the run
  j["model"]["fuse_unk"] = false;
  auto unfused = load_bpe_tokenizer_from_json(j.dump(), "spm");
  EXPECT_EQ(unfused->encode("日本a"), (Ids{kSpace, 0, 0, kA}));
  // byte_fallback with a byte token missing: that character becomes <unk>.
  auto missing = spm_tokenizer();
  missing["model"]["vocab"].erase("<0xE6>");
  auto m = load_bpe_tokenizer_from_json(missing.dump(), "spm");
  EXPECT_EQ(m->encode("日a"), (Ids{kSpace, 0, kA}));
  EXPECT_EQ(m->encode("é"), (Ids{kSpace, kByte0 + 0xC3, kByte0 + 0xA9}));
  // Neither: an error naming the character.
  auto none = spm_tokenizer();
  none["model"]["byte_fallback"] = false;
  none["model"]["unk_token"] = nullptr;
  auto n = load_bpe_tokenizer_from_json(none.dump(), "spm.json");
  const std::string err = error_of([&] { n->encode("a日"); });
  EXPECT_NE(err.find("tokenizer 'spm.json': model.vocab has no token for '日' (bytes 0xe6 0x97 "
                     "0xa5) and model.unk_token is not set"),
            std::string::npos)
      << err;
}

TEST(SentencePieceBpe, NormalizedAddedTokensMatchTheirNormalizedForm) {
  auto j = spm_tokenizer();
  j["added_tokens"].push_back({{"id", 265}, {"content", "b"}, {"normalized", true}});
  auto t = load_bpe_tokenizer_from_json(j.dump(), "spm");
  // "b" is looked for as "▁b" in the normalized text "▁ab▁b".
  EXPECT_EQ(t->encode("ab b"), (Ids{kSpaceAB, 265}));
  EXPECT_EQ(t->encode("bb"), (Ids{265, kB}));
}

TEST(SentencePieceBpe, MetaspacePreTokenizer) {
  auto j = spm_tokenizer();
  j["normalizer"] = nullptr;
  auto with = [&](const nlohmann::json& metaspace) {
    j["pre_tokenizer"] = metaspace;
    return load_bpe_tokenizer_from_json(j.dump(), "spm");
  };
  auto first = with(
      {{"type", "Metaspace"}, {"replacement", "▁"}, {"prepend_scheme", "first"}, {"split", false}});
  EXPECT_EQ(first->encode("ab"), (Ids{kSpaceAB}));
  EXPECT_EQ(first->encode("a ab"), (Ids{kSpaceA, kSpaceAB}));
  EXPECT_EQ(first->encode("<s>ab"), (Ids{1, kAB}));  // not at the start: nothing prepended
  auto always = with({{"type", "Metaspace"}, {"replacement", "▁"}, {"prepend_scheme", "always"}});
  EXPECT_EQ(always->encode("<s>ab"), (Ids{1, kSpaceAB}));
  // split (the default): each "▁" starts a word, so "▁a▁b" is two words.
  EXPECT_EQ(always->encode("a b"), (Ids{kSpaceA, kSpace, kB}));
  auto never = with({{"type", "Metaspace"}, {"replacement", "▁"}, {"add_prefix_space", false}});
  EXPECT_EQ(never->encode("ab"), (Ids{kAB}));
  EXPECT_NE(error_of([&] {
              with({{"type", "Metaspace"},
                    {"replacement", "▁"},
                    {"add_prefix_space", false},
                    {"prepend_scheme", "always"}});
            }).find("pre_tokenizer: add_prefix_space false contradicts prepend_scheme \"always\""),
            std::string::npos);
  EXPECT_NE(error_of([&] {
              with({{"type", "Metaspace"}, {"replacement", "ab"}});
            }).find("pre_tokenizer.replacement is \"ab\", not one character"),
            std::string::npos);
}

TEST(SentencePieceBpe, MetaspaceDecoderAndNoDecoder) {
  auto j = spm_tokenizer();
  j["decoder"] = {{"type", "Metaspace"}, {"replacement", "▁"}, {"prepend_scheme", "always"}};
  auto t = load_bpe_tokenizer_from_json(j.dump(), "spm");
  // In the first token every "▁" goes (as tokenizers does); later ones become spaces.
  EXPECT_EQ(t->decode({kSpaceA, kSpaceAB, kSpace}), "a ab ");
  j["decoder"]["prepend_scheme"] = "never";
  EXPECT_EQ(load_bpe_tokenizer_from_json(j.dump(), "spm")->decode({kSpaceA, kSpaceAB}), " a ab");
  // No decoder: tokenizers joins the tokens with spaces.
  j["decoder"] = nullptr;
  EXPECT_EQ(load_bpe_tokenizer_from_json(j.dump(), "spm")->decode({kSpaceA, kB}), "▁a b");
}

TEST(BpeTokenizer, Qwen2StyleNfcAndDigitSplit) {
  auto j = tiny_tokenizer(kMerges);
  j["normalizer"] = {{"type", "NFC"}};
  j["pre_tokenizer"] = {{"type", "Sequence"},
                        {"pretokenizers",
                         {{{"type", "Split"},
                           {"pattern", {{"Regex", kQwen2SplitRegex}}},
                           {"behavior", "Isolated"},
                           {"invert", false}},
                          {{"type", "ByteLevel"},
                           {"add_prefix_space", false},
                           {"trim_offsets", false},
                           {"use_regex", false}}}}};
  auto t = load_bpe_tokenizer_from_json(j.dump(), "x");
  EXPECT_EQ(t->encode("e\u0301"), t->encode("\u00e9"));
  EXPECT_EQ(t->encode("e\u0301"), (Ids{0xC3, 0xA9}));
  EXPECT_EQ(t->decode(t->encode("cafe\u0301 12")), "caf\u00e9 12");
  EXPECT_EQ(t->encode("12"), (Ids{'1', '2'}));
}

TEST(BpeTokenizer, UnsupportedFeaturesAreRefusedByName) {
  auto refused = [](const nlohmann::json& j) {
    return error_of([&] { load_bpe_tokenizer_from_json(j.dump(), "t.json"); });
  };
  auto expect = [&](const nlohmann::json& j, const std::string& what) {
    const std::string err = refused(j);
    EXPECT_NE(err.find("tokenizer 't.json': " + what), std::string::npos) << err;
  };
  auto j = tiny_tokenizer(kMerges);
  auto bert = j;
  bert["normalizer"] = {{"type", "BertNormalizer"}};
  expect(bert, "normalizer.type 'BertNormalizer' is not supported");
  auto whitespace = j;
  whitespace["pre_tokenizer"] = {
      {"type", "Sequence"}, {"pretokenizers", {{{"type", "Whitespace"}}, {{"type", "ByteLevel"}}}}};
  expect(whitespace, "pre_tokenizer.pretokenizers[0].type 'Whitespace' is not supported");
  auto after = j;
  after["pre_tokenizer"] = {
      {"type", "Sequence"},
      {"pretokenizers",
       {{{"type", "ByteLevel"}},
        {{"type", "Split"}, {"pattern", {{"String", " "}}}, {"behavior", "Isolated"}}}}};
  expect(after, "pre_tokenizer: a step after ByteLevel is not supported");
  auto behavior = j;
  behavior["pre_tokenizer"] = {
      {"type", "Split"}, {"pattern", {{"String", " "}}}, {"behavior", "Sideways"}};
  expect(behavior, "pre_tokenizer.behavior is \"Sideways\"; expected Isolated, Removed");
  auto pattern = j;
  pattern["pre_tokenizer"] = {{"type", "Split"}, {"pattern", "x"}, {"behavior", "Isolated"}};
  expect(pattern, "pre_tokenizer.pattern is \"x\", not {\"String\": ...} or {\"Regex\": ...}");
  auto wordpiece = j;
  wordpiece["decoder"] = {{"type", "Sequence"},
                          {"decoders", {{{"type", "Fuse"}}, {{"type", "WordPiece"}}}}};
  expect(wordpiece, "decoder.decoders[1].type 'WordPiece' is not supported");
  auto strip = j;
  strip["decoder"] = {{"type", "Strip"}, {"content", " "}, {"start", 1}};
  expect(strip, "decoder.stop is missing or not a non-negative integer");
  auto prefix = j;
  prefix["model"]["continuing_subword_prefix"] = "##";
  expect(prefix, "model.continuing_subword_prefix is set; not supported");
  auto empty_replace = j;
  empty_replace["normalizer"] = {
      {"type", "Replace"}, {"pattern", {{"String", ""}}}, {"content", "x"}};
  expect(empty_replace,
         "normalizer.pattern.String \"\" is not supported: the pattern is an empty string");
}

// Outputs of the `tokenizers` library for small trained tokenizers, made by
// tests/data/make_bpe_fixture.py where `tokenizers` is installed.
class BpeFixture : public ::testing::TestWithParam<std::string> {};

TEST_P(BpeFixture, MatchesHuggingFaceTokenizers) {
  const std::string dir = std::string(ACCEL_TEST_DATA_DIR) + "/fixtures/bpe/" + GetParam();
  if (!std::filesystem::exists(dir + "/expected.json")) {
    GTEST_SKIP() << "no fixture in " << dir
                 << "; make it with: python3 tests/data/make_bpe_fixture.py (needs the tokenizers "
                    "and transformers packages)";
  }
  auto t = load_bpe_tokenizer(dir + "/tokenizer.json");
  std::ifstream in(dir + "/expected.json");
  nlohmann::json expected = nlohmann::json::parse(in);
  EXPECT_EQ(t->vocab_size(), expected["vocab_size"].get<int64_t>());
  ASSERT_GT(expected["cases"].size(), 10u);
  if (GetParam().rfind("spm", 0) == 0) {
    // The layout of real checkpoints, and some cases must have fallen back to byte tokens.
    EXPECT_EQ(t->token_to_id("<0x00>"), 3u);
    EXPECT_EQ(t->token_to_id("<0xFF>"), 258u);
    size_t byte_cases = 0;
    for (const auto& c : expected["cases"]) {
      for (uint32_t id : c["ids"].get<std::vector<uint32_t>>()) {
        if (id >= 3 && id <= 258) {
          ++byte_cases;
          break;
        }
      }
    }
    EXPECT_GT(byte_cases, 5u);
  }
  for (const auto& c : expected["cases"]) {
    const std::string text = c["text"];
    const auto ids = c["ids"].get<std::vector<uint32_t>>();
    EXPECT_EQ(t->encode(text), ids) << "text: " << nlohmann::json(text).dump();
    EXPECT_EQ(t->decode(ids), c["decoded"].get<std::string>())
        << "text: " << nlohmann::json(text).dump();
  }
}

INSTANTIATE_TEST_SUITE_P(Variants, BpeFixture,
                         ::testing::Values("gpt2", "llama3", "qwen2", "spm_bpe", "spm_metaspace"));

}  // namespace
}  // namespace accel
