#include "runtime/data/jsonl.h"

#include <unistd.h>
#include <zlib.h>
#include <zstd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <stdexcept>

#include "runtime/data/chat_template.h"
#include "runtime/data/loader.h"
#include "runtime/data/random.h"
#include "runtime/data/shard.h"
#include "runtime/data/tokenizer.h"
#include "runtime/json.h"

namespace accel {

namespace fs = std::filesystem;

namespace {

bool ends_with(const std::string& s, const std::string& tail) {
  return s.size() >= tail.size() && s.compare(s.size() - tail.size(), tail.size(), tail) == 0;
}

}  // namespace

// ---- lines of plain, gzip and zstd files -------------------------------------------------------

struct LineReader::Impl {
  enum Kind { Plain, Gzip, Zstd } kind = Plain;
  std::string path;
  FILE* file = nullptr;
  gzFile gz = nullptr;
  ZSTD_DStream* zstd = nullptr;
  std::vector<char> in_buf;  // zstd input
  ZSTD_inBuffer zin{nullptr, 0, 0};
  size_t last_zstd_ret = 0;  // 0 after a complete frame
  std::vector<char> buf;     // decompressed bytes not yet returned
  size_t pos = 0;
  bool eof = false;

  ~Impl() {
    if (file) fclose(file);
    if (gz) gzclose(gz);
    if (zstd) ZSTD_freeDStream(zstd);
  }

  [[noreturn]] void fail(const std::string& what) const {
    throw std::runtime_error("'" + path + "': " + what);
  }

