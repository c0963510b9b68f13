#include "runtime/data/loader.h"

#include <glob.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>
#include <stdexcept>

#include "runtime/data/corpus.h"
#include "runtime/data/jsonl.h"
#include "runtime/data/random.h"
#include "runtime/data/shard.h"
#include "runtime/data/tokenizer.h"
#include "runtime/json.h"

namespace accel {

namespace fs = std::filesystem;

void to_json(nlohmann::json& j, const DataPosition& p) {
  j = nlohmann::json{{"epoch", p.epoch},
                     {"samples_consumed", p.samples_consumed},
                     {"num_samples", p.num_samples},
                     {"seed", p.seed}};
}

void from_json(const nlohmann::json& j, DataPosition& p) {
  if (!j.is_object()) {
    throw std::runtime_error("data position: expected a JSON object, got " + j.dump());
  }
  auto get_int = [&](const char* key) -> int64_t {
    if (!j.contains(key))
      throw std::runtime_error(std::string("data position: missing key '") + key + "'");
    const auto& v = j[key];
    if (!v.is_number_integer() || v.get<int64_t>() < 0) {
      throw std::runtime_error(std::string("data position: '") + key +
                               "' must be a non-negative integer, got " + v.dump());
    }
    return v.get<int64_t>();
  };
  p.epoch = get_int("epoch");
  p.samples_consumed = get_int("samples_consumed");
  p.num_samples = get_int("num_samples");
  if (!j.contains("seed") || !j["seed"].is_number_unsigned()) {
    throw std::runtime_error("data position: missing or malformed key 'seed'");
  }
  p.seed = j["seed"].get<uint64_t>();
}

namespace {

bool is_pattern(const std::string& s) { return s.find_first_of("*?[") != std::string::npos; }

std::string join_paths(const std::vector<std::string>& paths) {
  std::string out;
  for (size_t i = 0; i < paths.size() && i < 3; ++i) out += (i ? ", " : "") + paths[i];
  if (paths.size() > 3) out += ", ... (" + std::to_string(paths.size()) + " files)";
  return out;
}

// accel-data writes <out>/manifest.json beside <out>/train and <out>/eval, recording the
// tokenizer: shards read with another tokenizer train on ids that mean other text.
void check_shard_tokenizer(const std::vector<std::string>& files, const std::string& spec) {
  std::unique_ptr<Tokenizer> tok;
  std::set<std::string> checked;
  for (const std::string& f : files) {
    const fs::path dir = fs::path(f).parent_path();
    fs::path manifest;
    for (const fs::path& m : {dir / "manifest.json", dir.parent_path() / "manifest.json"})
      if (manifest.empty() && fs::exists(m)) manifest = m;
    if (manifest.empty() || !checked.insert(manifest.string()).second) continue;
    nlohmann::json j;
    try {
      j = read_json_file(manifest.string());
    } catch (const std::exception& e) {
      throw std::runtime_error(manifest.string() + " (beside token shard '" + f +
                               "') is not valid JSON (" + e.what() +
                               "); remake the shards with accel-data");
    }
    if (!j.is_object() || !j.contains("tokenizer_fingerprint")) continue;
    if (!tok) tok = make_tokenizer(spec);
    if (j["tokenizer_fingerprint"] == tok->fingerprint()) continue;
    const std::string made_with = j.contains("tokenizer") && j["tokenizer"].is_string()
                                      ? j["tokenizer"].get<std::string>()
                                      : "another tokenizer";
    throw std::runtime_error("token shard '" + f + "' was made with " + made_with + " (" +
                             manifest.string() + "), but data.tokenizer is '" + spec + "' (" +
                             tok->description() +
                             "); set data.tokenizer to the tokenizer.json the shards were made "
                             "with");
  }
}

// The samples of an epoch, before shuffling: sample g fills one row.
class SampleSet {
 public:
  virtual ~SampleSet() = default;
  virtual int64_t num_samples() const = 0;
  // Rows are seq_len long (token windows, packed documents), or as long as the longest sample of
  // the batch (one padded document per row).
  virtual bool fixed_rows() const = 0;
  virtual int64_t length(int64_t g) const = 0;  // positions sample g fills
  // Sample g into a row of row_len >= length(g) positions: input ids and labels; positions and
  // segments when `positions` / `segments` are not null.
  virtual void read(int64_t g, int64_t row_len, int64_t* input, int64_t* labels, int64_t* positions,
                    int32_t* segments) const = 0;
  virtual bool packed() const { return false; }  // rows carry position and segment ids
  virtual bool has_documents() const { return false; }
  virtual bool reset_positions() const { return false; }
  virtual DataStats stats() const { return {}; }
  virtual int64_t vocab_size() const = 0;
  virtual std::string describe_shards() const = 0;  // "N shard(s) (T tokens, vocab V)"

