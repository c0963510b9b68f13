#include "runtime/data/corpus.h"

#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <sstream>
#include <stdexcept>

#include "runtime/data/loader.h"
#include "runtime/data/random.h"
#include "runtime/data/shard.h"
#include "runtime/data/tokenizer.h"
#include "runtime/data/unicode.h"
#include "runtime/json.h"

namespace accel {

namespace fs = std::filesystem;

namespace {

std::string shard_name(const std::string& prefix, size_t i) {
  char buf[32];
  snprintf(buf, sizeof(buf), "-%05zu", i);
  return prefix + buf + kShardExtension;
}

// Writes tokens into prefix-00000.tok, prefix-00001.tok, ... of at most shard_tokens each.
class RollingShardWriter {
 public:
  RollingShardWriter(std::string dir, std::string prefix, int64_t shard_tokens, int64_t vocab)
      : dir_(std::move(dir)),
        prefix_(std::move(prefix)),
        shard_tokens_(shard_tokens),
        vocab_(vocab) {}

  void append(const uint32_t* ids, size_t n) {
    while (n > 0) {
      if (!writer_) {
        writer_ = std::make_unique<ShardWriter>(
            (fs::path(dir_) / shard_name(prefix_, paths_.size())).string(), vocab_);
      }
      const size_t room = static_cast<size_t>(shard_tokens_ - writer_->count());
      const size_t m = std::min(room, n);
      writer_->append(ids, m);
      ids += m, n -= m;
      if (writer_->count() == shard_tokens_) finish_shard();
    }
  }
  void close() {
    if (writer_) finish_shard();
  }
  const std::vector<std::string>& paths() const { return paths_; }
  const std::vector<int64_t>& counts() const { return counts_; }

 private:
  void finish_shard() {
    writer_->close();
    paths_.push_back(writer_->path());
    counts_.push_back(writer_->count());
    writer_.reset();
  }
  std::string dir_, prefix_;
  int64_t shard_tokens_, vocab_;
  std::unique_ptr<ShardWriter> writer_;
  std::vector<std::string> paths_;
  std::vector<int64_t> counts_;
};

bool is_ascii_alnum(char c) {
  return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9');
}

// Feeds the text of `path` to the tokenizer in pieces of about `piece_bytes`. A piece ends after
// "x\n" where x is printable ASCII other than space and the next byte is an ASCII letter or digit:
// there both the GPT-2 and the Llama 3 patterns end a pre-token whether or not more text follows
// (the newline is a whitespace run of one, so the `\s+(?!\S)` lookahead matches it alone either
// way), so the ids are those of the whole text at once.
void tokenize_file(const std::string& path, const Tokenizer& tok, size_t piece_bytes,
                   const std::function<void(const std::vector<uint32_t>&)>& sink) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    throw std::runtime_error("text file '" + path + "': cannot open (" + strerror(errno) + ")");
  }
  std::string buf, carry;
  std::vector<uint32_t> ids;
  std::vector<char> chunk(std::max<size_t>(piece_bytes, 1));
  for (;;) {
    in.read(chunk.data(), static_cast<std::streamsize>(chunk.size()));
    const size_t got = static_cast<size_t>(in.gcount());
    if (in.bad()) throw std::runtime_error("text file '" + path + "': read error");
    buf = carry;
    buf.append(chunk.data(), got);
    carry.clear();
    const bool eof = got < chunk.size();
    size_t cut = buf.size();
    if (!eof) {
      cut = 0;
      for (size_t i = buf.size() - 1; i > 1; --i) {
        if (buf[i - 1] == '\n' && is_ascii_alnum(buf[i]) && buf[i - 2] > ' ' && buf[i - 2] < 127) {
          cut = i;
          break;
        }
      }
      carry.assign(buf, cut, std::string::npos);
      buf.resize(cut);
    }
    if (!buf.empty()) {
      ids.clear();
      tok.encode(buf, &ids);
      sink(ids);
    }
    if (eof) break;
  }
}