  // Appends up to n decompressed bytes to buf; 0 at the end of the data.
  size_t fill(size_t n) {
    const size_t old = buf.size();
    buf.resize(old + n);
    size_t got = 0;
    if (kind == Plain) {
      got = fread(buf.data() + old, 1, n, file);
      if (got == 0 && ferror(file)) fail(std::string("read error: ") + strerror(errno));
    } else if (kind == Gzip) {
      const int r = gzread(gz, buf.data() + old, static_cast<unsigned>(n));
      if (r < 0) {
        int code = 0;
        const char* msg = gzerror(gz, &code);
        fail(std::string("is not valid gzip data (") + msg + ")");
      }
      got = static_cast<size_t>(r);
    } else {
      ZSTD_outBuffer out{buf.data() + old, n, 0};
      while (out.pos == 0) {
        if (zin.pos == zin.size) {
          zin.size = fread(in_buf.data(), 1, in_buf.size(), file);
          zin.pos = 0;
          if (zin.size == 0) {
            if (ferror(file)) fail(std::string("read error: ") + strerror(errno));
            if (last_zstd_ret != 0) fail("is truncated: the zstd data ends inside a frame");
            break;
          }
        }
        last_zstd_ret = ZSTD_decompressStream(zstd, &out, &zin);
        if (ZSTD_isError(last_zstd_ret))
          fail(std::string("is not valid zstd data (") + ZSTD_getErrorName(last_zstd_ret) + ")");
      }
      got = out.pos;
    }
    buf.resize(old + got);
    return got;
  }
};

LineReader::LineReader(const std::string& path) : impl_(std::make_unique<Impl>()) {
  Impl& d = *impl_;
  d.path = path;
  d.kind = ends_with(path, ".gz") ? Impl::Gzip : ends_with(path, ".zst") ? Impl::Zstd : Impl::Plain;
  if (d.kind == Impl::Gzip) {
    d.gz = gzopen(path.c_str(), "rb");
    if (!d.gz) d.fail(std::string("cannot open: ") + strerror(errno));
    gzbuffer(d.gz, 1 << 17);
  } else {
    d.file = fopen(path.c_str(), "rb");
    if (!d.file) d.fail(std::string("cannot open: ") + strerror(errno));
    if (d.kind == Impl::Zstd) {
      d.zstd = ZSTD_createDStream();
      if (!d.zstd) d.fail("cannot create a zstd decoder");
      ZSTD_initDStream(d.zstd);
      d.in_buf.resize(ZSTD_DStreamInSize());
      d.zin = {d.in_buf.data(), 0, 0};
    }
  }
}

LineReader::~LineReader() = default;

bool LineReader::next(std::string* line) {
  Impl& d = *impl_;
  size_t scanned = d.pos;
  for (;;) {
    const char* start = d.buf.data() + d.pos;
    // memchr must not see the null data() of an empty buffer (undefined even for length 0).
    const void* nl = scanned < d.buf.size()
                         ? memchr(d.buf.data() + scanned, '\n', d.buf.size() - scanned)
                         : nullptr;
    if (nl) {
      const size_t end = static_cast<size_t>(static_cast<const char*>(nl) - d.buf.data());
      line->assign(start, end - d.pos);
      d.pos = end + 1;
      break;
    }
    if (d.eof) {
      if (d.pos == d.buf.size()) return false;
      line->assign(start, d.buf.size() - d.pos);  // a last line without a newline
      d.pos = d.buf.size();
      break;
    }
    // Keep the unfinished line, read more.
    d.buf.erase(d.buf.begin(), d.buf.begin() + static_cast<std::ptrdiff_t>(d.pos));
    d.pos = 0;
    scanned = d.buf.size();
    if (d.fill(1 << 20) == 0) d.eof = true;
  }
  if (!line->empty() && line->back() == '\r') line->pop_back();  // CRLF files
  ++line_;
  return true;
}

// ---- datasets we cannot read ---------------------------------------------------------------

void refuse_unreadable_dataset(const std::string& path, const std::string& what) {
  const std::string convert_parquet =
      "python3 -c \"import datasets; datasets.load_dataset('parquet', data_files='" + path +
      "', split='train').to_json('train.jsonl')\"";
  const std::string convert_arrow = "python3 -c \"import datasets; datasets.load_from_disk('" +
                                    path + "').to_json('train.jsonl')\"";
  const std::string tail = "and give train.jsonl instead (docs/data.md)";
  if (ends_with(path, ".parquet")) {
    throw std::runtime_error(what + ": '" + path +
                             "' is a Parquet file: accel-train reads JSONL (no Parquet reader is "
                             "packaged for Debian); convert it once with\n  " +
                             convert_parquet + "\n" + tail);
  }
  if (ends_with(path, ".arrow") ||
      (fs::is_directory(path) && (fs::exists(fs::path(path) / "dataset_info.json") ||
                                  fs::exists(fs::path(path) / "state.json") ||
                                  fs::exists(fs::path(path) / "dataset_dict.json")))) {
    throw std::runtime_error(what + ": '" + path +
                             "' is a Hugging Face datasets (Arrow) folder: accel-train reads JSONL "
                             "(no Arrow reader is packaged for Debian); convert it once with\n  " +
                             convert_arrow + "\n" + tail);
  }
}

// ---- formats -------------------------------------------------------------------------------

DataFormat detect_jsonl_format(const nlohmann::json& first, const JsonlOptions& o,
                               const std::string& where, std::string* why) {
  if (o.format != DataFormat::Auto) {
    *why = std::string("data.format ") + name_of(o.format);
    return o.format;
  }
  if (!first.is_object())
    throw std::runtime_error(where + ": expected a JSON object, got " + json_excerpt(first));
  DataFormat f;
  std::string because;
  if (first.contains("messages")) {
    f = DataFormat::Messages;
    because = "a 'messages' field";
  } else if (first.contains("prompt") && first.contains("completion")) {
    f = DataFormat::PromptCompletion;
    because = "'prompt' and 'completion' fields";
  } else if (first.contains(o.text_field)) {
    f = DataFormat::Text;
    because = "a '" + o.text_field + "' field (data.text_field)";
  } else {
    std::string keys;
    for (auto it = first.begin(); it != first.end(); ++it)
      keys += (keys.empty() ? "" : ", ") + text_excerpt(it.key(), 40);
    throw std::runtime_error(where + ": cannot tell the format: the object has the fields {" +
                             keys + "}, none of 'messages', 'prompt' + 'completion' or '" +
                             o.text_field +
                             "'; set data.format (text, prompt_completion, messages) and, for "
                             "text, data.text_field");
  }
  *why = std::string("data.format auto: ") + name_of(f) + " (" + where + " has " + because + ")";
  return f;
}

namespace {

std::unique_ptr<ChatTemplate> load_template(const JsonlOptions& o) {
  if (o.chat_template != ChatTemplateChoice::Auto)
    return std::make_unique<ChatTemplate>(ChatTemplate::by_name(name_of(o.chat_template)));
  fs::path dir = o.tokenizer_spec;
  if (o.tokenizer_spec == "byte" || o.tokenizer_spec.empty()) {
    throw std::runtime_error(
        "data.chat_template auto reads the chat_template of the tokenizer_config.json beside "
        "data.tokenizer, but data.tokenizer is 'byte'; name the template (data.chat_template: "
        "llama3, chatml, qwen3 or mistral)");
  }
  if (!fs::is_directory(dir)) dir = dir.parent_path();
  const fs::path config = dir / "tokenizer_config.json";
  if (!fs::exists(config)) {
    throw std::runtime_error("data.chat_template auto: no tokenizer_config.json in '" +
                             dir.string() +
                             "' (beside data.tokenizer); name the template (data.chat_template: "
                             "llama3, chatml, qwen3 or mistral)");
  }
  return std::make_unique<ChatTemplate>(ChatTemplate::from_tokenizer_config(config.string()));
}

const std::string& string_field(const nlohmann::json& obj, const std::string& key,
                                const std::string& where, const std::string& fmt) {
  if (!obj.is_object())
    throw std::runtime_error(where + ": expected a JSON object, got " + json_excerpt(obj));
  auto it = obj.find(key);
  if (it == obj.end())
    throw std::runtime_error(where + ": missing field '" + key + "' (data.format " + fmt + ")");
  if (!it->is_string()) {
    throw std::runtime_error(where + ": field '" + key + "' must be a string, got " +
                             json_excerpt(*it));
  }
  return it->get_ref<const std::string&>();
}

}  // namespace

DocumentBuilder::DocumentBuilder(DataFormat format, const JsonlOptions& options,
                                 const Tokenizer& tokenizer)
    : format_(format), options_(options), tokenizer_(tokenizer) {
  if (format == DataFormat::Auto)
    throw std::invalid_argument("DocumentBuilder: resolve the format first");
  if (format == DataFormat::Messages) template_ = load_template(options);
}

DocumentBuilder::~DocumentBuilder() = default;

std::string DocumentBuilder::template_name() const { return template_ ? template_->name() : ""; }

TokenizedDocument DocumentBuilder::build(const nlohmann::json& line,
                                         const std::string& where) const {
  const std::string fmt = name_of(format_);
  // The text and its pieces: [begin, end) byte ranges with their trained flag, covering the text.
  std::string text;
  std::vector<std::pair<size_t, bool>> cuts;  // (end of piece, trained)
  if (format_ == DataFormat::Text) {
    text = string_field(line, options_.text_field, where, fmt);
    cuts.emplace_back(text.size(), true);
  } else if (format_ == DataFormat::PromptCompletion) {
    if (line.is_object() && line.contains("prompt") && line["prompt"].is_array()) {
      throw std::runtime_error(where +
                               ": 'prompt' is a list of messages (TRL's conversational "
                               "prompt-completion); write the conversation as 'messages' with "
                               "data.format messages");
    }
    const std::string prompt = string_field(line, "prompt", where, fmt);
    const std::string completion = string_field(line, "completion", where, fmt);
    if (completion.empty())
      throw std::runtime_error(where + ": 'completion' is empty: nothing to train on");
    text = prompt + completion;
    if (!prompt.empty()) cuts.emplace_back(prompt.size(), false);
    cuts.emplace_back(text.size(), true);
  } else {
    if (!line.is_object())
      throw std::runtime_error(where + ": expected a JSON object, got " + json_excerpt(line));
    auto it = line.find("messages");
    if (it == line.end())
      throw std::runtime_error(where + ": missing field 'messages' (data.format messages)");
    if (!it->is_array())
      throw std::runtime_error(where + ": 'messages' must be a list, got " + json_excerpt(*it));
    if (it->empty()) throw std::runtime_error(where + ": empty conversation ('messages' is [])");
    std::vector<ChatMessage> msgs;
    bool assistant = false;
    for (size_t i = 0; i < it->size(); ++i) {
      const nlohmann::json& m = (*it)[i];
      const std::string at = where + ": messages[" + std::to_string(i) + "]";
      const std::string role = string_field(m, "role", at, fmt);
      const std::string content = string_field(m, "content", at, fmt);
      if (role != "system" && role != "user" && role != "assistant") {
        throw std::runtime_error(at + ": role '" + text_excerpt(role, 40) +
                                 "' is not one of system, user, assistant");
      }
      assistant = assistant || role == "assistant";
      msgs.push_back({role, content});
    }
    if (!assistant)
      throw std::runtime_error(where +
                               ": the conversation has no assistant turn: nothing to train on");
    RenderedChat r;
    try {
      r = template_->render(msgs);
    } catch (const std::exception& e) {
      throw std::runtime_error(where + ": " + e.what());
    }
    text = std::move(r.text);
    size_t at = 0;
    for (const auto& [b, e] : r.trained) {
      if (b < at || e < b || e > text.size())
        throw std::logic_error(where + ": the chat template gave unordered trained spans");
      if (b > at) cuts.emplace_back(b, false);
      if (e > b) cuts.emplace_back(e, true);
      at = e;
    }
    if (at < text.size()) cuts.emplace_back(text.size(), false);
  }

  TokenizedDocument doc;
  size_t begin = 0;
  for (const auto& [end, trained] : cuts) {
    tokenizer_.encode(std::string_view(text).substr(begin, end - begin), &doc.tokens);
    doc.trained.resize(doc.tokens.size(), trained ? 1 : 0);
    begin = end;
  }
  if (cuts.size() > 1) {
    // Pieces tokenized apart must give the tokens of the whole text, else the trained flags
    // would sit on tokens the model never sees.
    const std::vector<uint32_t> whole = tokenizer_.encode(text);
    if (whole != doc.tokens) {
      size_t i = 0;
      while (i < whole.size() && i < doc.tokens.size() && whole[i] == doc.tokens[i]) ++i;
      throw std::runtime_error(
          where + ": tokenizing the " +
          (format_ == DataFormat::Messages ? "trained and untrained parts"
                                           : std::string("prompt and the completion")) +
          " separately gives other tokens than the whole text (first difference at token " +
          std::to_string(i) +
          "): a token crosses the boundary; end the prompt with a space or newline, or start the "
          "completion with one, so that the boundary falls between tokens");
    }
  }
  if (auto eot = tokenizer_.end_of_text_id()) {
    doc.tokens.push_back(*eot);
    doc.trained.push_back(format_ == DataFormat::Messages ? 0 : 1);
  }
  if (doc.tokens.empty()) throw std::runtime_error(where + ": the " + fmt + " is empty");
  return doc;
}

DataFormat read_jsonl_documents(
    const std::vector<std::string>& files, const JsonlOptions& options, const Tokenizer& tokenizer,
    const std::function<void(const TokenizedDocument&, const std::string& file, int64_t line)>&
        sink,
    std::string* notice) {
  std::unique_ptr<DocumentBuilder> builder;
  std::string line;
  for (const std::string& f : files) {
    LineReader reader(f);
    while (reader.next(&line)) {
      const std::string where = f + ":" + std::to_string(reader.line_number());
      if (line.find_first_not_of(" \t") == std::string::npos) {
        throw std::runtime_error(where +
                                 ": empty line (JSONL holds one JSON object per line); remove it");
      }
      nlohmann::json j;
      try {
        j = parse_json(line, where);
      } catch (const JsonError& e) {
        throw std::runtime_error(std::string(e.what()) + " (each line must be one JSON object)");
      }
      if (!j.is_object())
        throw std::runtime_error(where + ": expected a JSON object, got " + json_excerpt(j));
      if (!builder) {
        const DataFormat fmt = detect_jsonl_format(j, options, where, notice);
        builder = std::make_unique<DocumentBuilder>(fmt, options, tokenizer);
        if (fmt == DataFormat::Messages) *notice += ", chat template " + builder->template_name();
      }
      sink(builder->build(j, where), f, reader.line_number());
    }
  }
  if (!builder) {
    throw std::runtime_error("the JSONL files (" + files.front() +
                             (files.size() > 1 ? ", ..." : "") + ") hold no lines");
  }
  return builder->format();
}

// ---- shards ----------------------------------------------------------------------------------

JsonlShardSet tokenize_jsonl_files(const std::vector<std::string>& files,
                                   const Tokenizer& tokenizer, const JsonlOptions& options,
                                   const std::string& out_dir, int64_t shard_tokens) {
  if (files.empty()) throw std::invalid_argument("no JSONL files to tokenize");
  if (shard_tokens <= 0) throw std::invalid_argument("shard_tokens must be > 0");
  const fs::path train_dir = fs::path(out_dir) / "train";
  std::error_code ec;
  fs::create_directories(train_dir, ec);
  if (ec)
    throw std::runtime_error("cannot create folder '" + train_dir.string() + "': " + ec.message());
  for (const auto& e : fs::directory_iterator(train_dir)) {  // earlier shards would mix in
    if (e.path().filename().string().rfind("train-", 0) == 0 &&
        e.path().extension() == kShardExtension)
      fs::remove(e.path());
  }
  JsonlShardSet set;
  set.vocab_size = tokenizer.vocab_size();
  std::unique_ptr<ShardWriter> writer;
  auto finish = [&] {
    writer->close();
    set.shards.push_back(writer->path());
    writer.reset();
  };
  set.format = read_jsonl_documents(
      files, options, tokenizer,
      [&](const TokenizedDocument& d, const std::string& file, int64_t) {
        if (writer && writer->count() > 0 &&
            writer->count() + static_cast<int64_t>(d.tokens.size()) > shard_tokens)
          finish();
        if (!writer) {
          char name[32];
          snprintf(name, sizeof(name), "train-%05zu%s", set.shards.size(), kShardExtension);
          writer = std::make_unique<ShardWriter>((train_dir / name).string(), set.vocab_size, true);
        }
        writer->append_document(d.tokens.data(), d.trained.data(), d.tokens.size());
        if (set.file_documents.empty() || set.file_documents.back().first != file)
          set.file_documents.emplace_back(file, 0);
        ++set.file_documents.back().second;
        ++set.documents;
        set.tokens += static_cast<int64_t>(d.tokens.size());
        for (uint8_t t : d.trained) set.trained_tokens += t;
      },
      &set.notice);
  if (writer) finish();

  nlohmann::json j;
  j["format"] = "accel document shards";
  j["shard_version"] = kDocumentShardVersion;
  j["data_format"] = name_of(set.format);
  j["tokenizer"] = tokenizer.description();
  j["tokenizer_fingerprint"] = tokenizer.fingerprint();
  j["vocab_size"] = set.vocab_size;
  j["train_shards"] = nlohmann::json::array();
  for (const auto& p : set.shards)
    j["train_shards"].push_back(fs::path(p).lexically_relative(out_dir).string());
  j["eval_shards"] = nlohmann::json::array();
  j["documents"] = set.documents;
  j["train_tokens"] = set.tokens;
  j["trained_tokens"] = set.trained_tokens;
  j["notice"] = set.notice;
  j["files"] = nlohmann::json::array();
  for (const auto& [path, n] : set.file_documents)
    j["files"].push_back({{"path", path}, {"documents", n}});
  const std::string path = (fs::path(out_dir) / "manifest.json").string();
  std::ofstream out(path);
  out << j.dump(2) << "\n";
  if (!out) throw std::runtime_error("cannot write '" + path + "'");
  return set;
}

std::string document_origin(const nlohmann::json& manifest, int64_t d) {
  if (!manifest.is_object() || !manifest.contains("files") || !manifest["files"].is_array())
    return "";
  for (const auto& f : manifest["files"]) {
    if (!f.is_object() || !f.contains("documents") || !f["documents"].is_number_integer() ||
        !f.contains("path") || !f["path"].is_string())
      return "";
    const int64_t n = f["documents"].get<int64_t>();
    if (d < n) return f["path"].get<std::string>() + ":" + std::to_string(d + 1);
    d -= n;
  }
  return "";
}

JsonlShardSet ensure_jsonl_corpus_shards(const std::vector<std::string>& patterns,
                                         const JsonlOptions& options,
                                         const std::string& cache_dir) {
  for (const std::string& p : patterns) refuse_unreadable_dataset(p, "data.jsonl_files");
  const std::vector<std::string> files = expand_data_paths(patterns, "data.jsonl_files", nullptr);
  for (const std::string& f : files) refuse_unreadable_dataset(f, "data.jsonl_files");
  const auto tokenizer = make_tokenizer(options.tokenizer_spec);
  const std::string key_text = "accel-jsonl-shards-v1\n" + tokenizer->fingerprint() + "\n" +
                               name_of(options.format) + "\n" + options.text_field + "\n" +
                               name_of(options.chat_template) + "\n";
  const fs::path dir = shard_cache_dir(cache_dir, "jsonl", key_text, files, "data.jsonl_files");

  auto load = [&]() {
    const fs::path manifest = dir / "manifest.json";
    try {
      const nlohmann::json j = read_json_file(manifest.string());
      JsonlShardSet out;
      for (const auto& name : j.at("train_shards"))
        out.shards.push_back((dir / name.get<std::string>()).string());
      out.documents = j.at("documents").get<int64_t>();
      out.tokens = j.at("train_tokens").get<int64_t>();
      out.trained_tokens = j.at("trained_tokens").get<int64_t>();
      out.vocab_size = j.at("vocab_size").get<int64_t>();
      out.notice = j.at("notice").get<std::string>();
      return out;
    } catch (const std::exception& e) {
      throw std::runtime_error("token cache '" + manifest.string() + "' is unreadable (" +
                               e.what() + "); delete the folder '" + dir.string() +
                               "' to rebuild it");
    }
  };
  if (fs::exists(dir / "manifest.json")) return load();
  std::error_code ec;
  fs::create_directories(cache_dir, ec);
  if (ec)
    throw std::runtime_error("cannot create the data cache folder '" + cache_dir +
                             "': " + ec.message());
  const fs::path tmp = dir.string() + ".tmp-" + std::to_string(getpid());
  fs::remove_all(tmp, ec);
  try {
    tokenize_jsonl_files(files, *tokenizer, options, tmp.string());
  } catch (...) {
    fs::remove_all(tmp, ec);
    throw;
  }
  fs::rename(tmp, dir, ec);
  if (ec) {  // another process finished first; use its shards
    fs::remove_all(tmp, ec);
    if (!fs::exists(dir / "manifest.json"))
      throw std::runtime_error("cannot move the tokenized JSONL into '" + dir.string() + "'");
  }
  return load();
}

}  // namespace accel
