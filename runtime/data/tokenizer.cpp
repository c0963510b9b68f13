#include "runtime/data/tokenizer.h"

#include <sys/stat.h>

#include <array>
#include <deque>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <queue>
#include <sstream>
#include <stdexcept>
#include <tuple>
#include <unordered_map>

#include "runtime/data/pretokenize.h"
#include "runtime/data/random.h"
#include "runtime/data/unicode.h"
#include "runtime/json.h"

namespace accel {

uint32_t byte_to_unicode(uint8_t b) {
  // Printable Latin-1 bytes keep their code point; the other 68 move to U+0100.. in byte order.
  static const std::array<uint32_t, 256> table = [] {
    std::array<uint32_t, 256> t{};
    uint32_t next = 256;
    for (int c = 0; c < 256; ++c) {
      bool keep = (c >= '!' && c <= '~') || (c >= 0xA1 && c <= 0xAC) || (c >= 0xAE && c <= 0xFF);
      t[c] = keep ? static_cast<uint32_t>(c) : next++;
    }
    return t;
  }();
  return table[b];
}

namespace {

std::string hex64(uint64_t v) {
  char buf[17];
  snprintf(buf, sizeof(buf), "%016llx", static_cast<unsigned long long>(v));
  return buf;
}

// Replaces each maximal invalid UTF-8 subsequence by U+FFFD (as Rust's from_utf8_lossy does).
std::string utf8_lossy(const std::string& s) {
  std::string out;
  out.reserve(s.size());
  const auto* u = reinterpret_cast<const unsigned char*>(s.data());
  const size_t n = s.size();
  size_t i = 0;
  while (i < n) {
    const unsigned char b = u[i];
    if (b < 0x80) {
      out.push_back(static_cast<char>(b));
      ++i;
      continue;
    }
    int need = 0;
    unsigned char lo = 0x80, hi = 0xBF;
    if (b >= 0xC2 && b <= 0xDF) {
      need = 1;
    } else if (b == 0xE0) {
      need = 2, lo = 0xA0;
    } else if ((b >= 0xE1 && b <= 0xEC) || b == 0xEE || b == 0xEF) {
      need = 2;
    } else if (b == 0xED) {
      need = 2, hi = 0x9F;
    } else if (b == 0xF0) {
      need = 3, lo = 0x90;
    } else if (b >= 0xF1 && b <= 0xF3) {
      need = 3;
    } else if (b == 0xF4) {
      need = 3, hi = 0x8F;
    }
    size_t j = i + 1;
    int got = 0;
    while (need > 0 && got < need && j < n) {
      const unsigned char c = u[j];
      const bool ok = got == 0 ? (c >= lo && c <= hi) : (c >= 0x80 && c <= 0xBF);
      if (!ok) break;
      ++j, ++got;
    }
    if (need > 0 && got == need) {
      out.append(s, i, j - i);
    } else {
      out.append("\xEF\xBF\xBD");
      if (need == 0) j = i + 1;
    }
    i = j;
  }
  return out;
}

class ByteTokenizer final : public Tokenizer {
 public:
  void encode(std::string_view text, std::vector<uint32_t>* out) const override {
    out->reserve(out->size() + text.size());
    for (unsigned char c : text) out->push_back(c);
  }
  std::string decode(const std::vector<uint32_t>& ids) const override {
    std::string s;
    s.reserve(ids.size());
    for (uint32_t id : ids) {
      if (id >= 256) {
        throw std::out_of_range("byte tokenizer: token id " + std::to_string(id) +
                                " is outside the vocabulary (vocab_size 256)");
      }
      s.push_back(static_cast<char>(id));
    }
    return s;
  }
  int64_t vocab_size() const override { return 256; }
  std::optional<uint32_t> token_to_id(const std::string& token) const override {
    if (token.size() == 1) return static_cast<unsigned char>(token[0]);
    return std::nullopt;
  }
  std::optional<uint32_t> end_of_text_id() const override { return std::nullopt; }
  std::string description() const override { return "byte-level (vocab 256)"; }
  std::string fingerprint() const override { return "byte-v1"; }
};

struct AddedToken {
  std::string content;
  std::string match;  // what is looked for: content, or content normalized when `normalized`
  uint32_t id = 0;
  bool single_word = false, lstrip = false, rstrip = false, normalized = true, special = false;
};

// tokenizer.json's normalizers, in order (a Sequence is flattened).
struct NormalizerStep {
  enum class Kind { Form, Prepend, Replace } kind = Kind::Form;
  NormalForm form = NormalForm::NFC;
  std::string text;     // Prepend: the prefix; Replace: the replacement
  TextPattern pattern;  // Replace
};

// Metaspace's prepend_scheme.
enum class Prepend { Always, First, Never };

// tokenizer.json's pre-tokenizers, in order (a Sequence is flattened).
struct PreTokStep {
  enum class Kind { Split, ByteLevel, Metaspace } kind = Kind::Split;
  TextPattern pattern;  // Split; ByteLevel with use_regex (the GPT-2 regex)
  SplitBehavior behavior = SplitBehavior::Isolated;
  bool invert = false;
  bool split = false;             // ByteLevel: use_regex; Metaspace: split
  bool add_prefix_space = false;  // ByteLevel
  std::string replacement;        // Metaspace: one character
  Prepend prepend = Prepend::Always;
};

// tokenizer.json's decoders, in order (a Sequence is flattened).
struct DecoderStep {
  enum class Kind {
    ByteLevel,
    Replace,
    ByteFallback,
    Fuse,
    Strip,
    Metaspace
  } kind = Kind::ByteLevel;
  TextPattern pattern;  // Replace
  std::string text;     // Replace: the replacement; Strip: the character; Metaspace: replacement
  size_t start = 0, stop = 0;  // Strip
  bool drop_first = false;     // Metaspace: prepend_scheme is not "never"
};

// A piece of text on its way through the pre-tokenizers. `at_start`: it begins at offset 0 of
// the encoded text (Metaspace's prepend_scheme "first" prepends only there).
struct Piece {
  std::string_view text;
  bool at_start;
};

// The UTF-8 characters of `s` (an invalid byte counts as one).
std::vector<std::string_view> utf8_chars(std::string_view s) {
  std::vector<std::string_view> out;
  for (size_t pos = 0; pos < s.size();) {
    uint32_t cp;
    const size_t len = utf8_decode(s.data() + pos, s.size() - pos, &cp);
    out.push_back(s.substr(pos, len));
    pos += len;
  }
  return out;
}

bool is_one_character(const std::string& s) { return !s.empty() && utf8_chars(s).size() == 1; }

std::string replace_all(std::string_view text, const TextPattern& pattern,
                        const std::string& content) {
  std::vector<MatchSpan> spans;
  pattern.find_matches(text, &spans);
  std::string out;
  out.reserve(text.size());
  for (const MatchSpan& m : spans) {
    if (m.is_match) {
      out += content;
    } else {
      out.append(text.substr(m.begin, m.end - m.begin));
    }
  }
  return out;
}

class BpeTokenizer final : public Tokenizer {
 public:
  BpeTokenizer(const nlohmann::json& j, std::string name, uint64_t content_hash);