 protected:
  static void check_vocab(const TokenShard& shard, int64_t model_vocab) {
    if (model_vocab > 0 && shard.vocab_size() > model_vocab) {
      throw std::runtime_error("token shard '" + shard.path() +
                               "' was made with a tokenizer of vocab_size " +
                               std::to_string(shard.vocab_size()) +
                               ", more than the model's vocab_size " + std::to_string(model_vocab) +
                               "; use the model's tokenizer or set model.vocab_size to at least " +
                               std::to_string(shard.vocab_size()));
    }
  }
};

// Samples of seq_len + 1 tokens taken every seq_len tokens within each shard (so each token is a
// target once); samples never span two shards.
class TokenWindows final : public SampleSet {
 public:
  // `what` names the config key and `sources` what it lists (the text files for data.source text,
  // whose shards are an internal cache), for messages.
  TokenWindows(std::vector<std::shared_ptr<const TokenShard>> shards, int64_t seq_len,
               int64_t model_vocab, const std::string& what,
               const std::vector<std::string>& sources)
      : seq_len_(seq_len), shards_(std::move(shards)) {
    first_sample_.push_back(0);
    for (const auto& shard : shards_) {
      check_vocab(*shard, model_vocab);
      vocab_size_ = std::max(vocab_size_, shard->vocab_size());
      tokens_ += shard->size();
      const int64_t n = shard->size() > seq_len ? (shard->size() - 1) / seq_len : 0;
      first_sample_.push_back(first_sample_.back() + n);
    }
    if (num_samples() == 0) {
      throw std::runtime_error(
          what + " (" + join_paths(sources) +
          "): the corpus is smaller than one "
          "sample: it holds " +
          std::to_string(tokens_) +
          " tokens, and one sample needs seq_len + 1 = " + std::to_string(seq_len + 1) +
          " tokens within one shard; add data or lower training.seq_len");
    }
  }

  int64_t num_samples() const override { return first_sample_.back(); }
  bool fixed_rows() const override { return true; }
  int64_t length(int64_t) const override { return seq_len_; }
  int64_t vocab_size() const override { return vocab_size_; }
  std::string describe_shards() const override {
    return std::to_string(shards_.size()) + " shard(s) (" + std::to_string(tokens_) +
           " tokens, vocab " + std::to_string(vocab_size_) + ")";
  }

  // Writes sample g as input (tokens [0, S)) and labels (tokens [1, S]).
  void read(int64_t g, int64_t, int64_t* input, int64_t* labels, int64_t*,
            int32_t*) const override {
    auto it = std::upper_bound(first_sample_.begin(), first_sample_.end(), g);
    const size_t s = static_cast<size_t>(it - first_sample_.begin()) - 1;
    const int64_t start = (g - first_sample_[s]) * seq_len_;
    shards_[s]->read(start, seq_len_, input);
    memcpy(labels, input + 1, static_cast<size_t>(seq_len_ - 1) * sizeof(int64_t));
    labels[seq_len_ - 1] = shards_[s]->at(start + seq_len_);
  }