// Rewrites the header count and drops the tokens past `keep`.
void truncate_shard(const std::string& path, int64_t keep, int width) {
  FILE* f = fopen(path.c_str(), "r+b");
  if (!f) throw std::runtime_error("token shard '" + path + "': cannot reopen: " + strerror(errno));
  uint64_t count = static_cast<uint64_t>(keep);
  bool ok = fseek(f, 16, SEEK_SET) == 0 && fwrite(&count, 8, 1, f) == 1;
  ok = (fclose(f) == 0) && ok;
  std::error_code ec;
  fs::resize_file(path, kShardHeaderBytes + static_cast<uint64_t>(keep) * width, ec);
  if (!ok || ec) throw std::runtime_error("token shard '" + path + "': cannot truncate");
}

void write_manifest(const std::string& dir, const ShardSet& set, const Tokenizer& tok) {
  nlohmann::json j;
  j["format"] = "accel token shards";
  j["shard_version"] = kShardVersion;
  j["tokenizer"] = tok.description();
  j["tokenizer_fingerprint"] = tok.fingerprint();
  j["vocab_size"] = set.vocab_size;
  auto names = [&](const std::vector<std::string>& paths) {  // relative to the manifest
    std::vector<std::string> out;
    for (const auto& p : paths) out.push_back(fs::path(p).lexically_relative(dir).string());
    return out;
  };
  j["train_shards"] = names(set.train_shards);
  j["eval_shards"] = names(set.eval_shards);
  j["train_tokens"] = set.train_tokens;
  j["eval_tokens"] = set.eval_tokens;
  j["files"] = nlohmann::json::array();
  for (const auto& [path, n] : set.file_tokens)
    j["files"].push_back({{"path", path}, {"tokens", n}});
  const std::string path = (fs::path(dir) / "manifest.json").string();
  std::ofstream out(path);
  out << j.dump(2) << "\n";
  if (!out) throw std::runtime_error("cannot write '" + path + "'");
}

}  // namespace