  void encode(std::string_view text, std::vector<uint32_t>* out) const override;
  std::string decode(const std::vector<uint32_t>& ids) const override;
  int64_t vocab_size() const override { return static_cast<int64_t>(id_to_token_.size()); }
  std::optional<uint32_t> token_to_id(const std::string& token) const override {
    for (const AddedToken& t : added_) {
      if (t.content == token) return t.id;
    }
    auto it = vocab_.find(token);
    if (it == vocab_.end()) return std::nullopt;
    return it->second;
  }
  std::optional<uint32_t> end_of_text_id() const override { return eot_; }
  std::string description() const override {
    return "BPE '" + name_ + "' (vocab " + std::to_string(vocab_size()) + ")";
  }
  std::string fingerprint() const override { return "bpe-v1-" + hex64(hash_); }

 private:
  using Cache = std::unordered_map<std::string, std::vector<uint32_t>>;
  [[noreturn]] void fail(const std::string& what) const {
    throw std::runtime_error("tokenizer '" + name_ + "': " + what);
  }
  void parse_model(const nlohmann::json& model);
  void parse_added_tokens(const nlohmann::json& j);
  void parse_normalizer(const nlohmann::json& n, const std::string& where);
  void parse_pre_tokenizer(const nlohmann::json& pt, const std::string& where);
  void parse_decoder(const nlohmann::json& d, const std::string& where);
  TextPattern parse_pattern(const nlohmann::json& p, const std::string& where) const;
  Prepend parse_prepend_scheme(const nlohmann::json& m, const std::string& where) const;
  std::string one_character(const nlohmann::json& m, const char* key, const std::string& where,
                            const char* fallback) const;

  std::string normalize(std::string_view text) const;
  // Splits text by the added tokens of `group` (indices into added_); calls plain(view, offset)
  // for the text between them and token(id) for each match.
  void split_added(std::string_view text, const std::vector<size_t>& group,
                   const std::function<void(std::string_view, size_t)>& plain,
                   const std::function<void(uint32_t)>& token) const;
  void pre_tokenize(Piece text, std::deque<std::string>* owned, std::vector<Piece>* out) const;
  void encode_word(std::string_view word, Cache* cache, std::vector<uint32_t>* out) const;
  void merge_word(std::string_view word, std::vector<uint32_t>* out) const;
  void add_symbol(std::string_view unit, int64_t id, std::vector<uint32_t>* ids,
                  std::optional<uint32_t>* pending_unk) const;

