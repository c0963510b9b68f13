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
  uint32_t id = 0;
  bool single_word = false, lstrip = false, rstrip = false, normalized = true, special = false;
};

// One pre-tokenizer step: optionally prepend a space to each piece, optionally split it by a
// pattern. ByteLevel(add_prefix_space, use_regex) and Split(pattern) are both of this form.
struct PreTokStep {
  bool add_prefix_space = false;
  bool split = false;
  SplitPattern pattern = SplitPattern::Gpt2;
};

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
  void parse_pre_tokenizer(const nlohmann::json& pt);
  void parse_split(const nlohmann::json& s, const std::string& where);

  // Splits text by the added tokens of `group` (indices into added_); calls plain(view) for the
  // text between them and token(id) for each match.
  void split_added(std::string_view text, const std::vector<size_t>& group,
                   const std::function<void(std::string_view)>& plain,
                   const std::function<void(uint32_t)>& token) const;
  void encode_plain(std::string_view text, Cache* cache, std::vector<uint32_t>* out) const;
  void encode_word(std::string_view word, Cache* cache, std::vector<uint32_t>* out) const;
  void merge_word(std::string_view word, std::vector<uint32_t>* out) const;

  std::string name_;
  uint64_t hash_;
  std::unordered_map<std::string, uint32_t> vocab_;
  std::vector<std::string> id_to_token_;  // model tokens and added tokens; "" for unused ids
  std::vector<bool> id_used_;
  // (left id << 32 | right id) -> (rank, merged id)
  std::unordered_map<uint64_t, std::pair<uint32_t, uint32_t>> merges_;
  std::array<int64_t, 256> byte_ids_{};  // -1 when the vocab lacks the byte's symbol
  std::array<std::string, 256> byte_symbols_;
  std::optional<uint32_t> unk_id_;
  bool ignore_merges_ = false;
  std::vector<PreTokStep> steps_;
  std::vector<AddedToken> added_;
  std::vector<size_t> raw_added_, normalized_added_;  // matched on raw text, then in the gaps
  std::optional<uint32_t> eot_;
};

BpeTokenizer::BpeTokenizer(const nlohmann::json& j, std::string name, uint64_t content_hash)
    : name_(std::move(name)), hash_(content_hash) {
  if (!j.is_object()) fail("the top level is not a JSON object");
  if (!j.contains("model") || !j["model"].is_object()) fail("missing 'model' object");
  parse_model(j["model"]);

  if (j.contains("normalizer") && !j["normalizer"].is_null()) {
    const auto& n = j["normalizer"];
    bool empty_sequence = n.is_object() && n.value("type", "") == "Sequence" &&
                          n.contains("normalizers") && n["normalizers"].is_array() &&
                          n["normalizers"].empty();
    if (!empty_sequence) {
      fail("normalizer '" + (n.is_object() ? text_excerpt(n.value("type", "?")) : json_excerpt(n)) +
           "' is not supported (byte-level BPE tokenizers have normalizer null)");
    }
  }
  if (!j.contains("pre_tokenizer") || j["pre_tokenizer"].is_null()) {
    fail(
        "pre_tokenizer is missing or null; only byte-level BPE (a ByteLevel pre-tokenizer) is "
        "supported");
  }
  parse_pre_tokenizer(j["pre_tokenizer"]);
  if (j.contains("decoder") && !j["decoder"].is_null()) {
    const auto& d = j["decoder"];
    if (!d.is_object() || d.value("type", "") != "ByteLevel") {
      fail("decoder '" + (d.is_object() ? text_excerpt(d.value("type", "?")) : json_excerpt(d)) +
           "' is not supported (expected ByteLevel)");
    }
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
         "; only byte-level BPE models are supported (GPT-2, Llama 3 style)");
  }
  if (!model.contains("vocab") || !model["vocab"].is_object()) {
    fail("missing model.vocab (an object mapping token -> id)");
  }
  if (!model.contains("merges") || !model["merges"].is_array()) {
    fail("missing model.merges (a list of merges)");
  }
  if (model.value("byte_fallback", false)) {
    fail(
        "model.byte_fallback is true (a SentencePiece-style BPE); only byte-level BPE is "
        "supported");
  }
  if (model.contains("dropout") && !model["dropout"].is_null() &&
      !(model["dropout"].is_number() && model["dropout"].get<double>() == 0.0)) {
    fail("model.dropout is set; BPE dropout is not supported");
  }
  for (const char* key : {"continuing_subword_prefix", "end_of_word_suffix"}) {
    if (model.contains(key) && !model[key].is_null() &&
        !(model[key].is_string() && model[key].get<std::string>().empty())) {
      fail(std::string("model.") + key + " is set; byte-level BPE does not use it");
    }
  }
  ignore_merges_ = model.value("ignore_merges", false);

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
    (added_[i].normalized ? normalized_added_ : raw_added_).push_back(i);
  }
}