 private:
  int64_t seq_len_;
  std::vector<std::shared_ptr<const TokenShard>> shards_;
  std::vector<int64_t> first_sample_;
  int64_t vocab_size_ = 0;
  int64_t tokens_ = 0;
};

// Documents of version-2 shards as rows: packed (consecutive documents fill rows of seq_len
// positions; a document never spans two rows) or one per row. A document of L tokens fills L
// positions and has L - 1 targets within itself: the label of position j is token j + 1 when that
// token is trained, else kIgnoreLabel, and the last position's label is kIgnoreLabel (the next
// document is not predicted from this one). Documents longer than seq_len follow
// options.overlong; documents left without a trained target are left out (counted).
class DocumentRows final : public SampleSet {
 public:
  // `origin(shard, d)` names document d of a shard for messages ("file.jsonl:12").
  DocumentRows(std::vector<std::shared_ptr<const TokenShard>> shards, const DataOptions& o,
               const std::string& what, const std::function<std::string(size_t, int64_t)>& origin)
      : seq_len_(o.seq_len),
        packed_(o.packing),
        reset_positions_(o.packing && o.reset_position_ids),
        shards_(std::move(shards)) {
    for (size_t s = 0; s < shards_.size(); ++s) {
      const TokenShard& shard = *shards_[s];
      check_vocab(shard, o.vocab_size);
      vocab_size_ = std::max(vocab_size_, shard.vocab_size());
      for (int64_t d = 0; d < shard.documents(); ++d) {
        ++stats_.documents;
        const int64_t start = shard.document_start(d);
        int64_t len = shard.document_start(d + 1) - start;
        if (len > seq_len_) {
          if (o.overlong == OverlongPolicy::Error) {
            const std::string where = origin(s, d);
            throw std::runtime_error(
                (where.empty() ? shard.path() + " document " + std::to_string(d) : where) +
                ": the sample has " + std::to_string(len) + " tokens, more than training.seq_len " +
                std::to_string(seq_len_) +
                " (data.overlong error); raise seq_len, shorten the sample, or set data.overlong "
                "to truncate or drop");
          }
          if (o.overlong == OverlongPolicy::Drop) {
            ++stats_.dropped_overlong;
            continue;
          }
          ++stats_.truncated;
          len = seq_len_;
        }
        int64_t trained = 0;
        for (int64_t i = 1; i < len; ++i) trained += shard.trained(start + i) ? 1 : 0;
        if (trained == 0) {
          ++stats_.dropped_untrained;
          continue;
        }
        stats_.trained_tokens += trained;
        docs_.push_back({static_cast<uint32_t>(s), start, len});
      }
    }
    if (docs_.empty()) {
      throw std::runtime_error(what + ": no document to train on (" + stats_.describe() +
                               "); check the data or data.overlong");
    }
    // Rows: a packed row takes documents while they fit.
    int64_t used = seq_len_;
    for (size_t i = 0; i < docs_.size(); ++i) {
      if (!packed_ || used + docs_[i].len > seq_len_) {
        first_doc_.push_back(i);
        used = 0;
      }
      used += docs_[i].len;
    }
    first_doc_.push_back(docs_.size());
    stats_.rows = num_samples();
    stats_.row_tokens = 0;
    for (int64_t g = 0; g < num_samples(); ++g) stats_.row_tokens += packed_ ? seq_len_ : length(g);
  }

  int64_t num_samples() const override { return static_cast<int64_t>(first_doc_.size()) - 1; }
  bool fixed_rows() const override { return packed_; }
  bool packed() const override { return packed_; }
  bool has_documents() const override { return true; }
  bool reset_positions() const override { return reset_positions_; }
  DataStats stats() const override { return stats_; }
  int64_t vocab_size() const override { return vocab_size_; }
  std::string describe_shards() const override {
    return std::to_string(shards_.size()) + " document shard(s) (" +
           std::to_string(stats_.documents) + " documents, vocab " + std::to_string(vocab_size_) +
           ")";
  }
  int64_t length(int64_t g) const override {
    int64_t n = 0;
    for (size_t i = first_doc_[g]; i < first_doc_[g + 1]; ++i) n += docs_[i].len;
    return n;
  }

  void read(int64_t g, int64_t row_len, int64_t* input, int64_t* labels, int64_t* positions,
            int32_t* segments) const override {
    int64_t t = 0;
    int32_t segment = 0;
    for (size_t i = first_doc_[g]; i < first_doc_[g + 1]; ++i, ++segment) {
      const Doc& d = docs_[i];
      const TokenShard& shard = *shards_[d.shard];
      shard.read(d.start, d.len, input + t);
      for (int64_t j = 0; j < d.len; ++j) {
        const bool target = j + 1 < d.len && shard.trained(d.start + j + 1);
        labels[t + j] = target ? input[t + j + 1] : kIgnoreLabel;
        if (positions) positions[t + j] = reset_positions_ ? j : t + j;
        if (segments) segments[t + j] = segment;
      }
      t += d.len;
    }
    for (; t < row_len; ++t) {  // padding: token 0, no target, a segment of its own
      input[t] = 0;
      labels[t] = kIgnoreLabel;
      if (positions) positions[t] = reset_positions_ ? 0 : t;
      if (segments) segments[t] = segment;
    }
  }