ShardSet tokenize_text_files(const std::vector<std::string>& text_files, const Tokenizer& tokenizer,
                             const TextShardOptions& o) {
  if (o.out_dir.empty()) throw std::invalid_argument("tokenize_text_files: no output folder");
  if (o.shard_tokens <= 0) {
    throw std::invalid_argument("shard_tokens must be > 0, got " + std::to_string(o.shard_tokens));
  }
  if (!(o.eval_fraction >= 0.0 && o.eval_fraction < 1.0)) {
    throw std::invalid_argument("eval_fraction must be in [0, 1), got " +
                                std::to_string(o.eval_fraction));
  }
  if (text_files.empty()) throw std::invalid_argument("no text files to tokenize");
  std::error_code ec;
  fs::create_directories(o.out_dir, ec);
  if (ec) throw std::runtime_error("cannot create folder '" + o.out_dir + "': " + ec.message());
  // Earlier shards in these folders would mix with the new ones.
  const std::string train_dir = (fs::path(o.out_dir) / "train").string();
  const std::string eval_dir = (fs::path(o.out_dir) / "eval").string();
  for (const std::string& d : {train_dir, eval_dir}) {
    fs::create_directories(d, ec);
    if (ec) throw std::runtime_error("cannot create folder '" + d + "': " + ec.message());
    for (const auto& e : fs::directory_iterator(d)) {
      const std::string name = e.path().filename().string();
      if ((name.rfind("train-", 0) == 0 || name.rfind("eval-", 0) == 0) &&
          e.path().extension() == kShardExtension) {
        fs::remove(e.path());
      }
    }
  }

  ShardSet set;
  set.vocab_size = tokenizer.vocab_size();
  const auto eot = o.end_of_text_between_files ? tokenizer.end_of_text_id() : std::nullopt;
  RollingShardWriter train(train_dir, "train", o.shard_tokens, set.vocab_size);
  for (const std::string& file : text_files) {
    int64_t n = 0;
    tokenize_file(file, tokenizer, o.read_piece_bytes, [&](const std::vector<uint32_t>& ids) {
      train.append(ids.data(), ids.size());
      n += static_cast<int64_t>(ids.size());
    });
    if (eot) {
      train.append(&*eot, 1);
      ++n;
    }
    set.file_tokens.emplace_back(file, n);
    set.train_tokens += n;
  }
  train.close();
  set.train_shards = train.paths();
  std::vector<int64_t> counts = train.counts();

  if (o.eval_fraction > 0.0) {
    const int64_t n_eval =
        static_cast<int64_t>(static_cast<double>(set.train_tokens) * o.eval_fraction);
    if (n_eval == 0 || n_eval >= set.train_tokens) {
      std::string names = text_files[0];
      if (text_files.size() > 1) names += " and " + std::to_string(text_files.size() - 1) + " more";
      throw std::runtime_error(
          "the text (" + names + ") holds " + std::to_string(set.train_tokens) +
          " tokens, too few to hold out eval_fraction " + std::to_string(o.eval_fraction));
    }
    // The last n_eval tokens, in order, as (shard, first token) ranges to the end of each shard.
    std::vector<std::pair<size_t, int64_t>> tail;
    int64_t need = n_eval;
    for (size_t s = counts.size(); s-- > 0 && need > 0;) {
      const int64_t take = std::min(need, counts[s]);
      tail.emplace_back(s, counts[s] - take);
      need -= take;
    }
    std::reverse(tail.begin(), tail.end());
    RollingShardWriter eval(eval_dir, "eval", o.shard_tokens, set.vocab_size);
    std::vector<uint32_t> buf;
    for (const auto& [s, first] : tail) {
      auto shard = TokenShard::open(set.train_shards[s], false);
      for (int64_t pos = first; pos < shard->size(); pos += 1 << 20) {
        const int64_t m = std::min<int64_t>(1 << 20, shard->size() - pos);
        buf.resize(static_cast<size_t>(m));
        shard->read(pos, m, buf.data());
        eval.append(buf.data(), buf.size());
      }
    }
    eval.close();
    const int width = shard_token_bytes(set.vocab_size);
    for (const auto& [s, first] : tail) {
      if (first == 0) {
        fs::remove(set.train_shards[s]);
      } else {
        truncate_shard(set.train_shards[s], first, width);
      }
    }
    set.train_shards.resize(tail.front().second == 0 ? tail.front().first : tail.front().first + 1);
    set.eval_shards = eval.paths();
    set.eval_tokens = n_eval;
    set.train_tokens -= n_eval;
  }
  write_manifest(o.out_dir, set, tokenizer);
  return set;
}

namespace {

std::string read_file_bytes(const std::string& path, size_t max_bytes, const std::string& what) {
  std::ifstream in(path, std::ios::binary);
  std::string bytes(max_bytes, '\0');
  in.read(bytes.data(), static_cast<std::streamsize>(max_bytes));
  if (in.bad() || (!in && !in.eof()))
    throw std::runtime_error(what + ": cannot read '" + path + "'");
  bytes.resize(static_cast<size_t>(in.gcount()));
  return bytes;
}

// Why the start of a file says it is not text ("" when it is text).
std::string binary_reason(const std::string& head, size_t window) {
  for (size_t i = 0; i < head.size() && i < window;) {
    if (head[i] == '\0') return "NUL byte at offset " + std::to_string(i);
    uint32_t cp = 0;
    const size_t len = utf8_decode(head.data() + i, head.size() - i, &cp);
    // A sequence cut by the end of what was read is not evidence either way.
    if (cp >= kInvalidCodePointBase && head.size() - i >= 4)
      return "invalid UTF-8 at offset " + std::to_string(i);
    i += len;
  }
  return "";
}

std::string notice(const std::string& what, size_t n, const std::string& kind,
                   const std::vector<std::string>& examples, const std::string& reason) {
  std::string list;
  for (size_t i = 0; i < examples.size() && i < 3; ++i) list += (i ? ", " : "") + examples[i];
  if (examples.size() > 3) list += ", ...";
  return what + ": skipped " + std::to_string(n) + " " + kind + " (" + list + "): " + reason;
}

}  // namespace

