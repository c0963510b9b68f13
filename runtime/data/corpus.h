// Text -> token shards: what accel-data does, and the cached version the trainer uses for
// `data.source: text` (tokenize at start, reuse on later runs).
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace accel {

class Tokenizer;

struct TextShardOptions {
  std::string out_dir;                 // created if missing
  int64_t shard_tokens = 100'000'000;  // tokens per shard file at most
  // The last eval_fraction of all tokens goes to eval-NNNNN.tok shards (0: no eval shards).
  double eval_fraction = 0.0;
  // Put the tokenizer's end-of-text token (if it has one) after each file's text.
  bool end_of_text_between_files = true;
  // Text is read and tokenized in pieces of about this many bytes.
  size_t read_piece_bytes = 4 << 20;
};

struct ShardSet {
  std::vector<std::string> train_shards, eval_shards;
  int64_t train_tokens = 0, eval_tokens = 0;
  int64_t vocab_size = 0;
  std::vector<std::pair<std::string, int64_t>> file_tokens;  // tokens of each input file
};

// Tokenizes the files (in order; each is read in pieces, so size is not limited by memory) into
// out_dir/train/train-00000.tok, ... and, with eval_fraction > 0, out_dir/eval/eval-00000.tok,
// ...; writes out_dir/manifest.json describing them. Shards left in those folders by an earlier
// run are removed first. Throws std::runtime_error naming the file on errors.
ShardSet tokenize_text_files(const std::vector<std::string>& text_files, const Tokenizer& tokenizer,
                             const TextShardOptions& options);

// The text files among `files` (paths, already expanded), in order: a binary file (a NUL byte or
// invalid UTF-8 in its first KiB, such as fortune's .dat index files) and an exact duplicate of
// an earlier file (a copy or a symlink, such as fortune's .u8 files) are left out, with one
// notice line per kind giving the count and examples. `what` names the option in messages.
// Throws std::runtime_error when no file is left.
struct TextFileSelection {
  std::vector<std::string> files;
  std::vector<std::string> notices;
};
TextFileSelection select_text_files(const std::vector<std::string>& files, const std::string& what);

struct TextCorpusShards {
  std::vector<std::string> shards;
  std::vector<std::string> notices;  // select_text_files' notices
  std::string dir;                   // cache_dir/text-<key>
  bool built = false;                // false: reused from an earlier run
  int64_t tokens = 0;
  int64_t vocab_size = 0;
};

// The shards of `text_files` (paths or glob patterns) tokenized with `tokenizer_spec` ("byte" or
// a tokenizer.json), built on first use under cache_dir/text-<key>, where the key covers the
// tokenizer and each file's path, size and modification time. Safe when several processes call
// it at once (each builds in its own temporary folder; the first rename wins).
TextCorpusShards ensure_text_corpus_shards(const std::vector<std::string>& text_files,
                                           const std::string& tokenizer_spec,
                                           const std::string& cache_dir);

}  // namespace accel