void BpeTokenizer::parse_split(const nlohmann::json& s, const std::string& where) {
  PreTokStep step;
  step.split = true;
  if (!s.contains("pattern") || !s["pattern"].is_object() || !s["pattern"].contains("Regex")) {
    fail(where + ".pattern is not a {\"Regex\": ...} object (string patterns are not supported)");
  }
  const std::string re = s["pattern"]["Regex"].get<std::string>();
  if (re == kGpt2SplitRegex) {
    step.pattern = SplitPattern::Gpt2;
  } else if (re == kLlama3SplitRegex) {
    step.pattern = SplitPattern::Llama3;
  } else {
    fail(where + ".pattern.Regex " + nlohmann::json(re).dump() +
         " is not supported (supported: the GPT-2 and the Llama 3 pre-tokenizer regex)");
  }
  std::string behavior = s.value("behavior", "Isolated");
  if (behavior != "Isolated") {
    fail(where + ".behavior is '" + text_excerpt(behavior) + "'; only Isolated is supported");
  }
  if (s.value("invert", false)) fail(where + ".invert is true; not supported");
  steps_.push_back(step);
}

void BpeTokenizer::parse_pre_tokenizer(const nlohmann::json& pt) {
  std::vector<std::pair<nlohmann::json, std::string>> parts;
  if (pt.is_object() && pt.value("type", "") == "Sequence") {
    if (!pt.contains("pretokenizers") || !pt["pretokenizers"].is_array()) {
      fail("pre_tokenizer.pretokenizers is missing");
    }
    for (size_t i = 0; i < pt["pretokenizers"].size(); ++i) {
      parts.emplace_back(pt["pretokenizers"][i],
                         "pre_tokenizer.pretokenizers[" + std::to_string(i) + "]");
    }
  } else {
    parts.emplace_back(pt, "pre_tokenizer");
  }
  bool byte_level = false;
  for (const auto& [p, where] : parts) {
    if (!p.is_object() || !p.contains("type")) fail(where + " has no 'type'");
    const std::string type = p["type"].get<std::string>();
    if (type == "Split") {
      if (byte_level) fail(where + ": a Split after ByteLevel is not supported");
      parse_split(p, where);
    } else if (type == "ByteLevel") {
      if (byte_level) fail(where + ": more than one ByteLevel step");
      byte_level = true;
      PreTokStep step;
      step.add_prefix_space = p.value("add_prefix_space", true);
      step.split = p.value("use_regex", true);
      step.pattern = SplitPattern::Gpt2;
      steps_.push_back(step);
    } else {
      fail(where + ".type '" + text_excerpt(type) +
           "' is not supported (supported: ByteLevel, Split with the GPT-2 or Llama 3 regex)");
    }
  }
  if (!byte_level) {
    fail("pre_tokenizer has no ByteLevel step; only byte-level BPE tokenizers are supported");
  }
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
                               const std::function<void(std::string_view)>& plain,
                               const std::function<void(uint32_t)>& token) const {
  if (group.empty()) {
    if (!text.empty()) plain(text);
    return;
  }
  std::array<bool, 256> first{};
  for (size_t g : group) first[static_cast<unsigned char>(added_[g].content[0])] = true;
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
      if (a.content.size() <= text.size() - pos &&
          text.compare(pos, a.content.size(), a.content) == 0 &&
          (!best || a.content.size() > best->content.size())) {
        best = &a;
      }
    }
    if (!best) {
      ++pos;
      continue;
    }
    size_t start = pos, stop = pos + best->content.size();
    pos = stop;
    if (best->single_word && (ends_with_word(text, start) || starts_with_word(text, stop))) {
      continue;
    }
    if (best->lstrip) start = std::max(whitespace_start_before(text, start), done);
    if (best->rstrip) stop = whitespace_end_after(text, stop);
    if (done < start) plain(text.substr(done, start - done));
    token(best->id);
    done = stop;
    pos = std::max(pos, stop);
  }
  if (done < text.size()) plain(text.substr(done));
}