TextFileSelection select_text_files(const std::vector<std::string>& files,
                                    const std::string& what) {
  constexpr size_t kWindow = 1024;
  TextFileSelection out;
  std::vector<std::string> binary, duplicate;
  std::string first_binary_reason;
  std::map<std::pair<uintmax_t, uint64_t>, std::vector<std::string>> seen;  // (size, hash) -> files
  for (const std::string& f : files) {
    const std::string reason = binary_reason(read_file_bytes(f, kWindow + 3, what), kWindow);
    if (!reason.empty()) {
      if (binary.empty()) first_binary_reason = f + ": " + reason;
      binary.push_back(f);
      continue;
    }
    const std::string all = read_file_bytes(f, static_cast<size_t>(fs::file_size(f)), what);
    std::vector<std::string>& same_key = seen[{all.size(), fnv1a64(all)}];
    bool dup = false;
    for (const std::string& earlier : same_key)
      if (read_file_bytes(earlier, all.size(), what) == all) dup = true;
    if (dup) {
      duplicate.push_back(f);
      continue;
    }
    same_key.push_back(f);
    out.files.push_back(f);
  }
  if (!binary.empty())
    out.notices.push_back(notice(what, binary.size(), "binary file(s)", binary,
                                 "not text (" + first_binary_reason + ")"));
  if (!duplicate.empty())
    out.notices.push_back(notice(what, duplicate.size(), "duplicate file(s)", duplicate,
                                 "the same bytes as a file listed earlier"));
  if (out.files.empty())
    throw std::runtime_error(what + ": no text file among the " + std::to_string(files.size()) +
                             " given (all binary or duplicates); list UTF-8 text files");
  return out;
}

TextCorpusShards ensure_text_corpus_shards(const std::vector<std::string>& text_files,
                                           const std::string& tokenizer_spec,
                                           const std::string& cache_dir) {
  TextFileSelection selected = select_text_files(
      expand_data_paths(text_files, "data.text_files", nullptr), "data.text_files");
  const std::vector<std::string>& files = selected.files;
  const auto tokenizer = make_tokenizer(tokenizer_spec);

  const std::string key_text = "accel-text-shards-v1\n" + tokenizer->fingerprint() + "\n";
  const fs::path dir = shard_cache_dir(cache_dir, "text", key_text, files, "data.text_files");

  auto load = [&](bool built) {
    const fs::path manifest = dir / "manifest.json";
    nlohmann::json j;
    try {
      j = read_json_file(manifest.string());
      TextCorpusShards out;
      out.dir = dir.string();
      out.built = built;
      out.notices = selected.notices;
      for (const auto& name : j.at("train_shards")) {
        out.shards.push_back((dir / name.get<std::string>()).string());
      }
      out.tokens = j.at("train_tokens").get<int64_t>();
      out.vocab_size = j.at("vocab_size").get<int64_t>();
      return out;
    } catch (const std::exception& e) {  // JsonError or a missing/mistyped field
      throw std::runtime_error("token cache '" + manifest.string() + "' is unreadable (" +
                               e.what() + "); delete the folder '" + dir.string() +
                               "' to rebuild it");
    }
  };
  if (fs::exists(dir / "manifest.json")) return load(false);

  std::error_code ec;
  fs::create_directories(cache_dir, ec);
  if (ec)
    throw std::runtime_error("cannot create the data cache folder '" + cache_dir +
                             "': " + ec.message());
  const fs::path tmp = dir.string() + ".tmp-" + std::to_string(getpid());
  fs::remove_all(tmp, ec);
  try {
    TextShardOptions o;
    o.out_dir = tmp.string();
    tokenize_text_files(files, *tokenizer, o);
  } catch (...) {
    fs::remove_all(tmp, ec);
    throw;
  }
  fs::rename(tmp, dir, ec);
  if (ec) {  // another process finished first; use its shards
    fs::remove_all(tmp, ec);
    if (!fs::exists(dir / "manifest.json")) {
      throw std::runtime_error("cannot move the tokenized text into '" + dir.string() + "'");
    }
    return load(false);
  }
  return load(true);
}

}  // namespace accel
