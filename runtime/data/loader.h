// Batches for training and evaluation: token shards (or text tokenized on first use) cut into
// samples of seq_len + 1 tokens, shuffled per epoch from a seed, split over ranks; or random
// tokens. Documents (JSONL lines, document shards) are packed into rows of seq_len tokens or put
// one per row and padded; their untrained tokens and the padding get the label -100.
//
// Labels follow the Hugging Face convention *after* the shift: `labels[b][t]` is the target of
// position t, i.e. the token after `input_ids[b][t]`. A sample of seq_len + 1 tokens x gives
// input_ids = x[0 .. S) and labels = x[1 .. S]. The model must not shift the labels again.
#pragma once

#include <cstdint>
#include <memory>
#include <nlohmann/json_fwd.hpp>
#include <string>
#include <vector>

#include "runtime/config.h"  // DataSource
#include "runtime/tensor.h"

namespace accel {

constexpr int64_t kIgnoreLabel = -100;  // Hugging Face's ignore_index: not trained

struct Batch {
  Tensor input_ids;  // [micro_batch_size, S] int64, on the CPU; S = seq_len, or less when padded
  Tensor labels;     // [micro_batch_size, S] int64: next token after t, or kIgnoreLabel
  // Packed documents: [B, S] int64 positions restarting at 0 in each document
  // (data.reset_position_ids) and [B, S] int32 document numbers (padding has its own); both
  // undefined for unpacked rows.
  Tensor position_ids, segment_ids;
  int64_t trained_tokens = 0;  // labels that are not kIgnoreLabel
};

// What became of the documents of a source, for the log and metrics.jsonl.
struct DataStats {
  int64_t documents = 0;          // read from the files
  int64_t truncated = 0;          // longer than seq_len, cut (data.overlong truncate)
  int64_t dropped_overlong = 0;   // longer than seq_len, left out (data.overlong drop)
  int64_t dropped_untrained = 0;  // no trained token left after truncation, left out
  int64_t rows = 0;               // samples per epoch (packed rows, or documents)
  int64_t row_tokens = 0;         // input positions of all rows (seq_len each when packed)
  int64_t trained_tokens = 0;     // targets that count in the loss
  nlohmann::json to_json() const;
  std::string describe() const;  // one line
};

// Where a stream is: `samples_consumed` entries of epoch `epoch`'s sample order have been taken
// by all ranks together (each rank takes every world_size-th entry), so a position saved by one
// world size resumes correctly under another. `num_samples` and `seed` identify the data the
// position belongs to; restore() refuses a position from different data.
struct DataPosition {
  int64_t epoch = 0;
  int64_t samples_consumed = 0;
  int64_t num_samples = 0;  // samples per epoch; 0 for the synthetic source (endless)
  uint64_t seed = 0;
  bool operator==(const DataPosition& o) const {
    return epoch == o.epoch && samples_consumed == o.samples_consumed &&
           num_samples == o.num_samples && seed == o.seed;
  }
};
// {"epoch": 0, "samples_consumed": 96, "num_samples": 1000, "seed": 1234}
void to_json(nlohmann::json& j, const DataPosition& p);
// Throws std::runtime_error naming the missing or malformed key.
void from_json(const nlohmann::json& j, DataPosition& p);

class BatchSource {
 public:
  virtual ~BatchSource() = default;
  virtual Batch next() = 0;
  // The position after the last batch returned by next().
  virtual DataPosition position() const = 0;
  virtual void restore(const DataPosition& p) = 0;
  // Batches one rank needs to see every sample of an epoch once; -1 for endless sources.
  virtual int64_t batches_per_epoch() const = 0;
  virtual int64_t vocab_size() const = 0;    // tokens are < this
  virtual std::string describe() const = 0;  // one line for the log
  // Documents (some labels are kIgnoreLabel, rows may be padded) rather than a token stream.
  virtual bool has_documents() const { return false; }
  virtual DataStats stats() const { return {}; }
};

// What the trainer fills in from the `data:` config section.
struct DataOptions {
  DataSource source = DataSource::Shards;
  // shards: shard files, folders (every *.tok inside) or glob patterns, in this order.
  std::vector<std::string> files;
  // Held-out data: separate shard files (as `files`); when empty and eval_fraction > 0, the last
  // eval_fraction of the samples of `files` (before shuffling) is held out.
  std::vector<std::string> eval_files;
  double eval_fraction = 0.0;
  // text: UTF-8 text files (or glob patterns) tokenized at start, cached under cache_dir.
  std::vector<std::string> text_files;
  std::string tokenizer = "byte";  // "byte" or a tokenizer.json path
  std::string cache_dir;           // e.g. "<output_dir>/data"
  // jsonl: JSONL files (or glob patterns) tokenized at start, cached under cache_dir, with
  // format, text_field and chat_template as in the config's data section.
  std::vector<std::string> jsonl_files;
  DataFormat format = DataFormat::Auto;
  std::string text_field = "text";
  ChatTemplateChoice chat_template = ChatTemplateChoice::Auto;
  // Documents (jsonl, or shards made from JSONL): packed rows or padded rows.
  bool packing = true;
  bool reset_position_ids = true;
  int64_t pad_to_multiple_of = 0;
  OverlongPolicy overlong = OverlongPolicy::Truncate;

  int64_t seq_len = 0;
  int64_t micro_batch_size = 0;
  // The model's vocabulary: every token must be < this (0 = do not check).
  int64_t vocab_size = 0;
  int rank = 0;
  int world_size = 1;
  uint64_t seed = 0;
  bool shuffle = true;
  bool validate_tokens = true;  // scan every token against the shard's vocab_size on open
};

struct DataSources {
  std::unique_ptr<BatchSource> train;
  std::unique_ptr<BatchSource> eval;  // null when there is no held-out data (and for synthetic)
  std::vector<std::string> notices;   // files of data.text_files left out (select_text_files)
  // How the JSONL format was chosen, what became of the documents (DataStats::describe).
  std::vector<std::string> info;
};

// Builds the sources; every problem with the options or the files is a std::runtime_error (or
// std::invalid_argument for impossible options) that names the file and says what to do. The eval
// source goes over the held-out samples in order (no shuffling), split over ranks the same way.
DataSources make_data_sources(const DataOptions& options);

// Expands data paths in order: a pattern with * ? or [ gives its matches sorted by name; a folder
// gives its files ending in `folder_extension` sorted by name (a folder is an error when
// `folder_extension` is null); a file is itself. `what` names the option in errors
// ("data.train_path"). Throws std::runtime_error when a path does not exist or a pattern matches
// nothing.
std::vector<std::string> expand_data_paths(const std::vector<std::string>& paths,
                                           const std::string& what, const char* folder_extension);

// The cache folder cache_dir/<prefix>-<hash> of shards made from `files`: the hash covers
// `key_head` (format and tokenizer) and each file's absolute path, size and modification time, so
// a changed input gets a new folder. `what` names the option in errors.
std::string shard_cache_dir(const std::string& cache_dir, const std::string& prefix,
                            std::string key_head, const std::vector<std::string>& files,
                            const std::string& what);

}  // namespace accel