  std::string name_;
  uint64_t hash_;
  std::unordered_map<std::string, uint32_t> vocab_;
  std::vector<std::string> id_to_token_;  // model tokens and added tokens; "" for unused ids
  std::vector<bool> id_used_;
  // (left id << 32 | right id) -> (rank, merged id)
  std::unordered_map<uint64_t, std::pair<uint32_t, uint32_t>> merges_;
  std::array<int64_t, 256> byte_ids_{};  // -1 when the vocab lacks the byte's symbol
  std::array<std::string, 256> byte_symbols_;
  std::array<int64_t, 256> fallback_ids_{};  // <0xNN> tokens for byte_fallback; -1 if absent
  std::optional<uint32_t> unk_id_;
  bool ignore_merges_ = false, byte_fallback_ = false, fuse_unk_ = false;
  bool byte_level_ = false;  // a ByteLevel pre-tokenizer: the model sees bytes as symbols
  std::vector<NormalizerStep> normalizers_;
  std::vector<PreTokStep> pre_tokenizers_;
  bool has_decoder_ = false;
  std::vector<DecoderStep> decoders_;
  std::vector<AddedToken> added_;
  std::vector<size_t> raw_added_, normalized_added_;  // matched on raw text, then in the gaps
  std::optional<uint32_t> eot_;
};

BpeTokenizer::BpeTokenizer(const nlohmann::json& j, std::string name, uint64_t content_hash)
    : name_(std::move(name)), hash_(content_hash) {
  if (!j.is_object()) fail("the top level is not a JSON object");
  if (!j.contains("model") || !j["model"].is_object()) fail("missing 'model' object");
  parse_model(j["model"]);
  if (j.contains("normalizer")) parse_normalizer(j["normalizer"], "normalizer");
  if (j.contains("pre_tokenizer")) parse_pre_tokenizer(j["pre_tokenizer"], "pre_tokenizer");
  for (size_t i = 0; i < pre_tokenizers_.size(); ++i) {
    if (pre_tokenizers_[i].kind == PreTokStep::Kind::ByteLevel) {
      if (i + 1 != pre_tokenizers_.size()) {
        fail("pre_tokenizer: a step after ByteLevel is not supported (ByteLevel must come last)");
      }
      byte_level_ = true;
    }
  }
  if (j.contains("decoder") && !j["decoder"].is_null()) {
    has_decoder_ = true;
    parse_decoder(j["decoder"], "decoder");
  }
  if (j.contains("added_tokens")) parse_added_tokens(j["added_tokens"]);

  for (const char* eot : {"<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>"}) {
    if (auto id = token_to_id(eot)) {
      eot_ = id;
      break;
    }
  }
}

void BpeTokenizer::parse_model(const nlohmann::json& model) {
  if (model.contains("type") && model["type"] != "BPE") {
    fail("model.type is " + json_excerpt(model["type"]) +
         "; only BPE models are supported (byte-level as GPT-2 / Llama 3 / Qwen2, or "
         "SentencePiece-style with byte_fallback as Llama 2 / Mistral)");
  }
  if (!model.contains("vocab") || !model["vocab"].is_object()) {
    fail("missing model.vocab (an object mapping token -> id)");
  }
  if (!model.contains("merges") || !model["merges"].is_array()) {
    fail("missing model.merges (a list of merges)");
  }
  if (model.contains("dropout") && !model["dropout"].is_null() &&
      !(model["dropout"].is_number() && model["dropout"].get<double>() == 0.0)) {
    fail("model.dropout is set; BPE dropout is not supported");
  }
  for (const char* key : {"continuing_subword_prefix", "end_of_word_suffix"}) {
    if (model.contains(key) && !model[key].is_null() &&
        !(model[key].is_string() && model[key].get<std::string>().empty())) {
      fail(std::string("model.") + key +
           " is set; not supported (no GPT-2 / Llama style BPE uses it)");
    }
  }
  for (const char* key : {"ignore_merges", "byte_fallback", "fuse_unk"}) {
    if (model.contains(key) && !model[key].is_boolean() && !model[key].is_null()) {
      fail(std::string("model.") + key + " is " + json_excerpt(model[key]) + ", not true or false");
    }
  }
  ignore_merges_ = model.value("ignore_merges", false);
  byte_fallback_ = model.value("byte_fallback", false);
  fuse_unk_ = model.value("fuse_unk", false);

  uint32_t max_id = 0;
  for (auto it = model["vocab"].begin(); it != model["vocab"].end(); ++it) {
    if (!it.value().is_number_unsigned()) {
      fail("model.vocab['" + text_excerpt(it.key()) + "'] is " + json_excerpt(it.value()) +
           ", not a non-negative integer id");
    }
    uint64_t id = it.value().get<uint64_t>();
    if (id >= (1ull << 31))
      fail("model.vocab['" + text_excerpt(it.key()) + "'] has an id too large");
    vocab_[it.key()] = static_cast<uint32_t>(id);
    max_id = std::max<uint32_t>(max_id, static_cast<uint32_t>(id));
  }
  if (vocab_.empty()) fail("model.vocab is empty");
  id_to_token_.assign(max_id + 1, std::string());
  id_used_.assign(max_id + 1, false);
  // In file order (nlohmann keeps keys sorted), so the message names the same pair every time.
  for (auto it = model["vocab"].begin(); it != model["vocab"].end(); ++it) {
    const uint32_t id = vocab_.at(it.key());
    if (id_used_[id])
      fail("model.vocab gives id " + std::to_string(id) + " to both '" +
           text_excerpt(id_to_token_[id]) + "' and '" + text_excerpt(it.key()) +
           "'; each token needs its own id");
    id_to_token_[id] = it.key();
    id_used_[id] = true;
  }

  for (int b = 0; b < 256; ++b) {
    std::string sym;
    utf8_append(&sym, byte_to_unicode(static_cast<uint8_t>(b)));
    auto it = vocab_.find(sym);
    byte_ids_[b] = it == vocab_.end() ? -1 : static_cast<int64_t>(it->second);
    byte_symbols_[b] = sym;
    char name[8];
    snprintf(name, sizeof(name), "<0x%02X>", b);  // as tokenizers spells them
    auto fb = vocab_.find(name);
    fallback_ids_[b] = fb == vocab_.end() ? -1 : static_cast<int64_t>(fb->second);
  }
  if (model.contains("unk_token") && !model["unk_token"].is_null()) {
    if (!model["unk_token"].is_string()) fail("model.unk_token is not a string");
    auto it = vocab_.find(model["unk_token"].get<std::string>());
    if (it == vocab_.end())
      fail("model.unk_token " + json_excerpt(model["unk_token"]) + " is not in model.vocab");
    unk_id_ = it->second;
  }

  const auto& merges = model["merges"];
  merges_.reserve(merges.size() * 2);
  for (size_t r = 0; r < merges.size(); ++r) {
    const auto& m = merges[r];
    std::string where = "model.merges[" + std::to_string(r) + "] (" + json_excerpt(m) + ")";
    std::string a, b;
    if (m.is_string()) {
      const std::string s = m.get<std::string>();
      size_t sp = s.find(' ');
      if (sp == std::string::npos || s.find(' ', sp + 1) != std::string::npos) {
        fail(where + " is not two tokens separated by one space");
      }
      a = s.substr(0, sp);
      b = s.substr(sp + 1);
    } else if (m.is_array() && m.size() == 2 && m[0].is_string() && m[1].is_string()) {
      a = m[0].get<std::string>();
      b = m[1].get<std::string>();
    } else {
      fail(where + " is neither \"a b\" nor [\"a\", \"b\"]");
    }
    auto ia = vocab_.find(a);
    if (ia == vocab_.end())
      fail(where + " references '" + text_excerpt(a) + "', which is not in model.vocab");
    auto ib = vocab_.find(b);
    if (ib == vocab_.end())
      fail(where + " references '" + text_excerpt(b) + "', which is not in model.vocab");
    auto im = vocab_.find(a + b);
    if (im == vocab_.end())
      fail(where + ": the merged token '" + text_excerpt(a + b) + "' is not in model.vocab");
    uint64_t key = (static_cast<uint64_t>(ia->second) << 32) | ib->second;
    merges_[key] = {static_cast<uint32_t>(r),
                    im->second};  // a repeated pair: the last wins, as in `tokenizers`
  }
}

void BpeTokenizer::parse_added_tokens(const nlohmann::json& j) {
  if (j.is_null()) return;
  if (!j.is_array()) fail("added_tokens is not a list");
  for (size_t i = 0; i < j.size(); ++i) {
    const auto& t = j[i];
    std::string where = "added_tokens[" + std::to_string(i) + "]";
    if (!t.is_object()) fail(where + " is not an object");
    if (!t.contains("id") || !t["id"].is_number_unsigned()) fail(where + " lacks a numeric 'id'");
    if (!t.contains("content") || !t["content"].is_string()) fail(where + " lacks 'content'");
    AddedToken a;
    a.content = t["content"].get<std::string>();
    uint64_t id = t["id"].get<uint64_t>();
    if (id >= (1ull << 31)) fail(where + " has an id too large");
    a.id = static_cast<uint32_t>(id);
    a.single_word = t.value("single_word", false);
    a.lstrip = t.value("lstrip", false);
    a.rstrip = t.value("rstrip", false);
    a.special = t.value("special", false);
    a.normalized = t.value("normalized", !a.special);
    if (a.content.empty()) continue;
    // A normalized token is looked for in normalized text, so in its normalized form.
    a.match = a.normalized ? normalize(a.content) : a.content;
    if (a.id >= id_to_token_.size()) {
      id_to_token_.resize(a.id + 1);
      id_used_.resize(a.id + 1, false);
    }
    // An added token may repeat its vocab entry (GPT-2's <|endoftext|>), not take another's id.
    if (id_used_[a.id] && id_to_token_[a.id] != a.content)
      fail(where + " gives id " + std::to_string(a.id) + " to '" + text_excerpt(a.content) +
           "', which already belongs to '" + text_excerpt(id_to_token_[a.id]) +
           "'; each token needs its own id");
    id_to_token_[a.id] = a.content;
    id_used_[a.id] = true;
    added_.push_back(a);
  }
  for (size_t i = 0; i < added_.size(); ++i) {
    if (added_[i].match.empty()) continue;  // normalized to nothing: never matches
    (added_[i].normalized ? normalized_added_ : raw_added_).push_back(i);
  }
}

std::string type_of(const nlohmann::json& j) {
  return j.is_object() && j.contains("type") && j["type"].is_string() ? j["type"].get<std::string>()
                                                                      : "";
}

TextPattern BpeTokenizer::parse_pattern(const nlohmann::json& p, const std::string& where) const {
  if (!p.is_object() || p.size() != 1 || !(p.contains("String") || p.contains("Regex")) ||
      !p.begin().value().is_string()) {
    fail(where + " is " + json_excerpt(p) + ", not {\"String\": ...} or {\"Regex\": ...}");
  }
  const std::string text = p.begin().value().get<std::string>();
  try {
    if (p.contains("String")) return TextPattern::literal(text);
    return TextPattern::regex(text);
  } catch (const std::invalid_argument& e) {
    fail(where + "." + p.begin().key() + " " + json_excerpt(nlohmann::json(text)) +
         " is not supported: " + e.what());
  }
}

void BpeTokenizer::parse_normalizer(const nlohmann::json& n, const std::string& where) {
  if (n.is_null()) return;
  const std::string type = type_of(n);
  if (type.empty()) fail(where + " has no 'type' (" + json_excerpt(n) + ")");
  NormalizerStep step;
  if (type == "Sequence") {
    if (!n.contains("normalizers") || !n["normalizers"].is_array())
      fail(where + ".normalizers is missing or not a list");
    for (size_t i = 0; i < n["normalizers"].size(); ++i) {
      parse_normalizer(n["normalizers"][i], where + ".normalizers[" + std::to_string(i) + "]");
    }
    return;
  } else if (type == "NFC" || type == "NFD" || type == "NFKC" || type == "NFKD") {
    step.kind = NormalizerStep::Kind::Form;
    step.form = type == "NFC"    ? NormalForm::NFC
                : type == "NFD"  ? NormalForm::NFD
                : type == "NFKC" ? NormalForm::NFKC
                                 : NormalForm::NFKD;
  } else if (type == "Prepend") {
    if (!n.contains("prepend") || !n["prepend"].is_string())
      fail(where + ".prepend is missing or not a string");
    step.kind = NormalizerStep::Kind::Prepend;
    step.text = n["prepend"].get<std::string>();
  } else if (type == "Replace") {
    if (!n.contains("content") || !n["content"].is_string())
      fail(where + ".content is missing or not a string");
    if (!n.contains("pattern")) fail(where + ".pattern is missing");
    step.kind = NormalizerStep::Kind::Replace;
    step.pattern = parse_pattern(n["pattern"], where + ".pattern");
    step.text = n["content"].get<std::string>();
  } else {
    fail(where + ".type '" + text_excerpt(type) +
         "' is not supported (supported normalizers: NFC, NFD, NFKC, NFKD, Prepend, Replace, "
         "Sequence)");
  }
  normalizers_.push_back(std::move(step));
}

Prepend BpeTokenizer::parse_prepend_scheme(const nlohmann::json& m,
                                           const std::string& where) const {
  // As tokenizers reads it: prepend_scheme (default "always"); the older add_prefix_space false
  // means "never".
  Prepend scheme = Prepend::Always;
  if (m.contains("prepend_scheme")) {
    const auto& s = m["prepend_scheme"];
    if (s == "always") {
      scheme = Prepend::Always;
    } else if (s == "first") {
      scheme = Prepend::First;
    } else if (s == "never") {
      scheme = Prepend::Never;
    } else {
      fail(where + ".prepend_scheme is " + json_excerpt(s) +
           ", not \"always\", \"first\" or \"never\"");
    }
  }
  if (m.contains("add_prefix_space") && m["add_prefix_space"] == false) {
    if (scheme != Prepend::Never && m.contains("prepend_scheme"))
      fail(where + ": add_prefix_space false contradicts prepend_scheme " +
           json_excerpt(m["prepend_scheme"]));
    scheme = Prepend::Never;
  }
  return scheme;
}

std::string BpeTokenizer::one_character(const nlohmann::json& m, const char* key,
                                        const std::string& where, const char* fallback) const {
  if (!m.contains(key)) {
    if (fallback) return fallback;
    fail(where + "." + key + " is missing");
  }
  if (!m[key].is_string() || !is_one_character(m[key].get<std::string>()))
    fail(where + "." + key + " is " + json_excerpt(m[key]) + ", not one character");
  return m[key].get<std::string>();
}

void BpeTokenizer::parse_pre_tokenizer(const nlohmann::json& p, const std::string& where) {
  if (p.is_null()) return;
  const std::string type = type_of(p);
  if (type.empty()) fail(where + " has no 'type' (" + json_excerpt(p) + ")");
  PreTokStep step;
  if (type == "Sequence") {
    if (!p.contains("pretokenizers") || !p["pretokenizers"].is_array())
      fail(where + ".pretokenizers is missing or not a list");
    for (size_t i = 0; i < p["pretokenizers"].size(); ++i) {
      parse_pre_tokenizer(p["pretokenizers"][i],
                          where + ".pretokenizers[" + std::to_string(i) + "]");
    }
    return;
  } else if (type == "Split") {
    step.kind = PreTokStep::Kind::Split;
    if (!p.contains("pattern")) fail(where + ".pattern is missing");
    step.pattern = parse_pattern(p["pattern"], where + ".pattern");
    const std::string behavior =
        p.contains("behavior") && p["behavior"].is_string() ? p["behavior"].get<std::string>() : "";
    // tokenizers writes these names; its reader also takes the snake_case ones.
    if (behavior == "Isolated" || behavior == "isolated") {
      step.behavior = SplitBehavior::Isolated;
    } else if (behavior == "Removed" || behavior == "removed") {
      step.behavior = SplitBehavior::Removed;
    } else if (behavior == "MergedWithPrevious" || behavior == "merged_with_previous") {
      step.behavior = SplitBehavior::MergedWithPrevious;
    } else if (behavior == "MergedWithNext" || behavior == "merged_with_next") {
      step.behavior = SplitBehavior::MergedWithNext;
    } else if (behavior == "Contiguous" || behavior == "contiguous") {
      step.behavior = SplitBehavior::Contiguous;
    } else {
      fail(where + ".behavior is " +
           (p.contains("behavior") ? json_excerpt(p["behavior"]) : "missing") +
           "; expected Isolated, Removed, MergedWithPrevious, MergedWithNext or Contiguous");
    }
    if (p.contains("invert") && !p["invert"].is_boolean())
      fail(where + ".invert is " + json_excerpt(p["invert"]) + ", not true or false");
    step.invert = p.value("invert", false);
  } else if (type == "ByteLevel") {
    step.kind = PreTokStep::Kind::ByteLevel;
    step.add_prefix_space = p.value("add_prefix_space", true);
    step.split = p.value("use_regex", true);
    if (step.split) step.pattern = TextPattern::regex(kGpt2SplitRegex);
  } else if (type == "Metaspace") {
    step.kind = PreTokStep::Kind::Metaspace;
    step.replacement = one_character(p, "replacement", where, nullptr);
    step.prepend = parse_prepend_scheme(p, where);
    step.split = p.value("split", true);
    step.pattern = TextPattern::literal(step.replacement);
  } else {
    fail(where + ".type '" + text_excerpt(type) +
         "' is not supported (supported pre-tokenizers: ByteLevel, Split, Metaspace, Sequence)");
  }
  pre_tokenizers_.push_back(std::move(step));
}

void BpeTokenizer::parse_decoder(const nlohmann::json& d, const std::string& where) {
  const std::string type = type_of(d);
  if (type.empty()) fail(where + " has no 'type' (" + json_excerpt(d) + ")");
  DecoderStep step;
  if (type == "Sequence") {
    if (!d.contains("decoders") || !d["decoders"].is_array())
      fail(where + ".decoders is missing or not a list");
    for (size_t i = 0; i < d["decoders"].size(); ++i) {
      parse_decoder(d["decoders"][i], where + ".decoders[" + std::to_string(i) + "]");
    }
    return;
  } else if (type == "ByteLevel") {
    step.kind = DecoderStep::Kind::ByteLevel;
  } else if (type == "Replace") {
    if (!d.contains("content") || !d["content"].is_string())
      fail(where + ".content is missing or not a string");
    if (!d.contains("pattern")) fail(where + ".pattern is missing");
    step.kind = DecoderStep::Kind::Replace;
    step.pattern = parse_pattern(d["pattern"], where + ".pattern");
    step.text = d["content"].get<std::string>();
  } else if (type == "ByteFallback") {
    step.kind = DecoderStep::Kind::ByteFallback;
  } else if (type == "Fuse") {
    step.kind = DecoderStep::Kind::Fuse;
  } else if (type == "Strip") {
    step.kind = DecoderStep::Kind::Strip;
    step.text = one_character(d, "content", where, nullptr);
    for (const char* key : {"start", "stop"}) {
      if (!d.contains(key) || !d[key].is_number_unsigned())
        fail(where + "." + key + " is missing or not a non-negative integer");
    }
    step.start = d["start"].get<size_t>();
    step.stop = d["stop"].get<size_t>();
  } else if (type == "Metaspace") {
    step.kind = DecoderStep::Kind::Metaspace;
    step.text = one_character(d, "replacement", where, nullptr);
    step.drop_first = parse_prepend_scheme(d, where) != Prepend::Never;
  } else {
    fail(where + ".type '" + text_excerpt(type) +
         "' is not supported (supported decoders: ByteLevel, Replace, ByteFallback, Fuse, Strip, "
         "Metaspace, Sequence)");
  }
  decoders_.push_back(std::move(step));
}

// The whitespace run that ends at `end` (text[start..end) all whitespace), as a start offset.
size_t whitespace_start_before(std::string_view text, size_t end) {
  size_t pos = end;
  while (pos > 0) {
    size_t k = pos - 1;
    while (k > 0 && (static_cast<unsigned char>(text[k]) & 0xC0) == 0x80) --k;
    uint32_t cp;
    size_t len = utf8_decode(text.data() + k, pos - k, &cp);
    if (k + len != pos || !is_whitespace(cp)) break;
    pos = k;
  }
  return pos;
}

size_t whitespace_end_after(std::string_view text, size_t start) {
  size_t pos = start;
  while (pos < text.size()) {
    uint32_t cp;
    size_t len = utf8_decode(text.data() + pos, text.size() - pos, &cp);
    if (!is_whitespace(cp)) break;
    pos += len;
  }
  return pos;
}

bool is_word_char(uint32_t cp) { return cp == '_' || is_letter(cp) || is_number(cp); }

bool ends_with_word(std::string_view text, size_t end) {
  if (end == 0) return false;
  size_t k = end - 1;
  while (k > 0 && (static_cast<unsigned char>(text[k]) & 0xC0) == 0x80) --k;
  uint32_t cp;
  utf8_decode(text.data() + k, end - k, &cp);
  return is_word_char(cp);
}

bool starts_with_word(std::string_view text, size_t start) {
  if (start >= text.size()) return false;
  uint32_t cp;
  utf8_decode(text.data() + start, text.size() - start, &cp);
  return is_word_char(cp);
}

void BpeTokenizer::split_added(std::string_view text, const std::vector<size_t>& group,
                               const std::function<void(std::string_view, size_t)>& plain,
                               const std::function<void(uint32_t)>& token) const {
  if (group.empty()) {
    if (!text.empty()) plain(text, 0);
    return;
  }
  std::array<bool, 256> first{};
  for (size_t g : group) first[static_cast<unsigned char>(added_[g].match[0])] = true;
  size_t done = 0;  // text[0..done) has been emitted
  size_t pos = 0;
  while (pos < text.size()) {
    if (!first[static_cast<unsigned char>(text[pos])]) {
      ++pos;
      continue;
    }
    const AddedToken* best = nullptr;  // longest match starting at pos
    for (size_t g : group) {
      const AddedToken& a = added_[g];
      if (a.match.size() <= text.size() - pos && text.compare(pos, a.match.size(), a.match) == 0 &&
          (!best || a.match.size() > best->match.size())) {
        best = &a;
      }
    }
    if (!best) {
      ++pos;
      continue;
    }
    size_t start = pos, stop = pos + best->match.size();
    pos = stop;
    if (best->single_word && (ends_with_word(text, start) || starts_with_word(text, stop))) {
      continue;
    }
    if (best->lstrip) start = std::max(whitespace_start_before(text, start), done);
    if (best->rstrip) stop = whitespace_end_after(text, stop);
    if (done < start) plain(text.substr(done, start - done), done);
    token(best->id);
    done = stop;
    pos = std::max(pos, stop);
  }
  if (done < text.size()) plain(text.substr(done), done);
}

std::string BpeTokenizer::normalize(std::string_view text) const {
  std::string s(text);
  for (const NormalizerStep& n : normalizers_) {
    switch (n.kind) {
      case NormalizerStep::Kind::Form:
        s = unicode_normalize(s, n.form);
        break;
      case NormalizerStep::Kind::Prepend:
        if (!s.empty()) s = n.text + s;
        break;
      case NormalizerStep::Kind::Replace:
        s = replace_all(s, n.pattern, n.text);
        break;
    }
  }
  return s;
}

void BpeTokenizer::encode(std::string_view text, std::vector<uint32_t>* out) const {
  Cache cache;
  std::deque<std::string> owned;  // normalized and rewritten texts the pieces point into
  std::vector<Piece> pieces;
  auto emit = [out](uint32_t id) { out->push_back(id); };
  split_added(
      text, raw_added_,
      [&](std::string_view gap, size_t gap_offset) {
        std::string_view normalized = gap;
        if (!normalizers_.empty()) {
          owned.push_back(normalize(gap));
          normalized = owned.back();
        }
        split_added(
            normalized, normalized_added_,
            [&](std::string_view plain, size_t offset) {
              pieces.clear();
              pre_tokenize({plain, gap_offset == 0 && offset == 0}, &owned, &pieces);
              for (const Piece& p : pieces) encode_word(p.text, &cache, out);
            },
            emit);
      },
      emit);
}

void BpeTokenizer::pre_tokenize(Piece text, std::deque<std::string>* owned,
                                std::vector<Piece>* out) const {
  std::vector<Piece> pieces{text}, next;
  std::vector<MatchSpan> spans;
  std::vector<std::pair<size_t, size_t>> cuts;
  // Splits `p` (whose text is `s`) by `pattern` into `next`.
  auto split = [&](std::string_view s, bool at_start, const TextPattern& pattern,
                   SplitBehavior behavior, bool invert) {
    spans.clear();
    cuts.clear();
    pattern.find_matches(s, &spans);
    split_spans(spans, behavior, invert, &cuts);
    for (const auto& [begin, end] : cuts) {
      next.push_back({s.substr(begin, end - begin), at_start && begin == 0});
    }
  };
  for (const PreTokStep& step : pre_tokenizers_) {
    next.clear();
    for (Piece p : pieces) {
      switch (step.kind) {
        case PreTokStep::Kind::Split:
          split(p.text, p.at_start, step.pattern, step.behavior, step.invert);
          break;
        case PreTokStep::Kind::ByteLevel:
          if (step.add_prefix_space && (p.text.empty() || p.text[0] != ' ')) {
            owned->push_back(" " + std::string(p.text));
            p.text = owned->back();
          }
          if (step.split) {
            split(p.text, p.at_start, step.pattern, SplitBehavior::Isolated, false);
          } else {
            next.push_back(p);
          }
          break;
        case PreTokStep::Kind::Metaspace: {
          std::string s = p.text.find(' ') == std::string_view::npos
                              ? std::string(p.text)
                              : replace_all(p.text, TextPattern::literal(" "), step.replacement);
          const bool starts = s.compare(0, step.replacement.size(), step.replacement) == 0;
          if (!starts &&
              (step.prepend == Prepend::Always || (step.prepend == Prepend::First && p.at_start))) {
            s = step.replacement + s;
          }
          owned->push_back(std::move(s));
          if (step.split) {
            split(owned->back(), p.at_start, step.pattern, SplitBehavior::MergedWithNext, false);
          } else {
            next.push_back({owned->back(), p.at_start});
          }
          break;
        }
      }
    }
    pieces.swap(next);
  }
  for (const Piece& p : pieces) {
    if (!p.text.empty()) out->push_back(p);
  }
}

void BpeTokenizer::encode_word(std::string_view word, Cache* cache,
                               std::vector<uint32_t>* out) const {
  if (word.empty()) return;
  if (ignore_merges_) {
    std::string sym;
    if (byte_level_) {
      for (unsigned char c : word) sym += byte_symbols_[c];
    } else {
      sym = word;
    }
    auto it = vocab_.find(sym);
    if (it != vocab_.end()) {
      out->push_back(it->second);
      return;
    }
  }
  constexpr size_t kMaxCachedWord = 256;
  if (word.size() > kMaxCachedWord) {
    merge_word(word, out);
    return;
  }
  std::string key(word);
  auto it = cache->find(key);
  if (it == cache->end()) {
    std::vector<uint32_t> ids;
    merge_word(word, &ids);
    if (cache->size() > (1u << 20)) cache->clear();
    it = cache->emplace(std::move(key), std::move(ids)).first;
  }
  out->insert(out->end(), it->second.begin(), it->second.end());
}

// One initial symbol of a word, as tokenizers' BPE builds them: the vocab id of `unit` (one byte
// symbol or one character), else its <0xNN> byte tokens (byte_fallback), else unk_token (one unk
// for a run of unknown units with fuse_unk).
void BpeTokenizer::add_symbol(std::string_view unit, int64_t id, std::vector<uint32_t>* ids,
                              std::optional<uint32_t>* pending_unk) const {
  if (id >= 0) {
    if (*pending_unk) ids->push_back(**pending_unk);
    pending_unk->reset();
    ids->push_back(static_cast<uint32_t>(id));
    return;
  }
  if (byte_fallback_) {
    bool all = true;
    for (unsigned char b : unit) all = all && fallback_ids_[b] >= 0;
    if (all) {
      // tokenizers adds the byte tokens without flushing a pending unk first.
      for (unsigned char b : unit) ids->push_back(static_cast<uint32_t>(fallback_ids_[b]));
      return;
    }
  }
  if (!unk_id_) {
    std::string shown;
    for (unsigned char b : unit) {
      char buf[8];
      snprintf(buf, sizeof(buf), "%s0x%02x", shown.empty() ? "" : " ", b);
      shown += buf;
    }
    fail("model.vocab has no token for '" + text_excerpt(std::string(unit)) + "' (bytes " + shown +
         ")" + (byte_fallback_ ? ", nor all of its <0xNN> byte tokens," : "") +
         " and model.unk_token is not set");
  }
  if (*pending_unk && !fuse_unk_) ids->push_back(**pending_unk);
  *pending_unk = *unk_id_;
}

void BpeTokenizer::merge_word(std::string_view word, std::vector<uint32_t>* out) const {
  std::vector<uint32_t> ids;
  ids.reserve(word.size());
  std::optional<uint32_t> pending_unk;
  if (byte_level_) {
    for (unsigned char c : word) add_symbol(byte_symbols_[c], byte_ids_[c], &ids, &pending_unk);
  } else {
    for (std::string_view ch : utf8_chars(word)) {
      auto it = vocab_.find(std::string(ch));
      add_symbol(ch, it == vocab_.end() ? -1 : static_cast<int64_t>(it->second), &ids,
                 &pending_unk);
    }
  }
  if (pending_unk) ids.push_back(*pending_unk);
  const int n = static_cast<int>(ids.size());
  if (n == 0) return;
  std::vector<int> prev(n), next(n);
  std::vector<bool> alive(n, true);
  for (int i = 0; i < n; ++i) {
    prev[i] = i - 1;
    next[i] = i + 1 < n ? i + 1 : -1;
  }
  // (rank, left position, left id, right id): lowest rank first, then leftmost.
  using Cand = std::tuple<uint32_t, int, uint32_t, uint32_t>;
  std::priority_queue<Cand, std::vector<Cand>, std::greater<Cand>> heap;
  auto push = [&](int left) {
    if (left < 0 || next[left] < 0) return;
    uint32_t a = ids[left], b = ids[next[left]];
    auto it = merges_.find((static_cast<uint64_t>(a) << 32) | b);
    if (it != merges_.end()) heap.emplace(it->second.first, left, a, b);
  };
  for (int i = 0; i + 1 < n; ++i) push(i);
  while (!heap.empty()) {
    auto [rank, left, a, b] = heap.top();
    heap.pop();
    int right = next[left];
    if (!alive[left] || right < 0 || ids[left] != a || ids[right] != b) continue;  // stale
    ids[left] = merges_.at((static_cast<uint64_t>(a) << 32) | b).second;
    alive[right] = false;
    next[left] = next[right];
    if (next[right] >= 0) prev[next[right]] = left;
    push(prev[left]);
    push(left);
  }
  for (int i = 0; i >= 0; i = next[i]) out->push_back(ids[i]);
}

// ByteLevel decoder: each token's symbols back to bytes (a token with a symbol outside the map,
// such as an added "<|x y|>", is taken as it is), all joined, invalid UTF-8 replaced.
std::vector<std::string> decode_byte_level(const std::vector<std::string>& tokens) {
  static const std::array<int16_t, 324> unicode_to_byte = [] {
    std::array<int16_t, 324> t;
    t.fill(-1);
    for (int b = 0; b < 256; ++b)
      t[byte_to_unicode(static_cast<uint8_t>(b))] = static_cast<int16_t>(b);
    return t;
  }();
  std::string bytes, raw;
  for (const std::string& tok : tokens) {
    raw.clear();
    bool mapped = true;
    for (size_t pos = 0; pos < tok.size();) {
      uint32_t cp;
      pos += utf8_decode(tok.data() + pos, tok.size() - pos, &cp);
      if (cp >= unicode_to_byte.size() || unicode_to_byte[cp] < 0) {
        mapped = false;
        break;
      }
      raw.push_back(static_cast<char>(unicode_to_byte[cp]));
    }
    bytes += mapped ? raw : tok;
  }
  return {utf8_lossy(bytes)};
}

// ByteFallback decoder: runs of <0xNN> tokens become their bytes when those are valid UTF-8, else
// one U+FFFD per byte token.
std::vector<std::string> decode_byte_fallback(const std::vector<std::string>& tokens) {
  auto hex = [](char c) -> int {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
  };
  // Rust's u8::from_str_radix(token[3..5], 16), which also takes "+F".
  auto byte_of = [&](const std::string& t) -> int {
    if (t.size() != 6 || t.compare(0, 3, "<0x") != 0 || t[5] != '>') return -1;
    if (t[3] == '+') return hex(t[4]);
    const int hi = hex(t[3]), lo = hex(t[4]);
    return hi < 0 || lo < 0 ? -1 : hi * 16 + lo;
  };
  std::vector<std::string> out;
  std::string bytes;
  size_t count = 0;
  auto flush = [&] {
    if (count == 0) return;
    if (utf8_lossy(bytes) == bytes) {
      out.push_back(bytes);
    } else {
      for (size_t k = 0; k < count; ++k) out.push_back("\xEF\xBF\xBD");
    }
    bytes.clear();
    count = 0;
  };
  for (const std::string& t : tokens) {
    const int b = byte_of(t);
    if (b >= 0) {
      bytes.push_back(static_cast<char>(b));
      ++count;
    } else {
      flush();
      out.push_back(t);
    }
  }
  flush();
  return out;
}

// Strip decoder: up to `start` leading and `stop` trailing copies of the character, per token.
std::string strip_token(const std::string& token, const std::string& c, size_t start, size_t stop) {
  const std::vector<std::string_view> chars = utf8_chars(token);
  size_t begin = 0, end = chars.size();
  while (begin < start && begin < chars.size() && chars[begin] == c) ++begin;
  for (size_t k = 0; k < stop && end > begin && chars[end - 1] == c; ++k) --end;
  std::string out;
  for (size_t k = begin; k < end; ++k) out.append(chars[k]);
  return out;
}

std::string BpeTokenizer::decode(const std::vector<uint32_t>& ids) const {
  std::vector<std::string> tokens;
  tokens.reserve(ids.size());
  for (uint32_t id : ids) {
    if (id >= id_to_token_.size() || !id_used_[id]) {
      throw std::out_of_range("tokenizer '" + name_ + "': token id " + std::to_string(id) +
                              " is not in the vocabulary (vocab_size " +
                              std::to_string(vocab_size()) + ")");
    }
    tokens.push_back(id_to_token_[id]);
  }
  std::string text;
  if (!has_decoder_) {  // tokenizers joins the tokens with spaces
    for (size_t i = 0; i < tokens.size(); ++i) text += (i ? " " : "") + tokens[i];
    return text;
  }
  for (const DecoderStep& d : decoders_) {
    switch (d.kind) {
      case DecoderStep::Kind::ByteLevel:
        tokens = decode_byte_level(tokens);
        break;
      case DecoderStep::Kind::Replace:
        for (std::string& t : tokens) t = replace_all(t, d.pattern, d.text);
        break;
      case DecoderStep::Kind::ByteFallback:
        tokens = decode_byte_fallback(tokens);
        break;
      case DecoderStep::Kind::Fuse: {
        std::string all;
        for (const std::string& t : tokens) all += t;
        tokens.assign(1, all);
        break;
      }
      case DecoderStep::Kind::Strip:
        for (std::string& t : tokens) t = strip_token(t, d.text, d.start, d.stop);
        break;
      case DecoderStep::Kind::Metaspace:
        // The replacement becomes a space; in the first token it is dropped (all of them, as
        // tokenizers does) unless prepend_scheme is "never".
        for (size_t i = 0; i < tokens.size(); ++i) {
          tokens[i] = replace_all(tokens[i], TextPattern::literal(d.text),
                                  i == 0 && d.drop_first ? "" : " ");
        }
        break;
    }
  }
  for (const std::string& t : tokens) text += t;
  return text;
}

std::string read_file(const std::string& path, const std::string& what) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::runtime_error(what + " '" + path + "': cannot open the file");
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

}  // namespace

std::unique_ptr<Tokenizer> make_byte_tokenizer() { return std::make_unique<ByteTokenizer>(); }

std::unique_ptr<Tokenizer> load_bpe_tokenizer_from_json(const std::string& json_text,
                                                        const std::string& name) {
  // JsonError's message starts "tokenizer 'NAME': ".
  const nlohmann::json j = parse_json(json_text, "tokenizer '" + name + "'");
  try {
    return std::make_unique<BpeTokenizer>(j, name, fnv1a64(json_text));
  } catch (const nlohmann::json::exception& e) {
    // A field of the wrong JSON type that the checks above did not anticipate.
    throw std::runtime_error("tokenizer '" + name + "': malformed field (" + e.what() + ")");
  }
}

std::unique_ptr<Tokenizer> load_bpe_tokenizer(const std::string& path) {
  return load_bpe_tokenizer_from_json(read_file(path, "tokenizer"), path);
}

std::unique_ptr<Tokenizer> make_tokenizer(const std::string& spec) {
  if (spec == "byte") return make_byte_tokenizer();
  struct stat st;
  if (stat(spec.c_str(), &st) != 0) {
    throw std::runtime_error("tokenizer '" + spec +
                             "': no such file (expected 'byte' or the path of a Hugging Face "
                             "tokenizer.json)");
  }
  if (S_ISDIR(st.st_mode)) {
    std::string file = spec + "/tokenizer.json";
    if (stat(file.c_str(), &st) != 0) {
      throw std::runtime_error("tokenizer '" + spec + "' is a folder without a tokenizer.json");
    }
    return load_bpe_tokenizer(file);
  }
  return load_bpe_tokenizer(spec);
}

}  // namespace accel
