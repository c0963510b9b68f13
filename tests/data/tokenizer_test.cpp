#include "runtime/data/tokenizer.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "runtime/data/pretokenize.h"
#include "runtime/data/unicode.h"
#include "tests/data/test_util.h"

namespace accel {
namespace {

using testing::error_of;
using testing::TempDir;
using testing::write_bytes;

std::vector<std::string> split(const std::string& text, SplitPattern p) {
  std::vector<std::string_view> views;
  split_pretokens(text, p, &views);
  return std::vector<std::string>(views.begin(), views.end());
}

using Pieces = std::vector<std::string>;

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
  const auto g = SplitPattern::Gpt2;
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
  // Invalid UTF-8 is kept byte by byte, as "other" characters.
  EXPECT_EQ(split("ab\xFF\xFEz", g), (Pieces{"ab", "\xFF\xFE", "z"}));
}

TEST(PreTokenize, Llama3Pattern) {
  const auto l = SplitPattern::Llama3;
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
  EXPECT_NE(err.find("byte 0x71"), std::string::npos) << err;
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
  fallback["model"]["byte_fallback"] = true;
  check(fallback.dump(), "model.byte_fallback");
  auto metaspace = j;
  metaspace["pre_tokenizer"] = {{"type", "Metaspace"}};
  check(metaspace.dump(), "pre_tokenizer.type 'Metaspace' is not supported");
  auto no_pre = j;
  no_pre["pre_tokenizer"] = nullptr;
  check(no_pre.dump(), "pre_tokenizer is missing or null");
  auto other_regex = j;
  other_regex["pre_tokenizer"] = {
      {"type", "Sequence"},
      {"pretokenizers",
       {{{"type", "Split"}, {"pattern", {{"Regex", "\\w+"}}}, {"behavior", "Isolated"}},
        {{"type", "ByteLevel"}, {"use_regex", false}}}}};
  check(other_regex.dump(), "pre_tokenizer.pretokenizers[0].pattern.Regex");
  auto nfc = j;
  nfc["normalizer"] = {{"type", "NFC"}};
  check(nfc.dump(), "normalizer 'NFC' is not supported");
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
  EXPECT_NE(err.find("normalizer '[7,7,7"), std::string::npos) << err.substr(0, 300);
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

// Outputs of the `tokenizers` library for two small trained tokenizers, made by
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
  for (const auto& c : expected["cases"]) {
    const std::string text = c["text"];
    const auto ids = c["ids"].get<std::vector<uint32_t>>();
    EXPECT_EQ(t->encode(text), ids) << "text: " << nlohmann::json(text).dump();
    EXPECT_EQ(t->decode(ids), c["decoded"].get<std::string>())
        << "text: " << nlohmann::json(text).dump();
  }
}

INSTANTIATE_TEST_SUITE_P(Variants, BpeFixture, ::testing::Values("gpt2", "llama3"));

}  // namespace
}  // namespace accel