 private:
  struct Doc {
    uint32_t shard;
    int64_t start, len;
  };
  int64_t seq_len_;
  bool packed_, reset_positions_;
  std::vector<std::shared_ptr<const TokenShard>> shards_;
  std::vector<Doc> docs_;
  std::vector<size_t> first_doc_;  // row g holds docs_[first_doc_[g] .. first_doc_[g + 1])
  int64_t vocab_size_ = 0;
  DataStats stats_;
};

void check_position(const DataPosition& p, int64_t num_samples, uint64_t seed,
                    const std::string& what) {
  if (p.num_samples != num_samples) {
    throw std::runtime_error(
        "cannot restore the " + what + " data position: it was saved for " +
        std::to_string(p.num_samples) + " samples per epoch but the data now has " +
        std::to_string(num_samples) +
        " (the data files, seq_len or eval split changed); resume with the same data settings or "
        "start a new run");
  }
  if (p.seed != seed) {
    throw std::runtime_error("cannot restore the " + what +
                             " data position: it was saved with seed " + std::to_string(p.seed) +
                             " but the data seed is now " + std::to_string(seed) +
                             "; resume with the same seed");
  }
  if (num_samples > 0 && p.samples_consumed > num_samples) {
    throw std::runtime_error("cannot restore the " + what + " data position: samples_consumed " +
                             std::to_string(p.samples_consumed) + " exceeds the " +
                             std::to_string(num_samples) + " samples of an epoch");
  }
}

Batch empty_batch(int64_t b, int64_t s) {
  Batch out;
  out.input_ids = Tensor::empty({b, s}, DType::I64);
  out.labels = Tensor::empty({b, s}, DType::I64);
  return out;
}

int64_t count_trained(const Batch& b) {
  const int64_t* lab = b.labels.data<int64_t>();
  int64_t n = 0;
  for (int64_t i = 0; i < b.labels.numel(); ++i) n += lab[i] != kIgnoreLabel ? 1 : 0;
  return n;
}

class ShardSource final : public BatchSource {
 public:
  ShardSource(std::shared_ptr<const SampleSet> index, int64_t begin, int64_t end,
              const DataOptions& o, bool shuffle, std::string what)
      : index_(std::move(index)),
        pad_multiple_(o.pad_to_multiple_of),
        begin_(begin),
        n_(end - begin),
        seq_len_(o.seq_len),
        batch_(o.micro_batch_size),
        rank_(o.rank),
        world_(o.world_size),
        seed_(o.seed),
        shuffle_(shuffle),
        what_(std::move(what)) {
    if (n_ < world_) {
      throw std::runtime_error(what_ + ": only " + std::to_string(n_) +
                               " samples of seq_len + 1 = " + std::to_string(seq_len_ + 1) +
                               " tokens for " + std::to_string(world_) +
                               " ranks; every rank needs at least one; add data or lower seq_len");
    }
    if (n_ > static_cast<int64_t>(UINT32_MAX)) {
      throw std::runtime_error(what_ +
                               ": more than 2^32 samples per epoch are not supported; "
                               "raise seq_len");
    }
  }

