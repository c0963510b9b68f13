// JSONL corpora for training and fine-tuning: one JSON object per line, in plain, .gz (zlib) or
// .zst (zstd) files. Each line becomes one document of tokens, each token flagged as a trained
// target or not (docs/data.md):
//   text               the string field `text_field`; every token trained
//   prompt_completion  `prompt` + `completion` strings (TRL); only the completion trained
//   messages           a list of {role, content} (TRL / OpenAI chat) rendered by a chat template;
//                      only the assistant turns trained
// The tokenizer's end-of-text token (when it has one) ends each document: trained for text and
// prompt_completion (the model learns to stop), not for messages (the template's end-of-turn
// token, inside the assistant turn, already is).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <nlohmann/json_fwd.hpp>
#include <string>
#include <vector>

#include "runtime/config.h"  // DataFormat, ChatTemplateChoice

namespace accel {

class Tokenizer;
class ChatTemplate;

// Reads the lines of a plain, .gz or .zst file (chosen by the name's ending), without their
// line ends. Errors name the file.
class LineReader {
 public:
  explicit LineReader(const std::string& path);
  ~LineReader();
  LineReader(const LineReader&) = delete;
  LineReader& operator=(const LineReader&) = delete;
  // False at the end of the file.
  bool next(std::string* line);
  int64_t line_number() const { return line_; }  // of the line next() returned, 1-based

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
  int64_t line_ = 0;
};

// Paths that name data we cannot read (Parquet files, Hugging Face `datasets` Arrow folders):
// throws std::runtime_error saying so, with the one-line conversion to JSONL. `what` names the
// option. Anything else passes.
void refuse_unreadable_dataset(const std::string& path, const std::string& what);

struct JsonlOptions {
  DataFormat format = DataFormat::Auto;
  std::string text_field = "text";
  ChatTemplateChoice chat_template = ChatTemplateChoice::Auto;
  // The tokenizer spec ("byte" or a tokenizer.json): chat_template auto reads the
  // tokenizer_config.json beside it.
  std::string tokenizer_spec = "byte";
};

// One line as tokens; trained[i] says whether token i is a trained target (the loss counts the
// prediction of token i from the tokens before it).
struct TokenizedDocument {
  std::vector<uint32_t> tokens;
  std::vector<uint8_t> trained;
};

// The format of a corpus whose first line is `first` (`where` is "file:1"): `format` itself unless
// auto; else messages (a "messages" list), prompt_completion ("prompt" and "completion"), or text
// (the text field). `why` gets the line the trainer prints. Throws naming `where` when nothing
// fits.
DataFormat detect_jsonl_format(const nlohmann::json& first, const JsonlOptions& options,
                               const std::string& where, std::string* why);

// Turns lines into documents for one resolved format and tokenizer.
class DocumentBuilder {
 public:
  DocumentBuilder(DataFormat format, const JsonlOptions& options, const Tokenizer& tokenizer);
  ~DocumentBuilder();
  // `where` ("file.jsonl:12") starts every error message: a missing or mistyped field, a wrong
  // role, an empty conversation, a conversation without an assistant turn, and pieces whose
  // tokens differ from the whole text's (a token crossing a prompt/answer boundary).
  TokenizedDocument build(const nlohmann::json& line, const std::string& where) const;
  DataFormat format() const { return format_; }
  // "chatml" etc. for messages, "" otherwise.
  std::string template_name() const;

 private:
  DataFormat format_;
  JsonlOptions options_;
  const Tokenizer& tokenizer_;
  std::unique_ptr<ChatTemplate> template_;
};

// Every line of `files` (in order) as a document: `sink(document, "file:line")`. An empty line,
// a line that is not a JSON object and every DocumentBuilder error stop with an error naming file
// and line. Returns the format used; `notice` gets the detection line.
DataFormat read_jsonl_documents(
    const std::vector<std::string>& files, const JsonlOptions& options, const Tokenizer& tokenizer,
    const std::function<void(const TokenizedDocument&, const std::string& file, int64_t line)>&
        sink,
    std::string* notice);

// JSONL -> document shards (version 2) in out_dir/train/train-NNNNN.tok plus manifest.json,
// which records the format and each file's document count (so that a document's file and line
// can be named later). Documents never span two shards.
struct JsonlShardSet {
  std::vector<std::string> shards;
  int64_t documents = 0, tokens = 0, trained_tokens = 0, vocab_size = 0;
  DataFormat format = DataFormat::Auto;
  std::string notice;  // how the format was chosen
  std::vector<std::pair<std::string, int64_t>> file_documents;
};
JsonlShardSet tokenize_jsonl_files(const std::vector<std::string>& files,
                                   const Tokenizer& tokenizer, const JsonlOptions& options,
                                   const std::string& out_dir, int64_t shard_tokens = 100'000'000);

// The document shards of `files` (paths or glob patterns), built on first use under
// cache_dir/jsonl-<key> (the key covers the tokenizer, the options, and each file's path, size
// and modification time). Safe when several processes call it at once.
JsonlShardSet ensure_jsonl_corpus_shards(const std::vector<std::string>& files,
                                         const JsonlOptions& options, const std::string& cache_dir);

// For a document shard of a manifest written by tokenize_jsonl_files: "file.jsonl:LINE" of
// document `d` counted over all shards of the manifest, or "" when the manifest does not say.
std::string document_origin(const nlohmann::json& manifest, int64_t d);

}  // namespace accel