void BpeTokenizer::encode(std::string_view text, std::vector<uint32_t>* out) const {
  Cache cache;
  auto emit = [out](uint32_t id) { out->push_back(id); };
  split_added(
      text, raw_added_,
      [&](std::string_view gap) {
        split_added(
            gap, normalized_added_,
            [&](std::string_view plain) { encode_plain(plain, &cache, out); }, emit);
      },
      emit);
}

void BpeTokenizer::encode_plain(std::string_view text, Cache* cache,
                                std::vector<uint32_t>* out) const {
  std::vector<std::string_view> pieces{text}, next;
  std::deque<std::string> owned;  // prefixed copies the views point into
  for (const PreTokStep& step : steps_) {
    next.clear();
    for (std::string_view p : pieces) {
      if (step.add_prefix_space && (p.empty() || p[0] != ' ')) {
        owned.push_back(" " + std::string(p));
        p = owned.back();
      }
      if (step.split) {
        split_pretokens(p, step.pattern, &next);
      } else {
        next.push_back(p);
      }
    }
    pieces.swap(next);
  }
  for (std::string_view w : pieces) encode_word(w, cache, out);
}

void BpeTokenizer::encode_word(std::string_view word, Cache* cache,
                               std::vector<uint32_t>* out) const {
  if (word.empty()) return;
  if (ignore_merges_) {
    std::string sym;
    for (unsigned char c : word) sym += byte_symbols_[c];
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

void BpeTokenizer::merge_word(std::string_view word, std::vector<uint32_t>* out) const {
  const int n = static_cast<int>(word.size());
  std::vector<uint32_t> ids(n);
  std::vector<int> prev(n), next(n);
  std::vector<bool> alive(n, true);
  for (int i = 0; i < n; ++i) {
    const unsigned char c = static_cast<unsigned char>(word[i]);
    if (byte_ids_[c] < 0) {
      if (!unk_id_) {
        char buf[8];
        snprintf(buf, sizeof(buf), "0x%02x", c);
        fail(std::string("model.vocab has no symbol for byte ") + buf + " ('" + byte_symbols_[c] +
             "') and model.unk_token is not set");
      }
      ids[i] = *unk_id_;
    } else {
      ids[i] = static_cast<uint32_t>(byte_ids_[c]);
    }
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

std::string BpeTokenizer::decode(const std::vector<uint32_t>& ids) const {
  static const std::array<int16_t, 324> unicode_to_byte = [] {
    std::array<int16_t, 324> t;
    t.fill(-1);
    for (int b = 0; b < 256; ++b)
      t[byte_to_unicode(static_cast<uint8_t>(b))] = static_cast<int16_t>(b);
    return t;
  }();
  std::string bytes;
  for (uint32_t id : ids) {
    if (id >= id_to_token_.size() || !id_used_[id]) {
      throw std::out_of_range("tokenizer '" + name_ + "': token id " + std::to_string(id) +
                              " is not in the vocabulary (vocab_size " +
                              std::to_string(vocab_size()) + ")");
    }
    const std::string& tok = id_to_token_[id];
    // Each symbol maps back to one byte; a token with a symbol outside the map (an added token
    // such as "<|x y|>") is taken as UTF-8 text, as the ByteLevel decoder does.
    std::string raw;
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
  return utf8_lossy(bytes);
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