  Batch next() override {
    std::vector<int64_t> samples(static_cast<size_t>(batch_));
    for (int64_t& g : samples) {
      if (consumed_ + world_ > n_) {  // too few left for every rank: next epoch
        ++epoch_;
        consumed_ = 0;
      }
      g = begin_ + sample_at(consumed_ + rank_);
      consumed_ += world_;
    }
    int64_t row = seq_len_;
    if (!index_->fixed_rows()) {  // padded to the longest, or up to a multiple of it
      row = 0;
      for (int64_t g : samples) row = std::max(row, index_->length(g));
      if (pad_multiple_ > 1)
        row = std::max(
            row, std::min(seq_len_, (row + pad_multiple_ - 1) / pad_multiple_ * pad_multiple_));
    }
    Batch b = empty_batch(batch_, row);
    int64_t* in = b.input_ids.data<int64_t>();
    int64_t* lab = b.labels.data<int64_t>();
    int64_t* pos = nullptr;
    int32_t* seg = nullptr;
    if (index_->packed()) {
      b.segment_ids = Tensor::empty({batch_, row}, DType::I32);
      seg = b.segment_ids.data<int32_t>();
      if (index_->reset_positions()) {
        b.position_ids = Tensor::empty({batch_, row}, DType::I64);
        pos = b.position_ids.data<int64_t>();
      }
    }
    for (int64_t i = 0; i < batch_; ++i) {
      index_->read(samples[static_cast<size_t>(i)], row, in + i * row, lab + i * row,
                   pos ? pos + i * row : nullptr, seg ? seg + i * row : nullptr);
    }
    b.trained_tokens = count_trained(b);
    return b;
  }

  DataPosition position() const override { return {epoch_, consumed_, n_, seed_}; }

  void restore(const DataPosition& p) override {
    check_position(p, n_, seed_, what_);
    epoch_ = p.epoch;
    consumed_ = p.samples_consumed;
  }

  int64_t batches_per_epoch() const override {
    const int64_t per_rank = n_ / world_;
    return (per_rank + batch_ - 1) / batch_;
  }
  int64_t vocab_size() const override { return index_->vocab_size(); }
  bool has_documents() const override { return index_->has_documents(); }
  DataStats stats() const override { return index_->stats(); }
  std::string describe() const override {
    std::ostringstream ss;
    ss << what_ << ": " << n_;
    if (!index_->has_documents())
      ss << " samples of " << seq_len_ + 1 << " tokens";
    else if (index_->packed())
      ss << " packed rows of " << seq_len_ << " tokens"
         << (index_->reset_positions() ? " (positions restart per document)" : "");
    else
      ss << " documents padded to the longest in a batch";
    ss << " from " << index_->describe_shards() << ", " << batches_per_epoch() << " batches of "
       << batch_ << " per rank per epoch, " << (shuffle_ ? "shuffled" : "in order") << ", rank "
       << rank_ << "/" << world_;
    return ss.str();
  }

 private:
  int64_t sample_at(int64_t k) {
    if (!shuffle_) return k;
    if (order_epoch_ != epoch_) {
      // Fisher-Yates from a generator seeded by (seed, epoch): the same order on every rank.
      order_.resize(static_cast<size_t>(n_));
      for (int64_t i = 0; i < n_; ++i) order_[i] = static_cast<uint32_t>(i);
      DataRng rng(mix_seed(seed_, static_cast<uint64_t>(epoch_), 0x5348554646ull));
      for (int64_t i = n_ - 1; i > 0; --i) {
        const int64_t j = static_cast<int64_t>(rng.below(static_cast<uint64_t>(i + 1)));
        std::swap(order_[i], order_[j]);
      }
      order_epoch_ = epoch_;
    }
    return order_[k];
  }

  std::shared_ptr<const SampleSet> index_;
  int64_t pad_multiple_;
  int64_t begin_, n_, seq_len_, batch_;
  int rank_, world_;
  uint64_t seed_;
  bool shuffle_;
  std::string what_;
  int64_t epoch_ = 0, consumed_ = 0;
  std::vector<uint32_t> order_;
  int64_t order_epoch_ = -1;
};

// Uniform random tokens; sample g (counted over all ranks) depends only on (seed, g).
class SyntheticSource final : public BatchSource {
 public:
  explicit SyntheticSource(const DataOptions& o)
      : seq_len_(o.seq_len),
        batch_(o.micro_batch_size),
        vocab_(o.vocab_size),
        rank_(o.rank),
        world_(o.world_size),
        seed_(o.seed) {
    if (vocab_ <= 0) {
      throw std::invalid_argument("data.source synthetic needs the model's vocab_size (> 0)");
    }
  }

  Batch next() override {
    Batch b = empty_batch(batch_, seq_len_);
    int64_t* in = b.input_ids.data<int64_t>();
    int64_t* lab = b.labels.data<int64_t>();
    const uint64_t v = static_cast<uint64_t>(vocab_);
    for (int64_t i = 0; i < batch_; ++i) {
      DataRng rng(mix_seed(seed_, static_cast<uint64_t>(consumed_ + rank_), 0x53594e5448ull));
      int64_t* row = in + i * seq_len_;
      for (int64_t t = 0; t < seq_len_; ++t) row[t] = static_cast<int64_t>(rng.below(v));
      memcpy(lab + i * seq_len_, row + 1, static_cast<size_t>(seq_len_ - 1) * sizeof(int64_t));
      lab[i * seq_len_ + seq_len_ - 1] = static_cast<int64_t>(rng.below(v));
      consumed_ += world_;
    }
    return b;
  }
  DataPosition position() const override { return {0, consumed_, 0, seed_}; }
  void restore(const DataPosition& p) override {
    check_position(p, 0, seed_, "synthetic");
    consumed_ = p.samples_consumed;
  }
  int64_t batches_per_epoch() const override { return -1; }
  int64_t vocab_size() const override { return vocab_; }
  std::string describe() const override {
    std::ostringstream ss;
    ss << "synthetic: uniform random tokens < " << vocab_ << ", seed " << seed_ << ", batches of "
       << batch_ << " x " << seq_len_ << ", rank " << rank_ << "/" << world_;
    return ss.str();
  }

 private:
  int64_t seq_len_, batch_, vocab_;
  int rank_, world_;
  uint64_t seed_;
  int64_t consumed_ = 0;
};

void check_options(const DataOptions& o) {
  auto bad = [](const std::string& what) { throw std::invalid_argument("data options: " + what); };
  if (o.seq_len <= 0) bad("seq_len must be > 0, got " + std::to_string(o.seq_len));
  if (o.micro_batch_size <= 0) {
    bad("micro_batch_size must be > 0, got " + std::to_string(o.micro_batch_size));
  }
  if (o.world_size <= 0) bad("world_size must be > 0, got " + std::to_string(o.world_size));
  if (o.rank < 0 || o.rank >= o.world_size) {
    bad("rank " + std::to_string(o.rank) + " is outside [0, world_size " +
        std::to_string(o.world_size) + ")");
  }
  if (!(o.eval_fraction >= 0.0 && o.eval_fraction < 1.0)) {
    bad("data.eval_fraction must be in [0, 1), got " + std::to_string(o.eval_fraction));
  }
  if (o.vocab_size < 0) bad("vocab_size must be >= 0");
  if (o.pad_to_multiple_of < 0) bad("data.pad_to_multiple_of must be >= 0");
}

}  // namespace

std::string shard_cache_dir(const std::string& cache_dir, const std::string& prefix,
                            std::string key_head, const std::vector<std::string>& files,
                            const std::string& what) {
  for (const std::string& f : files) {
    std::error_code ec;
    const auto size = fs::file_size(f, ec);
    if (ec) throw std::runtime_error(what + ": cannot read '" + f + "': " + ec.message());
    const auto mtime = fs::last_write_time(f, ec).time_since_epoch().count();
    key_head += fs::absolute(f).string() + "\t" + std::to_string(size) + "\t" +
                std::to_string(static_cast<long long>(mtime)) + "\n";
  }
  char key[17];
  snprintf(key, sizeof(key), "%016llx", static_cast<unsigned long long>(fnv1a64(key_head)));
  return (fs::path(cache_dir) / (prefix + "-" + key)).string();
}

std::vector<std::string> expand_data_paths(const std::vector<std::string>& paths,
                                           const std::string& what, const char* folder_extension) {
  std::vector<std::string> out;
  for (const std::string& p : paths) {
    if (is_pattern(p)) {
      glob_t g;
      int rc = glob(p.c_str(), 0, nullptr, &g);
      std::vector<std::string> matches;
      if (rc == 0) {
        for (size_t i = 0; i < g.gl_pathc; ++i) {
          if (fs::is_regular_file(g.gl_pathv[i])) matches.emplace_back(g.gl_pathv[i]);
        }
      }
      globfree(&g);
      if (matches.empty()) throw std::runtime_error(what + ": '" + p + "' matches no file");
      std::sort(matches.begin(), matches.end());
      out.insert(out.end(), matches.begin(), matches.end());
      continue;
    }
    std::error_code ec;
    fs::file_status st = fs::status(p, ec);
    if (ec || !fs::exists(st)) {
      throw std::runtime_error(what + ": '" + p + "' does not exist");
    }
    if (fs::is_directory(st)) {
      if (!folder_extension) {
        throw std::runtime_error(what + ": '" + p +
                                 "' is a folder; list the files or use a pattern such as '" + p +
                                 "/*.txt'");
      }
      std::vector<std::string> found;
      for (const auto& e : fs::directory_iterator(p)) {
        const std::string name = e.path().filename().string();
        const std::string ext = folder_extension;
        if (e.is_regular_file() && name.size() > ext.size() &&
            name.compare(name.size() - ext.size(), ext.size(), ext) == 0) {
          found.push_back(e.path().string());
        }
      }
      if (found.empty()) {
        throw std::runtime_error(what + ": folder '" + p + "' holds no *" + folder_extension +
                                 " files (make them with accel-data)");
      }
      std::sort(found.begin(), found.end());
      out.insert(out.end(), found.begin(), found.end());
      continue;
    }
    out.push_back(p);
  }
  return out;
}

namespace {

// The manifest.json beside (or one folder above) a shard, as accel-data and the caches write it;
// null when there is none or it is not JSON (check_shard_tokenizer reports that).
nlohmann::json manifest_of(const std::string& shard) {
  const fs::path dir = fs::path(shard).parent_path();
  for (const fs::path& m : {dir / "manifest.json", dir.parent_path() / "manifest.json"}) {
    if (!fs::exists(m)) continue;
    try {
      return read_json_file(m.string());
    } catch (const std::exception&) {
      return nullptr;
    }
  }
  return nullptr;
}

// Token windows for token-stream shards, document rows for document shards (a mix is refused).
std::shared_ptr<const SampleSet> make_samples(const std::vector<std::string>& files,
                                              const DataOptions& o, const std::string& what,
                                              const std::vector<std::string>& sources) {
  std::vector<std::shared_ptr<const TokenShard>> shards;
  size_t with_documents = 0;
  for (const std::string& f : files) {
    shards.push_back(TokenShard::open(f, o.validate_tokens));
    with_documents += shards.back()->has_documents() ? 1 : 0;
  }
  if (with_documents == 0)
    return std::make_shared<TokenWindows>(std::move(shards), o.seq_len, o.vocab_size, what,
                                          sources);
  if (with_documents != shards.size()) {
    throw std::runtime_error(what + " (" + join_paths(files) +
                             ") mixes token-stream shards (from text) and document shards (from "
                             "JSONL); train on one kind at a time");
  }
  // Documents are counted over the shards of one manifest in order (accel-data writes them so).
  std::vector<nlohmann::json> manifests;
  std::vector<int64_t> first_in_manifest;
  std::map<std::string, int64_t> seen;  // manifest dir -> documents before this shard
  for (const auto& shard : shards) {
    manifests.push_back(manifest_of(shard->path()));
    int64_t& before = seen[fs::path(shard->path()).parent_path().string()];
    first_in_manifest.push_back(before);
    before += shard->documents();
  }
  auto origin = [&](size_t s, int64_t d) {
    return document_origin(manifests[s], first_in_manifest[s] + d);
  };
  return std::make_shared<DocumentRows>(std::move(shards), o, what, origin);
}

}  // namespace

nlohmann::json DataStats::to_json() const {
  return {{"documents", documents},
          {"truncated", truncated},
          {"dropped_overlong", dropped_overlong},
          {"dropped_untrained", dropped_untrained},
          {"rows", rows},
          {"row_tokens", row_tokens},
          {"trained_tokens", trained_tokens}};
}

std::string DataStats::describe() const {
  std::ostringstream ss;
  ss << documents << " documents: " << truncated << " truncated to seq_len (data.overlong), "
     << dropped_overlong << " dropped as longer than seq_len, " << dropped_untrained
     << " dropped with no trained token left; " << trained_tokens << " trained tokens in " << rows
     << " rows";
  if (row_tokens > 0) {
    ss.precision(3);
    ss << " (" << 100.0 * static_cast<double>(trained_tokens) / static_cast<double>(row_tokens)
       << "% of their positions)";
  }
  return ss.str();
}

DataSources make_data_sources(const DataOptions& o) {
  check_options(o);
  DataSources out;
  if (o.source == DataSource::Synthetic) {
    out.train = std::make_unique<SyntheticSource>(o);
    return out;
  }
  for (const std::string& p : o.files) refuse_unreadable_dataset(p, "data.train_path");
  for (const std::string& p : o.eval_files) refuse_unreadable_dataset(p, "data.eval_path");
  for (const std::string& p : o.text_files) refuse_unreadable_dataset(p, "data.text_files");
  std::vector<std::string> files;
  std::string what;
  if (o.source == DataSource::Shards) {
    // The config keys that fill o.files / o.eval_files (docs/config.md).
    if (o.files.empty()) {
      throw std::runtime_error(
          "data.train_path is empty: give token shards (made by accel-data), or "
          "use data.source text or synthetic");
    }
    files = expand_data_paths(o.files, "data.train_path", kShardExtension);
    what = "data.train_path";
    check_shard_tokenizer(files, o.tokenizer);
  } else if (o.source == DataSource::Jsonl) {
    if (o.jsonl_files.empty()) throw std::runtime_error("data.source jsonl needs data.jsonl_files");
    if (o.cache_dir.empty())
      throw std::invalid_argument("data.source jsonl needs a cache folder for the tokenized JSONL");
    JsonlOptions jo;
    jo.format = o.format;
    jo.text_field = o.text_field;
    jo.chat_template = o.chat_template;
    jo.tokenizer_spec = o.tokenizer;
    JsonlShardSet set = ensure_jsonl_corpus_shards(o.jsonl_files, jo, o.cache_dir);
    files = set.shards;
    out.info.push_back(set.notice);
    what = "data.jsonl_files";
  } else {  // text
    if (o.text_files.empty()) throw std::runtime_error("data.source text needs data.text_files");
    if (o.cache_dir.empty()) {
      throw std::invalid_argument("data.source text needs a cache folder for the tokenized text");
    }
    TextCorpusShards text = ensure_text_corpus_shards(o.text_files, o.tokenizer, o.cache_dir);
    files = text.shards;
    out.notices = text.notices;
    what = "data.text_files";
  }

  const std::vector<std::string>& sources = o.source == DataSource::Text    ? o.text_files
                                            : o.source == DataSource::Jsonl ? o.jsonl_files
                                                                            : files;
  auto index = make_samples(files, o, what, sources);
  const int64_t n = index->num_samples();
  int64_t n_train = n;
  if (o.eval_files.empty() && o.eval_fraction > 0.0) {
    const int64_t n_eval =
        std::max<int64_t>(o.world_size, static_cast<int64_t>(n * o.eval_fraction));
    n_train = n - n_eval;
    if (n_train < o.world_size) {
      throw std::runtime_error(what + ": " + std::to_string(n) +
                               " samples are too few to hold out " + std::to_string(n_eval) +
                               " for eval (data.eval_fraction " + std::to_string(o.eval_fraction) +
                               ") and keep one per rank for training; add data or lower "
                               "eval_fraction / seq_len");
    }
    out.eval = std::make_unique<ShardSource>(index, n_train, n, o, false, what + " (eval split)");
  }
  out.train = std::make_unique<ShardSource>(index, 0, n_train, o, o.shuffle, what);
  if (!o.eval_files.empty()) {
    auto eval_files = expand_data_paths(o.eval_files, "data.eval_path", kShardExtension);
    check_shard_tokenizer(eval_files, o.tokenizer);
    auto eval_index = make_samples(eval_files, o, "data.eval_path", eval_files);
    out.eval = std::make_unique<ShardSource>(eval_index, 0, eval_index->num_samples(), o, false,
                                             "data.eval_path");
  }
  if (index->has_documents()) out.info.push_back(what + ": " + index->stats().describe());
  if (!index->fixed_rows() && o.pad_to_multiple_of <= 1)
    // Every new row length is a new GEMM and attention problem, whose plans the CUDA backend
    // makes (and times) once per length: say how to bound the lengths, without changing them.
    out.info.push_back(
        "data.packing false: rows are padded to the longest sample of each batch, so most "
        "batches have a length not seen before, and on CUDA the first batch of each length "
        "also chooses GEMM algorithms and builds attention plans; data.pad_to_multiple_of 64 "
        "bounds the lengths to seq_len / 64 (docs/data.md)");
  return out;
}

}  // namespace accel
